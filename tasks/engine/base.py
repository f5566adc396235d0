"""What every task's LightningModule shares, so that every promise of the suite holds in every
task: hyper-parameters in the checkpoint, the non-finite-loss guard, exact evaluation losses,
data-identity checks, RNG states for exact resume, and where `test`/`predict` write."""
from __future__ import annotations

import math
import warnings
from typing import Any, Literal

import torch
import torch.nn as nn
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics import MeanMetric

from layers.compat import skip_update_on_device, supports_device_skip
from layers.compile import compile_mode, compile_networks, cpu_compile_notice
from tasks.engine.checkpoints import plain, qualified_name, rng_states, set_rng_states
from tasks.engine.compile_report import CompileReport
from tasks.engine.cost import model_cost, move_to
from tasks.engine.nonfinite import LossVerdict
from tasks.engine.optim import param_groups
from tasks.outputs.common import MetricsJson, PredictWriter, WandbTestTables, gather, predict_dir


def zero_loss(module: nn.Module) -> torch.Tensor:
    """A zero loss that reaches every trainable parameter of ``module`` (DDP's gradient all-reduce
    waits for all of them)."""
    return sum(p.sum() for p in module.parameters() if p.requires_grad) * 0.0


class SharedFactory:
    """A stateless factory (the optimizer/scheduler callable LightningCLI injects) that copies
    of the module share instead of duplicating. EMAWeightAveraging deep-copies the whole
    LightningModule; jsonargparse's callables reference the CLI that built them and, under
    DDP, through it the process group, whose locks cannot be copied."""

    def __init__(self, factory):
        self.factory = factory

    def __call__(self, *args, **kwargs):
        return self.factory(*args, **kwargs)

    def __deepcopy__(self, memo) -> "SharedFactory":
        return self


class TaskModule(LightningModule):
    """Base of the four task modules: what every task promises lives here, so no task can opt out.

    - The checkpoint carries the model: the constructor's arguments (backbone and head class
      paths with their arguments, and the values that come from the data, named in
      :attr:`DATA_LINKS`) are saved as hyper-parameters, so ``validate``/``test``/``predict
      --ckpt_path X`` and ``Task.load_from_checkpoint(X)`` rebuild the exact model.
    - :meth:`training_step` runs the task's :meth:`training_loss` and guards it: a non-finite
      loss on any rank makes that step's optimizer update a no-op on every rank, and then stops
      the run before any later checkpoint (or skips and counts the step); a batch whose images
      were all unreadable (``{"skipped": n}``) is skipped the same way. The verdict is reached on
      the device, so a training step never makes the host wait for the GPU (:meth:`guard_loss`).
    - Evaluation losses are sample-weighted means over the whole split (:meth:`log_eval_loss`),
      so the logged and written numbers are the same under 1 and N processes.
    - A checkpoint evaluated on a dataset whose classes / category ids / vocabulary differ from
      the ones it was trained on is refused (:meth:`check_data_identity`).

    Args:
        optimizer: a callable taking parameter groups (LightningCLI injects it from YAML).
        scheduler: a callable taking the optimizer; stepped every optimizer step. A
            ``total_steps`` attribute left at ``None`` is filled from the trainer.
        no_weight_decay_on_norm_bias: exempt norm weights, biases and 1-d params from decay.
        channels_last: keep weights and images in NHWC (faster convs on GPU with AMP).
        compile: ``torch.compile`` in place, state-dict keys unchanged (:mod:`layers.compile`):
            ``"regional"`` compiles each block the networks repeat (transformer layers, mixer
            blocks) and runs the rest eagerly; ``true`` or ``"network"`` compiles each sub-network
            whole. The first step that meets a new graph pays its compilation; it is logged.
        on_nonfinite_loss: ``"raise"`` stops the run at a NaN/inf loss, naming the step and
            batch; that step's update is never applied and no later checkpoint is written.
            ``"skip"`` skips that step on every rank and counts it (``train/skipped_nonfinite_steps``).
        num_worst_examples: `test` writes this many lowest-scored samples (with their overlays)
            under ``predictions/worst/``; 0 writes none.
    """

    #: datamodule attribute -> constructor argument, for every value that comes from the data
    #: (the CLI links them on ``fit``; a checkpoint supplies them on ``validate/test/predict``)
    DATA_LINKS: dict[str, str] = {}

    def __init__(self, optimizer: OptimizerCallable = torch.optim.AdamW,
                 scheduler: LRSchedulerCallable | None = None, no_weight_decay_on_norm_bias: bool = True,
                 channels_last: bool = False, compile: bool | Literal["network", "regional"] = False,
                 on_nonfinite_loss: Literal["raise", "skip"] = "raise", num_worst_examples: int = 16):
        super().__init__()
        # Lightning collects the arguments of the whole constructor chain (under LightningCLI: the resolved
        # config, class paths and their arguments, which load_from_checkpoint rebuilds). Built in Python,
        # the modules and callables passed in cannot go into a weights-only checkpoint: saved again without them.
        with warnings.catch_warnings():  # Lightning's advice to ignore module arguments: done just below
            warnings.filterwarnings("ignore", message=r"Attribute '\w+' is an instance of `nn.Module`")
            self.save_hyperparameters()
        unsaved = [name for name, value in self.hparams.items() if isinstance(value, nn.Module) or callable(value)]
        if unsaved:
            self.save_hyperparameters(ignore=unsaved)
        self.optimizer = SharedFactory(optimizer)
        self.scheduler = SharedFactory(scheduler) if scheduler is not None else None
        self.no_weight_decay_on_norm_bias = no_weight_decay_on_norm_bias
        self.channels_last = channels_last
        self.compile_mode = compile_mode(compile)
        self.on_nonfinite_loss = on_nonfinite_loss
        self.skipped_nonfinite_steps = 0
        self._logged_nonfinite_steps = 0
        self.skipped_empty_batches = 0
        self._verdicts: list[LossVerdict] = []  # loss verdicts on their way to the host, oldest first
        self._step_usable: torch.Tensor | None = None  # device verdict of this optimizer step's batches
        # sample-weighted means of the evaluation loss, synced exactly over ranks by torchmetrics
        self.eval_losses = nn.ModuleDict({"val": MeanMetric(), "test": MeanMetric()})
        self.num_worst_examples = num_worst_examples
        #: the numbers `test` computed, set by the task at the end of its test epoch (``metrics.json``)
        self.test_metrics: dict[str, float] | None = None

    # -- model set-up -------------------------------------------------------------------------
    def example_input(self, datamodule) -> Any:
        """One batch-1 input of :meth:`forward` at ``datamodule``'s evaluation size (a tensor, or a
        tuple of positional arguments), or ``None`` when the size is unknown. It gives the model
        summary its FLOPs and ``metrics.json`` its ``gflops``."""
        return None

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and self.example_input_array is None:
            self.example_input_array = self.example_input(datamodule)

    def model_cost(self) -> dict[str, float]:
        """``params`` and, at the example input's size, ``gflops`` and ``gmacs`` (see :mod:`tasks.engine.cost`)."""
        example = self.example_input_array
        return model_cost(self, move_to(example, self.device) if example is not None else None)

    def configure_model(self) -> None:
        if self.channels_last:
            self.to(memory_format=torch.channels_last)
        if self.compile_mode and not getattr(self, "_compiled", False):
            networks = [child for child in self.children() if any(True for _ in child.parameters())]
            rank_zero_info(compile_networks(networks, self.compile_mode))
            if self.training_device().type == "cpu":
                rank_zero_warn(cpu_compile_notice(self.compile_mode))
            self._compiled = True

    def training_device(self) -> torch.device:
        """The device the run computes on; in ``configure_model`` the weights may not be there yet."""
        try:
            return self.trainer.strategy.root_device
        except RuntimeError:  # not attached to a Trainer
            return self.device

    def configure_callbacks(self) -> list:
        """The compile report (when compiling) and the files `test` and `predict` write: ``metrics.json``,
        the task's :meth:`output_callbacks`, then the wandb tables that read them."""
        compiling = [CompileReport()] if self.compile_mode else []
        return [*compiling, MetricsJson(), *self.output_callbacks(), WandbTestTables()]

    def to_memory_format(self, images: torch.Tensor) -> torch.Tensor:
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.optimizer(param_groups(self, self.no_weight_decay_on_norm_bias))
        if self.scheduler is None:
            return {"optimizer": optimizer}
        scheduler = self.scheduler(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's mixed-precision plugin refuses to clip for a fused optimizer (the demo recipes'
        Adam/AdamW), which unscales fp16 gradients inside its step. Under bf16 there is no scaler and
        nothing to unscale, so clip exactly as in full precision. Under fp16 the gradients are
        unscaled first (``GradScaler.unscale_``), which tells the scaler's step that the fused
        optimizer must not unscale them again, and then clipped."""
        from lightning.pytorch.plugins.precision import MixedPrecision
        from lightning.pytorch.utilities import GradClipAlgorithmType

        plugin = self.trainer.precision_plugin
        fused = bool(optimizer.defaults.get("fused"))
        if gradient_clip_val and isinstance(plugin, MixedPrecision) and (plugin.scaler is None or fused):
            if plugin.scaler is not None:  # a fused step would unscale inside itself, after our clipping
                plugin.scaler.unscale_(optimizer)
            # the plugin's own clipping, without the fused-optimizer refusal of its clip_gradients
            if GradClipAlgorithmType(gradient_clip_algorithm or "norm") == GradClipAlgorithmType.VALUE:
                plugin.clip_grad_by_value(optimizer, gradient_clip_val)
            else:
                plugin.clip_grad_by_norm(optimizer, gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_start(self) -> None:
        # Filled here, not in configure_optimizers: estimated_stepping_batches builds the train
        # loader, which must happen after a checkpoint restored the loop position (exact resume).
        for config in self.trainer.lr_scheduler_configs:
            if getattr(config.scheduler, "total_steps", 0) is None:
                total = self.trainer.estimated_stepping_batches
                if not math.isfinite(total):
                    raise ValueError("the schedule needs trainer.max_epochs or trainer.max_steps to know its length")
                config.scheduler.total_steps = int(total)

    # -- training, guarded ----------------------------------------------------------------------
    def training_loss(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The task's training loss for one batch (a scalar tensor); log what it wants to show."""
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        skipped = batch.get("skipped", 0) if isinstance(batch, dict) else 0
        if skipped:
            self.log("data/skipped_images", float(skipped), on_step=False, on_epoch=True, reduce_fx="sum")
        if isinstance(batch, dict) and set(batch) == {"skipped"}:  # every image of the batch was unreadable
            return self.guard_loss(None, batch_idx)
        self.check_batchnorm_batch(batch, batch_idx)
        return self.guard_loss(self.training_loss(batch, batch_idx), batch_idx)

    def check_batchnorm_batch(self, batch: Any, batch_idx: int) -> None:
        """Refuse a training batch of one image (``batch["image"]`` (1,C,H,W)) when a BatchNorm
        layer trains on this rank's batch alone: it cannot take statistics of one value per channel,
        and PyTorch's own error names neither the batch size nor a remedy."""
        images = batch.get("image") if isinstance(batch, dict) else None
        if not torch.is_tensor(images) or images.ndim != 4 or images.shape[0] != 1:
            return
        per_rank = [m for m in self.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
                    and not (isinstance(m, nn.SyncBatchNorm) and self.trainer.world_size > 1)]
        if not per_rank:
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        size = datamodule.hparams.get("batch_size") if datamodule is not None else None
        raise ValueError(
            f"a training batch of 1 image at global step {self.global_step} (epoch {self.current_epoch}, "
            f"batch {batch_idx}; data.batch_size={size}, {self.trainer.world_size} process(es)): the network's "
            "BatchNorm layers cannot take batch statistics of a single image. Train with --data.batch_size 2 or "
            "more per process (the training loaders drop an incomplete last batch once the training split holds "
            "more images than one batch), or give the training split more than one image per process.")

    def guard_loss(self, loss: torch.Tensor | None, batch_idx: int) -> torch.Tensor | None:
        """Return the loss to train on; the verdict on it is reached on the device.

        The host never waits for the loss (on a GPU that would stall the queue of kernels every
        step). Instead the verdict (finite, and on every rank) is computed on the device, copied
        to the host without waiting, and :meth:`on_before_optimizer_step` makes the optimizer's
        update conditional on it (see there). The host reads the verdict later, at the latest
        before the next checkpoint, validation or the end of training; a non-finite loss then
        raises (naming its step and batch) or, with ``on_nonfinite_loss=skip``, is warned about
        and counted. ``loss=None`` (a batch with nothing left to train on) is known on the host:
        in one process Lightning skips that step; under DDP the rank trains on a zero loss that
        reaches every parameter, so the gradient all-reduce the other ranks wait for happens,
        and the verdict skips the update on every rank."""
        empty = loss is None
        distributed = self.trainer.world_size > 1
        if empty and not distributed:
            self._count_empty_batch(self._where(self.global_step, self.current_epoch, batch_idx))
            return None
        if empty:
            loss = zero_loss(self)
        finite = torch.isfinite(loss.detach()).all()
        # a batch with nothing to train on is not a non-finite loss: finite, but not usable
        verdict = torch.stack([finite, torch.zeros_like(finite) if empty else finite]).float()
        if distributed:  # every rank skips if one must; no barrier, so the host does not wait
            torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN)
        usable = verdict[1] > 0
        self._step_usable = usable if self._step_usable is None else self._step_usable & usable
        self._verdicts.append(LossVerdict.copy(self.global_step, self.current_epoch, batch_idx,
                                               torch.cat([verdict, loss.detach().float().reshape(1)])))
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply this step's loss verdict to the update, on the device where the optimizer allows it.

        A fused optimizer (``fused=True``: Adam, AdamW, SGD, Adagrad) skips its whole update, state
        and step count included, when its ``found_inf`` tensor is non-zero (the mechanism a
        gradient scaler uses, :func:`skip_update_on_device`). Under fp16 the scaler sets that
        tensor itself from its check of the gradients, so a step to skip gets a non-finite
        gradient instead. Other optimizers, and a fused one before its first update (fused SGD
        leaves its momentum buffer uninitialised when its first update is skipped), read the
        verdict on the host here, after the backward is queued: a non-finite loss raises before
        the update, and a step to skip drops its gradients. With gradient accumulation one
        unusable batch skips the whole accumulated step."""
        usable, self._step_usable = self._step_usable, None
        if usable is None:  # nothing was trained on: no gradients to apply
            return
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if supports_device_skip(optimizer) and scaler is not None:
            grads = (p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
            grad = next(grads, None)
            if grad is not None:
                grad.masked_fill_(~usable, float("nan"))
            return
        if supports_device_skip(optimizer) and optimizer.state:
            skip_update_on_device(optimizer, ~usable)
            return
        if not all(ok for step, ok in self._resolve_verdicts(wait=True, log=True) if step == self.global_step):
            optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        from lightning.pytorch.core.optimizer import LightningOptimizer

        try:
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        finally:  # the verdict was this step's only
            skip_update_on_device(optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer, None)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # under DDP every rank must stop at the same step: wait for the verdicts; alone, read the ready ones
        self._resolve_verdicts(wait=self.trainer.world_size > 1, log=True)

    def on_train_epoch_end(self) -> None:
        self._resolve_verdicts(wait=True, log=False)

    def on_train_end(self) -> None:
        self._resolve_verdicts(wait=True, log=False)

    def _resolve_verdicts(self, wait: bool, log: bool) -> list[tuple[int, bool]]:
        """Read the loss verdicts that reached the host (all of them with ``wait``), oldest first:
        raise at a non-finite loss (``on_nonfinite_loss=raise``), or warn and count the skipped
        step. Returns ``(global step, usable)`` of each verdict read."""
        read = []
        while self._verdicts and (wait or self._verdicts[0].ready()):
            record = self._verdicts.pop(0)
            finite, usable, value = record.read()
            read.append((record.step, usable))
            if usable:
                continue
            where = self._where(record.step, record.epoch, record.batch)
            if not finite and self.on_nonfinite_loss == "raise":
                self._verdicts.clear()
                shown = f"{value}" if not math.isfinite(value) else "on another rank"
                raise FloatingPointError(
                    f"non-finite loss ({shown}) at {where}; its optimizer step made no update, and the run stopped "
                    "before any later checkpoint, so no checkpoint holds the result. Lower the learning rate, check "
                    "the batch, or set model.on_nonfinite_loss=skip to skip and count such steps.")
            if finite:
                self._count_empty_batch(where)
                continue
            self.skipped_nonfinite_steps += 1
            rank_zero_warn(f"non-finite loss at {where}: step skipped ({self.skipped_nonfinite_steps} so far)")
        if log and self.skipped_nonfinite_steps != self._logged_nonfinite_steps:
            self.log("train/skipped_nonfinite_steps", float(self.skipped_nonfinite_steps), reduce_fx="max")
            self._logged_nonfinite_steps = self.skipped_nonfinite_steps
        return read

    def _count_empty_batch(self, where: str) -> None:
        self.skipped_empty_batches += 1
        rank_zero_warn(f"no readable image left in the batch at {where} (on some rank): step skipped")

    @staticmethod
    def _where(step: int, epoch: int, batch_idx: int) -> str:
        return f"global step {step} (epoch {epoch}, batch {batch_idx})"

    # -- evaluation ----------------------------------------------------------------------------------
    def log_eval_loss(self, stage: str, loss: torch.Tensor, weight: float | int) -> None:
        """Add a batch's mean loss with its weight (images, target tokens, positive anchors) to the
        split's running mean, logged as ``<stage>/loss`` once per epoch: exact under DDP."""
        metric = self.eval_losses[stage]
        metric.update(loss.detach().float(), weight=float(weight))
        self.log(f"{stage}/loss", metric, on_step=False, on_epoch=True)

    def data_identity(self) -> dict[str, Any]:
        """The values this model took from its training data (constructor arguments in :attr:`DATA_LINKS`)."""
        return {arg: self.hparams.get(arg) for arg in self.DATA_LINKS.values() if arg in self.hparams}

    def data_identity_mismatches(self, datamodule) -> list[str]:
        """What differs between the data this model was trained on and ``datamodule``'s data."""
        mismatches = []
        for attr, arg in self.DATA_LINKS.items():
            mine = self.hparams.get(arg)
            if mine is None:
                continue
            theirs = getattr(datamodule, attr)
            theirs = list(theirs) if isinstance(theirs, (list, tuple)) else theirs
            mine = list(mine) if isinstance(mine, (list, tuple)) else mine
            if mine != theirs:
                mismatches.append(f"{arg}: model {_short(mine)} vs data {_short(theirs)}")
        return mismatches

    def check_data_identity(self) -> None:
        """Refuse to score a dataset whose classes / category ids / vocabulary are not the model's:
        the labels would silently mean something else."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None:
            return
        mismatches = self.data_identity_mismatches(datamodule)
        if mismatches:
            source = f"checkpoint {self.trainer.ckpt_path}" if self.trainer.ckpt_path else "the model"
            raise ValueError(f"{source} was trained on other data than data.root={getattr(datamodule, 'root', None)}: "
                             + "; ".join(mismatches)
                             + ". Evaluate it on data with the same classes (ids, vocabulary), or fine-tune it with fit.")

    def on_validation_start(self) -> None:
        self._resolve_verdicts(wait=True, log=False)  # no validation of a run that must stop
        if not self.trainer.sanity_checking:
            self.check_data_identity()

    def on_test_start(self) -> None:
        self.check_data_identity()

    # -- checkpoints ------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._resolve_verdicts(wait=True, log=False)  # a run that must stop writes no checkpoint
        # resuming mid-epoch replays dropout and augmentation draws exactly only with the RNG states
        checkpoint["rng_states"] = rng_states()
        checkpoint["suite_task"] = qualified_name(type(self))
        checkpoint["hyper_parameters"] = without_start_weights(checkpoint.get("hyper_parameters", {}))
        group = getattr(self, "wandb_group", None)
        if group:
            checkpoint["wandb_group"] = group

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "rng_states" in checkpoint and self._trainer is not None and self._trainer.state.fn == "fit":
            set_rng_states(checkpoint["rng_states"])
        saved = checkpoint.get("hyper_parameters", {})
        differing = [f"{arg}: checkpoint {_short(saved[arg])} vs now {_short(value)}"
                     for arg, value in self.data_identity().items()
                     if arg in saved and plain(saved[arg]) != plain(value)]
        if differing:
            raise ValueError("the checkpoint was trained on other data than this run's: " + "; ".join(differing))
        self.skipped_nonfinite_steps = self._logged_nonfinite_steps = 0

    # -- what `test` and `predict` leave for their output callbacks (tasks/outputs/) -----------------------
    def output_callbacks(self) -> list:
        """The task's own output callbacks (:mod:`tasks.outputs`), numbers before pictures; the suite adds
        ``metrics.json`` before them and the wandb tables after them (:meth:`configure_callbacks`)."""
        return []

    @property
    def predict_destination(self) -> str:
        """Where `predict` wrote, as the CLI prints it: its writer's destination."""
        writer = next((cb for cb in self.trainer.callbacks if isinstance(cb, PredictWriter)), None)
        return writer.destination(self.trainer) if writer is not None else str(predict_dir(self.trainer).resolve())

    def eval_loss_value(self, stage: str) -> dict[str, float]:
        """``{"<stage>/loss": value}``, the sample-weighted mean over every rank's batches (empty when
        no batch had a loss). Called by every rank: computing the metric syncs it."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "compute before update" when a split had no labelled batch
            value = float(self.eval_losses[stage].compute())
        return {f"{stage}/loss": value} if math.isfinite(value) else {}

    def all_gather_objects(self, items: list) -> list:
        """Concatenate a per-rank Python list over all ranks (uneven lengths are fine), e.g. the
        hypotheses a corpus metric scores."""
        return gather(self.trainer, items)

def without_start_weights(hparams: dict[str, Any]) -> dict[str, Any]:
    """Saved constructor arguments without the weights training started from (``weights``, the backbone's
    ``pretrained``): the checkpoint's own weights replace them, so rebuilding it (``--ckpt_path``,
    ``tasks.load``) needs no start file, which the machine that evaluates may not have."""
    hparams = dict(hparams)
    if hparams.get("weights") is not None:
        hparams["weights"] = None
    backbone = hparams.get("backbone")
    init_args = backbone.get("init_args") if isinstance(backbone, dict) else None
    if isinstance(init_args, dict) and init_args.get("pretrained") is not None:
        hparams["backbone"] = {**backbone, "init_args": {**init_args, "pretrained": None}}
    return hparams


def _short(value, limit: int = 6) -> str:
    if isinstance(value, (list, tuple)):
        head = ", ".join(repr(v) for v in list(value)[:limit])
        return f"[{head}{', ...' if len(value) > limit else ''}] ({len(value)})"
    return repr(value)
