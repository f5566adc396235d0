"""The outputs every task writes, the bases of each task's own, and the helpers they draw and tabulate with.

A task computes: its ``test_step`` returns what the outputs need of that batch (a dict: rows to write,
candidates for the worst samples), its ``on_test_epoch_end`` computes the metrics and leaves them in
``test_metrics`` (what ``metrics.json`` holds) plus whatever else it computed for the outputs. Each
file is then one callback here or in ``tasks/outputs/<task>.py``, returned by the task's
``configure_callbacks``, so adding an output is adding a callback. Callbacks run on every rank (the
gathers are collective) and write on rank 0, in their list's order: numbers first, pictures last.

Under ``<trainer.default_root_dir>/predictions/``:
- ``metrics.json`` (:class:`MetricsJson`): the numbers `test` logged, with the model's cost;
- ``worst/`` (:class:`WorstSamples`, drawn by each task's subclass): the k lowest-scored samples;
- the per-class table, the confusion matrix, the worst samples as tables and images to the run's loggers
  (:class:`TestTables`, through the media sink of :mod:`tasks.outputs.media`).

Pictures come last: the callbacks write ``metrics.json`` and the tables first, then draw through
:func:`draw_after_metrics`, so a picture that cannot be drawn is a warning, never a `test` that ends
without its numbers.

An output folder never looks finished when it is not (:func:`begin_outputs`): as `test` starts, the
earlier test's outputs in ``predictions/`` are removed (``predict/`` is kept) and ``INCOMPLETE.txt`` is
written there; it is removed once every rank has written every output. `predict` does the same in
``predictions/predict/``. A second run into a run root therefore replaces the first one's outputs (what a
re-run is for; refusing would make every re-test need a new run root), and one interrupted half-way leaves
its partial files under ``INCOMPLETE.txt``, never beside an earlier run's ``metrics.json``. ``metrics.json``
and the tables are written to a temporary name and renamed, so none is ever half a file.
"""
from __future__ import annotations

import contextlib
import csv
import heapq
import io
import itertools
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info

from tasks.outputs.media import MediaSink, media_sink

log = logging.getLogger(__name__)

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


#: the marker of an output folder being written (:func:`begin_outputs`)
INCOMPLETE = "INCOMPLETE.txt"


def begin_outputs(trainer: Trainer, folder: Path, what: str, keep: tuple[str, ...] = ()) -> None:
    """Before `test` or `predict` (``what``) writes into ``folder``: rank 0 removes what an earlier run wrote
    there (every entry but the names in ``keep``), saying so, and writes :data:`INCOMPLETE` there, which
    :func:`finish_outputs` removes; every rank waits for it, so no rank writes a file that is then removed."""
    if trainer.global_rank == 0:
        earlier = sorted(p for p in folder.iterdir() if p.name not in keep) if folder.is_dir() else []
        for path in earlier:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        if earlier:
            rank_zero_info(f"{what}: removed the earlier outputs in {folder} ({', '.join(p.name for p in earlier[:6])}"
                           f"{', ...' if len(earlier) > 6 else ''}); this run writes its own")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / INCOMPLETE).write_text(
            f"`{what}` began writing here at {time.strftime('%Y-%m-%d %H:%M:%S')} and has not finished: the files "
            f"beside this one are partial. A `{what}` that ends removes this file; the next one replaces them.\n")
    trainer.strategy.barrier("outputs-begun")


def finish_outputs(trainer: Trainer, folder: Path) -> None:
    """Every output of the run is written: rank 0 removes :data:`INCOMPLETE` from ``folder``, once every rank
    is here. A writer of per-image files (the masks) writes on the rank that scored the image, so another rank
    may still be writing, or may have died half-way, when rank 0 is done: then the barrier fails and the marker
    stays."""
    trainer.strategy.barrier("outputs-written")
    if trainer.global_rank == 0:
        (folder / INCOMPLETE).unlink(missing_ok=True)


@contextlib.contextmanager
def open_atomically(path: Path, newline: str | None = ""):
    """A text file (UTF-8) written through a temporary file beside ``path`` and renamed onto it when the block
    ends without an error: a reader sees the old file, no file, or the whole new one, never a part.
    ``newline=""`` is what :mod:`csv` writers need."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "w", encoding="utf-8", newline=newline) as f:
            yield f
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)


def write_atomically(path: Path, text: str) -> None:
    """``text`` (``\n`` line ends) to ``path`` at once (:func:`open_atomically`)."""
    with open_atomically(path, newline="\n") as f:
        f.write(text)


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
    ``test_metrics``), plus the model's ``params``, ``gflops`` and ``gmacs`` at the evaluation size.

    The first of the test outputs, it also keeps the folder honest (:func:`begin_outputs`): the earlier test's
    files go as `test` starts, and ``INCOMPLETE.txt`` stays until the whole stage has ended (``teardown``, which
    Lightning calls only after every ``on_test_end``, and not after an interruption or an error)."""

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        begin_outputs(trainer, predictions_dir(trainer), "test", keep=(predict_dir(trainer).name,))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "test":
            finish_outputs(trainer, predictions_dir(trainer))

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = getattr(pl_module, "test_metrics", None)
        if trainer.global_rank != 0 or metrics is None:
            return
        values = {k: float(v) for k, v in metrics.items()} | pl_module.model_cost()
        write_atomically(predictions_dir(trainer) / "metrics.json", json.dumps(values, indent=2, sort_keys=True) + "\n")


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


class TestTables(Callback):
    """What `test` wrote, sent to the run's loggers (:func:`~tasks.outputs.media.media_sink`: wandb,
    TensorBoard, MLflow, CSV): ``test/per_class`` (per_class.csv), ``test/confusion_matrix`` (the PNG, when
    the task draws one), ``test/worst`` (worst.csv or worst.tsv) and ``test/worst_images`` (the overlays).
    Last in the list: it reads the files."""

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        media = media_sink(trainer)
        if media is None:
            return
        folder = predictions_dir(trainer)
        per_class = folder / "per_class.csv"
        if per_class.is_file():
            media.log_table("test/per_class", *read_table(per_class))
        picture = folder / "confusion_matrix.png"
        if picture.is_file():
            media.log_image("test/confusion_matrix", str(picture))
        for name, delimiter in (("worst.csv", ","), ("worst.tsv", "\t")):
            worst = folder / "worst" / name
            if worst.is_file():
                columns, rows = read_table(worst, delimiter)
                media.log_table("test/worst", columns, rows)
                if "file" in columns:  # the overlays, captioned with their rank
                    at = columns.index("file")
                    media.log_image("test/worst_images", [str(folder / "worst" / row[at]) for row in rows],
                                    captions=[f"{row[0]}: {row[1]}" for row in rows])




class PredictWriter(BasePredictionWriter):
    """Base of each task's `predict` output: Lightning hands it every ``predict_step`` result of this rank
    at the end; it gathers them and writes on rank 0 (:meth:`write`). A writer of per-image files that
    need no gather (masks) takes ``write_interval="batch"`` and overrides ``write_on_batch_end``, so no
    batch is kept. :meth:`destination` is what the CLI prints as where `predict` wrote.

    A writer into ``predictions/predict/`` (:attr:`writes_folder`) replaces an earlier `predict`'s files there
    and marks the folder :data:`INCOMPLETE` until it has written everything (:func:`begin_outputs`)."""

    #: whether the writer writes into ``predictions/predict/`` (translation writes one file it is given)
    writes_folder = True

    def __init__(self, write_interval: str = "epoch"):
        super().__init__(write_interval=write_interval)

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.writes_folder:
            begin_outputs(trainer, predict_dir(trainer), "predict")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "predict" and self.writes_folder:
            finish_outputs(trainer, predict_dir(trainer))

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
    """Base of the media of validation: ``count`` samples from batches spread over the split (a validation
    step's output ``"sample"``), logged by :meth:`log_samples` at the epoch's end to the run's media sink.
    Nothing is collected when no logger shows media (:func:`~tasks.outputs.media.media_sink` is ``None``)
    or during the sanity check."""

    def __init__(self, count: int):
        self.count = count
        self.samples: list = []
        self.batches: set[int] = set()

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.samples = []
        self.batches = spread_batches(trainer, self.count) if media_sink(trainer) is not None else set()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx in self.batches and not trainer.sanity_checking and isinstance(outputs, dict):
            self.samples.append(outputs["sample"])

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        media, samples, self.samples = media_sink(trainer), self.samples, []
        if media is not None and samples:
            self.log_samples(media, samples, pl_module)

    def log_samples(self, media: MediaSink, samples: list, pl_module: LightningModule) -> None:
        raise NotImplementedError


def spread_batches(trainer: Trainer, count: int) -> set[int]:
    """Indices of ``count`` validation batches spread evenly over the split, so logged samples show many
    classes (evaluation order is sorted, often by class)."""
    import math

    total = trainer.num_val_batches[0] if trainer.num_val_batches else 0
    total = int(total) if math.isfinite(total) else count
    if total <= 0 or count <= 0:
        return set()
    shown = min(count, total)  # fewer batches than samples wanted: every batch gives one
    return {int(i * total / shown) for i in range(shown)}


# -- drawing and tables -------------------------------------------------------------------------------
class WorstExamples:
    """The ``k`` samples with the lowest score seen on this rank, kept in a bounded heap so a split
    of any size costs ``k`` payloads of memory. ``make_payload`` runs only for a sample that enters
    the current k worst (images are copied only then). Ties keep the sample seen first; the final
    order (score, then key) is the same however the split was sharded over ranks."""

    def __init__(self, k: int):
        self.k = k
        self._heap: list[tuple[float, int, Any, Any]] = []  # (-score, -tiebreak, key, payload): max-heap of the k lowest
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def clear(self) -> None:
        self._heap = []

    def offer(self, score: float, key: Any, make_payload: Callable[[], Any]) -> None:
        if self.k <= 0 or math.isnan(score):
            return
        entry_rank = next(self._counter)
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, (-score, -entry_rank, key, make_payload()))
        elif score < -self._heap[0][0]:
            heapq.heapreplace(self._heap, (-score, -entry_rank, key, make_payload()))

    def entries(self) -> list[tuple[float, Any, Any]]:
        """``(score, key, payload)`` of this rank, lowest score first."""
        return sorted(((-s, key, payload) for s, _, key, payload in self._heap), key=lambda e: (e[0], e[1]))


def lowest(entries: Iterable[tuple[float, Any, Any]], k: int) -> list[tuple[float, Any, Any]]:
    """The ``k`` lowest ``(score, key, payload)`` of all ranks' entries, ordered by (score, key)."""
    return sorted(entries, key=lambda e: (e[0], e[1]))[:k]


def most_confused(confusion: torch.Tensor, max_classes: int) -> torch.Tensor:
    """Indices (ascending) of the ``max_classes`` classes with the most errors, as the true class
    or the predicted one, in a (K, K) confusion matrix; all K when K <= ``max_classes``."""
    if len(confusion) <= max_classes:
        return torch.arange(len(confusion))
    errors = confusion.sum(1) + confusion.sum(0) - 2 * confusion.diagonal()
    return errors.topk(max_classes).indices.sort().values


def write_confusion_matrix_png(confusion: torch.Tensor, class_names: list[str], path: Path,
                               max_classes: int = 40) -> None:
    """A confusion matrix a person can read: rows (true class) normalised to recall, the count in
    each non-empty cell, class names on both axes. With more than ``max_classes`` classes (ImageNet)
    the picture shows the ``max_classes`` classes with the most misclassified images, and says so;
    ``confusion_matrix.csv`` keeps the whole matrix."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    confusion = confusion.cpu().long()
    shown = most_confused(confusion, max_classes)
    title = "confusion matrix (rows: true, normalised)"
    if len(shown) < len(class_names):
        title = f"the {max_classes} most confused of {len(class_names)} classes (rows: true, normalised)"
    matrix = confusion[shown][:, shown].double()
    support = confusion[shown].sum(1, keepdim=True).double()
    normalised = (matrix / support.clamp_min(1)).numpy()
    names = [class_names[i] for i in shown.tolist()]
    side = max(4.0, 0.35 * len(names) + 2.0)
    fig, ax = plt.subplots(figsize=(side + 1.0, side))
    image = ax.imshow(normalised, cmap="Blues", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title, fontsize=10)
    if len(names) <= 20:
        for (row, col), count in zip(itertools.product(range(len(names)), repeat=2), matrix.flatten().tolist()):
            if count:
                ax.text(col, row, int(count), ha="center", va="center", fontsize=7,
                        color="white" if normalised[row, col] > 0.5 else "black")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def read_table(path: Path, delimiter: str = ",") -> tuple[list[str], list[list[Any]]]:
    """Columns and rows of a CSV/TSV written by `test`; a column whose every value is a number
    comes back as numbers, any other column as text (a table column keeps one type)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter=delimiter)
        columns = next(reader)
        rows = [list(row) for row in reader]
    for col in range(len(columns)):
        values = [row[col] for row in rows]
        if values and all(_is_number(v) for v in values):
            for row in rows:
                row[col] = int(row[col]) if row[col].lstrip("-").isdigit() else float(row[col])
    return columns, rows


def _is_number(value: str) -> bool:
    if len(value) > 24:  # a digit string that long is text (a token sequence), not a count
        return False
    try:
        float(value)
    except ValueError:
        return False
    return True


def displayable(image: torch.Tensor) -> torch.Tensor:
    """A normalised network input (3, H, W) -> uint8 (3, H, W), stretched to the full range: what
    the network saw, whatever mean/std the data used."""
    image = image.detach().float().cpu()
    lo, hi = image.amin(), image.amax()
    return ((image - lo) / (hi - lo).clamp_min(1e-6) * 255).round().to(torch.uint8)


def with_caption(image: torch.Tensor, lines: list[str], min_width: int = 256):
    """uint8 (3, H, W) -> PIL image enlarged (nearest) to at least ``min_width`` wide, with
    ``lines`` of text on a white band below it."""
    from PIL import Image, ImageDraw

    picture = Image.fromarray(image.permute(1, 2, 0).numpy())
    if picture.width < min_width:
        scale = math.ceil(min_width / picture.width)
        picture = picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
    band = 14 * len(lines) + 6
    out = Image.new("RGB", (picture.width, picture.height + band), "white")
    out.paste(picture, (0, 0))
    draw = ImageDraw.Draw(out)
    for i, line in enumerate(lines):
        draw.text((4, picture.height + 3 + 14 * i), line, fill="black")
    return out


def write_worst_csv(path: Path, columns: list[str], rows: list[list[Any]], delimiter: str = ",") -> None:
    """A table (``columns`` then ``rows``) as CSV or TSV, written atomically (:func:`write_atomically`)."""
    text = io.StringIO()
    writer = csv.writer(text, delimiter=delimiter, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows(rows)
    write_atomically(path, text.getvalue())


def draw_after_metrics(draw: Callable[[], None], what: str) -> None:
    """Run ``draw()``, which writes pictures (``what``, e.g. ``predictions/worst/``) once the metrics are on
    disk. Any failure in it is logged as a warning with its traceback, not raised: the numbers are
    what the run is for."""
    try:
        draw()
    except Exception:  # a drawing library rejecting one odd sample must not end the run
        log.warning("could not draw %s; the metrics are written", what, exc_info=True)
