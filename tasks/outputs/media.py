"""Where the tables and pictures of a run go: one media sink per logger of the run that can show them.

The output callbacks never talk to a logger themselves: they ask :func:`media_sink` for the run's sink and
call :meth:`MediaSink.log_image` / :meth:`MediaSink.log_table` on it. Which loggers get the media is
decided by ``--trainer.logger`` alone: every logger of ``trainer.loggers`` on rank 0 that has a sink here
gets them. Without one, :func:`media_sink` is ``None`` and the callbacks collect nothing (no copy to the
host, no drawing).

- ``WandbLogger``: wandb images (with their boxes and masks as wandb overlays) and wandb tables;
- ``TensorBoardLogger``: each image under ``<key>/NN``, the captions and the tables as markdown text;
- ``MLFlowLogger``: artifacts of the run, ``media/<key>/step_<n>_NN.png`` and ``media/<key>/step_<n>.json``;
- ``CSVLogger``: files under its ``log_dir``, ``media/<key>/step_<n>_NN.png`` and ``media/<key>/step_<n>.csv``.

Loggers without wandb's overlays get the overlays drawn into the picture: boxes on it, each mask as one
more panel to its right (image | prediction | truth).

A picture is a file path or a uint8 (H, W, 3) array.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger

#: a file (PNG, JPEG), or uint8 (H, W, 3) pixels
Picture = Union[str, Path, np.ndarray]


@dataclass(frozen=True, eq=False)
class Boxes:
    """Boxes to show on a picture: ``boxes`` (N, 4) x1y1x2y2 in the picture's pixels, ``labels`` (N,) class
    indices named by ``class_names``, ``scores`` (N,) or ``None`` (ground truth). Drawn in ``colour``."""

    boxes: torch.Tensor
    labels: torch.Tensor
    class_names: dict[int, str]
    scores: torch.Tensor | None = None
    colour: str = "red"

    def captions(self) -> list[str]:
        names = [self.class_names[int(label)] for label in self.labels.tolist()]
        if self.scores is None:
            return names
        return [f"{name} {float(score):.2f}" for name, score in zip(names, self.scores.tolist())]

    def wandb(self) -> dict:
        """The boxes in wandb's ``box_data`` form (pixel positions, class id, caption, score)."""
        rows = []
        for i, (box, label, caption) in enumerate(zip(self.boxes.tolist(), self.labels.tolist(), self.captions())):
            row = {"position": {"minX": box[0], "minY": box[1], "maxX": box[2], "maxY": box[3]},
                   "domain": "pixel", "class_id": int(label), "box_caption": caption}
            if self.scores is not None:
                row["scores"] = {"score": float(self.scores[i])}
            rows.append(row)
        return {"box_data": rows, "class_labels": self.class_names}

    def draw(self, picture: np.ndarray) -> np.ndarray:
        """uint8 (H, W, 3) -> the same with the boxes and their captions drawn on it."""
        from torchvision.utils import draw_bounding_boxes

        if not len(self.boxes):
            return picture
        image = torch.from_numpy(np.ascontiguousarray(picture)).permute(2, 0, 1)
        image = draw_bounding_boxes(image, drawable_boxes(self.boxes.cpu()), self.captions(), colors=self.colour,
                                    width=1)
        return image.permute(1, 2, 0).numpy()


@dataclass(frozen=True, eq=False)
class Mask:
    """Class labels to show over a picture: ``labels`` uint8 (H, W) at the picture's size, named by
    ``class_names``, coloured by ``palette`` (K, 3) uint8; pixels of ``ignore_index`` are white."""

    labels: np.ndarray
    class_names: dict[int, str]
    palette: np.ndarray
    ignore_index: int | None = None

    def wandb(self) -> dict:
        return {"mask_data": self.labels, "class_labels": self.class_names}

    def draw(self, picture: np.ndarray) -> np.ndarray:
        """uint8 (H, W, 3) -> the picture half-blended with the classes' colours, uint8 (H, W, 3)."""
        palette = np.asarray(self.palette, dtype=np.float32)
        colours = palette[np.clip(self.labels, 0, len(palette) - 1)]
        if self.ignore_index is not None:
            colours[self.labels == self.ignore_index] = 255.0
        return np.round(0.5 * picture.astype(np.float32) + 0.5 * colours).astype(np.uint8)


#: per picture, its overlays by name (wandb's box or mask group: ``"predictions"``, ``"ground_truth"``)
Overlays = dict[str, Union[Boxes, Mask]]


def stretched(images: torch.Tensor) -> list[np.ndarray]:
    """(N, 3, H, W) network inputs (any normalisation) -> N uint8 (H, W, 3) arrays, each stretched from its
    own minimum to its maximum: what the network saw. Copies to the host: call it only to log."""
    images = images.detach().float()
    lo, hi = images.amin(dim=(1, 2, 3), keepdim=True), images.amax(dim=(1, 2, 3), keepdim=True)
    pixels = ((images - lo) / (hi - lo).clamp_min(1e-6) * 255).byte().permute(0, 2, 3, 1).cpu().numpy()
    return list(pixels)


def pixels_of(picture: Picture) -> np.ndarray:
    """A picture as uint8 (H, W, 3), read from its file if it is one."""
    if isinstance(picture, np.ndarray):
        return picture
    from PIL import Image

    with Image.open(picture) as image:
        return np.asarray(image.convert("RGB"))


def drawn(picture: Picture, overlays: Overlays | None) -> np.ndarray:
    """The picture with its overlays drawn in, for a logger that has no overlays of its own: boxes on the
    picture, each mask as one more panel to its right. uint8 (H, W', 3)."""
    pixels = pixels_of(picture)
    panels = [pixels]
    for overlay in (overlays or {}).values():
        if isinstance(overlay, Boxes):
            panels[0] = overlay.draw(panels[0])
        else:
            panels.append(overlay.draw(pixels))
    return np.concatenate(panels, axis=1) if len(panels) > 1 else panels[0]


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A table as markdown (what TensorBoard's text tab renders); ``|`` and line breaks in cells escaped."""
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\r", " ").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class MediaSink:
    """Where the callbacks send tables and pictures. ``step`` ``None``: the logger's own choice (wandb: its
    next step; the others: the trainer's global step)."""

    def log_image(self, key: str, images: Picture | Sequence[Picture], captions: Sequence[str] | None = None,
                  step: int | None = None, overlays: Sequence[Overlays] | None = None) -> None:
        """``images``: a list of pictures, or one picture (wandb shows one picture and a list of one
        differently); ``captions`` and ``overlays``: one per picture."""
        raise NotImplementedError

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                  step: int | None = None) -> None:
        """``rows``: lists of values, one per column."""
        raise NotImplementedError


class AllSinks(MediaSink):
    """The media of a run with several loggers: each call goes to every one of them."""

    def __init__(self, sinks: list[MediaSink]):
        self.sinks = sinks

    def log_image(self, key, images, captions=None, step=None, overlays=None) -> None:
        for sink in self.sinks:
            sink.log_image(key, images, captions, step, overlays)

    def log_table(self, key, columns, rows, step=None) -> None:
        for sink in self.sinks:
            sink.log_table(key, columns, rows, step)


class WandbSink(MediaSink):
    """wandb images (captions, boxes and masks as wandb's own overlays) and wandb tables."""

    def __init__(self, logger: WandbLogger):
        self.logger = logger

    def log_image(self, key, images, captions=None, step=None, overlays=None) -> None:
        kwargs: dict[str, list] = {}
        if captions is not None:
            kwargs["caption"] = list(captions)
        if overlays is not None:
            for name, kind in (("boxes", Boxes), ("masks", Mask)):
                groups = [{group: o.wandb() for group, o in per.items() if isinstance(o, kind)} for per in overlays]
                if any(groups):
                    kwargs[name] = groups
        if isinstance(images, (list, tuple)):
            self.logger.log_image(key, list(images), step=step, **kwargs)
        else:
            import wandb

            picture = str(images) if isinstance(images, Path) else images
            self.logger.log_metrics({key: wandb.Image(picture, **{k: v[0] for k, v in kwargs.items()})}, step)

    def log_table(self, key, columns, rows, step=None) -> None:
        self.logger.log_table(key=key, columns=list(columns), data=[list(row) for row in rows], step=step)


class FlatSink(MediaSink):
    """Base of the loggers that show plain pictures: overlays drawn in (:func:`drawn`), ``step`` ``None``
    read as the trainer's global step. Picture ``i`` of a list is ``NN`` (``00``, ``01``, ...) in the names
    the subclasses give; one picture gets no number."""

    def __init__(self, logger: Logger, trainer: Trainer):
        self.logger = logger
        self.trainer = trainer

    def log_image(self, key, images, captions=None, step=None, overlays=None) -> None:
        single = not isinstance(images, (list, tuple))
        pictures = [images] if single else list(images)
        overlays = overlays if overlays is not None else [None] * len(pictures)
        named = {None if single else f"{i:02d}": drawn(picture, over)
                 for i, (picture, over) in enumerate(zip(pictures, overlays))}
        self.write_images(key, named, None if captions is None else list(captions), self.step(step))

    def step(self, step: int | None) -> int:
        return int(self.trainer.global_step if step is None else step)

    def write_images(self, key: str, pictures: dict[str | None, np.ndarray], captions: list[str] | None,
                     step: int) -> None:
        """``pictures``: uint8 (H, W, 3) by number (``None`` for a single picture)."""
        raise NotImplementedError


class TensorBoardSink(FlatSink):
    """TensorBoard: picture ``NN`` under the tag ``<key>/NN`` (one picture: ``<key>``), the captions as a
    markdown table under ``<key>/captions``, a table as markdown text under ``<key>``."""

    def write_images(self, key, pictures, captions, step) -> None:
        writer = self.logger.experiment
        for number, pixels in pictures.items():
            writer.add_image(key if number is None else f"{key}/{number}", pixels, step, dataformats="HWC")
        if captions is not None:
            numbers = [number or "" for number in pictures]
            writer.add_text(f"{key}/captions", markdown_table(["image", "caption"], list(zip(numbers, captions))), step)

    def log_table(self, key, columns, rows, step=None) -> None:
        self.logger.experiment.add_text(key, markdown_table(columns, rows), self.step(step))


class CsvSink(FlatSink):
    """Files beside the CSVLogger's ``metrics.csv``: ``<log_dir>/media/<key>/step_<n>.csv`` per table,
    ``step_<n>_NN.png`` per picture (one picture: ``step_<n>.png``) and ``step_<n>_captions.csv`` (file,
    caption)."""

    def folder(self, key: str) -> Path:
        folder = Path(self.logger.log_dir) / "media" / key
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def write_images(self, key, pictures, captions, step) -> None:
        from PIL import Image

        folder, names = self.folder(key), []
        for number, pixels in pictures.items():
            names.append(f"step_{step}.png" if number is None else f"step_{step}_{number}.png")
            Image.fromarray(pixels).save(folder / names[-1])
        if captions is not None:
            write_csv(folder / f"step_{step}_captions.csv", ["file", "caption"], list(zip(names, captions)))

    def log_table(self, key, columns, rows, step=None) -> None:
        write_csv(self.folder(key) / f"step_{self.step(step)}.csv", columns, rows)


class MlflowSink(FlatSink):
    """Artifacts of the MLflow run, through its client: ``media/<key>/step_<n>_NN.png`` per picture (one
    picture: ``step_<n>.png``), ``step_<n>_captions.json`` and ``media/<key>/step_<n>.json`` per table
    (MLflow's table format). mlflow is imported by the logger, only when one is configured."""

    def write_images(self, key, pictures, captions, step) -> None:
        client, run_id = self.logger.experiment, self.logger.run_id
        names = []
        for number, pixels in pictures.items():
            names.append(f"step_{step}.png" if number is None else f"step_{step}_{number}.png")
            client.log_image(run_id, pixels, artifact_file=f"media/{key}/{names[-1]}")
        if captions is not None:
            client.log_table(run_id, data={"file": names, "caption": captions},
                             artifact_file=f"media/{key}/step_{step}_captions.json")

    def log_table(self, key, columns, rows, step=None) -> None:
        data = {column: [row[i] for row in rows] for i, column in enumerate(columns)}
        self.logger.experiment.log_table(self.logger.run_id, data=data,
                                         artifact_file=f"media/{key}/step_{self.step(step)}.json")


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)


def sink_of(logger: Logger, trainer: Trainer) -> MediaSink | None:
    """The sink of one of Lightning's loggers, ``None`` for a logger that shows no media."""
    if isinstance(logger, WandbLogger):
        return WandbSink(logger)
    if isinstance(logger, TensorBoardLogger):
        return TensorBoardSink(logger, trainer)
    if isinstance(logger, MLFlowLogger):
        return MlflowSink(logger, trainer)
    if isinstance(logger, CSVLogger):
        return CsvSink(logger, trainer)
    return None


def media_sink(trainer: Trainer) -> MediaSink | None:
    """The run's media sink on rank 0: every logger of ``trainer.loggers`` that shows media gets them. ``None``
    on other ranks and when no logger does: the callbacks then collect nothing. Cheap (no logger is
    started), so callbacks may ask on every batch."""
    if trainer.global_rank != 0:
        return None
    sinks = [sink for sink in (sink_of(logger, trainer) for logger in trainer.loggers) if sink is not None]
    if not sinks:
        return None
    return sinks[0] if len(sinks) == 1 else AllSinks(sinks)


def drawable_boxes(boxes: torch.Tensor) -> torch.Tensor:
    """(N, 4) xyxy boxes with each pair of corners ordered, so a box read inverted from its annotation
    (x2 < x1) is drawn over the area it names instead of stopping ``draw_bounding_boxes``."""
    boxes = boxes.float()
    return torch.cat([torch.minimum(boxes[:, :2], boxes[:, 2:]), torch.maximum(boxes[:, :2], boxes[:, 2:])], dim=1)
