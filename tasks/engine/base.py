"""What every task's LightningModule shares, so that every promise of the suite holds in every
task: hyper-parameters in the checkpoint, the non-finite-loss guard, exact evaluation losses,
data-identity checks, RNG states for exact resume, and where `test`/`predict` write."""
from __future__ import annotations

import math
import warnings
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics import MeanMetric

from layers.checkpointing import checkpoint_networks
from layers.compile import compile_mode, compile_networks, cpu_compile_notice
from tasks.engine.checkpoints import qualified_name, rng_states, set_rng_states, without_start_weights
from tasks.engine.data_checks import (data_identity_mismatches, refuse_checkpoint_of_other_data, refuse_other_data,
                                      refuse_single_image_batchnorm)
from tasks.engine.compile_report import CompileReport
from tasks.engine.cost import model_cost, move_to
from tasks.engine.ema import use_foreach_ema
from tasks.engine.nonfinite import DDP_VERDICT_LAG, NonFiniteGuard
from tasks.engine.optim import build_optimizer
from tasks.outputs.common import MetricsJson, PredictWriter, TestTables, gather, predict_dir


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
    - A Lightning ``EMAWeightAveraging`` (the paper recipes' EMA) averages with foreach kernels and
      never makes the host read its counter (:mod:`tasks.engine.ema`, swapped in by :meth:`setup`).
    - A checkpoint evaluated on a dataset whose classes / category ids / vocabulary differ from
      the ones it was trained on is refused (:meth:`check_data_identity`).

    Args:
        optimizer: a callable taking parameter groups (LightningCLI injects it from YAML).
        scheduler: a callable taking the optimizer; stepped every optimizer step. A
            ``total_steps`` attribute left at ``None`` is filled from the trainer.
        no_weight_decay_on_norm_bias: exempt norm weights, biases and 1-d params from decay.
        channels_last: keep weights and images in NHWC (faster convs on GPU with AMP).
        layer_decay: layer-wise learning-rate decay (BEiT; timm's ``--layer-decay``), e.g. 0.65 to
            fine-tune: the head's groups train at the optimizer's rate and each layer below at
            ``layer_decay`` times the rate of the one above (:func:`tasks.engine.optim.layer_ids`:
            backbone stem, blocks, final norm, then heads; for translation the encoder's layers, then
            the decoder's, then its embeddings at the top); ``None``: one rate.
        activation_checkpointing: recompute each repeated block's activations in the backward pass
            instead of keeping them (:mod:`layers.checkpointing`): less memory, about one more forward.
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
                 on_nonfinite_loss: Literal["raise", "skip"] = "raise", num_worst_examples: int = 16,
                 layer_decay: float | None = None, activation_checkpointing: bool = False):
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
        self.layer_decay = layer_decay
        self.activation_checkpointing = activation_checkpointing
        self.compile_mode = compile_mode(compile)
        self.nonfinite_guard = NonFiniteGuard(on_nonfinite_loss)
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
        if stage == "fit":  # after the callbacks' setup, which built their averages, before any checkpoint loads
            for callback in self.trainer.callbacks:
                if isinstance(callback, WeightAveraging):
                    use_foreach_ema(callback)

    def model_cost(self) -> dict[str, float]:
        """``params`` and, at the example input's size, ``gflops`` and ``gmacs`` (see :mod:`tasks.engine.cost`)."""
        example = self.example_input_array
        return model_cost(self, move_to(example, self.device) if example is not None else None)

    def configure_model(self) -> None:
        if self.channels_last:
            self.to(memory_format=torch.channels_last)
        networks = [child for child in self.children() if any(True for _ in child.parameters())]
        if self.activation_checkpointing and not getattr(self, "_checkpointed", False):
            rank_zero_info(checkpoint_networks(networks))  # before compile, which compiles the wrapped blocks
            self._checkpointed = True
        if self.compile_mode and not getattr(self, "_compiled", False):
            rank_zero_info(compile_networks(networks, self.compile_mode))
            if self.training_device().type == "cpu":
                rank_zero_warn(cpu_compile_notice(self.compile_mode))
            self._compiled = True

    def fitting(self) -> bool:
        """Whether the module is attached to a Trainer that runs ``fit``."""
        try:
            return self.trainer.state.fn == "fit"
        except RuntimeError:  # not attached to a Trainer
            return False

    def training_device(self) -> torch.device:
        """The device the run computes on; in ``configure_model`` the weights may not be there yet."""
        try:
            return self.trainer.strategy.root_device
        except RuntimeError:  # not attached to a Trainer
            return self.device

    def configure_callbacks(self) -> list:
        """The compile report (when compiling) and the files `test` and `predict` write: ``metrics.json``,
        the task's :meth:`output_callbacks`, then the logged tables that read them."""
        compiling = [CompileReport()] if self.compile_mode else []
        return [*compiling, MetricsJson(), *self.output_callbacks(), TestTables()]

    def to_memory_format(self, images: torch.Tensor) -> torch.Tensor:
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images

    def configure_optimizers(self) -> dict[str, Any]:
        return build_optimizer(self, self.optimizer, self.scheduler, self.no_weight_decay_on_norm_bias,
                               self.layer_decay)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip as Lightning does, with two changes.

        - Lightning's mixed-precision plugin refuses to clip for a fused optimizer (the recipes' Adam/AdamW),
          which unscales fp16 gradients inside its step. Under bf16 there is no scaler and nothing to unscale,
          so clip exactly as in full precision. Under fp16 the gradients are unscaled first
          (``GradScaler.unscale_``), which tells the scaler's step that the fused optimizer must not unscale
          them again, and then clipped.
        - Clipping by norm with Lightning's own precision plugins (32, bf16, fp16) computes the total norm with
          ``torch.nn.utils.clip_grad_norm_`` here; without a gradient scaler (which skips inf/NaN gradients
          itself) that norm joins the step's non-finite verdict on the device
          (:meth:`tasks.engine.nonfinite.NonFiniteGuard.check_gradient_norm`): a NaN gradient from a finite
          loss is not applied."""
        from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
        from lightning.pytorch.utilities import GradClipAlgorithmType

        plugin = self.trainer.precision_plugin
        if not gradient_clip_val or type(plugin) not in (Precision, MixedPrecision, HalfPrecision):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and optimizer.defaults.get("fused"):  # a fused step would unscale after our clipping
            scaler.unscale_(optimizer)
        if GradClipAlgorithmType(gradient_clip_algorithm or "norm") == GradClipAlgorithmType.VALUE:
            plugin.clip_grad_by_value(optimizer, gradient_clip_val)
            return
        total_norm = torch.nn.utils.clip_grad_norm_(list(plugin.main_params(optimizer)), gradient_clip_val)
        if scaler is None and type(total_norm) is torch.Tensor:  # not a sharded (DTensor) norm
            self.nonfinite_guard.check_gradient_norm(self, optimizer, total_norm)

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
        refuse_single_image_batchnorm(self, batch, batch_idx)
        return self.guard_loss(self.training_loss(batch, batch_idx), batch_idx)

    def guard_loss(self, loss: torch.Tensor | None, batch_idx: int) -> torch.Tensor | None:
        """The loss to train on; the verdict on it is reached on the device, so the host never waits for
        the loss (:class:`tasks.engine.nonfinite.NonFiniteGuard`)."""
        return self.nonfinite_guard.guard(self, loss, batch_idx)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.nonfinite_guard.before_optimizer_step(self, optimizer)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        from lightning.pytorch.core.optimizer import LightningOptimizer

        try:
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        finally:
            self.nonfinite_guard.after_optimizer_step(
                optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer,
                getattr(self.trainer.precision_plugin, "scaler", None))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.world_size > 1:
            # every rank must stop at the same step: each reads exactly the verdicts of steps <= N - 2 at step N
            # (waiting for them: their event passed a step ago, so no wait in practice), never a younger one that
            # happens to have arrived on one rank only. Skips were applied on the device already; checkpoints,
            # validation and the end read every verdict (on_save_checkpoint, on_validation_start, on_train_end).
            self.nonfinite_guard.resolve(self, wait=True, log=True, upto=self.global_step - DDP_VERDICT_LAG)
        else:  # alone: read the ones that arrived
            self.nonfinite_guard.resolve(self, wait=False, log=True)

    def on_train_epoch_end(self) -> None:
        self.nonfinite_guard.resolve(self, wait=True, log=False)

    def on_train_end(self) -> None:
        self.nonfinite_guard.resolve(self, wait=True, log=False)

    @property
    def skipped_nonfinite_steps(self) -> int:
        return self.nonfinite_guard.skipped_nonfinite_steps

    @property
    def skipped_empty_batches(self) -> int:
        return self.nonfinite_guard.skipped_empty_batches

    # -- evaluation ----------------------------------------------------------------------------------
    def log_eval_loss(self, stage: str, loss: torch.Tensor, weight: float | int) -> None:
        """Add a batch's mean loss with its weight (images, target tokens, positive anchors) to the
        split's running mean, logged as ``<stage>/loss`` once per epoch: exact under DDP."""
        metric = self.eval_losses[stage]
        metric.update(loss.detach().float(), weight=float(weight))
        self.log(f"{stage}/loss", metric, on_step=False, on_epoch=True)

    def data_identity_mismatches(self, datamodule) -> list[str]:
        """What differs between the data this model was trained on and ``datamodule``'s data."""
        return data_identity_mismatches(self, datamodule)

    def check_data_identity(self) -> None:
        """Refuse to score a dataset whose classes / category ids / vocabulary are not the model's."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None:
            source = f"checkpoint {self.trainer.ckpt_path}" if self.trainer.ckpt_path else "the model"
            refuse_other_data(source, datamodule, self.data_identity_mismatches(datamodule))

    def on_validation_start(self) -> None:
        self.nonfinite_guard.resolve(self, wait=True, log=False)  # no validation of a run that must stop
        if not self.trainer.sanity_checking:
            self.check_data_identity()

    def on_test_start(self) -> None:
        self.check_data_identity()

    # -- checkpoints ------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.nonfinite_guard.resolve(self, wait=True, log=False)  # a run that must stop writes no checkpoint
        # resuming mid-epoch replays dropout and augmentation draws exactly only with the RNG states
        checkpoint["rng_states"] = rng_states()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # every rank's: ranks whose batches differ in shape (translation's token batches) draw different
            # numbers of dropout values, so rank 0's states are not the others' (collective: every rank saves)
            checkpoint["rng_states_per_rank"] = self.all_gather_objects([checkpoint["rng_states"]])
        checkpoint["suite_task"] = qualified_name(type(self))
        checkpoint["hyper_parameters"] = without_start_weights(checkpoint.get("hyper_parameters", {}))
        group = getattr(self, "wandb_group", None)
        if group:
            checkpoint["wandb_group"] = group

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "rng_states" in checkpoint and self.fitting():
            per_rank = checkpoint.get("rng_states_per_rank") or []
            # as many ranks as wrote it: each its own states; another number: rank 0's, as before
            same_ranks = len(per_rank) == self.trainer.world_size
            set_rng_states(per_rank[self.trainer.global_rank] if same_ranks else checkpoint["rng_states"])
        refuse_checkpoint_of_other_data(self, checkpoint)
        self.nonfinite_guard.reset_counts()

    # -- what `test` and `predict` leave for their output callbacks (tasks/outputs/) -----------------------
    def output_callbacks(self) -> list:
        """The task's own output callbacks (:mod:`tasks.outputs`), numbers before pictures; the suite adds
        ``metrics.json`` before them and the logged tables after them (:meth:`configure_callbacks`)."""
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
