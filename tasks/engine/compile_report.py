"""How long compilation held up a compiled run, measured where it happens.

``--model.compile`` compiles lazily: the first training step pays for the training graphs, the
first validation step for the evaluation ones. :class:`CompileReport` times each stage's first
step and the step after it, and says both once, so a user sees what compile cost on their
machine instead of a silent pause. The task adds it through ``configure_callbacks`` when it
compiles; it also puts the numbers in the logger (``compile/first_train_step_s`` ...).
"""
from __future__ import annotations

import time

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info


class CompileReport(Callback):
    """Times the first two steps of training and of validation (device-synchronised) and reports them."""

    def __init__(self) -> None:
        self.durations: dict[str, list[float]] = {"train": [], "validation": []}
        self._started: float | None = None

    def _start(self, stage: str, pl_module: LightningModule) -> None:
        if len(self.durations[stage]) < 2:
            self._synchronize(pl_module)
            self._started = time.perf_counter()

    def _end(self, stage: str, trainer: Trainer, pl_module: LightningModule) -> None:
        durations = self.durations[stage]
        if self._started is None or len(durations) >= 2:
            return
        self._synchronize(pl_module)
        durations.append(time.perf_counter() - self._started)
        self._started = None
        if len(durations) == 2:
            first, second = durations
            rank_zero_info(f"compile: the first {stage} step took {first:.1f} s (compilation included), "
                           f"the next {second:.3f} s")
            for logger in trainer.loggers:
                logger.log_metrics({f"compile/first_{stage}_step_s": first, f"compile/second_{stage}_step_s": second},
                                   step=trainer.global_step)

    @staticmethod
    def _synchronize(pl_module: LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start("train", pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._end("train", trainer, pl_module)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._start("validation", pl_module)  # the sanity check's steps count: they compile the same graphs

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._end("validation", trainer, pl_module)
