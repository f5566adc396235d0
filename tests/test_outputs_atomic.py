"""Outputs that never look complete when they are not (issue 50, item 3; :func:`tasks.outputs.common.begin_outputs`).

A `test` or `predict` replaces an earlier run's files in its folder (never leaves them beside its own), marks
the folder ``INCOMPLETE.txt`` until its last file is written, and writes ``metrics.json`` and the tables to a
temporary name first. Run on the real tasks through Lightning's own loops: a trained classification
checkpoint tested twice (the second interrupted as Ctrl-C interrupts it), and detection and segmentation
`predict` into a folder that holds an earlier run's per-image files.
"""
from __future__ import annotations

import json
import signal

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from tests.test_api import MEAN, STD, photos, tiny_backbone

INCOMPLETE = "INCOMPLETE.txt"


class CtrlC(Callback):
    """Interrupts `test` after its first batch, as SIGINT does (Python raises KeyboardInterrupt)."""

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        raise KeyboardInterrupt


def trainer(root, *callbacks) -> Trainer:
    return Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu",
                   default_root_dir=root, limit_test_batches=2, callbacks=list(callbacks))


def test_a_second_test_replaces_the_first_and_an_interrupted_one_looks_unfinished(demo_fit, tmp_path):
    """A `test` interrupted by SIGINT in a folder holding a complete earlier test kept the old ``metrics.json``
    beside a mix of old and new files. Now the earlier files go as `test` starts (``predict/`` stays), the
    interrupted run leaves ``INCOMPLETE.txt`` and no ``metrics.json``, and the next finished run clears both."""
    import tasks
    from datamodules.imagefolder import ImageFolderDataModule

    ckpt = demo_fit("classify") / "checkpoints" / "last.ckpt"
    model = tasks.load(ckpt)
    saved = torch.load(ckpt, weights_only=True)["datamodule_hyper_parameters"]  # the data it was trained on
    arguments = {**{k: v for k, v in saved.items() if not k.startswith("_")}, "num_workers": 0}
    folder = tmp_path / "predictions"

    trainer(tmp_path).test(model, ImageFolderDataModule(**arguments))
    finished = sorted(p.name for p in folder.iterdir())
    assert "metrics.json" in finished and "predictions.csv" in finished and INCOMPLETE not in finished
    (folder / "worst" / "99_stale.jpg").write_bytes(b"an earlier run's picture")
    (folder / "predict").mkdir()
    (folder / "predict" / "a.json").write_text("{}")  # predict's folder is not test's to clear

    default = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's answer to KeyboardInterrupt: exit 1
            trainer(tmp_path, CtrlC()).test(model, ImageFolderDataModule(**arguments))
    finally:
        signal.signal(signal.SIGINT, default)  # Lightning ignores a second Ctrl-C from then on
    left = sorted(p.name for p in folder.iterdir())
    assert INCOMPLETE in left and "metrics.json" not in left and "predictions.csv" not in left
    assert not (folder / "worst" / "99_stale.jpg").exists() and (folder / "predict" / "a.json").is_file()
    assert "has not finished: the files beside this one are partial" in (folder / INCOMPLETE).read_text()

    trainer(tmp_path).test(model, ImageFolderDataModule(**arguments))
    assert sorted(p.name for p in folder.iterdir()) == sorted(finished + ["predict"])
    metrics = json.loads((folder / "metrics.json").read_text())
    assert 0.0 <= metrics["test/top1"] <= 1.0
    assert not list(folder.rglob(".*.partial"))  # the temporary names are renamed away



def test_a_table_cut_by_a_full_disk_is_not_left_as_a_shorter_table(demo_fit, tmp_path, monkeypatch):
    """The disk fills while ``per_class.csv`` is half written: `test` fails with the OS error, and the folder
    holds no per-class table at all (nor its temporary file), not the first rows of one."""
    import csv
    import errno

    import tasks
    from datamodules.imagefolder import ImageFolderDataModule

    ckpt = demo_fit("classify") / "checkpoints" / "last.ckpt"
    model = tasks.load(ckpt)
    saved = torch.load(ckpt, weights_only=True)["datamodule_hyper_parameters"]
    arguments = {**{k: v for k, v in saved.items() if not k.startswith("_")}, "num_workers": 0}
    real_writer = csv.writer

    class FillsAfterTwoRows:
        def __init__(self, f, **kwargs):
            self.file, self.inner, self.rows = f, real_writer(f, **kwargs), 0

        def writerow(self, row):
            self.rows += 1
            if self.rows > 2 and self.file.name.endswith("per_class.csv.partial"):
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.inner.writerow(row)

        def writerows(self, rows):
            for row in rows:
                self.writerow(row)

    monkeypatch.setattr("tasks.outputs.classification.csv.writer", FillsAfterTwoRows)
    with pytest.raises(OSError, match="No space left"):
        trainer(tmp_path).test(model, ImageFolderDataModule(**arguments))
    folder = tmp_path / "predictions"
    assert (folder / INCOMPLETE).is_file()
    assert not (folder / "per_class.csv").exists() and not list(folder.rglob(".*.partial"))
    assert (folder / "confusion_matrix.csv").is_file()  # written whole before it, by the same writer

@pytest.mark.parametrize("task", ["detect", "segment"])
def test_predict_into_a_folder_with_an_earlier_runs_files_replaces_them(task, tmp_path):
    """`predict` into a folder holding an earlier run's per-image outputs left them beside the new ones with
    exit 0 (detection's JSON per image, segmentation's masks and overlays): the folder now holds this run's."""
    from tests.test_api import lightning_predict

    first, second = photos(tmp_path / "first"), photos(tmp_path / "second")
    for path in second[1:]:  # the second run predicts on a.png alone
        path.unlink()
    for path in first:
        path.rename(path.with_name(f"old_{path.name}"))
    if task == "detect":
        from datamodules.coco import CocoDataModule
        from tasks.detect import DetectionTask

        model = DetectionTask(tiny_backbone(), num_classes=3, category_ids=[2, 5, 9], category_names=["x", "y", "z"])

        def data(folder):
            return CocoDataModule(predict_path=str(folder), image_size=64, mean=MEAN, std=STD, eval_batch_size=2,
                                  num_workers=0, pin_memory=False, persistent_workers=False)
        expected = {"a.json"}
    else:
        from datamodules.segmentation import SegmentationDataModule
        from tasks.segment import SegmentationTask

        model = SegmentationTask(tiny_backbone(), class_names=[f"class{i}" for i in range(5)])

        def data(folder):
            return SegmentationDataModule(predict_path=str(folder), crop_size=64, eval_short_side=32, mean=MEAN,
                                          std=STD, num_workers=0, pin_memory=False, persistent_workers=False)
        expected = {"masks/a.png", "overlays/a.jpg"}

    out = lightning_predict(model, data(tmp_path / "first"), tmp_path)
    assert len([p for p in out.rglob("old_*") if p.is_file()]) == len(expected) * 3
    out = lightning_predict(model, data(tmp_path / "second"), tmp_path)
    assert {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} == expected


def test_a_folder_stays_unfinished_until_every_rank_has_written_its_files(tmp_path):
    """Masks are written by the rank that scored them, so rank 0 can be done while another rank still writes, or
    has died half-way: the marker goes only after every rank has reached the end (a barrier), and stays when one
    has not (the barrier fails, as gloo's does on a closed connection)."""
    from types import SimpleNamespace

    from tasks.outputs.common import begin_outputs, finish_outputs

    events = []

    class Strategy:
        def __init__(self, peer_alive: bool):
            self.peer_alive = peer_alive

        def barrier(self, name):
            events.append(name)
            if name == "outputs-written" and not self.peer_alive:  # the peer died after the outputs began
                raise RuntimeError("Connection closed by peer")

    for peer_alive in (True, False):
        folder = tmp_path / f"peer-alive-{peer_alive}"
        rank0 = SimpleNamespace(global_rank=0, strategy=Strategy(peer_alive))
        begin_outputs(rank0, folder, "predict")
        assert (folder / INCOMPLETE).is_file()
        if peer_alive:
            finish_outputs(rank0, folder)
        else:
            with pytest.raises(RuntimeError, match="closed by peer"):
                finish_outputs(rank0, folder)
        assert (folder / INCOMPLETE).is_file() != peer_alive
    assert events == ["outputs-begun", "outputs-written"] * 2
