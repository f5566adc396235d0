"""What segmentation's `test` and `predict` write (:class:`tasks.segment.SegmentationTask` computes it).

Under ``predictions/``: ``masks/<name>.png``, each test image's predicted labels at its original size in
the dataset's own label encoding; ``per_class.csv`` (class, iou, pixel_accuracy, support_pixels) from the
split's confusion matrix, the one mIoU comes from; ``worst/``: the images with the lowest per-image mIoU
drawn as image | prediction | truth, listed in ``worst.csv``. `predict` writes
``predictions/predict/masks/<name>.png`` and ``overlays/<name>.jpg``. ``<name>`` is the image's stem, or
its file name with the extension where two images share a stem (the batch's ``name``). Masks are written
as their batch ends, by the rank that computed them. The run's loggers (:mod:`tasks.outputs.media`) get
validation images with their predicted and true masks, and each validation's per-class IoU as one table
(``val/per_class``; a chart per class would be 150 on ADE20k).
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from PIL import Image

from datamodules.images import read_rgb_array
from datamodules.segmentation_layouts import voc_palette
from tasks.metrics.miou import confusion_scores
from tasks.outputs.common import (PredictWriter, ValidationSamples, WorstSamples, open_atomically, predict_dir,
                                  predictions_dir, write_worst_csv)
from tasks.outputs.media import Mask, media_sink, stretched


def output_name(batch: dict, k: int) -> str:
    """What the outputs of the batch's ``k``-th image are called: the datamodule's ``name`` (unique over
    the split), or the image's stem for a datamodule that gives none."""
    names = batch.get("name")
    return names[k] if names is not None else Path(batch["path"][k]).stem


def write_mask(datamodule, labels: torch.Tensor, path: Path) -> np.ndarray:
    """(H, W) labels -> ``path``, a PNG in the dataset's label encoding; returns the labels as uint8."""
    labels = labels.to(torch.uint8).cpu().numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    datamodule.encode_prediction(labels).save(path)
    return labels


def blend(image: torch.Tensor, labels: torch.Tensor, palette: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """uint8 (3, H, W) image and (h, w) labels -> the image half-blended with the classes' colours (labels
    resized to the image by nearest neighbour, ignored pixels white), uint8 (3, H, W)."""
    labels = F.interpolate(labels[None, None].float(), size=image.shape[-2:], mode="nearest")[0, 0].long()
    colours = palette[labels.clamp(0, len(palette) - 1)].permute(2, 0, 1)
    colours[:, labels == ignore_index] = 255.0
    return (0.5 * image.float() + 0.5 * colours).round().to(torch.uint8)


class TestMasks(Callback):
    """``predictions/masks/<name>.png``: each test image's predicted labels at its original size, written
    by the rank that scored it as its batch ends. Step outputs: ``{"preds": (B, H, W) labels}``."""

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if not isinstance(outputs, dict):
            return
        folder = predictions_dir(trainer) / "masks"
        for k, labels in enumerate(outputs["preds"]):
            write_mask(trainer.datamodule, labels, folder / f"{output_name(batch, k)}.png")


class PerClassIoUCsv(Callback):
    """``predictions/per_class.csv``: per class ``iou`` (TP / (TP + FP + FN), ``nan`` when the class is in
    neither truth nor prediction), ``pixel_accuracy`` (recall: TP / ground-truth pixels, ``nan`` without
    ground truth) and ``support_pixels`` (ground-truth pixels), from the test split's confusion matrix
    summed over ranks (the task's ``test_confusion``)."""

    def on_test_end(self, trainer, pl_module) -> None:
        confusion = getattr(pl_module, "test_confusion", None)
        if trainer.global_rank != 0 or confusion is None:
            return
        confusion = confusion.cpu().long()
        iou = confusion_scores(confusion)["iou"].tolist()
        tp, support = confusion.diagonal().tolist(), confusion.sum(1).tolist()
        folder = predictions_dir(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        with open_atomically(folder / "per_class.csv") as f:
            writer = csv.writer(f)
            writer.writerow(["class", "iou", "pixel_accuracy", "support_pixels"])
            for name, class_iou, hits, pixels in zip(pl_module.class_names, iou, tp, support):
                writer.writerow([name, repr(float(class_iou)), repr(hits / pixels if pixels else float("nan")), pixels])


class WorstSegmentations(WorstSamples):
    """``predictions/worst/NN_<image stem>.jpg``: the test images with the lowest per-image mIoU, side by
    side as the network saw the image, the prediction and the truth blended with the classes' colours
    (ignored truth pixels white); ``worst.csv`` lists them (rank, image, miou, file). Payload: ``(path,
    displayable image, prediction, truth)``, labels at the original size."""

    def draw(self, folder: Path, worst: list, pl_module) -> None:
        palette = torch.as_tensor(np.asarray(pl_module.trainer.datamodule.palette), dtype=torch.float32)
        folder.mkdir(parents=True, exist_ok=True)
        rows = []
        for rank, (miou, _, (path, image, pred, truth)) in enumerate(worst, start=1):
            panels = [image] + [blend(image, labels, palette, pl_module.ignore_index) for labels in (pred, truth)]
            name = f"{rank:02d}_{Path(path).stem}.jpg"
            Image.fromarray(torch.cat(panels, dim=2).permute(1, 2, 0).numpy()).save(folder / name, quality=90)
            rows.append([rank, path, repr(miou), name])
        write_worst_csv(folder / "worst.csv", ["rank", "image", "miou", "file"], rows)


class PredictMasks(PredictWriter):
    """``predictions/predict/masks/<name>.png`` and ``overlays/<name>.jpg`` (the upright image blended with
    the classes' colours), at the image's size, written by each rank as its batch ends. Step outputs: per
    image its (H, W) labels at the original size."""

    def __init__(self):
        super().__init__(write_interval="batch")  # each batch as it ends: no mask is kept

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx,
                           dataloader_idx) -> None:
        datamodule = trainer.datamodule
        folder = predict_dir(trainer)
        for k, (path, labels) in enumerate(zip(batch["path"], prediction or [])):
            name = output_name(batch, k)
            labels = write_mask(datamodule, labels, folder / "masks" / f"{name}.png")
            image = read_rgb_array(path)  # upright, as the network saw it
            overlay = (0.5 * image + 0.5 * datamodule.palette[labels]).round().astype(np.uint8)
            (folder / "overlays").mkdir(parents=True, exist_ok=True)
            Image.fromarray(overlay).save(folder / "overlays" / f"{name}.jpg", quality=90)


class ValidationOverlays(ValidationSamples):
    """``val/overlays`` to the run's loggers: validation images from batches spread over the split, at the
    network's input size, each with its predicted and true masks (wandb: its mask overlays; other loggers:
    image | prediction | truth blended with the classes' colours). Step output ``"sample"``: ``(image,
    prediction, truth)``, labels at the original size."""

    def log_samples(self, media, samples: list, pl_module) -> None:
        class_names = dict(enumerate(pl_module.class_names)) | {pl_module.ignore_index: "ignore"}
        palette = getattr(pl_module.trainer.datamodule, "palette", None)
        palette = voc_palette() if palette is None else np.asarray(palette)
        images = [stretched(image[None])[0] for image, _, _ in samples]  # one by one: their sizes may differ
        overlays = [{key: Mask(input_size_mask(labels, picture.shape[:2]), class_names, palette, pl_module.ignore_index)
                     for key, labels in (("prediction", pred), ("ground_truth", truth))}
                    for picture, (_, pred, truth) in zip(images, samples)]
        media.log_image("val/overlays", images, step=pl_module.global_step, overlays=overlays)




def input_size_mask(labels: torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    """(H, W) labels at the original size -> uint8 labels at the network's input ``size`` (nearest)."""
    return F.interpolate(labels[None, None].float(), size=size, mode="nearest")[0, 0].cpu().numpy().astype(np.uint8)


class PerClassIoUTable(Callback):
    """``val/per_class`` to the run's loggers: each validation's per-class IoU (the task's ``val_class_iou``)
    as one table (class, iou)."""

    def on_validation_end(self, trainer, pl_module) -> None:
        class_iou = getattr(pl_module, "val_class_iou", None)
        if trainer.sanity_checking or class_iou is None:
            return
        media = media_sink(trainer)
        if media is None:
            return
        rows = [[name, float(iou)] for name, iou in zip(pl_module.class_names, class_iou.tolist())]
        media.log_table("val/per_class", ["class", "iou"], rows)
