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

A rank that dies without a signal to catch (SIGKILL, the OOM killer, a segfault) would leave the others
waiting in their next collective: gloo sees the closed connection within seconds, but NCCL waits for the
process group's timeout (Lightning gives DDP 30 minutes). So under several processes a :class:`PeerWatch`
thread on each rank watches the ranks this process depends on on its node: rank 0 watches the ranks
Lightning's launcher started, the others watch the process that started them. Under the suite's ``ddp`` and
``fsdp`` strategies it starts before the process group's rendezvous, where a dead rank would otherwise leave the
others waiting for the group's timeout (:func:`tasks.cli.sharding.watch_peers_before_rendezvous`). When one is gone,
the rank prints where the run stands and the command that resumes it, and exits with code 1 at once, from
inside any collective; it writes nothing (``last.ckpt`` is only ever replaced whole). Ranks on other nodes
are their launcher's to stop (``srun`` ends a step whose task failed, ``torchrun`` its other workers).

A rank that dies after the run's last collective leaves no peer waiting, and Lightning's launcher does not wait
for the ranks it started: the command would exit 0 with one of its processes killed. So when the command is done,
the launching process waits for them and fails with :class:`RankEnded`, naming each that ended non-zero
(:func:`launched_ranks_failed`); what it wrote is complete, since every rank's share reached it through a
collective, but the fault (the OOM killer?) is the job's to report.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from configs.recipes import CommandLine
from layers.errors import Refusal
from tasks.cli.last_checkpoint import validation_or_epoch_end_follows

#: signals that stop `fit` unless the recipe names others (`--preemption.signals`)
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
#: the pid of the process whose Lightning launcher starts this node's other ranks, in their environment: a rank it
#: started watches that process even if it died before the watch started (during the rank's imports)
LAUNCHER_PID = "SUITE_LAUNCHER_PID"


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
        self._watch: PeerWatch | None = None
        if "LOCAL_RANK" not in os.environ:  # a process Lightning's launcher may make rank 0 (it gives its ranks one)
            os.environ[LAUNCHER_PID] = str(os.getpid())

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # the suite's DDP and FSDP strategies started the watch already, before their rendezvous
        if stage == "fit" and trainer.world_size > 1:
            self.watch_peers(trainer)

    def watch_peers(self, trainer: Trainer) -> None:
        """Start watching the processes this rank depends on, once per fit. The suite's strategies call this from
        ``setup_environment``, before the process group forms: a rank killed inside the rendezvous would leave
        the others in it until the group's timeout (Lightning calls :meth:`setup` only after the rendezvous)."""
        if self._watch is None:
            self._watch = PeerWatch.for_trainer(trainer, lambda why: self.peer_summary(trainer, why))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # a rank that finished may exit before its peers: from here on, a peer that is gone is not a failure
        self._stop_watching()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_watching()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # a collective that failed because a peer is gone (gloo: "Connection closed by peer")
        if trainer.world_size > 1 and peer_failure(exception):
            self._stop_watching()
            print(self.peer_summary(trainer, f"a collective failed: {str(exception).splitlines()[0][:300]}"),
                  file=sys.stderr, flush=True)

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def peer_summary(self, trainer: Trainer, why: str) -> str:
        """What a rank prints when a peer rank is gone: why, where the run stands, how to resume."""
        from tasks.cli.last_checkpoint import LatestCheckpoint, describe_checkpoint

        latest = next((c for c in trainer.checkpoint_callbacks if isinstance(c, LatestCheckpoint)), None)
        lines = [f"rank {trainer.global_rank}: stopping, another process of this run is gone ({why}); "
                 "nothing was written on the way out"]
        if trainer.state.fn != TrainerFn.FITTING:  # `test`, `predict`: their folder keeps its INCOMPLETE.txt
            what = trainer.state.fn.value
            lines.append(f"this {what} did not finish: its outputs stay marked unfinished; run the command again")
            return "\n".join(lines)
        if latest is not None and latest.path.is_file():
            lines.append(f"last checkpoint:  {latest.path.resolve()}{describe_checkpoint(latest.path)}")
            if self.resume_command:
                lines.append(f"resume with:      {self.resume_command}")
        else:
            lines.append("no last.ckpt yet: the run starts again from its beginning")
        return "\n".join(lines)

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


#: what gloo and NCCL say when a collective fails because a peer process is gone
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
             "Watchdog caught collective operation timeout")


def peer_failure(exception: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(exception, dist.DistError) or any(text in str(exception) for text in PEER_GONE)


class PeerWatch(threading.Thread):
    """Exits this process (code 1) once a process it depends on is gone, after printing ``summary(why)`` (see the
    module).

    Rank 0 under Lightning's launcher watches the ranks it started (``launcher.procs``): one that ended with a
    non-zero code is gone. Any other rank watches its parent (Lightning's rank 0, ``torchrun``'s agent): a new
    parent pid means it is gone. Checked every ``period`` seconds."""

    def __init__(self, children: list, parent: int | None, summary, period: float = 1.0):
        super().__init__(daemon=True, name="suite-peer-watch")
        self.children, self.parent, self.summary, self.period = children, parent, summary, period
        self._stopped = threading.Event()

    @classmethod
    def for_trainer(cls, trainer: Trainer, summary) -> "PeerWatch | None":
        """A started watch for this rank of ``trainer``'s run, ``None`` when there is nothing to watch."""
        children = launched_ranks(trainer)
        parent = launcher_pid() if not children and int(os.environ.get("LOCAL_RANK", "0")) > 0 else None
        if not children and parent in (None, 1):
            return None
        watch = cls(children, parent, summary)
        watch.start()
        return watch

    def stop(self) -> None:
        self._stopped.set()

    def gone(self) -> str | None:
        for proc in self.children:
            if proc.poll() not in (None, 0):
                return f"process {proc.pid} exited with code {proc.returncode}"
        if self.parent is not None and os.getppid() != self.parent:
            return f"process {self.parent}, which started this one, exited"
        return None

    def run(self) -> None:
        while not self._stopped.wait(self.period):
            why = self.gone()
            if why is not None and not self._stopped.is_set():
                try:
                    print(self.summary(why), file=sys.stderr, flush=True)
                finally:
                    os._exit(1)  # the main thread may sit in a collective that never returns


class RankEnded(Refusal):
    """A rank this process's launcher started ended non-zero after the run's last collective (see the module)."""


#: how long the launching process waits, once its command is done, for the ranks it started to exit: they are at
#: the same point of the run, so they normally follow within seconds (interpreter shutdown)
RANK_EXIT_WAIT_S = 120.0


def launched_ranks(trainer: Trainer) -> list:
    """The processes of local ranks 1, 2, ... that Lightning's launcher started from this one (``Popen``s); none in
    the ranks it started, or under ``torchrun`` or SLURM."""
    return list(getattr(trainer.strategy.launcher, "procs", None) or [])


def launched_ranks_failed(trainer: Trainer, wait_s: float = RANK_EXIT_WAIT_S) -> list[str]:
    """The ranks Lightning's launcher started from this process (``launcher.procs``; none under ``torchrun`` or
    SLURM, whose launchers report their own) that ended non-zero, or still run ``wait_s`` after this one finished,
    each described as ``"local rank 1 (process 1234) was killed by SIGKILL"``."""
    failed = []
    for local_rank, proc in enumerate(launched_ranks(trainer), start=1):
        try:
            code = proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            failed.append(f"local rank {local_rank} (process {proc.pid}) still runs {wait_s:.0f} s after rank 0 ended")
            continue
        if code < 0:
            failed.append(f"local rank {local_rank} (process {proc.pid}) was killed by {signal.Signals(-code).name}")
        elif code > 0:
            failed.append(f"local rank {local_rank} (process {proc.pid}) exited with code {code}")
    return failed


def launcher_pid() -> int:
    """The process that started this rank: the Lightning launcher's rank 0 (:data:`LAUNCHER_PID`, which it set
    before starting the others, so a rank whose parent died during its imports knows it), else the parent
    (``torchrun``'s agent, whose workers inherit no pid of ours)."""
    given = os.environ.get(LAUNCHER_PID)
    if given and "TORCHELASTIC_RUN_ID" not in os.environ:
        return int(given)
    return os.getppid()


def _signal(name: str | int) -> signal.Signals:
    if isinstance(name, int):
        return signal.Signals(name)
    key = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
    if key in ("SIGKILL", "SIGSTOP", "SIGINT") or not hasattr(signal, key):
        raise ValueError(f"preemption signal {name!r}: give a catchable signal name such as SIGTERM, SIGUSR1 "
                         "or SIGUSR2 (SIGINT stays Lightning's Ctrl+C handling)")
    return getattr(signal, key)
