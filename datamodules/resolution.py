"""Training batches whose image size changes during training: variable-resolution batches and progressive resizing.

Two schedules, each a recipe value of the image datamodules that train on random crops (classification):

- ``data.variable_resolution`` (:class:`VariableResolution`): every batch is cropped at one of a set of
  sizes, its batch size scaled so that pixels per batch stay near the base (``image_size`` x ``image_size``
  x ``batch_size``). The set and the batch sizes follow CVNets' ``variable_batch_sampler``
  (``data/sampler/utils.py::image_batch_pairs``; the MobileViT paper's multi-scale sampler, section 3.3),
  with the ``sampler.vbs.*`` keys as fields. :func:`resolution_table` computes the table.
- ``data.progressive_resizing`` (:class:`ProgressiveResizing`): small crops early, the full size late, at
  a constant batch size: Composer's ``ProgressiveResizing`` schedule (fastai's progressive resizing) on
  the fraction of training done, applied in the loader (the crop is taken at the smaller size) instead of
  by downsampling the loaded batch.

Evaluation stays at the fixed ``image_size``. Both run through one sampler, :class:`ResolutionSampler`,
which yields a whole batch's keys ``(index, seed, (height, width))``; the dataset wrapper
:class:`BatchesAtResolution` reads each sample under its seed at its size and collates the batch in the
loader's worker. What differs from the references, and why:

- CVNets draws each batch's (size, batch size) pair independently (``random.choice``), so the number of
  batches per epoch varies. Here each run of ``len(table)`` batches uses every pair once, in an order drawn
  per epoch: each pair's share is the same in expectation, and every epoch has the same number of steps,
  which Lightning and the learning-rate schedules count ahead. The samples left after the last full run
  (fewer than one run's worth per rank) wait for the next epoch's shuffle, as ``drop_last`` leaves a
  partial batch.
- The pairs are drawn from ``(seed, epoch)`` alone, so all DDP ranks train the same size and the same
  batch size at every step without communicating; each rank reads its own shard of the epoch's
  shuffled order (``DistributedSampler``'s). CVNets seeds Python's ``random`` with the epoch on every rank
  for the same effect.
- The loss is the batch mean, as CVNets computes it: a step of 400 small images weighs as much as a step
  of 128 large ones (CVNets scales no loss by the batch size).

Both resume exactly mid-epoch like every training loader (:mod:`datamodules.resumable`): the epoch's plan
is rebuilt from the seed and the epoch, and the position counts the samples of the epoch's order already
trained on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Literal

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from datamodules.resumable import EpochOrder, run_seeded, sample_seed, world
from datamodules.loaders import SuiteTrainLoader, worker_options
from layers.machine import NumWorkers, loader_workers

#: (height, width, batch size) of one entry of a resolution table
Resolution = tuple[int, int, int]


def make_divisible(value: float, divisor: int) -> int:
    """``value`` rounded to the nearest multiple of ``divisor``, at least ``divisor``, and not more than 10 %
    below ``value`` (then one multiple up): the rule of TF's MobileNet code that CVNets applies to crop sizes
    (``utils/math_utils.py::make_divisible``)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


@dataclass(frozen=True)
class VariableResolution:
    """``data.variable_resolution``: CVNets' variable-batch sampler (``sampler.vbs.*``).

    Args:
        min_size, max_size: the smallest and largest crop side (``min/max_crop_size_{width,height}``).
        scales: how many sizes from ``min_size`` to ``max_size``, evenly spaced, before rounding
            (``max_n_scales``); the base ``image_size`` is added to them.
        multiple: every size is rounded to a multiple of this (``check_scale``): 32 for networks that
            downsample five times.
        rule: ``"cvnets"``: CVNets' and CoreNet's current rule, batch size ``base area x base batch / area``
            (rounded down, at least 1), so a larger crop gets a smaller batch; ``"cvnets_v0.1"``: CVNets
            v0.1's (the release whose MobileViT v1 recipes produced the paper's numbers), where the batch is
            never below the base batch and is rounded to a multiple of the number of processes.
    """

    min_size: int = 160
    max_size: int = 320
    scales: int = 5
    multiple: int = 32
    rule: Literal["cvnets", "cvnets_v0.1"] = "cvnets"

    def __post_init__(self):
        for name in ("min_size", "max_size", "scales", "multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.variable_resolution.{name} must be a positive integer, got {value!r}")
        if self.min_size > self.max_size:
            raise ValueError(f"data.variable_resolution.min_size={self.min_size} is above max_size={self.max_size}")
        if self.rule not in ("cvnets", "cvnets_v0.1"):
            raise ValueError(f"data.variable_resolution.rule must be 'cvnets' or 'cvnets_v0.1', got {self.rule!r}")


@dataclass(frozen=True)
class ProgressiveResizing:
    """``data.progressive_resizing``: Composer's ``ProgressiveResizing`` schedule (same fields and defaults).

    The crop side is ``image_size`` times a scale that stays at ``initial_scale`` for the first
    ``delay_fraction`` of training, grows linearly to 1 until ``1 - finetune_fraction``, and stays 1 for the
    rest; the side is rounded to a multiple of ``multiple`` (Composer's ``size_increment``). Training's
    fraction counts batches over ``trainer.max_epochs`` epochs. The batch size does not change.
    """

    initial_scale: float = 0.5
    delay_fraction: float = 0.5
    finetune_fraction: float = 0.2
    multiple: int = 4

    def __post_init__(self):
        if not 0 < self.initial_scale <= 1:
            raise ValueError(f"data.progressive_resizing.initial_scale must be in (0, 1], got {self.initial_scale!r}")
        for name in ("delay_fraction", "finetune_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"data.progressive_resizing.{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.delay_fraction + self.finetune_fraction > 1:
            raise ValueError(f"data.progressive_resizing: delay_fraction + finetune_fraction must be at most 1, got "
                             f"{self.delay_fraction} + {self.finetune_fraction}")
        if isinstance(self.multiple, bool) or not isinstance(self.multiple, int) or self.multiple < 1:
            raise ValueError(f"data.progressive_resizing.multiple must be a positive integer, got {self.multiple!r}")

    def scale_at(self, fraction: float) -> float:
        """The scale after ``fraction`` (0 to 1) of training."""
        ramp = 1.0 - self.finetune_fraction - self.delay_fraction
        if fraction < self.delay_fraction:
            done = 0.0
        else:
            done = min((fraction - self.delay_fraction) / ramp, 1.0) if ramp > 0 else 1.0
        return self.initial_scale + (1.0 - self.initial_scale) * done

    def size_at(self, fraction: float, base_size: int) -> int:
        """The crop side after ``fraction`` of training (Composer pins the width the same way)."""
        return max(self.multiple, round(base_size * self.scale_at(fraction) / self.multiple) * self.multiple)


def resolution_table(base_size: int, base_batch: int, schedule: VariableResolution,
                     world_size: int = 1) -> list[Resolution]:
    """CVNets' table of (height, width, batch size) for a base crop ``base_size`` and a per-process batch
    ``base_batch``, sorted (``image_batch_pairs``; ``_image_batch_pairs`` in v0.1). Square crops: the suite's
    ``image_size`` is one side."""
    pixels = base_size * base_size * base_batch
    spaced = np.linspace(schedule.min_size, schedule.max_size, schedule.scales)
    if schedule.rule == "cvnets":
        sides = sorted(make_divisible(v, schedule.multiple) for v in {*spaced.tolist(), base_size})
        # int(round(x, 2)): CVNets rounds to two decimals, then truncates
        return sorted({(s, s, max(1, int(round(pixels / (s * s), 2)))) for s in sides})
    sides = spaced.tolist() + ([] if base_size in spaced else [base_size])
    table = set()
    for side in {make_divisible(s, schedule.multiple) for s in sides}:
        batch = max(base_batch, int(round(pixels / (side * side), 2)))
        table.add((side, side, make_divisible(batch, world_size)))
    return sorted(table)


class VariableBatchPlan:
    """An epoch's batches under :class:`VariableResolution`: runs of the whole table, each in its own order."""

    def __init__(self, table: list[Resolution]):
        self.table = list(table)

    def batches(self, epoch: int, seed: int, samples_per_rank: int) -> list[Resolution]:
        run = sum(batch for _, _, batch in self.table)
        runs = samples_per_rank // run
        if runs == 0:
            raise ValueError(f"data.variable_resolution: one run of the resolution table {self.table} takes {run} "
                             f"samples a process, and this process has {samples_per_rank} an epoch; lower "
                             "data.batch_size or train with more data")
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        return [self.table[i] for _ in range(runs) for i in torch.randperm(len(self.table), generator=generator)]


class ProgressivePlan:
    """An epoch's batches under :class:`ProgressiveResizing`: ``samples_per_rank // base_batch`` batches of
    the base batch size, each cropped at the schedule's size for the fraction of training done before it."""

    def __init__(self, schedule: ProgressiveResizing, base_size: int, base_batch: int, max_epochs: int):
        if not isinstance(max_epochs, int) or max_epochs < 1:
            raise ValueError("data.progressive_resizing follows the fraction of training done, counted over "
                             f"trainer.max_epochs; set it (got {max_epochs!r})")
        self.schedule, self.base_size, self.base_batch, self.max_epochs = schedule, base_size, base_batch, max_epochs

    def batches(self, epoch: int, seed: int, samples_per_rank: int) -> list[Resolution]:
        steps = samples_per_rank // self.base_batch
        total = self.max_epochs * steps
        sides = [self.schedule.size_at(min((epoch * steps + k) / total, 1.0), self.base_size) for k in range(steps)]
        return [(side, side, self.base_batch) for side in sides]


class ResolutionSampler(EpochOrder, DistributedSampler):
    """Yields one batch at a time, as a list of ``(index, sample_seed, (height, width))`` keys for
    :class:`BatchesAtResolution`.

    This rank's samples are ``DistributedSampler``'s shard of the epoch's shuffled order (seeded with
    ``seed + epoch``, padded by wrapping round); the plan (``plan.batches(epoch, seed, samples_per_rank)``,
    the same on every rank) cuts it into batches of the planned sizes. Resumes like
    :class:`datamodules.loaders.ResumableSampler`: ``start`` counts the samples of the epoch's order, over
    all ranks together, already trained on; ``len`` is the whole epoch's batches. A ``DistributedSampler``,
    so that Lightning does not wrap it under DDP.
    """

    def __init__(self, dataset: Dataset, plan, base_batch: int, seed: int = 0,
                 num_replicas: int | None = None, rank: int | None = None):
        if num_replicas is None or rank is None:
            num_replicas, rank = world()
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.plan, self.base_batch = plan, base_batch
        self._cached: tuple[int, list[Resolution], np.ndarray] | None = None

    def planned(self) -> tuple[list[Resolution], np.ndarray]:
        """The epoch's batches and, per batch, the samples of this rank before it (one more entry: the total)."""
        if self._cached is None or self._cached[0] != self.epoch:
            batches = self.plan.batches(self.epoch, self.seed, self.num_samples)
            before = np.concatenate([[0], np.cumsum([batch for _, _, batch in batches])]).astype(np.int64)
            self._cached = (self.epoch, batches, before)
        return self._cached[1], self._cached[2]

    def skipped(self) -> int:
        """Batches of the epoch whose samples were all trained on before ``start``."""
        _, before = self.planned()
        return int(np.searchsorted(before, self.start // self.num_replicas, side="right")) - 1

    def samples_after(self, batches: int) -> int:
        _, before = self.planned()
        return int(before[min(self.skipped() + batches, len(before) - 1)]) * self.num_replicas

    def __len__(self) -> int:
        return len(self.planned()[0])

    def __iter__(self) -> Iterator[list[tuple[int, int, tuple[int, int]]]]:
        epoch = self.epoch
        indices = list(DistributedSampler.__iter__(self))
        batches, before = self.planned()
        skip = self.skipped()
        for (height, width, _), first, end in zip(batches[skip:], before[skip:], before[skip + 1:]):
            yield [(i, sample_seed(self.seed, epoch, i), (height, width)) for i in indices[first:end]]


class BatchesAtResolution(Dataset):
    """``dataset[keys]`` is one collated batch: each ``(index, seed, size)`` key read by ``read_at(index, size)``
    under its seed (:func:`datamodules.resumable.run_seeded`), then ``collate`` of the list."""

    def __init__(self, read_at: Callable[[int, tuple[int, int]], object], collate: Callable, length: int):
        self.read_at, self.collate, self.length = read_at, collate, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, keys: list[tuple[int, int, tuple[int, int]]]):
        return self.collate([run_seeded(lambda: self.read_at(index, size), seed) for index, seed, size in keys])


class AtSize:
    """``read_at(index, size)`` of a dataset whose ``item(index, transform)`` builds its items: the transform
    for each size is ``make_transform(size)``, built once per size and process."""

    def __init__(self, dataset, make_transform: Callable[[tuple[int, int]], Callable]):
        self.dataset, self.make_transform = dataset, make_transform
        self._transforms: dict[tuple[int, int], Callable] = {}

    def __call__(self, index: int, size: tuple[int, int]):
        if size not in self._transforms:
            self._transforms[size] = self.make_transform(size)
        return self.dataset.item(index, self._transforms[size])


class ResolutionTrainLoader(SuiteTrainLoader):
    """The training loader of :class:`ResolutionSampler` batches (the sampler yields whole batches)."""

    @property
    def batch_setting(self) -> int:
        return self.sampler.base_batch


def _whole_batch(batch):
    return batch


def resolution_loader(dataset: Dataset, make_transform: Callable[[tuple[int, int]], Callable], plan, *,
                      base_batch: int, collate_fn: Callable, num_workers: NumWorkers, seed: int = 0,
                      pin_memory: bool = True, persistent_workers: bool = True,
                      prefetch_factor: int | None = None) -> ResolutionTrainLoader:
    """The training loader of a resolution schedule: batches planned by ``plan``
    (:class:`VariableBatchPlan` or :class:`ProgressivePlan`), each sample of ``dataset`` (which has
    ``item(index, transform)``) transformed by ``make_transform((height, width))``, collated by
    ``collate_fn`` in the worker that reads the batch."""
    num_workers = loader_workers(num_workers)
    sampler = ResolutionSampler(dataset, plan, base_batch, seed=seed)
    batches = BatchesAtResolution(AtSize(dataset, make_transform), collate_fn, len(dataset))
    extra = worker_options(num_workers, persistent_workers, prefetch_factor, train=True)
    # batch_size=None: the sampler's items are whole batches, collated in BatchesAtResolution
    return ResolutionTrainLoader(batches, batch_size=None, sampler=sampler, num_workers=num_workers,
                                 pin_memory=pin_memory and torch.cuda.is_available(), collate_fn=_whole_batch,
                                 generator=torch.Generator().manual_seed(seed), **extra)


def resolution_plan(hparams, trainer=None) -> VariableBatchPlan | ProgressivePlan | None:
    """The training plan of a datamodule's ``variable_resolution`` / ``progressive_resizing`` (with its
    ``image_size`` and ``batch_size``), ``None`` without either. The table's batch-size rounding of
    ``"cvnets_v0.1"`` depends on the number of processes, read from the process group."""
    variable, progressive = hparams.get("variable_resolution"), hparams.get("progressive_resizing")
    if variable is not None:
        variable = variable if isinstance(variable, VariableResolution) else VariableResolution(**variable)
        return VariableBatchPlan(resolution_table(hparams["image_size"], hparams["batch_size"], variable, world()[0]))
    if progressive is not None:
        progressive = progressive if isinstance(progressive, ProgressiveResizing) else ProgressiveResizing(**progressive)
        max_epochs = None if trainer is None else trainer.max_epochs
        return ProgressivePlan(progressive, hparams["image_size"], hparams["batch_size"], max_epochs)
    return None


def check_schedules(variable_resolution: VariableResolution | None, progressive_resizing: ProgressiveResizing | None,
                    repeated_augmentation: int = 1, streamed: bool = False) -> None:
    """Refuse the combinations no reference defines: both schedules at once, either with repeated augmentation,
    and either on a streamed split (LitData orders and batches streamed samples itself)."""
    chosen = [name for name, value in (("data.variable_resolution", variable_resolution),
                                       ("data.progressive_resizing", progressive_resizing)) if value is not None]
    if len(chosen) == 2:
        raise ValueError("data.variable_resolution and data.progressive_resizing each set the training crop size; "
                         "choose one")
    if chosen and repeated_augmentation > 1:
        raise ValueError(f"{chosen[0]} and data.repeated_augmentation > 1 each order the training samples; "
                         "choose one")
    if chosen and streamed:
        raise ValueError(f"{chosen[0]} needs the folder-read loaders: a streamed split (data.streaming_root) is "
                         "batched by LitData")

