"""What every task's LightningModule shares: optimizer/scheduler setup from YAML,
channels_last and torch.compile switches, and where `test` writes its outputs."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_only

from tasks.optim import param_groups


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
    """

    def __init__(self, optimizer: OptimizerCallable = torch.optim.AdamW,
                 scheduler: LRSchedulerCallable | None = None, no_weight_decay_on_norm_bias: bool = True,
                 channels_last: bool = False, compile: bool = False):
        super().__init__()
        self.optimizer = SharedFactory(optimizer)
        self.scheduler = SharedFactory(scheduler) if scheduler is not None else None
        self.no_weight_decay_on_norm_bias = no_weight_decay_on_norm_bias
        self.channels_last = channels_last
        self.compile_networks = compile

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
        if getattr(scheduler, "total_steps", 0) is None:
            total = self.trainer.estimated_stepping_batches
            if not math.isfinite(total):
                raise ValueError("the schedule needs trainer.max_epochs or trainer.max_steps to know its length")
            scheduler.total_steps = int(total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

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
