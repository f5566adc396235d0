"""Optimizer parameter groups and per-iteration learning-rate schedules.

Recipes inject the optimizer and scheduler from YAML as LightningCLI callables::

    model:
      optimizer:
        class_path: torch.optim.AdamW
        init_args: {lr: 0.002, weight_decay: 0.05}
      scheduler:
        class_path: tasks.engine.optim.WarmupCosineLR
        init_args: {warmup_steps: 20000, warmup_init_lr: 1.0e-6, min_lr: 2.0e-4}

Schedules are stepped every optimizer step (not every epoch), as the paper recipes
are. ``total_steps`` left unset is filled in from the trainer when training starts
(``TaskModule.on_train_start``), so one recipe scales to any number of devices and epochs.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LRScheduler

#: torch's normalisation layers, whose weights are never decayed (tests/test_optim.py checks that every
#: torch.nn class named ...Norm... is here)
NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d,
              nn.LazyBatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
              nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d, nn.GroupNorm, nn.LayerNorm,
              nn.LocalResponseNorm, nn.RMSNorm)


def param_groups(module: nn.Module, no_weight_decay_on_norm_bias: bool = True) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed group.

    Biases, normalisation weights and 1-d parameters (class tokens, position embeddings
    are >1-d and stay decayed, as in timm) go to the group with ``weight_decay=0``.
    """
    if not no_weight_decay_on_norm_bias:
        return [{"params": [p for p in module.parameters() if p.requires_grad]}]
    decay, no_decay, seen = [], [], set()
    for mod in module.modules():
        for name, p in mod.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(mod, NORM_TYPES) or name.endswith("bias") or p.ndim <= 1:
                no_decay.append(p)
            else:
                decay.append(p)
    groups = [{"params": decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class _Constant(LRScheduler):
    """A schedule with no arguments of its own: what its ``state_dict()`` holds is torch's bookkeeping."""

    def get_lr(self) -> list[float]:
        return list(self.base_lrs)


@functools.cache
def _schedule_progress_keys() -> frozenset[str]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return frozenset(_Constant(optimizer).state_dict()) - {"base_lrs"}


def schedule_arguments(schedule: LRScheduler) -> dict:
    """The part of ``schedule.state_dict()`` that its construction set: its own arguments (warm-up steps,
    total steps, ...) and ``base_lrs``, without the progress torch's ``LRScheduler`` keeps beside
    them (``last_epoch``, the step count, the last learning rates, ...). The progress keys are those
    a schedule without arguments saves, so a torch version that adds one leaves it out here too."""
    return {k: v for k, v in schedule.state_dict().items() if k not in _schedule_progress_keys()}


class _StepSchedule(LRScheduler):
    """A schedule given in closed form by ``lr_at(step, base_lr)``; its state is plain numbers."""

    def lr_at(self, step: int, base_lr: float) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.last_epoch, base_lr) for base_lr in self.base_lrs]


class WarmupCosineLR(_StepSchedule):
    """Linear warm-up from ``warmup_init_lr`` to the optimizer's lr over ``warmup_steps``,
    then cosine annealing to ``min_lr`` at ``total_steps`` (CVNets / timm convention).

    Args:
        total_steps: optimizer steps of the whole run; ``None`` means "ask the trainer":
            ``TaskModule.on_train_start`` sets it to ``trainer.estimated_stepping_batches``
            before the first step (not ``configure_optimizers``: that estimate builds the train
            loader, which must wait until a resumed checkpoint has restored the loop position).
            Left ``None`` outside a trainer, the cosine phase lasts one step (``min_lr`` one
            step after warm-up).
        min_lr: absolute floor of the cosine, reached at ``total_steps``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int = 0, total_steps: int | None = None,
                 warmup_init_lr: float = 1e-6, min_lr: float = 0.0, last_epoch: int = -1):
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.warmup_init_lr = warmup_init_lr
        self.min_lr = min_lr
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        if step < self.warmup_steps:
            return self.warmup_init_lr + (base_lr - self.warmup_init_lr) * step / self.warmup_steps
        total = self.total_steps or (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / max(1, total - self.warmup_steps))
        return self.min_lr + 0.5 * (base_lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))


class InverseSqrtLR(_StepSchedule):
    """The Transformer schedule (Vaswani et al.; fairseq ``inverse_sqrt``): linear warm-up
    from ``warmup_init_lr`` to the optimizer's lr over ``warmup_steps``, then
    ``lr * sqrt(warmup_steps / step)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int = 4000, warmup_init_lr: float = 1e-7,
                 last_epoch: int = -1):
        self.warmup_steps = warmup_steps
        self.warmup_init_lr = warmup_init_lr
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        if step < self.warmup_steps:
            return self.warmup_init_lr + (base_lr - self.warmup_init_lr) * step / max(1, self.warmup_steps)
        return base_lr * math.sqrt(self.warmup_steps / max(step, 1))
