"""Checkpoint-file mechanics shared by every task: RNG states, named errors for bad files,
atomic writes. (The task promises themselves are proven on the real tasks in test_contract.py.)"""
import errno

import fsspec.implementations.local
import pytest
import torch
import torch.nn as nn
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from tasks.base import TaskModule
from tasks.cli import check_checkpoint_file


class PoisonedRegression(TaskModule):
    """A linear model whose loss turns NaN at ``poison_step``."""

    def __init__(self, poison_step: int, **kwargs):
        super().__init__(optimizer=lambda params: torch.optim.SGD(params, lr=0.1), **kwargs)
        self.net = nn.Linear(4, 1)
        self.poison_step = poison_step

    def training_loss(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_step == self.poison_step:
            loss = loss * float("nan")
        return loss


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def trainer(tmp_path, **kwargs):
    return Trainer(default_root_dir=tmp_path, max_epochs=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=[ModelCheckpoint(tmp_path / "ckpt", save_last=True,
                                                                          every_n_train_steps=1)], **kwargs)


def test_checkpoint_holds_rng_states_and_loads_weights_only(tmp_path):
    trainer(tmp_path).fit(PoisonedRegression(poison_step=-1), loader())
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert set(saved["rng_states"]) == {"torch", "cuda", "numpy", "python"}


def test_truncated_and_foreign_checkpoints_are_named(tmp_path):
    trainer(tmp_path).fit(PoisonedRegression(poison_step=-1), loader())
    good = (tmp_path / "ckpt" / "last.ckpt").read_bytes()
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=r"cannot read checkpoint .*truncated.ckpt .*truncated"):
        check_checkpoint_file(str(truncated))
    foreign = tmp_path / "timm.pth"
    torch.save(nn.Linear(2, 2).state_dict(), foreign)
    with pytest.raises(ValueError, match=r"timm.pth is not a Lightning checkpoint .*'weight', 'bias'"):
        check_checkpoint_file(str(foreign))
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        check_checkpoint_file(str(tmp_path / "missing.ckpt"))


def test_failed_checkpoint_write_leaves_the_previous_file_intact(tmp_path, monkeypatch):
    """Disk full in the middle of writing last.ckpt: the old last.ckpt must survive."""
    t = trainer(tmp_path)
    t.fit(PoisonedRegression(poison_step=-1), loader())
    path = tmp_path / "ckpt" / "last.ckpt"
    before = path.read_bytes()

    def disk_full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsspec.implementations.local.LocalFileOpener, "write", disk_full)
    with pytest.raises(OSError, match="No space left"):
        t.save_checkpoint(path)
    assert path.read_bytes() == before
    torch.load(path, weights_only=True)
