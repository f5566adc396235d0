"""Metric parity (``export --score true``, the default): the exported model scored on the task's test split
by ``test``'s own code and metric (top-1, COCO mAP, mIoU, BLEU), beside the checkpoint's score.

The split is the checkpoint's datamodule's (the demo data, or ``--data.root``), rebuilt from the
checkpoint with the command's ``--data.*`` options. Each task module's ``score_with(model, runners,
target)`` makes the model's ``test`` run the exported program where it runs the network (the forward;
for translation the search's encoder and decoder step), so everything around it, pre-processing,
post-processing and the metric, is ``test``'s. The bound is in points of the task's score: 0.1 for a
float32 program, 1 for an INT8 one.
"""
from __future__ import annotations

import importlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

#: the largest |exported - checkpoint| score, in points, for float32 and INT8 programs
FP32_POINTS, INT8_POINTS = 0.1, 1.0


@dataclass
class ScoreCheck:
    """The exported model's score against the checkpoint's, in points."""

    metric: str
    what: str
    checkpoint: float
    exported: float
    tolerance: float

    @property
    def difference(self) -> float:
        return self.exported - self.checkpoint

    @property
    def ok(self) -> bool:
        return abs(self.difference) <= self.tolerance

    def __str__(self) -> str:
        return (f"{self.metric} of the {self.what}: {self.exported:.2f} against the checkpoint's {self.checkpoint:.2f}, "
                f"difference {self.difference:+.2f} points (tolerance {self.tolerance:g})"
                f"{'' if self.ok else '  FAILED'}")


def datamodule_of(ckpt_path: str | Path, overrides: dict[str, Any]):
    """The checkpoint's datamodule with the command line's ``--data.*`` options."""
    from tasks.engine.checkpoints import read_checkpoint

    checkpoint = read_checkpoint(ckpt_path)  # weights-only, as every checkpoint the suite reads
    arguments = dict(checkpoint.get("datamodule_hyper_parameters") or {})
    if "_class_path" not in arguments:
        raise ValueError(f"{ckpt_path} records no datamodule, so there is no test split to score the export on: "
                         "export with --score false")
    module_name, class_name = arguments["_class_path"].rsplit(".", 1)
    data_class = getattr(importlib.import_module(module_name), class_name)
    return data_class(**{**{k: v for k, v in arguments.items() if not k.startswith("_")}, **overrides})


def test_score(model: torch.nn.Module, datamodule, metric: str, limit_batches: int | None = None) -> float:
    """``model``'s ``test`` on ``datamodule``'s test split: the logged ``metric``. Only the score is
    kept: the task's output files (predictions, worst examples) are not written."""
    from lightning.pytorch import Trainer

    model.configure_callbacks = lambda: []
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, default_root_dir=workdir,
                          limit_test_batches=limit_batches)
        trainer.test(model, datamodule=datamodule, verbose=False)
    return float(model.test_metrics[metric])


class Scorer:
    """Scores exported programs of one checkpoint against the checkpoint itself (scored once, lazily).

    ``load_model()`` gives a fresh copy of the checkpoint's model (each score patches its own);
    ``exporter`` is the task's export module (``score_with``, ``SCORE_POINTS``)."""

    def __init__(self, load_model: Callable[[], torch.nn.Module], exporter, datamodule, metric: str,
                 where: str, limit_batches: int | None = None):
        self.load_model, self.exporter, self.datamodule = load_model, exporter, datamodule
        self.metric, self.where, self.limit_batches = metric, where, limit_batches
        self._checkpoint: float | None = None

    def points(self, model: torch.nn.Module) -> float:
        return test_score(model, self.datamodule, self.metric, self.limit_batches) * self.exporter.SCORE_POINTS

    @property
    def checkpoint(self) -> float:
        if self._checkpoint is None:
            self._checkpoint = self.points(self.load_model())
        return self._checkpoint

    def check(self, target: str, int8: bool, runners: dict) -> ScoreCheck:
        model = self.load_model()
        self.exporter.score_with(model, runners, target)
        what = f"{target}{' int8' if int8 else ''} model on {self.where}"
        try:
            exported = self.points(model)
        except ValueError as err:  # the program cannot take the split's inputs (a static program's size)
            what += f" (not scored: {err})"
            exported = float("nan")
        return ScoreCheck(self.metric, what, self.checkpoint, exported, INT8_POINTS if int8 else FP32_POINTS)


def calibration_images(datamodule, count: int) -> list[torch.Tensor]:
    """The first ``count`` training images as the model gets them, in the training loader's batches:
    finished by the datamodule's ``on_after_batch_transfer`` (a classification batch leaves the loader as
    uint8 and is normalised there)."""
    datamodule.setup("fit")
    batches, seen = [], 0
    for batch in datamodule.train_dataloader():
        batch = datamodule.on_after_batch_transfer(batch, 0)
        if "image" not in batch:  # a text task: no images to calibrate on (its programs refuse INT8, naming why)
            return []
        images = batch["image"][: count - seen]
        if not images.is_floating_point():
            raise TypeError(f"{type(datamodule).__name__} gives {images.dtype} training images after "
                            "on_after_batch_transfer; calibration needs the float images the model takes")
        batches.append(images)
        seen += len(images)
        if seen >= count:
            break
    return batches
