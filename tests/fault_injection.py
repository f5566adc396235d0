"""A deterministic SIGKILL at a named point of a run, for the fault campaign (scripts/fault_campaign.py) and
its tests: ``--trainer.callbacks+=tests.fault_injection.FaultInjector`` with ``SUITE_FAULT=<point>:<n>[:<rank>]``
in the environment. No product code knows about it: the points are Lightning callback hooks, and the points
inside a library call (a checkpoint write, an all-reduce, an EMA update) wrap that call for the one
process the fault is meant for.

Points (``n`` counts from 0 over the whole run, on the rank ``rank``, default 0):

- ``step:n``        before optimizer step ``n`` (global step ``n``) starts;
- ``backward:n``    in step ``n``, before its backward: under DDP the peer waits inside the gradient all-reduce;
- ``optimizer:n``   in step ``n``, after the gradients are reduced and before the weights change;
- ``validation:n``  after the ``n``-th validation batch of the run;
- ``checkpoint:n``  inside the ``n``-th checkpoint write (half of the file's bytes written to its temporary name);
- ``rename:n``      after the ``n``-th checkpoint's bytes are written and synced, before they replace the old file;
- ``ema:n``         on entering the ``n``-th EMA update (the average's ``update_parameters``);
- ``allreduce:n``   on entering the ``n``-th ``torch.distributed.all_reduce`` of the process (its peers wait in it);
- ``rendezvous:n``  on entering the ``n``-th ``torch.distributed.init_process_group`` of the rank (the process
  group's rendezvous, before any callback's ``setup``: its peers wait in it; rank 0 hosts its TCPStore);
- ``resume:0``      inside the first optimizer step after a resume (``--ckpt_path``), after its backward;
- ``test_output:n`` during `test`'s writers, after the first ``n`` output callbacks (tasks.outputs) have written;
- ``exit:0``        as the rank's interpreter exits, after its command has ended (after the run's last collective:
  no peer waits on it);
- ``worker:n``      before step ``n``, one of the process's loader workers is SIGKILLed (what the OOM killer does
  to the largest process: often a worker holding decoded images); the process itself goes on.

``SUITE_FAULT_COUNTS=<file>`` makes an uninterrupted run write how many times each point was reached on each
rank (``<file>.rank<r>``, JSON), from which the campaign draws its points.
"""
from __future__ import annotations

import atexit
import io
import json
import os
import signal
from pathlib import Path

from lightning.pytorch import Callback

from layers.compat import weight_averaging_model

POINTS = ("step", "backward", "optimizer", "validation", "checkpoint", "rename", "ema", "allreduce", "rendezvous",
          "resume", "test_output", "worker", "exit")


def parse_fault(text: str) -> tuple[str, int, int]:
    """``"checkpoint:3"`` -> ``("checkpoint", 3, 0)``; ``"allreduce:2:1"`` -> ``("allreduce", 2, 1)``."""
    parts = text.split(":")
    if parts[0] not in POINTS or not 2 <= len(parts) <= 3:
        raise ValueError(f"SUITE_FAULT={text!r}: give <point>:<n>[:<rank>] with a point of {', '.join(POINTS)}")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 0


def die() -> None:
    """What the OOM killer or a pre-empted node does to a process: no handler runs, nothing is flushed."""
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjector(Callback):
    """SIGKILLs its own process at the point ``SUITE_FAULT`` names (see the module); without it, only counts."""

    def __init__(self):
        fault = os.environ.get("SUITE_FAULT")
        self.point, self.n, self.rank = parse_fault(fault) if fault else (None, -1, 0)
        self.counts_file = os.environ.get("SUITE_FAULT_COUNTS")
        self.counts = dict.fromkeys(POINTS, 0)
        self.armed = False  # this process is the rank the fault is meant for
        self._resumed = False
        self._wrap_rendezvous()  # built before `fit`: the rendezvous comes before any hook

    # -- counting and firing ---------------------------------------------------------------------------------
    def reached(self, point: str) -> None:
        """Point ``point`` is reached once more: die if it is the fault's."""
        if self.armed and point == self.point and self.counts[point] == self.n:
            die()
        self.counts[point] += 1

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.armed = self.point is not None and trainer.global_rank == self.rank
        if self.armed and self.point == "exit" and self.counts["exit"] == 0:
            self.counts["exit"] = 1
            atexit.register(die)
        self._wrap_checkpoint_io(trainer)
        self._wrap_library_calls()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.counts_file:
            Path(f"{self.counts_file}.rank{trainer.global_rank}").write_text(json.dumps(self.counts))

    def on_train_start(self, trainer, pl_module) -> None:
        self._resumed = trainer.ckpt_path is not None
        for callback in trainer.callbacks:  # EMAWeightAveraging's average (the suite's ForeachEMA) exists by now
            average = weight_averaging_model(callback)
            if average is not None and "update_parameters" not in vars(average):
                self._before(average, "update_parameters", "ema")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.counts["step"] <= trainer.global_step:  # once per optimizer step (accumulation repeats a step)
            self.counts["step"] = trainer.global_step
            self.reached("step")
        if self.armed and self.point == "worker" and trainer.global_step == self.n and self.counts["worker"] == 0:
            self.counts["worker"] = 1
            os.kill(loader_workers()[0], signal.SIGKILL)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.counts["backward"] <= trainer.global_step:
            self.counts["backward"] = trainer.global_step
            self.reached("backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.counts["optimizer"] <= trainer.global_step:
            self.counts["optimizer"] = trainer.global_step
            self.reached("optimizer")
        if self._resumed:
            self._resumed = False
            self.reached("resume")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self.reached("validation")

    def on_test_start(self, trainer, pl_module) -> None:
        # the task's writers run after this callback: each one's on_test_end is followed by a check
        for callback in trainer.callbacks:
            if type(callback).__module__.startswith("tasks.outputs") and "on_test_end" in type(callback).__dict__:
                self._after(callback, "on_test_end", "test_output")

    def on_test_end(self, trainer, pl_module) -> None:
        self.reached("test_output")  # before the first writer

    # -- wrapped calls -----------------------------------------------------------------------------------------
    def _before(self, obj, name: str, point: str) -> None:
        method = getattr(obj, name)

        def wrapped(*args, **kwargs):
            self.reached(point)
            return method(*args, **kwargs)

        setattr(obj, name, wrapped)

    def _after(self, obj, name: str, point: str) -> None:
        method = getattr(obj, name)

        def wrapped(*args, **kwargs):
            result = method(*args, **kwargs)
            self.reached(point)
            return result

        setattr(obj, name, wrapped)

    def _wrap_checkpoint_io(self, trainer) -> None:
        checkpoint_io = trainer.strategy.checkpoint_io
        if getattr(checkpoint_io, "_fault_wrapped", False):
            return
        save = checkpoint_io.save_checkpoint

        def save_checkpoint(checkpoint, path, *args, **kwargs):
            if self.armed and self.point in ("checkpoint", "rename") and self.counts[self.point] == self.n:
                _kill_inside_the_write(self.point)
            self.counts["checkpoint"] += 1
            self.counts["rename"] += 1
            return save(checkpoint, path, *args, **kwargs)

        checkpoint_io.save_checkpoint = save_checkpoint
        checkpoint_io._fault_wrapped = True

    def _wrap_library_calls(self) -> None:
        import torch.distributed as dist

        if getattr(dist.all_reduce, "_fault_wrapped", False):
            return
        all_reduce = dist.all_reduce

        def counted_all_reduce(*args, **kwargs):
            self.reached("allreduce")
            return all_reduce(*args, **kwargs)

        counted_all_reduce._fault_wrapped = True
        dist.all_reduce = counted_all_reduce

    def _wrap_rendezvous(self) -> None:
        import torch.distributed as dist

        if getattr(dist.init_process_group, "_fault_wrapped", False):
            return
        init_process_group = dist.init_process_group

        def counted_init_process_group(*args, **kwargs):
            # the rank comes with the call (Lightning passes it): `armed` is only known at `setup`, after this
            if self.point == "rendezvous" and kwargs.get("rank") == self.rank and self.counts["rendezvous"] == self.n:
                die()
            self.counts["rendezvous"] += 1
            return init_process_group(*args, **kwargs)

        counted_init_process_group._fault_wrapped = True
        dist.init_process_group = counted_init_process_group


def loader_workers() -> list[int]:
    """The pids of this process's loader workers (its child processes), oldest first."""
    children = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    if not children:
        raise RuntimeError("SUITE_FAULT=worker:...: this process has no loader workers (--data.num_workers 0?)")
    return sorted(children)


def _kill_inside_the_write(point: str) -> None:
    """Make the coming checkpoint write die: ``checkpoint`` after half its bytes reached the file,
    ``rename`` once the file is complete and synced, just before it would replace the old one."""
    import torch

    if point == "rename":
        def replace(src, dst, *args, **kwargs):
            die()

        os.replace = replace
        return
    real_save = torch.save

    def half_save(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        die()

    torch.save = half_save
