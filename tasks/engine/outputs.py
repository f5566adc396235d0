"""The outputs every task writes, and the base of each task's own.

A task computes: its ``test_step`` returns what the outputs need of that batch (a dict: rows to write,
candidates for the worst samples), its ``on_test_epoch_end`` computes the metrics and leaves them in
``test_metrics`` (what ``metrics.json`` holds) plus whatever else it computed for the outputs. Each
file is then one callback here or in ``tasks/outputs/<task>.py``, returned by the task's
``configure_callbacks``, so adding an output is adding a callback. Callbacks run on every rank (the
gathers are collective) and write on rank 0, in their list's order: numbers first, pictures last.

Under ``<trainer.default_root_dir>/predictions/``:
- ``metrics.json`` (:class:`MetricsJson`): the numbers `test` logged, with the model's cost;
- ``worst/`` (:class:`WorstSamples`, drawn by each task's subclass): the k lowest-scored samples;
- the per-class table, the confusion matrix, the worst samples as wandb tables (:class:`WandbTestTables`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter

from tasks.engine.analysis import WorstExamples, draw_after_metrics, lowest, read_table

#: a worst-sample candidate a step offers: ``(score, key, make_payload)``; the payload (pixels, boxes) is
#: built only if the sample enters the k lowest
WorstCandidate = tuple[float, Any, Callable[[], Any]]


def predictions_dir(trainer: Trainer) -> Path:
    """``<trainer.default_root_dir>/predictions``: where `test` writes."""
    return Path(trainer.default_root_dir) / "predictions"


def predict_dir(trainer: Trainer) -> Path:
    """``<trainer.default_root_dir>/predictions/predict``: where `predict` writes."""
    return predictions_dir(trainer) / "predict"


def gather(trainer: Trainer, items: list) -> list:
    """A per-rank Python list concatenated over all ranks (uneven lengths are fine); every rank calls it."""
    if trainer.world_size == 1 or not torch.distributed.is_initialized():
        return list(items)
    gathered: list[list] = [None] * trainer.world_size  # type: ignore[list-item]
    torch.distributed.all_gather_object(gathered, items)
    return [item for rank_items in gathered for item in rank_items]


class TestRows(Callback):
    """Collects the list each ``test_step`` output carries under :attr:`key`, gathers it over ranks at
    the end of `test` and hands it to :meth:`write` on rank 0. Subclasses write one file."""

    key = "rows"

    def __init__(self):
        self.rows: list = []

    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.rows = []

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if isinstance(outputs, dict):
            self.rows += outputs.get(self.key, [])

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rows, self.rows = gather(trainer, self.rows), []
        if trainer.global_rank == 0:
            self.write(predictions_dir(trainer), rows, pl_module)

    def write(self, folder: Path, rows: list, pl_module: LightningModule) -> None:
        raise NotImplementedError


class MetricsJson(Callback):
    """``predictions/metrics.json``: metric name -> value, the numbers `test` logged (the task's
    ``test_metrics``), plus the model's ``params``, ``gflops`` and ``gmacs`` at the evaluation size."""

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = getattr(pl_module, "test_metrics", None)
        if trainer.global_rank != 0 or metrics is None:
            return
        folder = predictions_dir(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        values = {k: float(v) for k, v in metrics.items()} | pl_module.model_cost()
        (folder / "metrics.json").write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


class WorstSamples(Callback):
    """``predictions/worst/``: the ``k`` lowest-scored samples of the whole split, the same under 1 and N
    processes (a bounded heap per rank, merged at the end). Steps offer candidates under the output key
    ``"worst"`` (:data:`WorstCandidate`); a task's subclass draws them (:meth:`draw`), after the numbers are
    written: a picture that cannot be drawn is a warning."""

    def __init__(self, k: int):
        self.heap = WorstExamples(k)

    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.heap.clear()

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if isinstance(outputs, dict):
            for score, key, make_payload in outputs.get("worst", ()):
                self.heap.offer(score, key, make_payload)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        worst = lowest(gather(trainer, self.heap.entries()), self.heap.k)
        self.heap.clear()
        if trainer.global_rank == 0 and worst:
            folder = predictions_dir(trainer) / "worst"
            draw_after_metrics(lambda: self.draw(folder, worst, pl_module), "predictions/worst/")

    def draw(self, folder: Path, worst: list[tuple[float, Any, Any]], pl_module: LightningModule) -> None:
        """Write ``folder/NN_<name>.<ext>`` per ``(score, key, payload)``, lowest first, and a table of them."""
        raise NotImplementedError


class WandbTestTables(Callback):
    """What `test` wrote, sent to wandb (when a WandbLogger is on rank 0): ``test/per_class``
    (per_class.csv), ``test/confusion_matrix`` (the PNG, when the task draws one), ``test/worst``
    (worst.csv or worst.tsv) and ``test/worst_images`` (the overlays). Last in the list: it reads the files."""

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        logger = wandb_logger(trainer)
        if logger is None:
            return
        import wandb

        folder = predictions_dir(trainer)
        per_class = folder / "per_class.csv"
        if per_class.is_file():
            columns, rows = read_table(per_class)
            logger.log_table(key="test/per_class", columns=columns, data=rows)
        picture = folder / "confusion_matrix.png"
        if picture.is_file():
            logger.experiment.log({"test/confusion_matrix": wandb.Image(str(picture))})
        for name, delimiter in (("worst.csv", ","), ("worst.tsv", "\t")):
            worst = folder / "worst" / name
            if worst.is_file():
                columns, rows = read_table(worst, delimiter)
                logger.log_table(key="test/worst", columns=columns, data=rows)
                if "file" in columns:  # the overlays, captioned with their rank
                    at = columns.index("file")
                    logger.log_image("test/worst_images", [str(folder / "worst" / row[at]) for row in rows],
                                     caption=[f"{row[0]}: {row[1]}" for row in rows])


class PredictWriter(BasePredictionWriter):
    """Base of each task's `predict` output: Lightning hands it every ``predict_step`` result of this rank
    at the end; it gathers them and writes on rank 0 (:meth:`write`). A writer of per-image files that
    need no gather (masks) takes ``write_interval="batch"`` and overrides ``write_on_batch_end``, so no
    batch is kept. :meth:`destination` is what the CLI prints as where `predict` wrote."""

    def __init__(self, write_interval: str = "epoch"):
        super().__init__(write_interval=write_interval)

    def destination(self, trainer: Trainer) -> str:
        return str(predict_dir(trainer).resolve())

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        rows = [row for batch in predictions or [] for row in (batch or [])]
        rows = gather(trainer, rows)
        if trainer.global_rank == 0:
            self.write(trainer, predict_dir(trainer), rows, pl_module)

    def write(self, trainer: Trainer, folder: Path, rows: list, pl_module: LightningModule) -> None:
        raise NotImplementedError


class ValidationSamples(Callback):
    """Base of the wandb media of validation: ``count`` samples from batches spread over the split (a
    validation step's output ``"sample"``), logged by :meth:`log_samples` at the epoch's end. Nothing is collected
    without a WandbLogger or during the sanity check."""

    def __init__(self, count: int):
        self.count = count
        self.samples: list = []
        self.batches: set[int] = set()

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.samples = []
        self.batches = spread_batches(trainer, self.count) if wandb_logger(trainer) is not None else set()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx in self.batches and not trainer.sanity_checking and isinstance(outputs, dict):
            self.samples.append(outputs["sample"])

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        logger, samples, self.samples = wandb_logger(trainer), self.samples, []
        if logger is not None and samples:
            self.log_samples(logger, samples, pl_module)

    def log_samples(self, logger, samples: list, pl_module: LightningModule) -> None:
        raise NotImplementedError


def wandb_logger(trainer: Trainer):
    """The WandbLogger on rank 0, else ``None`` (media are logged only when it exists)."""
    from lightning.pytorch.loggers import WandbLogger

    if trainer.global_rank != 0:
        return None
    return next((lg for lg in trainer.loggers if isinstance(lg, WandbLogger)), None)


def spread_batches(trainer: Trainer, count: int) -> set[int]:
    """Indices of ``count`` validation batches spread evenly over the split, so logged samples show many
    classes (evaluation order is sorted, often by class)."""
    import math

    total = trainer.num_val_batches[0] if trainer.num_val_batches else 0
    total = int(total) if math.isfinite(total) else count
    if total <= 0 or count <= 0:
        return set()
    return {int(i * total / count) for i in range(min(count, total))}
