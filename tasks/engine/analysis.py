"""What `test` adds beyond the headline metric, shared by the four tasks: the model's cost
(parameters, FLOPs), the k worst-scored samples, the confusion-matrix picture and the per-class
table as wandb sees it.

FLOPs are counted by PyTorch's own ``torch.utils.flop_counter.FlopCounterMode`` on one batch-1
input at the data's evaluation size (the same count Lightning's model summary shows). It counts
a multiply-add as 2 FLOPs; the MobileViT papers' "FLOPs" are multiply-adds, so their tables
compare with ``gmacs`` = ``gflops / 2``. Only matrix products and convolutions are counted
(normalisation, activations and softmax are not), as in the papers' counters.

Pictures come last: the output callbacks (:mod:`tasks.outputs`) write ``metrics.json`` and the tables
first, then draw through :func:`draw_after_metrics`, so a picture that cannot be drawn is a warning,
never a `test` that ends without its numbers.
"""
from __future__ import annotations

import csv
import heapq
import itertools
import logging
import math
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger(__name__)


def count_parameters(model: nn.Module) -> int:
    """Parameters of ``model``, each shared tensor once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@torch.no_grad()
def count_flops(model: nn.Module, example_input: Any) -> int:
    """FLOPs (2 per multiply-add) of ``model(example_input)`` in eval mode; a tuple/list input is
    unpacked into positional arguments, a dict into keyword arguments. The training mode of every
    sub-module is restored afterwards."""
    from layers.attention import register_cpu_sdpa_flops

    register_cpu_sdpa_flops()  # torch's counter does not know the CPU attention kernels yet
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        counter = FlopCounterMode(display=False)
        with counter:
            if isinstance(example_input, dict):
                model(**example_input)
            elif isinstance(example_input, (list, tuple)):
                model(*example_input)
            else:
                model(example_input)
    finally:
        for module, training in modes.items():
            module.training = training
    return counter.get_total_flops()


def model_cost(model: nn.Module, example_input: Any | None) -> dict[str, float]:
    """``{"params", "gflops", "gmacs"}`` of ``model`` (FLOPs only when an example input is known)."""
    cost: dict[str, float] = {"params": count_parameters(model)}
    if example_input is not None:
        flops = count_flops(model, example_input)
        cost |= {"gflops": flops / 1e9, "gmacs": flops / 2e9}
    return cost


def move_to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(move_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: move_to(v, device) for k, v in value.items()}
    return value


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
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter=delimiter, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)


def draw_after_metrics(draw: Callable[[], None], what: str) -> None:
    """Run ``draw()``, which writes pictures (``what``, e.g. ``predictions/worst/``) once the metrics are on
    disk. Any failure in it is logged as a warning with its traceback, not raised: the numbers are
    what the run is for."""
    try:
        draw()
    except Exception:  # a drawing library rejecting one odd sample must not end the run
        log.warning("could not draw %s; the metrics are written", what, exc_info=True)


def drawable_boxes(boxes: torch.Tensor) -> torch.Tensor:
    """(N, 4) xyxy boxes with each pair of corners ordered, so a box read inverted from its annotation
    (x2 < x1) is drawn over the area it names instead of stopping ``draw_bounding_boxes``."""
    boxes = boxes.float()
    return torch.cat([torch.minimum(boxes[:, :2], boxes[:, 2:]), torch.maximum(boxes[:, :2], boxes[:, 2:])], dim=1)
