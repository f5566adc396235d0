"""Cluster mechanics of `fit` on a toy task (the CLI cells on the real tasks are in test_contract.py):
a stop signal ends the run at a step boundary with last.ckpt and exit code 128 + signal, and the
resume equals the uninterrupted run; a resume with other settings is refused unless accepted; one
fit per run root."""
from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from lightning.pytorch import LightningDataModule, Trainer
from torch.utils.data import TensorDataset

from datamodules.loaders import make_loader
from tasks.engine.base import TaskModule
from tasks.cli.checkpoint_io import AtomicCheckpointIO
from tasks.cli.last_checkpoint import LatestCheckpoint
from tasks.engine.optim import WarmupCosineLR
from tasks.cli.preemption import Preempted, Preemption, resume_command
from tasks.cli.resume import ResumeGuard, RunInUse, RunLock
from tests.callbacks import SignalAtStep


class Regression(TaskModule):
    """A linear model with dropout (so the RNG state matters), SGD with momentum and a warm-up schedule."""

    def __init__(self, lr: float = 0.05):
        super().__init__(optimizer=functools.partial(torch.optim.SGD, lr=lr, momentum=0.9),
                         scheduler=functools.partial(WarmupCosineLR, warmup_steps=3, total_steps=40))
        self.net = nn.Sequential(nn.Dropout(0.2), nn.Linear(4, 1))

    def training_loss(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


class Shuffled(LightningDataModule):
    """32 samples in batches of 4, shuffled by the suite's resumable sampler."""

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=g)
        return make_loader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, num_workers=0, train=True,
                           trainer=self.trainer)


SETTINGS = {"data.batch_size": 4, "trainer.accumulate_grad_batches": 1,
            "model.optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05}}}


def fit(root, *callbacks, ckpt_path=None, model=None, settings=SETTINGS, allow=None, epochs=2):
    checkpoint = LatestCheckpoint(root / "checkpoints", every_n_train_steps=100)
    trainer = Trainer(default_root_dir=root, max_epochs=epochs, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", plugins=[AtomicCheckpointIO()],
                      callbacks=[*callbacks, Preemption(), ResumeGuard(settings, allow), checkpoint])
    torch.manual_seed(0)
    trainer.fit(model or Regression(), Shuffled(), ckpt_path=ckpt_path)
    return torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.mark.parametrize("name, code", [("SIGTERM", 143), ("SIGUSR1", 138)])
def test_signal_mid_epoch_stops_at_a_step_with_last_ckpt_and_resumes_exactly(tmp_path, capsys, name, code):
    straight = fit(tmp_path / "straight")
    assert straight["global_step"] == 16

    with pytest.raises(Preempted) as stopped:
        fit(tmp_path / "resumed", SignalAtStep(step=5, signal=name))
    assert stopped.value.code == code
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # Lightning put the previous handlers back
    interrupted = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)
    assert interrupted["global_step"] == 6 and interrupted["epoch"] == 0  # the step the signal arrived in, finished
    err = capsys.readouterr().err
    assert f"stopped by {name} after global step 6 (epoch 0); exit code {code}" in err
    assert f"last checkpoint:  {tmp_path / 'resumed/checkpoints/last.ckpt'}" in err

    resumed = fit(tmp_path / "resumed", ckpt_path=tmp_path / "resumed/checkpoints/last.ckpt")
    assert resumed["global_step"] == 16
    for key, value in straight["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][key]), key
    assert straight["lr_schedulers"] == resumed["lr_schedulers"]
    assert torch.equal(straight["optimizer_states"][0]["state"][0]["momentum_buffer"],
                       resumed["optimizer_states"][0]["state"][0]["momentum_buffer"])
    assert resumed["suite_run"]["id"] == interrupted["suite_run"]["id"]  # one run, across the resume


def test_resume_command_keeps_the_users_arguments():
    command = resume_command("classify", ["fit", "--config", "my recipe.yaml", "--ckpt_path", "old.ckpt",
                                          "--trainer.default_root_dir=runs/x", "--data.batch_size", "8"], "runs/x")
    assert command == (f"python -m tasks.classify fit --config 'my recipe.yaml' --data.batch_size 8 "
                       f"--trainer.default_root_dir {os.path.abspath('runs/x')} --ckpt_path last")


# -- a resume refuses to drift ----------------------------------------------------------------------
def test_resume_with_other_batch_or_optimizer_is_refused_naming_each_difference(tmp_path):
    with pytest.raises(Preempted):
        fit(tmp_path, SignalAtStep(step=3))
    ckpt = tmp_path / "checkpoints/last.ckpt"
    other = {**SETTINGS, "data.batch_size": 8,
             "model.optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}}
    with pytest.raises(ValueError) as refused:
        fit(tmp_path, ckpt_path=ckpt, settings=other)
    message = str(refused.value)
    assert "data.batch_size: 4 -> 8" in message and "model.optimizer.init_args.lr: 0.05 -> 0.1" in message
    assert "--allow_changed data.batch_size,model.optimizer.init_args.lr" in message
    assert torch.load(ckpt, weights_only=True)["global_step"] == 4  # nothing trained, nothing overwritten

    another_class = {**SETTINGS, "model.optimizer": {"class_path": "torch.optim.Adam", "init_args": {"lr": 0.05}}}
    with pytest.raises(ValueError, match=r"another optimizer .*torch\.optim\.SGD -> torch\.optim\.Adam"):
        fit(tmp_path, ckpt_path=ckpt, settings=another_class, allow=["model.optimizer"])


def test_accepted_learning_rate_change_takes_effect_and_keeps_the_moments(tmp_path):
    with pytest.raises(Preempted):
        fit(tmp_path, SignalAtStep(step=3))
    ckpt = tmp_path / "checkpoints/last.ckpt"
    faster = {**SETTINGS, "model.optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}}
    resumed = fit(tmp_path, ckpt_path=ckpt, model=Regression(lr=0.1), settings=faster, allow=["model.optimizer"])
    schedule = resumed["lr_schedulers"][0]
    assert schedule["base_lrs"] == [0.1, 0.1]  # the new learning rate, not the checkpoint's 0.05
    expected = WarmupCosineLR.lr_at(argparse_schedule(schedule), schedule["last_epoch"], 0.1)
    assert resumed["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(expected)
    assert resumed["suite_resume"]["model.optimizer"]["init_args"]["lr"] == 0.1


def argparse_schedule(state: dict) -> WarmupCosineLR:
    schedule = WarmupCosineLR.__new__(WarmupCosineLR)
    schedule.__dict__.update(state)
    return schedule


# -- one fit per run root ---------------------------------------------------------------------------
def test_second_fit_in_a_run_root_is_refused_naming_the_first(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        first = RunLock(tmp_path)
        first.me["pid"] = other.pid  # a live process on this host holds the root
        first.acquire()
        with pytest.raises(RunInUse, match=rf"in use by another fit: pid {other.pid} on host {socket.gethostname()}"):
            RunLock(tmp_path).acquire()
    finally:
        other.kill()
        other.wait()
    # its process is gone: the lock is stale and taken over, then released at the end
    second = RunLock(tmp_path)
    second.acquire()
    assert second.holder()["pid"] == os.getpid()
    second.release()
    assert not (tmp_path / "fit.lock").exists()


def test_run_lock_of_another_host_is_refused_unless_it_is_the_same_slurm_job(tmp_path, monkeypatch):
    first = RunLock(tmp_path)
    first.me.update(host="node-a", pid=12345, job="777")
    first.acquire()
    with pytest.raises(RunInUse, match=r"pid 12345 on host node-a \(SLURM job 777\)"):
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "777")  # the same job, requeued onto another node
    requeued = RunLock(tmp_path)
    requeued.acquire()
    assert requeued.holder()["host"] == socket.gethostname()


# -- the logged metrics come back with last.ckpt -----------------------------------------------------------
class Validated(Regression):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self.net(x), y))


class ShuffledAndValidated(Shuffled):
    def val_dataloader(self):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def fit_keeping_the_best(root, *callbacks, ckpt_path=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    best = ModelCheckpoint(root / "checkpoints", filename="best-{step}", monitor="val/loss", every_n_train_steps=1)
    trainer = Trainer(default_root_dir=root, max_epochs=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", plugins=[AtomicCheckpointIO()],
                      callbacks=[*callbacks, Preemption(), best, LatestCheckpoint(root / "checkpoints", 100)])
    torch.manual_seed(0)
    trainer.fit(Validated(), ShuffledAndValidated(), ckpt_path=ckpt_path)
    return best.best_model_path, None if best.best_model_score is None else float(best.best_model_score)


def test_a_resume_after_a_validation_scores_the_next_steps_as_the_uninterrupted_run(tmp_path):
    """ModelCheckpoint saving every step scores a step with the last validation's metric, which Lightning does
    not checkpoint: stopped right after epoch 0's validation and resumed, the run scored nothing until the next
    validation and kept no best checkpoint of step 9 (the uninterrupted run's). last.ckpt now brings it back."""
    straight = fit_keeping_the_best(tmp_path / "straight")
    assert straight[0].endswith("best-step=9.ckpt")  # the first step after epoch 0's validation
    with pytest.raises(Preempted):  # the signal in the epoch's last step stops after its validation
        fit_keeping_the_best(tmp_path / "resumed", SignalAtStep(step=7))
    assert torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)["global_step"] == 8
    resumed = fit_keeping_the_best(tmp_path / "resumed", ckpt_path=tmp_path / "resumed/checkpoints/last.ckpt")
    assert resumed == (straight[0].replace("straight", "resumed"), straight[1])
