"""Fault handling shared by every task: non-finite losses, bad checkpoint files, atomic
checkpoint writes, SyncBatchNorm on CPU."""
import errno

import fsspec.implementations.local
import pytest
import torch
import torch.nn as nn
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from tasks.base import TaskModule
from tasks.cli import SuiteCLI, check_checkpoint_file
from tests.conftest import REPO


class PoisonedRegression(TaskModule):
    """A linear model whose loss turns NaN at ``poison_step``."""

    def __init__(self, poison_step: int, **kwargs):
        super().__init__(optimizer=lambda params: torch.optim.SGD(params, lr=0.1), **kwargs)
        self.net = nn.Linear(4, 1)
        self.poison_step = poison_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_step == self.poison_step:
            loss = loss * float("nan")
        return self.guard_loss(loss, batch_idx)


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def trainer(tmp_path, **kwargs):
    return Trainer(default_root_dir=tmp_path, max_epochs=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=[ModelCheckpoint(tmp_path / "ckpt", save_last=True,
                                                                          every_n_train_steps=1)], **kwargs)


def test_nonfinite_loss_stops_naming_step_and_batch_and_no_nan_reaches_last_ckpt(tmp_path):
    model = PoisonedRegression(poison_step=3)
    with pytest.raises(FloatingPointError, match=r"global step 3 \(epoch 0, batch 3\)"):
        trainer(tmp_path).fit(model, loader())
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 3
    assert all(torch.isfinite(v).all() for v in saved["state_dict"].values())


def test_nonfinite_loss_can_be_skipped_and_counted(tmp_path):
    model = PoisonedRegression(poison_step=2, on_nonfinite_loss="skip")
    before = model.net.weight.detach().clone()
    with pytest.warns(UserWarning, match="step skipped"):
        trainer(tmp_path).fit(model, loader())
    assert model.skipped_nonfinite_steps == 1
    assert torch.isfinite(model.net.weight).all() and not torch.equal(before, model.net.weight)


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


def test_sync_batchnorm_on_cpu_is_refused_clearly():
    from datamodules.imagefolder import ImageFolderDataModule
    from tasks.classify import ClassificationTask

    with pytest.raises(ValueError, match="sync_batchnorm=true .*needs CUDA"):
        SuiteCLI(ClassificationTask, ImageFolderDataModule, task="classify", default_config="demo_mobilevitv2.yaml",
                 monitor="val/top1",
                 args=["--config", str(REPO / "configs/classify/demo_mobilevitv2.yaml"), "--trainer.sync_batchnorm", "true", "--trainer.accelerator", "cpu",
                       "--trainer.logger", "false"], run=False)
