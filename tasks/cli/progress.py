"""Progress that reads well where the output goes.

On a terminal the CLI shows Lightning's Rich progress bar. When standard output is a file or a
pipe (a SLURM log, ``> log``, CI) a redrawn bar leaves one frame per run; :class:`LineProgress`
prints plain lines instead::

    fit epoch 3/15 step 420/1500 (batch 20/100) loss 1.2345 | 7.9 it/s | 253 img/s, data wait 3.0 % | epoch ETA 0:00:10 | total ETA 0:02:16
    validate: 30/30 batches, 2.1 s | val/top1 0.9123 | val/loss 0.3312
"""
from __future__ import annotations

import sys
import time
from datetime import timedelta

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar


def training_loss(trainer) -> float | None:
    """The last logged training loss as a number: one host read of a device value, so a display calls it at
    its own interval, never every batch (the tasks log ``train/loss`` off the progress bar, whose values
    Lightning turns into numbers every batch)."""
    metrics = trainer.callback_metrics
    loss = metrics.get("train/loss_step", metrics.get("train/loss"))
    return None if loss is None else float(loss)


def stdout_is_terminal() -> bool:
    return sys.stdout.isatty()


def _eta(seconds: float) -> str:
    return str(timedelta(seconds=int(max(seconds, 0))))


class LineProgress(ProgressBar):
    """Plain progress lines: one after the first training step, then one every ``every_n_steps``
    steps or ``every_seconds`` seconds, whichever comes first, with the loss, the rate, the throughput
    (:mod:`tasks.cli.throughput`) and the ETA; one line per evaluation run with its scores. Written to
    standard output on rank 0."""

    def __init__(self, every_n_steps: int = 50, every_seconds: float = 30.0):
        super().__init__()
        self.every_n_steps = every_n_steps
        self.every_seconds = every_seconds
        self._enabled = True
        self._last_print = 0.0
        self._start = 0.0
        self._eval_start = 0.0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _print(self, text: str) -> None:
        if self._enabled and self.trainer.is_global_zero:
            print(text, flush=True)

    # -- training ------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self._start = self._last_print = time.monotonic()
        self._start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.monotonic()
        step = trainer.global_step
        first = step == self._start_step + 1  # show at once that training runs, then at the interval
        due = first or (self.every_n_steps > 0 and step % self.every_n_steps == 0) or \
            now - self._last_print >= self.every_seconds
        if not due:
            return
        self._last_print = now
        rate = (step - self._start_step) / max(now - self._start, 1e-9)
        batches = self.total_train_batches
        max_steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if max_steps is None and trainer.max_epochs and batches != float("inf"):
            max_steps = int(trainer.max_epochs * batches // max(trainer.accumulate_grad_batches, 1))
        parts = [f"fit epoch {trainer.current_epoch + 1}" + (f"/{trainer.max_epochs}" if trainer.max_epochs else ""),
                 f"step {step}" + (f"/{max_steps}" if max_steps else ""),
                 f"(batch {batch_idx + 1}" + (f"/{int(batches)})" if batches != float("inf") else ")")]
        loss = training_loss(trainer)
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        line = " ".join(parts) + f" | {rate:.2f} it/s"
        for callback in trainer.callbacks:  # tasks.cli.throughput.Throughput: "812 img/s, data wait 3.0 %"
            text = callback.progress_text() if hasattr(callback, "progress_text") else ""
            if text:
                line += f" | {text}"
        if rate > 0 and batches != float("inf"):
            line += f" | epoch ETA {_eta((batches - batch_idx - 1) / rate)}"
        if rate > 0 and max_steps:
            line += f" | total ETA {_eta((max_steps - step) / rate)}"
        self._print(line)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._print(f"fit epoch {trainer.current_epoch + 1} done at step {trainer.global_step}, "
                    f"{_eta(time.monotonic() - self._start)} elapsed")

    # -- evaluation ----------------------------------------------------------------------------
    def _eval_started(self, *args) -> None:
        self._eval_start = time.monotonic()

    on_validation_start = on_test_start = on_predict_start = _eval_started

    def _eval_ended(self, stage: str, prefix: str) -> None:
        trainer = self.trainer
        if trainer.sanity_checking:
            return
        totals = {"validate": trainer.num_val_batches, "test": trainer.num_test_batches,
                  "predict": trainer.num_predict_batches}[stage]
        totals = sum(totals) if isinstance(totals, list) else totals
        scores = [f"{k} {float(v):.4f}" for k, v in sorted(trainer.callback_metrics.items())
                  if prefix and k.startswith(prefix) and k.count("/") == 1 and v.numel() == 1]
        batches = f"{int(totals)} batches" if totals != float("inf") else "done"
        self._print(" | ".join([f"{stage}: {batches}, {time.monotonic() - self._eval_start:.1f} s", *scores]))

    def on_validation_end(self, trainer, pl_module) -> None:
        self._eval_ended("validate", "val/")

    def on_test_end(self, trainer, pl_module) -> None:
        self._eval_ended("test", "test/")

    def on_predict_end(self, trainer, pl_module) -> None:
        self._eval_ended("predict", "")


class RichProgress(RichProgressBar):
    """Lightning's Rich bar with the training loss beside its metrics, read at most every ``loss_every_seconds``
    (:func:`training_loss`): what a terminal shows without a host sync per batch."""

    def __init__(self, *args, loss_every_seconds: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_every_seconds = loss_every_seconds
        self._loss: float | None = None
        self._loss_read = float("-inf")

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        if trainer.training:
            now = time.monotonic()
            if now - self._loss_read >= self.loss_every_seconds:
                self._loss, self._loss_read = training_loss(trainer), now
            if self._loss is not None:
                metrics["loss"] = f"{self._loss:.4f}"
        return metrics
