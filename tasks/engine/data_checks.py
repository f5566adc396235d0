"""Refusals about the data a task module meets, each naming what differs and what to do: a dataset whose
classes, category ids or vocabulary are not the model's (the labels would silently mean something else), and
a training batch of one image where BatchNorm layers take batch statistics."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from lightning.pytorch import LightningModule

from layers.compat import is_batchnorm
from tasks.engine.checkpoints import plain


def data_identity(module: LightningModule) -> dict[str, Any]:
    """The values ``module`` took from its training data (its constructor arguments in ``DATA_LINKS``)."""
    return {arg: module.hparams.get(arg) for arg in module.DATA_LINKS.values() if arg in module.hparams}


def data_identity_mismatches(module: LightningModule, datamodule) -> list[str]:
    """What differs between the data ``module`` was trained on and ``datamodule``'s data."""
    mismatches = []
    for attr, arg in module.DATA_LINKS.items():
        mine = module.hparams.get(arg)
        if mine is None:
            continue
        theirs = getattr(datamodule, attr)
        theirs = list(theirs) if isinstance(theirs, (list, tuple)) else theirs
        mine = list(mine) if isinstance(mine, (list, tuple)) else mine
        if mine != theirs:
            mismatches.append(f"{arg}: model {short(mine)} vs data {short(theirs)}")
    return mismatches


def refuse_other_data(source: str, datamodule, mismatches: list[str]) -> None:
    """Refuse to score ``datamodule``'s data with a model (``source``) trained on data that differs."""
    if mismatches:
        raise ValueError(f"{source} was trained on other data than data.root={getattr(datamodule, 'root', None)}: "
                         + "; ".join(mismatches)
                         + ". Evaluate it on data with the same classes (ids, vocabulary), or fine-tune it with fit.")


def refuse_checkpoint_of_other_data(module: LightningModule, checkpoint: dict[str, Any]) -> None:
    """Refuse a checkpoint whose saved data values (class names, ids, vocabulary) differ from ``module``'s."""
    saved = checkpoint.get("hyper_parameters", {})
    differing = [f"{arg}: checkpoint {short(saved[arg])} vs now {short(value)}"
                 for arg, value in data_identity(module).items()
                 if arg in saved and plain(saved[arg]) != plain(value)]
    if differing:
        raise ValueError("the checkpoint was trained on other data than this run's: " + "; ".join(differing))


def refuse_single_image_batchnorm(module: LightningModule, batch: Any, batch_idx: int) -> None:
    """Refuse a training batch of one image (``batch["image"]`` (1,C,H,W)) when a BatchNorm layer trains on
    this rank's batch alone: it cannot take statistics of one value per channel, and PyTorch's own error
    names neither the batch size nor a remedy."""
    images = batch.get("image") if isinstance(batch, dict) else None
    if not torch.is_tensor(images) or images.ndim != 4 or images.shape[0] != 1:
        return
    trainer = module.trainer
    per_rank = [m for m in module.modules() if is_batchnorm(m) and m.training
                and not (isinstance(m, nn.SyncBatchNorm) and trainer.world_size > 1)]
    if not per_rank:
        return
    datamodule = getattr(trainer, "datamodule", None)
    size = datamodule.hparams.get("batch_size") if datamodule is not None else None
    raise ValueError(
        f"a training batch of 1 image at global step {module.global_step} (epoch {module.current_epoch}, "
        f"batch {batch_idx}; data.batch_size={size}, {trainer.world_size} process(es)): the network's "
        "BatchNorm layers cannot take batch statistics of a single image. Train with --data.batch_size 2 or "
        "more per process (the training loaders drop an incomplete last batch once the training split holds "
        "more images than one batch), or give the training split more than one image per process.")


def short(value, limit: int = 6) -> str:
    if isinstance(value, (list, tuple)):
        head = ", ".join(repr(v) for v in list(value)[:limit])
        return f"[{head}{', ...' if len(value) > limit else ''}] ({len(value)})"
    return repr(value)
