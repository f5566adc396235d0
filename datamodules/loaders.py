"""DataLoader settings every datamodule shares."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset


def eval_sampler(dataset: Dataset) -> UnrepeatedDistributedSampler | None:
    """Under DDP, split evaluation data across ranks *without* the padding repeats that
    ``DistributedSampler`` adds, so every sample is scored exactly once and metrics equal
    the single-process values. Lightning keeps a sampler that is already distributed."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return UnrepeatedDistributedSampler(dataset, shuffle=False)
    return None


def make_loader(dataset: Dataset, *, batch_size: int, num_workers: int, train: bool, pin_memory: bool = True,
                persistent_workers: bool = True, prefetch_factor: int | None = None,
                collate_fn: Callable | None = None) -> DataLoader:
    """A DataLoader with the suite's conventions: shuffled and drop_last for training,
    unrepeated distributed sampling for evaluation, workers kept alive between epochs."""
    sampler = None if train else eval_sampler(dataset)
    extra = {}
    if num_workers > 0:
        extra["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            extra["prefetch_factor"] = prefetch_factor
    return DataLoader(dataset, batch_size=batch_size, shuffle=train and sampler is None, sampler=sampler,
                      drop_last=train and len(dataset) > batch_size, num_workers=num_workers,
                      pin_memory=pin_memory and torch.cuda.is_available(),
                      collate_fn=collate_fn, **extra)
