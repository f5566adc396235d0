"""Checkpoint-file mechanics shared by every task: RNG states, named errors for bad files,
atomic writes (beside the destination, whatever $TMPDIR is; a kill or a full disk during the
write leaves the previous file); batches the loss guard must tell apart. (The task promises themselves are proven on the real tasks in test_contract.py.)"""
import errno
import io
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from tasks.cli import checkpoint_io
from tasks.engine.base import TaskModule
from tasks.cli.checkpoint_io import AtomicCheckpointIO
from tasks.engine.checkpoints import check_checkpoint_file


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
    """Disk full in the middle of writing last.ckpt: the old last.ckpt survives, no partial file is
    left, and the error names the path and the bytes the checkpoint needs."""
    t = trainer(tmp_path, plugins=[AtomicCheckpointIO()])
    t.fit(PoisonedRegression(poison_step=-1), loader())
    path = tmp_path / "ckpt" / "last.ckpt"
    before = path.read_bytes()

    def half_then_disk_full(obj, f, *args, **kwargs):
        f.write(before[: len(before) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_io.torch, "save", half_then_disk_full)
    with pytest.raises(OSError, match=rf"no space left on device writing checkpoint {path}: it needs about "
                                      r"[\d,]+ bytes \([\d,]+ bytes free there\)") as full:
        t.save_checkpoint(path)
    assert full.value.errno == errno.ENOSPC
    assert path.read_bytes() == before
    assert not any(".tmp-" in p.name for p in path.parent.iterdir())
    torch.load(path, weights_only=True)


class FillingDisk(io.RawIOBase):
    """A file on a disk with ``room`` bytes left: the write that reaches the end comes up short, the next
    fails with ENOSPC, as on a full filesystem."""

    def __init__(self, path, room: int):
        self.file, self.room = open(path, "wb"), room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        data = bytes(data)[: self.room]
        self.file.write(data)
        self.room -= len(data)
        return len(data)

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        self.file.close()
        super().close()


@pytest.mark.parametrize("free", ["too little", "plenty"])
def test_disk_filling_inside_torchs_zip_writer_is_named_as_a_full_disk(tmp_path, monkeypatch, free):
    """torch's zip writer reports the short write of a full disk as ``RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos``: with less than the checkpoint's size free it is the same
    disk-full error as ENOSPC; with enough free space it is not relabelled."""
    t = trainer(tmp_path, plugins=[AtomicCheckpointIO()])
    t.fit(PoisonedRegression(poison_step=-1), loader())
    path = tmp_path / "ckpt" / "last.ckpt"
    before = path.read_bytes()
    monkeypatch.setattr(checkpoint_io, "open", lambda name, mode: FillingDisk(name, room=500), raising=False)
    room = 100 if free == "too little" else 10 * len(before)
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage", lambda folder: SimpleNamespace(free=room))
    if free == "too little":
        with pytest.raises(OSError, match=rf"no space left on device writing checkpoint {path}: it needs about "
                                          rf"{len(before):,} bytes \(100 bytes free there\)\. Free space .*the last "
                                          rf"good checkpoint at {path} is intact") as full:
            t.save_checkpoint(path)
        assert full.value.errno == errno.ENOSPC and "inline_container" in str(full.value.__cause__)
    else:
        with pytest.raises(RuntimeError, match="inline_container.*unexpected pos"):
            t.save_checkpoint(path)
    assert path.read_bytes() == before
    assert not any(".tmp-" in p.name for p in path.parent.iterdir())


def test_checkpoints_are_written_beside_their_destination_not_in_tmpdir(tmp_path, monkeypatch):
    """$TMPDIR on another (small, full, missing) filesystem plays no part: the suite's CLI installs
    AtomicCheckpointIO for every task."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path / "no-such-tmpdir"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(tempfile, "mkstemp", lambda *a, **k: pytest.fail("a temporary file outside the run"))
    trainer(tmp_path, plugins=[AtomicCheckpointIO()]).fit(PoisonedRegression(poison_step=-1), loader())
    torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert not any(".tmp-" in p.name for p in (tmp_path / "ckpt").iterdir())


def test_kill_during_a_checkpoint_write_leaves_the_old_file(tmp_path):
    """A writer SIGKILLed after writing the whole new file but before renaming it (a forked
    process, so no interpreter start): the old checkpoint is untouched."""
    import os
    import signal
    import time

    path = tmp_path / "last.ckpt"
    torch.save({"old": torch.ones(3)}, path)
    before = path.read_bytes()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        real_save = torch.save

        def save_then_hang(obj, f, *args, **kwargs):
            real_save(obj, f, *args, **kwargs)
            f.flush()
            os.write(ready_w, b"1")
            time.sleep(60)  # killed here

        checkpoint_io.torch.save = save_then_hang
        try:
            checkpoint_io.save_atomically({"new": torch.zeros(1000)}, path)
        finally:
            os._exit(1)
    assert os.read(ready_r, 1) == b"1"
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert path.read_bytes() == before
    assert torch.equal(torch.load(path, weights_only=True)["old"], torch.ones(3))
    # the killed writer's file has its own name: it never replaces a checkpoint
    assert [p.name for p in tmp_path.iterdir() if p.name != "last.ckpt"] == [f"last.ckpt.tmp-{pid}"]
    # the next write (the resumed run's) removes the dead writer's partial file, and only that file
    (tmp_path / "best.ckpt.tmp-1").write_bytes(b"another checkpoint's")
    checkpoint_io.save_atomically({"new": torch.zeros(3)}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.ckpt.tmp-1", "last.ckpt"]


# -- batches the guard must tell apart ----------------------------------------------------------------
class SkippedBatches(PoisonedRegression):
    """Every training batch arrives with all of its images unreadable (``{"skipped": n}``)."""

    def training_step(self, batch, batch_idx):
        return super().training_step({"skipped": 4}, batch_idx)


def test_all_unreadable_batch_is_skipped_and_counted_in_one_process(tmp_path):
    model = SkippedBatches(poison_step=-1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="no readable image left in the batch"):
        trainer(tmp_path).fit(model, loader())  # not "non-finite loss (on another rank)"
    assert model.skipped_empty_batches == 8 and model.skipped_nonfinite_steps == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class BatchNormNet(TaskModule):
    def __init__(self):
        super().__init__(optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))

    def training_loss(self, batch, batch_idx):
        return self.net(batch["image"]).mean()


def test_training_batch_of_one_with_batchnorm_is_named(tmp_path):
    images = DataLoader(TensorDataset(torch.randn(1, 3, 8, 8)), batch_size=4,
                        collate_fn=lambda items: {"image": torch.stack([x for (x,) in items])})
    with pytest.raises(ValueError, match=r"a training batch of 1 image at global step 0 .*BatchNorm .*"
                                         r"--data.batch_size 2 or more"):
        trainer(tmp_path).fit(BatchNormNet(), images)


def test_batch_of_one_refusal_names_the_batch_size_the_user_gave(tmp_path, monkeypatch):
    from tasks.classify import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"data.batch_size=1, 1 process"):
        main(["fit", "--data.batch_size", "1", "--trainer.max_steps", "1", "--trainer.logger", "false",
              "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu"])
