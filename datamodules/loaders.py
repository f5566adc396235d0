"""DataLoader settings every datamodule shares, including exact mid-epoch resume.

Training loaders shuffle with ``ResumableSampler``: the order of epoch ``e`` is a function
of (seed, e) alone, shared by all ranks and sharded across them. The loader is stateful
(:class:`datamodules.resumable.ResumableLoader`): Lightning keeps its position in the checkpoint
and, after a restart from a checkpoint taken within an epoch, the sampler skips the samples
already trained on. Each sample's augmentation runs under its own RNG seed (a function of seed,
epoch and index), so a resumed run draws exactly what the uninterrupted run drew, whatever the
number of workers. With ``repeated_augmentation`` k > 1 the training order is
:class:`RepeatedAugmentationSampler` (DeiT's / timm's repeated augmentation), resumed the same way,
each copy of an image under its own seed.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Iterator

import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from datamodules.resumable import (EpochOrder, ResumableLoader, SingleThreadedWorkers, opencv_threads,  # noqa: F401
                                   run_seeded, sample_seed, world)
from layers.machine import NumWorkers, loader_workers


def eval_sampler(dataset: Dataset) -> UnrepeatedDistributedSampler | None:
    """Under DDP, split evaluation data across ranks *without* the padding repeats that
    ``DistributedSampler`` adds, so every sample is scored exactly once and metrics equal
    the single-process values. Lightning keeps a sampler that is already distributed."""
    replicas, _ = world()
    return UnrepeatedDistributedSampler(dataset, shuffle=False) if replicas > 1 else None


class ResumableSampler(EpochOrder, DistributedSampler):
    """Seeded, sharded shuffling that resumes mid-epoch.

    Yields ``(index, sample_seed)`` keys for :class:`SeededSamples`. Iteration starts ``start``
    samples into the epoch's order (all ranks together: this rank skips ``start / num_replicas``),
    which :class:`SuiteTrainLoader` sets from the position Lightning saved. Being a
    ``DistributedSampler``, Lightning does not replace it under DDP.
    """

    def __init__(self, dataset: Dataset, batch_size: int, seed: int = 0, drop_last: bool = True):
        replicas, rank = world()
        super().__init__(dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
        self.batch_size = batch_size

    def samples_after(self, batches: int) -> int:
        return self.start + batches * self.batch_size * self.num_replicas

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        indices = list(super().__iter__())[self.start // self.num_replicas:]
        return iter([(i, sample_seed(self.seed, epoch, i)) for i in indices])


class RepeatedAugmentationSampler(EpochOrder, DistributedSampler):
    """Repeated augmentation (``data.repeated_augmentation: k``): every image ``k`` times an epoch, the
    copies spread over the ranks, each under its own augmentation seed.

    The order is DeiT's ``RASampler`` as timm's ``RepeatAugSampler`` has it (timm
    ``data/distributed_sampler.py``; torchvision references' ``--ra-sampler``, CVNets'
    ``sampler.num_repeats``): a permutation from a ``torch.Generator`` seeded with ``seed + epoch``
    (timm seeds with the epoch alone: the same order at ``seed=0``), each index repeated ``k`` times in a
    row, padded by wrapping round to a multiple of the world size, rank ``r`` taking every
    ``world_size``-th element from ``r``, and cut to ``floor(len // 256 * 256 / world_size)`` per rank
    (``ceil(len / world_size)`` below 256 samples): an epoch still trains about ``len(dataset)`` samples,
    ``k`` times fewer distinct images. Consecutive copies of an image thus go to consecutive ranks.

    Yields ``(index, sample_seed)`` keys for :class:`SeededSamples`; copy ``c`` of an index (``c``
    counting on through the wrap-round padding) is seeded with ``sample_seed(seed, epoch, index, c)``.
    Resumes like :class:`ResumableSampler`: ``start`` counts the samples of the epoch's order over all
    ranks together. A ``DistributedSampler`` so that Lightning does not wrap it under DDP.
    """

    #: timm's ``selected_round`` (DeiT's 256): the per-epoch sample count is rounded down to a multiple of it
    SELECTED_ROUND = 256

    def __init__(self, dataset: Dataset, batch_size: int, repeats: int, seed: int = 0,
                 num_replicas: int | None = None, rank: int | None = None):
        if num_replicas is None or rank is None:
            num_replicas, rank = world()
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.batch_size, self.repeats = batch_size, check_repeated_augmentation(repeats)
        size = len(dataset)
        self.num_samples = math.ceil(size * repeats / num_replicas)  # per rank, before the cut
        self.total_size = self.num_samples * num_replicas
        if size >= self.SELECTED_ROUND:
            selected = size // self.SELECTED_ROUND * self.SELECTED_ROUND // num_replicas
        else:
            selected = math.ceil(size / num_replicas)
        self.num_selected = min(selected, self.num_samples)

    def __len__(self) -> int:
        return self.num_selected

    def samples_after(self, batches: int) -> int:
        return self.start + batches * self.batch_size * self.num_replicas

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch, k = self.epoch, self.repeats
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        order = torch.randperm(len(self.dataset), generator=generator).tolist()
        repeated = len(order) * k
        positions = range(self.rank, self.total_size, self.num_replicas)[:self.num_selected]
        keys = []
        for position in positions[self.start // self.num_replicas:]:
            wrapped, at = divmod(position, repeated)
            index = order[at // k]
            keys.append((index, sample_seed(self.seed, epoch, index, wrapped * k + at % k)))
        return iter(keys)


def check_repeated_augmentation(repeats: int) -> int:
    """``data.repeated_augmentation`` checked: an integer >= 1 (1: off)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"data.repeated_augmentation is the number of copies of each image an epoch, an integer "
                         f">= 1 (1: off), got {repeats!r}")
    return repeats


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


class SuiteDataLoader(SingleThreadedWorkers, DataLoader):
    """``torch.utils.data.DataLoader`` with one OpenCV thread per worker process."""


class SuiteTrainLoader(ResumableLoader, SuiteDataLoader):
    """The training loader: its position in the epoch is saved in checkpoints and resumed from."""


def check_positive_counts(**counts) -> None:
    """Refuse a batch size or token budget (``batch_size=...``, ``max_tokens=...``) that is not a positive whole
    number, naming its key ``data.<name>``: ``--data.batch_size null`` is refused here, at the start, not as a
    ``TypeError`` inside the loader. An ``eval_*`` count may be ``None`` (it then follows the training one)."""
    for name, value in counts.items():
        if value is None and name.startswith("eval_"):
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"data.{name}={value!r}: give a positive whole number (--data.{name} 32)"
                             + (f", or leave data.{name} out to use the training one" if name.startswith("eval_") else ""))


def make_loader(dataset: Dataset, *, batch_size: int, num_workers: NumWorkers, train: bool, pin_memory: bool = True,
                persistent_workers: bool = True, prefetch_factor: int | None = None,
                collate_fn: Callable | None = None, trainer=None, seed: int = 0,
                repeated_augmentation: int = 1) -> DataLoader:
    """A DataLoader with the suite's conventions: resumable seeded shuffling and drop_last for
    training (:class:`SuiteTrainLoader`), unrepeated distributed
    sampling for evaluation, training workers kept alive between epochs (evaluation workers are not). A split streamed from an optimized
    dataset (an ``IterableDataset``: :class:`datamodules.streaming.StreamedSplit`) gets LitData's loader
    with the same conventions (:func:`datamodules.streaming.streaming_loader`). ``num_workers="auto"``
    starts the workers this process's CPU plan gives (:func:`layers.machine.loader_workers`).
    ``repeated_augmentation`` > 1 trains with :class:`RepeatedAugmentationSampler` (evaluation loaders
    ignore it)."""
    num_workers = loader_workers(num_workers)
    repeats = check_repeated_augmentation(repeated_augmentation) if train else 1
    if isinstance(dataset, IterableDataset):
        if repeats > 1:
            raise ValueError("data.repeated_augmentation > 1 needs the folder-read loaders: a streamed split "
                             "(data.streaming_root) is ordered by LitData, which repeats no sample")
        from datamodules.streaming import streaming_loader

        return streaming_loader(dataset, batch_size=batch_size, num_workers=num_workers, train=train,
                                pin_memory=pin_memory, persistent_workers=persistent_workers,
                                prefetch_factor=prefetch_factor, collate_fn=collate_fn, trainer=trainer, seed=seed)
    extra = worker_options(num_workers, persistent_workers, prefetch_factor, train)
    drop_last = train and len(dataset) > batch_size
    if repeats > 1:
        sampler = RepeatedAugmentationSampler(dataset, batch_size, repeats, seed=seed)
        drop_last = len(sampler) > batch_size
        dataset = SeededSamples(dataset)
    elif train:
        sampler = ResumableSampler(dataset, batch_size, seed=seed, drop_last=drop_last)
        dataset = SeededSamples(dataset)
    else:
        sampler = eval_sampler(dataset)
    loader_class = SuiteTrainLoader if train else SuiteDataLoader
    # a private generator: creating the iterator must not consume the global RNG (exact resume)
    return loader_class(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, num_workers=num_workers,
                        pin_memory=pin_memory and torch.cuda.is_available(), collate_fn=collate_fn,
                        generator=torch.Generator().manual_seed(seed), **extra)


def worker_options(num_workers: int, persistent_workers: bool, prefetch_factor: int | None, train: bool) -> dict:
    """The DataLoader arguments that only apply with worker processes."""
    extra = {}
    if num_workers > 0:
        # evaluation workers idle through every training epoch: forking them anew per validation costs
        # a fraction of a second, keeping them costs their memory for the whole fit
        extra["persistent_workers"] = persistent_workers and train
        if prefetch_factor is not None:
            extra["prefetch_factor"] = prefetch_factor
    return extra


class SplitLoaders:
    """The dataloader hooks of a LightningDataModule whose ``setup`` fills ``train_set``,
    ``val_set``, ``test_set`` / ``predict_set`` and whose ``_loader(dataset, train)`` builds a loader
    (with :func:`make_loader`; ``trainer=self.trainer`` gives a streamed training split the trainer's epoch)."""

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
