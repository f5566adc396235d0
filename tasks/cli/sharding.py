"""Sharded data-parallel training: ``--trainer.strategy fsdp`` (PyTorch's FSDP2, ``fully_shard``).

Each rank keeps a ``1/N`` slice of every parameter, its gradient and its optimizer state, and gathers a
block's full weights only while that block computes (forward, and again in the backward pass), as
ZeRO-3 does; the batches are split over the ranks as under DDP, so the global batch, the data order
and the metrics are those of ``ddp`` with the same ``devices``.

:class:`FullyShardedStrategy` is Lightning's ``ModelParallelStrategy`` (FSDP2; the only FSDP that runs
on CPU: FSDP1, Lightning's ``FSDPStrategy``, needs a GPU) with every rank in one data-parallel
group and the suite's sharding plan, applied after the task's ``configure_model`` (activation
checkpointing wraps, channels-last) and before the optimizer is built:

- one FSDP unit per repeated block of each network (``repeated_blocks``: the units of regional
  compilation and activation checkpointing: transformer layers, MobileViT blocks, mixer blocks),
  so only one block's full weights are held at a time;
- the task itself as the root unit for what remains (stems, heads, embeddings): FSDP2 needs one
  root, and translation's encoder and decoder share their token table, which must sit in one unit.

Evaluation gathers every unit once and keeps them gathered until the next training step (see
:class:`FullyShardedStrategy`). Parameter names do not change, so the optimizer's parameter groups
(weight-decay exemptions, ``--model.layer_decay``) are built as without sharding, and activation
checkpointing (which wraps a block's ``forward`` inside the module's hooks) works unchanged.

Checkpoints are one ordinary file, gathered to rank 0 (``save_distributed_checkpoint=False``), with the
optimizer state numbered as an unsharded run numbers it: ``last.ckpt`` and its atomic writing, exact
mid-epoch resume, ``--ckpt_path`` on ``test``/``predict``, ``export``, ``tasks.load`` and checkpoint
averaging read it as any other, and a run may resume under another strategy or number of processes.
The suite's models fit one rank's memory whole, which is what a one-file checkpoint asks.

:func:`check_sharding` refuses, before anything is built and in one line, what does not work with it,
naming the setting and the way out: Lightning's FSDP1 (``fsdp_cpu_offload``, ``FSDPStrategy``),
``16-mixed``, EMA weights (``EMAWeightAveraging``), ``--model.compile`` and ``--trainer.sync_batchnorm``.
"""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

#: what ``--trainer.strategy`` says for sharded training
FSDP = "fsdp"
#: Lightning's FSDP1 names, refused (see :func:`check_sharding`)
FSDP1_NAMES = ("fsdp_cpu_offload", "lightning.pytorch.strategies.FSDPStrategy", "FSDPStrategy")


class FullyShardedStrategy(ModelParallelStrategy):
    """FSDP2 over all ranks (data parallelism only), sharded by the suite's plan (see the module).

    Training gathers each unit's weights only while it computes. Evaluation (validate, test, predict) gathers
    every unit once and keeps them until the next training step, as DDP would hold them: a decoding loop
    (translation's beam search) calls the decoder a different number of times on each rank, and per-call
    gathers would then pair up collectives of different calls.

    Args:
        reshard_after_forward: free each block's gathered weights after its forward and gather them
            again for its backward (ZeRO-3: least memory); ``False`` keeps them until the backward
            (ZeRO-2's memory for parameters, one all-gather less per block).
        process_group_backend: ``None`` picks gloo on CPU and NCCL on GPU.
        timeout: of the collectives.
    """

    strategy_name = "suite_fsdp"

    def __init__(self, reshard_after_forward: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout):
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=False,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.reshard_after_forward = reshard_after_forward
        self._gathered = False

    def setup_environment(self) -> None:
        # every rank of every node is one data-parallel shard (ModelParallelStrategy's "auto" would make
        # the ranks of a node a tensor-parallel group)
        self._data_parallel_size = self.num_nodes * self.num_processes
        watch_peers_before_rendezvous(self)
        super().setup_environment()

    def setup(self, trainer) -> None:
        # the task's configure_model has run (Lightning calls it before the strategy's setup)
        shard_task(self.lightning_module, self.device_mesh["data_parallel"], self.reshard_after_forward)
        self._gathered = False
        super().setup(trainer)

    # -- gathered for evaluation, sharded for training and checkpoints ---------------------------------------
    def units(self) -> list[nn.Module]:
        """The FSDP units, root first: the same order on every rank, so their collectives pair up."""
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.lightning_module.modules() if isinstance(m, FSDPModule)]

    def gather_all(self) -> None:
        """Gather every unit's weights and keep them gathered through forwards (evaluation)."""
        if not self._gathered:
            for unit in self.units():
                unit.set_reshard_after_forward(False, recurse=False)
                unit.unshard()
            self._gathered = True

    def shard_all(self) -> None:
        """Every unit back to its shard and to training's resharding (the root keeps its weights from the
        forward to the backward, FSDP2's default for a root). Also after a forward without a backward (the
        model summary's), which leaves the root gathered: torch's state-dict functions need the shards."""
        units = self.units()
        for unit in units:
            if self._gathered:
                unit.set_reshard_after_forward(self.reshard_after_forward and unit is not units[0], recurse=False)
            unit.reshard()
        self._gathered = False

    def training_step(self, *args, **kwargs):
        if self._gathered:
            self.shard_all()
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args, **kwargs):
        self.gather_all()
        return super().validation_step(*args, **kwargs)

    def test_step(self, *args, **kwargs):
        self.gather_all()
        return super().test_step(*args, **kwargs)

    def predict_step(self, *args, **kwargs):
        self.gather_all()
        return super().predict_step(*args, **kwargs)

    # -- checkpoints: one full file ----------------------------------------------------------------------
    # Its optimizer state is numbered as an unsharded run numbers it (by place in the parameter groups), so a
    # run resumes under fsdp, ddp or one process alike. (Lightning's own numbering follows named_parameters(),
    # which differs once weight decay splits the groups, and its loader copies each submodule's tensors into
    # sharded parameters one module at a time, which torch 2.14 refuses; torch's set_model_state_dict shards the
    # tensors of named_parameters() only, which name a shared parameter once: translation's tied table is refused.)
    def lightning_module_state_dict(self) -> dict:
        self.shard_all()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        self.shard_all()
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's
        full = get_optimizer_state_dict(self.model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return numbered_by_place(full) if full else full  # gathered on rank 0 only

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():  # a sharded checkpoint of Lightning's ModelParallelStrategy
            return super().load_checkpoint(path, weights_only=weights_only)
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        self.shard_all()
        self.model.load_state_dict(sharded_like(checkpoint.pop("state_dict"), self.model.state_dict()),
                                   strict=self.lightning_module.strict_loading)
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            options = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
            for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
                set_optimizer_state_dict(self.model, optimizer, named_by_place(state, optimizer, self.model),
                                         options=options)
        return checkpoint


def shard_task(module: nn.Module, mesh, reshard_after_forward: bool = True) -> list[str]:
    """``fully_shard`` ``module`` in place: each repeated block of its networks, then the task itself as the
    root unit, which holds the rest (FSDP2 needs one root, and translation's encoder and decoder share a
    parameter). Returns the units' names, the root (``""``) last; a task already sharded (a second
    ``trainer.fit`` in one process) is left as it is and gives ``[]``."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from layers.compile import repeated_blocks

    if isinstance(module, FSDPModule):
        return []
    units = []
    for name, network in module.named_children():
        for block_name, block in repeated_blocks(network):
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
            units.append(f"{name}.{block_name}")
    # the root keeps its gathered weights from the forward to the backward (FSDP2's own default for a root):
    # they are needed again at once
    fully_shard(module, mesh=mesh, reshard_after_forward=False)
    return [*units, ""]


def sharded_like(full: dict[str, torch.Tensor], sharded: dict[str, Any]) -> dict[str, Any]:
    """``full`` (a checkpoint's state dict, whole on every rank) cut as ``sharded`` (the sharded model's state
    dict) is: each tensor that is a DTensor there becomes this rank's shard of it, with no communication. A
    shared parameter is cut under each of its names."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    return {name: distribute_tensor(value, sharded[name].device_mesh, sharded[name].placements, src_data_rank=None)
            if isinstance(sharded.get(name), DTensor) else value for name, value in full.items()}


def numbered_by_place(state: dict) -> dict:
    """An optimizer state keyed by parameter name (``get_optimizer_state_dict``) keyed as ``Optimizer.state_dict``
    keys it: each parameter by its place in the parameter groups, counted over the groups in order."""
    number = {name: i for i, name in enumerate(n for group in state["param_groups"] for n in group["params"])}
    return {"state": {number[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [number[n] for n in group["params"]]}
                             for group in state["param_groups"]]}


def named_by_place(state: dict, optimizer, model: nn.Module) -> dict:
    """The inverse of :func:`numbered_by_place` for ``optimizer`` of ``model``: the parameter in each place of
    its groups named as ``model`` names it (what ``set_optimizer_state_dict`` takes)."""
    if state["state"] and isinstance(next(iter(state["state"])), str):
        return state  # keyed by name already
    names = {id(p): name for name, p in model.named_parameters()}
    saved = [i for group in state["param_groups"] for i in group["params"]]
    current = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(saved) != len(current):
        raise ValueError(f"the checkpoint's optimizer holds {len(saved)} parameters, this model's {len(current)}")
    name = dict(zip(saved, current))
    return {"state": {name[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [name[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


def is_fsdp(strategy: Any) -> bool:
    """Whether a ``trainer.strategy`` value (a name, a class-path config or an instance) asks for sharding."""
    if isinstance(strategy, FullyShardedStrategy):
        return True
    return strategy == FSDP or _class_path(strategy).endswith(f".{FullyShardedStrategy.__name__}")


def _class_path(value: Any) -> str:
    if isinstance(value, str):
        return value
    path = value.get("class_path") if hasattr(value, "get") else None
    return str(path or "")


def check_sharding(subcommand: str | None, config) -> None:
    """Refuse, before anything is built, a sharded run the suite cannot do, naming the setting and the way
    out (see the module). ``config`` is the subcommand's parsed config (``trainer``, ``model``)."""
    trainer = config.trainer
    strategy = trainer.strategy
    name = _class_path(strategy)
    if name in FSDP1_NAMES or name.endswith(".FSDPStrategy"):
        raise ValueError(
            f"--trainer.strategy {name}: the suite shards with FSDP2 (torch.distributed.fsdp.fully_shard), not "
            "Lightning's FSDPStrategy (FSDP1, which needs a GPU and flattens the parameters the optimizer groups "
            "by name). Use --trainer.strategy fsdp.")
    if not is_fsdp(strategy):
        return
    precision = str(trainer.precision)
    if precision in ("16-mixed", "16"):
        raise ValueError(
            f"--trainer.strategy fsdp with --trainer.precision {precision}: Lightning's FSDP2 strategy "
            "(ModelParallelStrategy) has no gradient scaler for sharded fp16 gradients and takes 32-true, bf16-mixed, "
            "bf16-true or 16-true. Use --trainer.precision bf16-mixed, or --trainer.strategy ddp for 16-mixed.")
    if subcommand not in (None, "fit"):
        return  # evaluation: no optimizer, no averaging, nothing below applies
    averaging = [_class_path(c) for c in (trainer.callbacks or []) if "WeightAveraging" in _class_path(c)]
    if averaging:
        raise ValueError(
            f"--trainer.strategy fsdp with {averaging[0]}: the average is a whole copy of the model on every rank, "
            "updated from parameters that FSDP2 holds as shards (and FSDP2's modules cannot be deep-copied). Train "
            "EMA recipes with --trainer.strategy ddp, or leave the callback out of trainer.callbacks.")
    model = config.get("model") or {}
    if model.get("compile"):
        raise ValueError(
            f"--trainer.strategy fsdp with --model.compile {model.get('compile')}: the task compiles its blocks in "
            "configure_model, before the strategy shards them, and FSDP2 is meant to wrap modules before they are "
            "compiled (untested the other way round). Drop --model.compile, or compile under --trainer.strategy ddp.")
    if trainer.get("sync_batchnorm"):
        raise ValueError(
            "--trainer.strategy fsdp with --trainer.sync_batchnorm true: the FSDP2 strategy does not convert "
            "BatchNorm layers, so their statistics would stay per rank. Use --trainer.strategy ddp for "
            "synchronised BatchNorm.")


#: how long a collective may wait for a peer before the process group gives up, under ``ddp`` and ``fsdp``:
#: torch's own default for NCCL (``torch.distributed.constants.default_pg_nccl_timeout``, 10 minutes in
#: torch 2.14.1) instead of the 30 minutes Lightning gives every backend. It bounds what no other mechanism
#: does: a rank on another node that died. Then NCCL's watchdog, with torch's default
#: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, aborts the collective and takes the process down, and the other
#: ranks follow (:class:`tasks.cli.preemption.PeerWatch` on a node, the launcher across nodes); a rank on the
#: same node that died ends its peers within seconds through PeerWatch, on any backend. 10 minutes is above
#: the longest wait the suite's collectives legitimately have: rank 0 writing the largest recipe's
#: checkpoint while the others wait in the barrier after it, or one rank compiling its first step.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def watch_peers_before_rendezvous(strategy: ParallelStrategy) -> None:
    """Start the fit's :class:`tasks.cli.preemption.PeerWatch` from ``strategy.setup_environment``, before the
    process group's rendezvous: a rank killed inside ``init_process_group`` would otherwise leave the others in
    it until :data:`COLLECTIVE_TIMEOUT`, since Lightning calls the callbacks' ``setup`` only after it. Lightning's
    launcher has started this node's other ranks by then (``launcher.procs`` on rank 0, ``LOCAL_RANK`` on the
    others), which is what the watch follows."""
    from tasks.cli.preemption import Preemption

    trainer = strategy.lightning_module.trainer
    if trainer.state.fn != TrainerFn.FITTING or strategy.num_nodes * strategy.num_processes < 2:
        return
    for callback in trainer.callbacks:
        if isinstance(callback, Preemption):
            callback.watch_peers(trainer)


class WatchedDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose fit watches its peer ranks from before the rendezvous
    (:func:`watch_peers_before_rendezvous`)."""

    def setup_environment(self) -> None:
        watch_peers_before_rendezvous(self)
        super().setup_environment()


def sharded_strategy(strategy: Any) -> Any:
    """The strategy the Trainer gets for a ``trainer.strategy`` value: ``fsdp`` becomes a
    :class:`FullyShardedStrategy` and ``ddp`` a :class:`WatchedDDPStrategy`, both with :data:`COLLECTIVE_TIMEOUT`
    and watching their peers from before the rendezvous; anything else is returned as it is."""
    if strategy == FSDP:
        return FullyShardedStrategy(timeout=COLLECTIVE_TIMEOUT)
    if strategy == "ddp":
        return WatchedDDPStrategy(timeout=COLLECTIVE_TIMEOUT)
    return strategy
