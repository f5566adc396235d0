"""Exact mid-epoch resume, one mechanism for every training loader, and the per-sample seeds it relies on.

A training loader here is *stateful*: Lightning saves its ``state_dict()`` in every checkpoint
(``loops.fit_loop.state_dict.combined_loader``) and, on ``fit --ckpt_path`` from a checkpoint taken
within an epoch, hands it back through ``load_state_dict()`` before it creates the epoch's iterator.

- Folder-read and token-batched loaders (:class:`ResumableLoader`): the state is
  ``{"epoch": e, "samples": n, "batch_size": b}``, ``n`` the samples of epoch ``e``'s order that all
  ranks together have been given. The next iteration rebuilds epoch ``e``'s order (a function of the
  seed and the epoch alone) and starts after those ``n`` samples, whatever the batch size is now: a
  resume with another ``data.batch_size`` goes on with the first sample not trained on.
- Streamed loaders keep LitData's own state (:class:`datamodules.streaming.StreamingTrainLoader`),
  which LitData replays the same way (and restripes over another batch size or world size itself).

The position counts the batches the loader has handed to Lightning, in the main process, not what
worker processes have read ahead: Lightning takes no batch ahead of the one it trains from a loader
with a length, so in a checkpoint written at the end of a training step it is the batches trained.

Each sample's augmentation runs under its own RNG seed (:func:`sample_seed` of seed, epoch and
index), so a resumed run draws exactly what the uninterrupted run drew, whatever the number of
workers or the batch it falls in.
"""
from __future__ import annotations

import contextlib
import inspect
import random
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """``(world size, rank)`` of the running process group (``(1, 0)`` without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def sample_seed(seed: int, epoch: int, index: int, copy: int = 0) -> int:
    """The RNG seed of sample ``index``'s augmentation in ``epoch``: the same whatever the order, the
    rank or the worker that reads it, and whether it is read from files or streamed.

    ``copy``: which of the sample's copies in the epoch under repeated augmentation
    (:class:`datamodules.loaders.RepeatedAugmentationSampler`), each drawing its own augmentation; copy 0
    draws what the sample draws without repeats. (Python hashes tuples of ints the same in every process.)"""
    if copy == 0:
        return hash((seed, epoch, index)) & 0x7FFF_FFFF
    return hash((seed, epoch, index, copy)) & 0x7FFF_FFFF


def run_seeded(read: Callable[[], object], seed: int):
    """``read()`` under the torch, numpy and Python RNG seed ``seed``, restoring the caller's RNG states
    afterwards (dropout draws in the main process are untouched when ``num_workers=0``)."""
    np_state, py_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        # the CPU generator only: torch.manual_seed also queues a lazy seeding of every accelerator
        # backend, each recording a Python stack trace (0.6 ms a sample), for draws no sample makes
        torch.default_generator.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        try:
            return read()
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)


@contextlib.contextmanager
def opencv_threads(count: int):
    """OpenCV's thread count set to ``count`` in this process, restored on exit. Worker processes forked
    meanwhile keep ``count``: OpenCV (albumentations' kernels) otherwise starts one thread per core in
    every worker, so N workers on N cores oversubscribe them N times. Setting it inside a forked worker
    (``worker_init_fn``) can deadlock on the thread pool inherited from the parent; in the parent it is
    safe."""
    try:
        import cv2
    except ImportError:  # nothing to set
        yield
        return
    previous = cv2.getNumThreads()
    cv2.setNumThreads(count)
    try:
        yield
    finally:
        cv2.setNumThreads(previous)


class SingleThreadedWorkers:
    """Mixin for a ``DataLoader`` class: its worker processes run OpenCV on one thread each.

    The workers are forked while ``DataLoader.__iter__`` creates the iterator (every epoch, or the
    first one only with ``persistent_workers``), so that call runs under :func:`opencv_threads`. A
    loader whose ``__iter__`` is a generator (LitData's) creates its iterator at the first ``next``:
    :meth:`iterate_with_single_threaded_workers` covers that call too."""

    def __iter__(self):
        if self.num_workers == 0:
            return super().__iter__()
        with opencv_threads(1):
            iterator = super().__iter__()
        if inspect.isgenerator(iterator):  # nothing has run yet, the workers included
            return self.iterate_with_single_threaded_workers(iterator)
        return iterator

    @staticmethod
    def iterate_with_single_threaded_workers(iterator):
        with opencv_threads(1):
            first = next(iterator, _END)
        if first is _END:
            return
        yield first
        yield from iterator


_END = object()


class EpochOrder:
    """What a sampler offers :class:`ResumableLoader`: its epoch's order, rebuilt at will, and a start
    inside it.

    ``epoch`` and ``set_epoch`` (Lightning calls it before every epoch); ``start`` is the number of
    samples of the epoch's order, over all ranks together, that the next iteration skips;
    :meth:`samples_after` converts batches this rank has handed out since ``start`` into such a
    position."""

    epoch: int = 0
    start: int = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def samples_after(self, batches: int) -> int:
        """The position (samples over all ranks) once this rank has handed out ``batches`` batches after ``start``."""
        raise NotImplementedError


class ResumableLoader:
    """Mixin for a training ``DataLoader`` whose sampler (or batch sampler) is an :class:`EpochOrder`:
    Lightning saves :meth:`state_dict` in the checkpoint and calls :meth:`load_state_dict` on a restart
    within an epoch; the next iteration rebuilds that epoch's order and skips what was trained."""

    _resume: dict | None = None
    _handed_out: int = 0

    @property
    def order(self) -> EpochOrder:
        return self.batch_sampler if isinstance(self.batch_sampler, EpochOrder) else self.sampler

    @property
    def batch_setting(self) -> int | None:
        """The batch size the position was counted with (recorded for the reader of a checkpoint)."""
        return self.batch_size

    def state_dict(self) -> dict:
        order = self.order
        return {"epoch": order.epoch, "samples": order.samples_after(self._handed_out),
                "batch_size": self.batch_setting}

    def load_state_dict(self, state: dict) -> None:
        self._resume = dict(state)

    def __iter__(self) -> Iterator:
        order = self.order
        resume, self._resume = self._resume, None
        if resume is not None:
            order.set_epoch(int(resume["epoch"]))
            order.start = int(resume["samples"])
        else:
            order.start = 0
        self._handed_out = 0
        return self._counted(super().__iter__())

    def _counted(self, iterator: Iterator) -> Iterator:
        for batch in iterator:
            self._handed_out += 1
            yield batch
