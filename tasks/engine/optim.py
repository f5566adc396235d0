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


def param_groups(module: nn.Module, no_weight_decay_on_norm_bias: bool = True,
                 layer_decay: float | None = None) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed group.

    Biases, normalisation weights and 1-d parameters (class tokens, position embeddings
    are >1-d and stay decayed, as in timm) go to the group with ``weight_decay=0``.

    With ``layer_decay`` (BEiT's layer-wise learning-rate decay, timm's ``--layer-decay`` and
    ``param_groups_layer_decay``) each of those groups is split further by layer
    (:func:`layer_ids`), and a group of layer ``i`` carries ``lr_scale = layer_decay ** (top - i)``:
    the head trains at the full rate, each layer below it ``layer_decay`` times slower than the
    one above. :func:`apply_lr_scale` and the schedules here multiply every group's rate by it.
    """
    if layer_decay is not None:
        return _layer_decay_groups(module, no_weight_decay_on_norm_bias, layer_decay)
    if not no_weight_decay_on_norm_bias:
        return [{"params": [p for p in module.parameters() if p.requires_grad]}]
    decay, no_decay = [], []
    for p, decayed in _trainable(module, no_weight_decay_on_norm_bias):
        (decay if decayed else no_decay).append(p)
    groups = [{"params": decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _trainable(module: nn.Module, no_weight_decay_on_norm_bias: bool):
    """(parameter, whether it is decayed) of each trainable parameter of ``module``, once each, in module order."""
    seen = set()
    for mod in module.modules():
        for name, p in mod.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            exempt = isinstance(mod, NORM_TYPES) or name.endswith("bias") or p.ndim <= 1
            yield p, not (no_weight_decay_on_norm_bias and exempt)


def repeated_block_order(network: nn.Module, name: str) -> tuple[int, ...] | None:
    """The layer order of a network that states none (a head): parameters of its ``i``-th repeated
    block (:func:`layers.compile.repeated_blocks`, e.g. the translation decoder's layers) are
    layer ``(i,)`` of it, everything else (embeddings, norms, classifiers) sits at the top (``None``)."""
    from layers.compile import repeated_blocks

    for i, (prefix, _) in enumerate(repeated_blocks(network)):
        if name.startswith(prefix + "."):
            return (i,)
    return None


def layer_ids(module: nn.Module) -> tuple[dict[int, int], int]:
    """``{id(parameter): layer id}`` of every parameter of a task module, and the top layer's id.

    The task's networks (its children with parameters) are taken in the order they were built:
    backbone then head; encoder then decoder. A network that has ``layer_order(name)`` (every
    backbone family, :class:`backbones.transformer.TransformerEncoder`) gives an ordinal per
    parameter name, shallow first (timm's ``group_matcher``: the stem, each block in order, a final
    norm with the last block); ordinals are ranked densely into layer ids. Any other network (the
    classifier, detection and segmentation heads, the translation decoder) numbers its repeated
    blocks in order after the layers below it (:func:`repeated_block_order`) and puts the rest at
    the top. Parameters ``layer_order`` answers ``None`` for (a feature pyramid built on top of
    a plain backbone) sit at the top too. A parameter shared by two networks (tied embeddings)
    keeps the layer of the first one.
    """
    ids: dict[int, int] = {}
    top_params: list[int] = []
    next_id = 0
    for _, network in module.named_children():
        order = getattr(network, "layer_order", None)
        ordinals: dict[int, tuple] = {}
        for name, p in network.named_parameters():
            if id(p) in ids or id(p) in ordinals or id(p) in top_params:
                continue
            ordinal = order(name) if order is not None else repeated_block_order(network, name)
            if ordinal is None:
                top_params.append(id(p))
            else:
                ordinals[id(p)] = tuple(ordinal)
        rank = {ordinal: next_id + i for i, ordinal in enumerate(sorted(set(ordinals.values())))}
        ids.update({pid: rank[ordinal] for pid, ordinal in ordinals.items()})
        next_id += len(rank)
    for name, p in module.named_parameters():  # the networks' top parameters, and any of the module's own
        ids.setdefault(id(p), next_id)
    return ids, next_id


def _layer_decay_groups(module: nn.Module, no_weight_decay_on_norm_bias: bool, layer_decay: float) -> list[dict]:
    ids, top = layer_ids(module)
    groups: dict[tuple[int, bool], dict] = {}
    for p, decayed in _trainable(module, no_weight_decay_on_norm_bias):
        layer = ids[id(p)]
        group = groups.setdefault((layer, decayed), {"params": [], "lr_scale": layer_decay ** (top - layer),
                                                     "layer_id": layer})
        if not decayed:
            group["weight_decay"] = 0.0
        group["params"].append(p)
    return [groups[key] for key in sorted(groups)]


def apply_lr_scale(optimizer: torch.optim.Optimizer) -> None:
    """Multiply each parameter group's learning rate by its ``lr_scale`` (layer-wise decay), once, right
    after the optimizer is built: the schedules start from these rates (their ``base_lrs``). Groups
    without a scale are left as they are."""
    for group in optimizer.param_groups:
        if "lr_scale" in group:
            group["lr"] = group["lr"] * group["lr_scale"]


def build_optimizer(module: nn.Module, optimizer_factory, scheduler_factory, no_weight_decay_on_norm_bias: bool,
                    layer_decay: float | None = None) -> dict:
    """What ``TaskModule.configure_optimizers`` returns: the optimizer over :func:`param_groups` (rates
    scaled per layer under ``layer_decay``) and the schedule, stepped every optimizer step."""
    optimizer = optimizer_factory(param_groups(module, no_weight_decay_on_norm_bias, layer_decay))
    apply_lr_scale(optimizer)
    if scheduler_factory is None:
        return {"optimizer": optimizer}
    scheduler = scheduler_factory(optimizer)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


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
    """A schedule given in closed form by ``lr_at(step, base_lr, scale)``; its state is plain numbers.

    A parameter group with an ``lr_scale`` (layer-wise decay, :func:`param_groups`) starts from its
    scaled rate, and its absolute rates (warm-up start, floor) are scaled with it, so that every
    group follows the one schedule times its scale, as timm's schedulers apply ``lr_scale``."""

    def lr_at(self, step: int, base_lr: float, scale: float = 1.0) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.last_epoch, base_lr, group.get("lr_scale", 1.0))
                for base_lr, group in zip(self.base_lrs, self.optimizer.param_groups)]


def rewind_schedule(schedule: LRScheduler, steps: int = 1) -> bool:
    """Move a closed-form schedule (:class:`_StepSchedule`) back ``steps`` optimizer steps and set its rates, so
    a step whose update was skipped does not count as one. Returns whether it could (other schedules are left
    where they are)."""
    if not isinstance(schedule, _StepSchedule):
        return False
    schedule.last_epoch = max(0, schedule.last_epoch - steps)
    for group, lr in zip(schedule.optimizer.param_groups, schedule.get_lr()):
        group["lr"] = lr
    return True


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

    def lr_at(self, step: int, base_lr: float, scale: float = 1.0) -> float:
        warmup_init_lr, min_lr = self.warmup_init_lr * scale, self.min_lr * scale
        if step < self.warmup_steps:
            return warmup_init_lr + (base_lr - warmup_init_lr) * step / self.warmup_steps
        total = self.total_steps or (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / max(1, total - self.warmup_steps))
        return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


class InverseSqrtLR(_StepSchedule):
    """The Transformer schedule (Vaswani et al.; fairseq ``inverse_sqrt``): linear warm-up
    from ``warmup_init_lr`` to the optimizer's lr over ``warmup_steps``, then
    ``lr * sqrt(warmup_steps / step)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int = 4000, warmup_init_lr: float = 1e-7,
                 last_epoch: int = -1):
        self.warmup_steps = warmup_steps
        self.warmup_init_lr = warmup_init_lr
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float, scale: float = 1.0) -> float:
        if step < self.warmup_steps:
            warmup_init_lr = self.warmup_init_lr * scale
            return warmup_init_lr + (base_lr - warmup_init_lr) * step / max(1, self.warmup_steps)
        return base_lr * math.sqrt(self.warmup_steps / max(step, 1))
