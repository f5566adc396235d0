"""DataLoader settings every datamodule shares, including exact mid-epoch resume.

Training loaders shuffle with ``ResumableSampler``: the order of epoch ``e`` is a function
of (seed, e) alone, shared by all ranks and sharded across them, and after a restart from
a checkpoint taken within an epoch it skips the batches already trained on. Each sample's
augmentation runs under its own RNG seed (a function of seed, epoch and index), so a
resumed run draws exactly what the uninterrupted run drew, whatever the number of workers.
"""
from __future__ import annotations

import contextlib
import random
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def eval_sampler(dataset: Dataset) -> UnrepeatedDistributedSampler | None:
    """Under DDP, split evaluation data across ranks *without* the padding repeats that
    ``DistributedSampler`` adds, so every sample is scored exactly once and metrics equal
    the single-process values. Lightning keeps a sampler that is already distributed."""
    world, _ = _world()
    return UnrepeatedDistributedSampler(dataset, shuffle=False) if world > 1 else None


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The RNG seed of sample ``index``'s augmentation in ``epoch``: the same whatever the order, the
    rank or the worker that reads it, and whether it is read from files or streamed."""
    return hash((seed, epoch, index)) & 0x7FFF_FFFF


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


def restart_position(trainer) -> tuple[int, int] | None:
    """``(epoch, batches trained)`` when Lightning is restarting ``fit`` from a checkpoint taken
    within that epoch, else ``None``. A training sampler calls it when iteration starts,
    rebuilds that epoch's order and skips the batches already trained on (this rank's share);
    its ``__len__`` stays the full epoch, since Lightning counts those batches in itself.

    The count is the epoch's ``processed`` batches, not ``completed``: a checkpoint written in
    ``on_train_batch_end`` has not yet marked its own batch completed, and Lightning's epoch
    loop catches up only when it starts, after the loader's iterator exists (a batch sampler,
    or worker processes, ask the sampler for indices as soon as the iterator is created).
    ``processed`` is the same number before and after that catch-up."""
    loop = getattr(trainer, "fit_loop", None)
    if loop is None or not loop.restarting:
        return None
    return trainer.current_epoch, loop.epoch_loop.batch_progress.current.processed


class ResumableSampler(DistributedSampler):
    """Seeded, sharded shuffling that resumes mid-epoch.

    Yields ``(index, sample_seed)`` keys for :class:`SeededSamples`. ``trainer`` (optional)
    is read when iteration starts: if Lightning is restarting within an epoch, that epoch's
    order is rebuilt and the ``batches trained x batch_size`` samples already seen by this
    rank are skipped (:func:`restart_position`). Being a ``DistributedSampler``, Lightning does not replace it under DDP.
    """

    def __init__(self, dataset: Dataset, batch_size: int, trainer=None, seed: int = 0, drop_last: bool = True):
        world, rank = _world()
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
        self.batch_size = batch_size
        self.trainer = trainer

    def __iter__(self) -> Iterator[tuple[int, int]]:
        skip = 0
        restart = restart_position(self.trainer)
        if restart is not None:
            epoch, trained = restart
            self.set_epoch(epoch)
            skip = trained * self.batch_size
        epoch = self.epoch
        indices = list(super().__iter__())[skip:]
        return iter([(i, sample_seed(self.seed, epoch, i)) for i in indices])


class SeededSamples(Dataset):
    """Runs ``dataset[index]`` under the RNG seed that came with the index (:func:`run_seeded`)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int] | int):
        if not isinstance(key, tuple):  # a plain sampler (e.g. Lightning's overfit_batches swaps one in)
            return self.dataset[key]
        index, seed = key
        return run_seeded(lambda: self.dataset[index], seed)


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
    """Mixin for a ``DataLoader`` class: its worker processes run OpenCV on one thread each
    (:func:`opencv_threads` around the fork, which happens when the iterator is created)."""

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        with opencv_threads(1):
            return super()._get_iterator()


class SuiteDataLoader(SingleThreadedWorkers, DataLoader):
    """``torch.utils.data.DataLoader`` with one OpenCV thread per worker process."""


def make_loader(dataset: Dataset, *, batch_size: int, num_workers: int, train: bool, pin_memory: bool = True,
                persistent_workers: bool = True, prefetch_factor: int | None = None,
                collate_fn: Callable | None = None, trainer=None, seed: int = 0) -> DataLoader:
    """A DataLoader with the suite's conventions: resumable seeded shuffling and drop_last for
    training (pass the datamodule's ``trainer`` to resume mid-epoch), unrepeated distributed
    sampling for evaluation, training workers kept alive between epochs (evaluation workers are not). A split streamed from an optimized
    dataset (an ``IterableDataset``: :class:`datamodules.streaming.StreamedSplit`) gets LitData's loader
    with the same conventions (:func:`datamodules.streaming.streaming_loader`)."""
    if isinstance(dataset, IterableDataset):
        from datamodules.streaming import streaming_loader

        return streaming_loader(dataset, batch_size=batch_size, num_workers=num_workers, train=train,
                                pin_memory=pin_memory, persistent_workers=persistent_workers,
                                prefetch_factor=prefetch_factor, collate_fn=collate_fn, trainer=trainer, seed=seed)
    extra = {}
    if num_workers > 0:
        # evaluation workers idle through every training epoch: forking them anew per validation costs
        # a fraction of a second, keeping them costs their memory for the whole fit
        extra["persistent_workers"] = persistent_workers and train
        if prefetch_factor is not None:
            extra["prefetch_factor"] = prefetch_factor
    drop_last = train and len(dataset) > batch_size
    if train:
        sampler = ResumableSampler(dataset, batch_size, trainer=trainer, seed=seed, drop_last=drop_last)
        dataset = SeededSamples(dataset)
    else:
        sampler = eval_sampler(dataset)
    # a private generator: creating the iterator must not consume the global RNG (exact resume)
    return SuiteDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, num_workers=num_workers,
                           pin_memory=pin_memory and torch.cuda.is_available(), collate_fn=collate_fn,
                           generator=torch.Generator().manual_seed(seed), **extra)


class SplitLoaders:
    """The dataloader hooks of a LightningDataModule whose ``setup`` fills ``train_set``,
    ``val_set``, ``test_set`` / ``predict_set`` and whose ``_loader(dataset, train)`` builds a loader
    (with :func:`make_loader`, passing ``trainer=self.trainer`` for training so it can resume)."""

    def train_dataloader(self):
        return self._loader(self.train_set, train=True)

    def val_dataloader(self):
        return self._loader(self.val_set, train=False)

    def test_dataloader(self):
        return self._loader(self.test_set, train=False)

    def predict_dataloader(self):
        return self._loader(self.predict_set, train=False)


class StreamedSource:
    """Mixin for a datamodule that can read an optimized dataset (``hparams.streaming_root``, read with
    its ``streaming_layout``): :attr:`streamed` opens it once; a datamodule whose settings must match
    what was optimized (label encoding, vocabulary) checks them in :meth:`check_streamed`."""

    def reads_streamed(self) -> bool:
        return self.hparams.get("streaming_root") is not None

    @property
    def streamed(self):
        """The optimized dataset at ``streaming_root`` (:class:`datamodules.streaming.OptimizedDataset`),
        or ``None`` when the data is read from ``root``."""
        if not self.reads_streamed():
            return None
        if getattr(self, "_streamed", None) is None:
            from datamodules.streaming import OptimizedDataset

            streamed = OptimizedDataset(self.hparams.streaming_root, self.streaming_layout)
            self.check_streamed(streamed)
            self._streamed = streamed
        return self._streamed

    def check_streamed(self, streamed) -> None:
        """Raise a ``ValueError`` naming the setting if ``streamed`` was optimized with other settings."""
