"""Callbacks that CLI tests inject with ``--trainer.callbacks+=tests.callbacks.X``."""
import os
import signal

from lightning.pytorch import Callback


class KillAtStep(Callback):
    """SIGKILLs the process when global step ``step`` is about to run: the hard interruption a
    pre-empted cluster job sees (no exception handler, no checkpoint on the way out)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class NaNOutputAtStep(Callback):
    """Makes the task's network output NaN at global step ``step`` (a forward hook on the
    LightningModule), so the real task's real loss turns non-finite there."""

    def __init__(self, step: int):
        self.step = step
        self._handle = None

    @staticmethod
    def _poison(output):
        import torch

        if isinstance(output, torch.Tensor):
            return output * float("nan") if output.is_floating_point() else output
        if isinstance(output, dict):
            return {k: NaNOutputAtStep._poison(v) for k, v in output.items()}
        if isinstance(output, (tuple, list)):
            poisoned = [NaNOutputAtStep._poison(v) for v in output]
            return type(output)(*poisoned) if hasattr(output, "_fields") else type(output)(poisoned)  # a NamedTuple
        return output

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self._handle is None:
            self._handle = pl_module.register_forward_hook(lambda module, args, output: self._poison(output))


class SignalAtStep(Callback):
    """Sends ``signal`` (a name: SIGTERM, SIGUSR1) to its own process when global step ``step`` is
    about to run, on global rank ``rank`` only (``-1``: every rank): what a scheduler's pre-emption
    notice looks like to the rank that receives it, mid-epoch and mid-step."""

    def __init__(self, step: int, signal: str = "SIGTERM", rank: int = -1):
        self.step = step
        self.signal = signal
        self.rank = rank
        self.sent = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not self.sent and self.rank in (-1, trainer.global_rank):
            self.sent = True
            os.kill(os.getpid(), getattr(signal, self.signal))


class RecordBatchShapes(Callback):
    """Appends ``[global step, batch shape]`` of every training batch's images to ``<folder>/rank<r>.jsonl``."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import json
        from pathlib import Path

        Path(self.folder).mkdir(parents=True, exist_ok=True)
        with open(Path(self.folder) / f"rank{trainer.global_rank}.jsonl", "a") as out:
            out.write(json.dumps([trainer.global_step, list(batch["image"].shape)]) + "\n")
