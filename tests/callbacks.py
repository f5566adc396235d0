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
