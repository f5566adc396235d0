"""Preemption-safe ``fit``: a stop signal ends the run at a step boundary on every rank, with
``last.ckpt`` written and a non-zero exit code, so a requeue wrapper resumes instead of
believing the run finished.

Lightning 2.6 turns SIGTERM into ``SIGTERMException``, a ``SystemExit`` without a code, so the
process exits 0 with no summary (Lightning issue #19916, fixed by PR #21623 after 2.6); under
DDP its handler broadcasts from inside the signal handler and only rank 0's signal counts.
:class:`Preemption` replaces those handlers once training starts (Lightning restores the
previous ones at teardown). A handler only records the signal; at the next optimizer-step
boundary (and at an epoch end) every rank joins one all-reduce, so a signal that reached any
rank stops all of them after the same step. A signal during the epoch's last step, or a step
that a validation follows, stops after that validation
(:func:`tasks.cli.last_checkpoint.validation_or_epoch_end_follows`), so the resumed run equals the
uninterrupted one. Then ``last.ckpt`` is written (its writes are atomic:
:mod:`tasks.cli.checkpoint_io`), rank 0 prints where and how to resume, and every rank exits with
``128 + signal number``: 143 for SIGTERM, 138 for SIGUSR1 (SLURM's ``--signal=USR1@<seconds>``
warning before the time limit; give it more seconds than a validation takes).
"""
from __future__ import annotations

import shlex
import signal
import sys
import threading
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from configs.recipes import CommandLine
from tasks.cli.last_checkpoint import validation_or_epoch_end_follows

#: signals that stop `fit` unless the recipe names others (`--preemption.signals`)
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class Preempted(SIGTERMException):
    """Raised on every rank after a stop signal; the process exits with ``128 + signum``."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class Preemption(Callback):
    """Stop ``fit`` cleanly on ``signals`` (see the module).

    Args:
        signals: signal names (``SIGTERM``, ``SIGUSR1``, ``SIGUSR2``, ...) that stop the run;
            ``None``: :data:`DEFAULT_SIGNALS`. SIGINT (Ctrl+C) stays Lightning's.
    """

    def __init__(self, signals: list[str] | None = None):
        self.signals = [_signal(name) for name in (DEFAULT_SIGNALS if signals is None else signals)]
        self.received: int | None = None
        #: the command that resumes this run; the suite's CLI fills it in
        self.resume_command: str | None = None
        self._step_checked = -1

    def _record(self, signum: int, frame) -> None:
        # a signal handler only records: saving or talking to other ranks here could interrupt a collective
        if self.received is None:
            self.received = signum

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning registered its own handlers just before; they are restored at its teardown
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                signal.signal(signum, self._record)
        if trainer.received_sigterm:  # arrived while Lightning's handler was still the one installed
            self._record(signal.SIGTERM, None)
        self._step_checked = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        # only after an optimizer step: with gradient accumulation a mid-accumulation stop would
        # lose the accumulated gradients, which no checkpoint holds
        if trainer.global_step != self._step_checked:
            self._step_checked = trainer.global_step
            if not validation_or_epoch_end_follows(trainer, batch_idx):
                self._stop_if_signalled(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._stop_if_signalled(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop_if_signalled(trainer)

    def _stop_if_signalled(self, trainer: Trainer) -> None:
        # every rank reaches this point after the same step, so the all-reduce cannot hang
        local = self.received is not None
        if not trainer.strategy.reduce_boolean_decision(local, all=False):
            return
        # one exit code on every rank: rank 0's signal, or SIGTERM (what a scheduler sends) if only others got one
        signum = int(trainer.strategy.broadcast(self.received or -1, src=0))
        signum = signum if signum > 0 else int(signal.SIGTERM)
        last = self._save_last(trainer)
        if trainer.is_global_zero:
            print(self.summary(trainer, signum, last), file=sys.stderr, flush=True)
        raise Preempted(signum)

    @staticmethod
    def _save_last(trainer: Trainer) -> Path | None:
        from tasks.cli.last_checkpoint import LatestCheckpoint

        latest = next((c for c in trainer.checkpoint_callbacks if isinstance(c, LatestCheckpoint)), None)
        return latest.save(trainer) if latest is not None else None

    def summary(self, trainer: Trainer, signum: int, last: Path | None) -> str:
        name = signal.Signals(signum).name
        lines = [f"stopped by {name} after global step {trainer.global_step} (epoch {trainer.current_epoch}); "
                 f"exit code {128 + signum}",
                 f"run directory:    {Path(trainer.default_root_dir).resolve()}"]
        if last is None:
            lines.append("no last.ckpt: checkpointing is off, so this run cannot be resumed")
        else:
            lines.append(f"last checkpoint:  {last.resolve()}")
            if self.resume_command:
                lines.append(f"resume with:      {self.resume_command}")
        return "\n".join(lines)


def resume_command(task: str, argv: list[str] | CommandLine, root: str) -> str:
    """The user's ``fit`` command with ``--ckpt_path last`` and the run root made explicit."""
    argv = argv.argv() if isinstance(argv, CommandLine) else argv
    args, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--ckpt_path", "--trainer.default_root_dir"):
            skip = "=" not in arg
            continue
        args.append(arg)
    return shlex.join(["python", "-m", f"tasks.{task}", *args, "--trainer.default_root_dir",
                       str(Path(root).resolve()), "--ckpt_path", "last"])


def _signal(name: str | int) -> signal.Signals:
    if isinstance(name, int):
        return signal.Signals(name)
    key = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
    if key in ("SIGKILL", "SIGSTOP", "SIGINT") or not hasattr(signal, key):
        raise ValueError(f"preemption signal {name!r}: give a catchable signal name such as SIGTERM, SIGUSR1 "
                         "or SIGUSR2 (SIGINT stays Lightning's Ctrl+C handling)")
    return getattr(signal, key)
