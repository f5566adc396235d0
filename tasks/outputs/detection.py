"""What detection's `test` and `predict` write (:class:`tasks.detect.DetectionTask` computes it).

Under ``predictions/``: ``detections.json`` (COCO results format: the annotation file's image and category
ids, ``[x, y, w, h]`` boxes in original-image pixels), ``per_class.csv`` (per category AP, AP50, AP75,
AR100 from the evaluation that gave mAP; VOC: AP50) and ``worst/``: the images with the lowest F1 at IoU
0.5, drawn with their predicted (red) and true (green) boxes, listed in ``worst.csv``. `predict` writes one
JSON per image under ``predictions/predict/`` (and, with ``model.draw_predictions``, the image with its
boxes), named after the image's stem, or after its file name with the extension when two images share a
stem (``photo.jpg.json`` and ``photo.png.json``). Validation images with their boxes go to the run's loggers
(:mod:`tasks.outputs.media`).

Detections reach these callbacks in original-image pixels (the head's ``postprocess``); a picture of the
network input gets its boxes through :func:`boxes_on_picture`.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Sequence

import torch
from lightning.pytorch import Callback

from datamodules.images import output_names, read_rgb
from tasks.outputs.common import (PredictWriter, TestRows, WorstSamples, draw_after_metrics, open_atomically,
                                  predictions_dir, write_atomically, write_worst_csv)
from tasks.outputs.media import Boxes, drawable_boxes, media_sink, stretched


def coco_records(det: dict[str, torch.Tensor], category_ids: Sequence[int], **extra) -> list[dict]:
    """One image's detections (``{"boxes" (D, 4) x1y1x2y2, "scores", "labels"}``) as COCO result records:
    ``{**extra, "category_id": the annotation file's id, "bbox": [x, y, w, h], "score"}``."""
    boxes = det["boxes"].float().cpu()
    xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], dim=1).tolist()
    return [{**extra, "category_id": category_ids[label], "bbox": box, "score": score}
            for box, score, label in zip(xywh, det["scores"].float().cpu().tolist(), det["labels"].cpu().tolist())]


def boxes_on_picture(boxes: torch.Tensor, original_size: Sequence[int], picture_size: Sequence[int]) -> torch.Tensor:
    """(N, 4) x1y1x2y2 boxes of an image of ``original_size`` ``(height, width)`` -> the same boxes on a
    picture of that image of ``picture_size`` ``(height, width)``, e.g. the network input drawn as it saw it."""
    (original_height, original_width), (height, width) = original_size, picture_size
    x, y = width / original_width, height / original_height
    return boxes.float().cpu() * torch.tensor([x, y, x, y])


class DetectionsJson(TestRows):
    """``predictions/detections.json``: every test detection as a COCO result record (:func:`coco_records`),
    by image id, each image once (a padding sampler scores some twice). Step rows: ``(image_id, detections
    in original pixels)``."""

    key = "detections"

    def write(self, folder: Path, rows: list, pl_module) -> None:
        per_image = dict(reversed(rows))  # the first copy of an image, as the metric keeps
        records = [r for image_id in sorted(per_image)
                   for r in coco_records(per_image[image_id], pl_module.category_ids, image_id=image_id)]
        write_atomically(folder / "detections.json", json.dumps(records))


class PerClassAP(Callback):
    """``predictions/per_class.csv``: ``category_id, name`` and the per-category numbers the task computed
    from the evaluation that gave mAP (its ``test_per_class``, column -> one value per label; COCO: ``ap,
    ap50, ap75, ar100``, -1 without ground truth; VOC: ``ap50``, ``nan`` without ground truth)."""

    def on_test_end(self, trainer, pl_module) -> None:
        columns = getattr(pl_module, "test_per_class", None)
        if trainer.global_rank != 0 or columns is None:
            return
        folder = predictions_dir(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        with open_atomically(folder / "per_class.csv") as f:
            writer = csv.writer(f)
            writer.writerow(["category_id", "name", *columns])
            for label, (category_id, name) in enumerate(zip(pl_module.category_ids, pl_module.category_names)):
                writer.writerow([category_id, name, *(repr(float(values[label])) for values in columns.values())])


class WorstDetections(WorstSamples):
    """``predictions/worst/NN_<image stem>.jpg``: the test images with the lowest F1 at IoU 0.5 (detections
    scoring at least ``display_score_threshold``), as the network saw them, with predicted boxes in red
    (name and score) and true boxes in green; ``worst.csv`` lists them (rank, image, f1, detections drawn,
    objects, file). Payload: ``(path, displayable input image, detections, true boxes, true labels,
    original size)``, boxes in original pixels."""

    def draw(self, folder: Path, worst: list, pl_module) -> None:
        from torchvision.io import write_jpeg
        from torchvision.utils import draw_bounding_boxes

        names = pl_module.category_names
        rows = []
        folder.mkdir(parents=True, exist_ok=True)
        for rank, (f1, _, (path, image, det, gt_boxes, gt_labels, original_size)) in enumerate(worst, start=1):
            name = f"{rank:02d}_{Path(str(path)).stem}.jpg"
            picture_size = tuple(image.shape[-2:])
            if len(gt_boxes):
                image = draw_bounding_boxes(image, drawable_boxes(boxes_on_picture(gt_boxes, original_size, picture_size)),
                                            [names[i] for i in gt_labels.tolist()], colors="lime", width=1)
            if len(det["boxes"]):
                labels = [f"{names[c]} {s:.2f}" for c, s in zip(det["labels"].tolist(), det["scores"].tolist())]
                image = draw_bounding_boxes(image, boxes_on_picture(det["boxes"], original_size, picture_size), labels,
                                            colors="red", width=1)
            write_jpeg(image, str(folder / name), quality=90)
            rows.append([rank, path, repr(f1), len(det["boxes"]), len(gt_boxes), name])
        write_worst_csv(folder / "worst.csv", ["rank", "image", "f1", "detections", "objects", "file"], rows)


class DetectionPredictions(PredictWriter):
    """``predictions/predict/<name>.json`` per image: ``{"image", "height", "width", "detections": [COCO
    records with "category_name"]}``, in the upright image's pixels; with ``draw``, ``<name>.jpg``: the image
    with its boxes, drawn once every JSON is written. Rows: ``(path, (height, width), detections)``."""

    def __init__(self, draw: bool = False):
        super().__init__()
        self.draw = draw

    def write(self, trainer, folder: Path, rows: list, pl_module) -> None:
        # all ranks' images are known here: two that share a stem keep their extensions
        names = output_names(path for path, _, _ in rows)
        written = []
        for path, (height, width), det in rows:
            records = coco_records(det, pl_module.category_ids)
            for record, label in zip(records, det["labels"].tolist()):
                record["category_name"] = pl_module.category_names[label]
            row = {"image": path, "height": height, "width": width, "detections": records}
            target = folder / names[str(path)]
            target.parent.mkdir(parents=True, exist_ok=True)
            Path(f"{target}.json").write_text(json.dumps(row, indent=1))
            written.append((row, Path(f"{target}.jpg")))
        if self.draw:
            draw_after_metrics(lambda: [draw_row(row, picture) for row, picture in written],
                               "the predicted boxes (model.draw_predictions)")


def draw_row(row: dict, path: Path) -> None:
    """The image of a `predict` row, read upright (the frame its boxes are in), with its boxes and labels."""
    from torchvision.io import write_jpeg
    from torchvision.utils import draw_bounding_boxes

    image = read_rgb(row["image"])
    if row["detections"]:
        boxes = torch.tensor([d["bbox"] for d in row["detections"]])
        boxes[:, 2:] += boxes[:, :2]
        labels = [f"{d['category_name']} {d['score']:.2f}" for d in row["detections"]]
        image = draw_bounding_boxes(image, boxes, labels, colors="red", width=2)
    write_jpeg(image, str(path))


class ValidationBoxes(Callback):
    """``val/samples`` to the run's loggers: the first ``count`` images of the first validation batch, as the
    network saw them, with their predicted boxes (scoring at least the model's ``display_score_threshold``,
    captioned with name and score, red) and true boxes (green): wandb overlays them, other loggers get them
    drawn in. Step outputs: ``{"samples": (images, detections in original pixels, targets)}``."""

    def __init__(self, count: int):
        self.count = count

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.count <= 0 or batch_idx != 0 or trainer.sanity_checking or not isinstance(outputs, dict):
            return
        media = media_sink(trainer)
        if media is None:
            return
        images, detections, targets = outputs["samples"]
        n = min(self.count, len(images))
        class_names = dict(enumerate(pl_module.category_names))
        picture_size = tuple(images.shape[-2:])
        overlays = []
        for det, target in zip(detections[:n], targets[:n]):
            keep = det["scores"] >= pl_module.display_score_threshold
            predicted = boxes_on_picture(det["boxes"][keep], target["orig_size"], picture_size)
            overlays.append({"predictions": Boxes(predicted, det["labels"][keep].cpu(), class_names,
                                                  det["scores"][keep].cpu(), colour="red"),
                             "ground_truth": Boxes(target["boxes"].cpu(), target["labels"].cpu(), class_names,
                                                   colour="lime")})
        media.log_image("val/samples", stretched(images[:n]), overlays=overlays)
