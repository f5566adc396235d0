"""What every task's LightningModule shares: optimizer/scheduler setup from YAML,
channels_last and torch.compile switches, and where `test` writes its outputs."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from tasks.optim import param_groups


def rng_states() -> dict[str, Any]:
    """Global RNG states of torch (CPU and CUDA), numpy and Python as tensors and plain
    values, so a checkpoint holding them still loads with ``weights_only=True``."""
    state, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [state, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "python": [version, list(internal), gauss],
    }


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    state, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((state, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))


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
    """Base of the four task modules.

    Args:
        optimizer: a callable taking parameter groups (LightningCLI injects it from YAML).
        scheduler: a callable taking the optimizer; stepped every optimizer step. A
            ``total_steps`` attribute left at ``None`` is filled from the trainer.
        no_weight_decay_on_norm_bias: exempt norm weights, biases and 1-d params from decay.
        channels_last: keep weights and images in NHWC (faster convs on GPU with AMP).
        compile: ``torch.compile`` each sub-network in place (state-dict keys unchanged).
        on_nonfinite_loss: ``"raise"`` stops the run at a NaN/inf loss, naming the step and
            batch, before the optimizer step can write non-finite weights; ``"skip"`` skips that
            step on every rank and counts it (``train/skipped_nonfinite_steps``).
    """

    def __init__(self, optimizer: OptimizerCallable = torch.optim.AdamW,
                 scheduler: LRSchedulerCallable | None = None, no_weight_decay_on_norm_bias: bool = True,
                 channels_last: bool = False, compile: bool = False,
                 on_nonfinite_loss: Literal["raise", "skip"] = "raise"):
        super().__init__()
        self.optimizer = SharedFactory(optimizer)
        self.scheduler = SharedFactory(scheduler) if scheduler is not None else None
        self.no_weight_decay_on_norm_bias = no_weight_decay_on_norm_bias
        self.channels_last = channels_last
        self.compile_networks = compile
        self.on_nonfinite_loss = on_nonfinite_loss
        self.skipped_nonfinite_steps = 0

    # -- model set-up -------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.channels_last:
            self.to(memory_format=torch.channels_last)
        if self.compile_networks and not getattr(self, "_compiled", False):
            for child in self.children():
                if any(True for _ in child.parameters()):
                    child.compile()
            self._compiled = True

    def to_memory_format(self, images: torch.Tensor) -> torch.Tensor:
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.optimizer(param_groups(self, self.no_weight_decay_on_norm_bias))
        if self.scheduler is None:
            return {"optimizer": optimizer}
        scheduler = self.scheduler(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        # Filled here, not in configure_optimizers: estimated_stepping_batches builds the train
        # loader, which must happen after a checkpoint restored the loop position (exact resume).
        for config in self.trainer.lr_scheduler_configs:
            if getattr(config.scheduler, "total_steps", 0) is None:
                total = self.trainer.estimated_stepping_batches
                if not math.isfinite(total):
                    raise ValueError("the schedule needs trainer.max_epochs or trainer.max_steps to know its length")
                config.scheduler.total_steps = int(total)

    # -- faults and exact resume ---------------------------------------------------------------
    def guard_loss(self, loss: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        """Return ``loss`` if it is finite on every rank; otherwise raise or (``on_nonfinite_loss=skip``)
        return ``None``, which makes Lightning skip backward and the optimizer step. Ranks agree
        on the verdict, so DDP never waits on a rank that skipped."""
        finite = torch.isfinite(loss.detach()).all()
        if self.trainer.world_size > 1:
            finite = self.trainer.strategy.reduce(finite.float(), reduce_op="min") > 0
        if finite:
            return loss
        where = f"global step {self.global_step} (epoch {self.current_epoch}, batch {batch_idx})"
        if self.on_nonfinite_loss == "skip":
            self.skipped_nonfinite_steps += 1
            rank_zero_warn(f"non-finite loss at {where}: step skipped "
                           f"({self.skipped_nonfinite_steps} so far)")
            self.log("train/skipped_nonfinite_steps", float(self.skipped_nonfinite_steps), reduce_fx="max")
            return None
        raise FloatingPointError(
            f"non-finite loss ({loss.detach().float().item()}) at {where}; stopped before the optimizer step, so "
            "no checkpoint holds the result. Lower the learning rate, check the batch, or set "
            "model.on_nonfinite_loss=skip to skip and count such steps.")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # resuming mid-epoch replays dropout and augmentation draws exactly only with the RNG states
        checkpoint["rng_states"] = rng_states()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "rng_states" in checkpoint and self.trainer is not None and self.trainer.state.fn == "fit":
            set_rng_states(checkpoint["rng_states"])
        self.skipped_nonfinite_steps = 0

    # -- outputs of `test` ----------------------------------------------------------------------
    @property
    def predictions_dir(self) -> Path:
        """``<trainer.default_root_dir>/predictions``, where `test` writes what it scored."""
        return Path(self.trainer.default_root_dir) / "predictions"

    @rank_zero_only
    def write_metrics_json(self, metrics: dict[str, float]) -> Path:
        """Write ``metrics.json`` (metric name -> value, the numbers that were logged)."""
        self.predictions_dir.mkdir(parents=True, exist_ok=True)
        path = self.predictions_dir / "metrics.json"
        clean = {k: float(v) for k, v in metrics.items()}
        path.write_text(json.dumps(clean, indent=2, sort_keys=True) + "\n")
        return path

    def all_gather_objects(self, items: list) -> list:
        """Concatenate a per-rank Python list over all ranks (uneven lengths are fine).
        For what `test` writes: detections, file names, hypotheses."""
        if self.trainer.world_size == 1 or not torch.distributed.is_initialized():
            return list(items)
        gathered: list[list] = [None] * self.trainer.world_size  # type: ignore[list-item]
        torch.distributed.all_gather_object(gathered, items)
        return [item for rank_items in gathered for item in rank_items]

    # -- logging helpers --------------------------------------------------------------------------
    @property
    def wandb_logger(self):
        """The WandbLogger on rank 0, else ``None`` (tasks log media only when it exists)."""
        from lightning.pytorch.loggers import WandbLogger

        if self.global_rank != 0:
            return None
        return next((lg for lg in self.loggers if isinstance(lg, WandbLogger)), None)
