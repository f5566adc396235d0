"""Semantic segmentation: ``python -m tasks.segment {fit,validate,test,predict}``.

A backbone's feature pyramid feeds a DeepLabv3 or PSPNet head; cross-entropy with
the ignore label (plus, in training only, the auxiliary head's loss, weight ``aux_weight``
0.4, when the head has one: CVNets reads it from stage 4, ``head.aux_stage: 4``).

Scores: one dataset-wide confusion matrix over every evaluated
pixel at the original resolution (ignore label excluded), per-class IoU
``TP / (TP + FP + FN)``, mIoU = mean over the classes whose union is non-empty
(mmsegmentation / CVNets), pixel accuracy = trace / total. Evaluation feeds one
image per step (resized by the datamodule), upsamples its logits to the original
size and counts every image once under DDP (the datamodule's unrepeated sampler),
so 1-process and N-process numbers are the same.

`test` writes ``predictions/masks/<name>.png`` (original size, the dataset's own
label encoding; ``<name>`` is the image's stem, or its file name with the extension when two images share
a stem), ``predictions/metrics.json`` and ``predictions/per_class.csv`` (class, iou,
pixel_accuracy = TP / ground-truth pixels, support_pixels, from the same confusion matrix; logged to
wandb as one table, ``val/per_class`` each validation, ``test/per_class``, rather than a chart per
class) and ``predictions/worst/``: the images with the lowest per-image mIoU (:func:`image_miou`),
image | prediction | truth, listed in ``worst.csv``; `predict` writes
``predictions/predict/{masks,overlays}/``.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from datamodules.images import read_rgb_array
from datamodules.input_spec import input_spec_of, segmentation_spec
from datamodules.segmentation_transforms import IGNORE_INDEX
from torchmetrics.classification import MulticlassConfusionMatrix

from backbones import Backbone
from heads.deeplabv3 import DeepLabV3
from heads.seg_common import SegmentationHead
from tasks.engine.analysis import displayable, draw_after_metrics, write_worst_csv
from tasks.export import segmentation as onnx_segmentation
from tasks.engine.predictor import Predictor
from tasks.engine.base import TaskModule


#: builds a head from ``(backbone.feature_channels, num_classes, stage_channels=backbone.stage_channels)``;
#: YAML: ``class_path: heads.pspnet.PSPNet``. ``stage_channels`` (stage index -> channels, empty for
#: single-scale backbones) is what an auxiliary head read by stage needs; the task always passes it.
HeadFactory = Callable[[dict[int, int], int], SegmentationHead]


def confusion_scores(confmat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Scores of a (K, K) confusion matrix (rows: truth, columns: prediction).

    Returns ``iou`` (K,) with NaN where a class is in neither truth nor prediction,
    ``miou`` (mean over the other classes), ``pixel_acc`` and ``present`` (K,) bool.
    """
    confmat = confmat.double()
    tp = confmat.diagonal()
    union = confmat.sum(0) + confmat.sum(1) - tp
    present = union > 0
    iou = torch.where(present, tp / union.clamp_min(1), torch.full_like(tp, float("nan")))
    total = confmat.sum()
    return {
        "iou": iou,
        "miou": iou[present].mean() if present.any() else torch.tensor(float("nan"), dtype=torch.float64),
        "pixel_acc": tp.sum() / total if total > 0 else torch.tensor(float("nan"), dtype=torch.float64),
        "present": present,
    }


def image_miou(pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int) -> float:
    """One image's mIoU: (H, W) labels -> the mean IoU over the classes present in its truth or
    prediction (labelled pixels only); NaN for an image without a labelled pixel."""
    keep = target != ignore_index
    confmat = torch.bincount(target[keep].long() * num_classes + pred[keep].long(), minlength=num_classes ** 2)
    return float(confusion_scores(confmat.reshape(num_classes, num_classes))["miou"])


def label_maps(logits: torch.Tensor, orig_sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """(B, K, h, w) logits of images of ``orig_sizes`` (height, width) -> per image its (H, W) labels: the
    logits upsampled bilinearly to the original size, then the best class of each pixel (`predict` and
    ``model.predict``)."""
    return [F.interpolate(logits[k:k + 1], size=(int(height), int(width)), mode="bilinear",
                          align_corners=False).argmax(1)[0] for k, (height, width) in enumerate(orig_sizes)]


def output_name(batch: dict, k: int) -> str:
    """What the outputs of the batch's ``k``-th image are called: the datamodule's ``name`` (unique over
    the split), or the image's stem for a datamodule that gives none."""
    names = batch.get("name")
    return names[k] if names is not None else Path(batch["path"][k]).stem


class SegmentationMetric(MulticlassConfusionMatrix):
    """Dataset-wide confusion matrix (torchmetrics sums it over updates and ranks);
    :meth:`scores` turns it into IoU/mIoU/pixel accuracy with :func:`confusion_scores`.

    ``update(preds, target)``: (N, H, W) int labels; target pixels equal to ``ignore_index`` are skipped.
    """

    def __init__(self, num_classes: int, ignore_index: int = IGNORE_INDEX):
        super().__init__(num_classes=num_classes, ignore_index=ignore_index, normalize="none")

    def scores(self) -> dict[str, torch.Tensor]:
        return confusion_scores(self.compute())


class SegmentationTask(Predictor, TaskModule):
    """Backbone + segmentation head, trained with pixel-wise cross-entropy.

    Args:
        backbone: any image backbone (YAML ``class_path: backbones.MobileViTv2``; its
            ``output_stride`` sets the head's resolution).
        class_names: linked from the datamodule; label i is ``class_names[i]``.
        head: builds the head from ``(feature_channels, num_classes, stage_channels=...)`` (YAML ``class_path:
            heads.deeplabv3.DeepLabV3`` / ``heads.pspnet.PSPNet`` with their other arguments);
            ``None`` is a default DeepLabV3.
        ignore_index: label excluded from the loss and the scores.
        aux_weight: weight of the auxiliary head's loss (used in training when the head has one;
            CVNets' ``loss.segmentation.cross_entropy.aux_weight``, 0.4).
        class_weights: per-class weights of the cross-entropy (mmsegmentation's ``class_weight``),
            e.g. to stop a dominant background from drowning the rare classes; ``None``: all 1.
            The loss stays a weighted mean over the labelled pixels; scores are unaffected.
        num_sample_images: validation images logged to wandb with prediction / truth masks each epoch.
        Remaining arguments: see :class:`tasks.engine.base.TaskModule`.
    """

    DATA_LINKS = {"class_names": "class_names"}
    #: the input specification of a segmentation datamodule's arguments (see :class:`tasks.engine.predictor.Predictor`)
    input_spec_rule = staticmethod(segmentation_spec)
    #: the module that writes this task's ONNX graph and checks it (``python -m tasks.segment export``)
    onnx_export = onnx_segmentation

    def __init__(self, backbone: Backbone, class_names: list[str], head: HeadFactory | None = None,
                 ignore_index: int = IGNORE_INDEX, aux_weight: float = 0.4, class_weights: list[float] | None = None,
                 num_sample_images: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone
        self.class_names = list(class_names)
        num_classes = len(self.class_names)
        self.head = (head or DeepLabV3)(dict(backbone.feature_channels), num_classes,
                                        stage_channels=dict(backbone.stage_channels))
        self.ignore_index = ignore_index
        self.aux_weight = aux_weight
        if class_weights is not None and len(class_weights) != num_classes:
            raise ValueError(f"class_weights has {len(class_weights)} entries for {num_classes} classes "
                             f"({', '.join(self.class_names)})")
        # a buffer, so it follows the module to its device; not persistent: a recipe value, not a weight
        self.register_buffer("class_weights", None if class_weights is None else
                             torch.tensor(class_weights, dtype=torch.float32), persistent=False)
        self.num_sample_images = num_sample_images
        self.val_metric = SegmentationMetric(num_classes, ignore_index)
        self.test_metric = SegmentationMetric(num_classes, ignore_index)
        self._samples: list[dict] = []

    # -- model ----------------------------------------------------------------------------------------------
    def example_input(self, datamodule) -> torch.Tensor | None:
        # the papers count FLOPs at the crop size (512 x 512 on ADE20k and VOC)
        spec = input_spec_of(datamodule, self.input_spec_rule)
        size = spec.image_size if spec is not None else None
        return torch.zeros(1, 3, size, size) if size else None

    def forward(self, images: torch.Tensor, size: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """(B, 3, H, W) -> ``{"out": (B, K, *size)}`` (+ ``"aux"`` while training), logits upsampled
        bilinearly to ``size`` (default: the input's H, W)."""
        size = tuple(size) if size is not None else tuple(images.shape[-2:])
        images = self.to_memory_format(images)
        stages = getattr(self.head, "input_stages", ())  # empty in eval: inference never runs the aux head
        if stages:
            out = self.head(*self.backbone.forward_stages(images, stages))
        else:
            out = self.head(self.backbone(images))
        return {k: F.interpolate(v, size=size, mode="bilinear", align_corners=False) for k, v in out.items()}

    def pixel_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """(B, K, H, W) logits, (B, H, W) labels -> (class-weighted) mean cross-entropy over labelled pixels."""
        return F.cross_entropy(logits.float(), target, weight=self.class_weights, ignore_index=self.ignore_index)

    def losses(self, logits: dict[str, torch.Tensor], target: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"loss": total, "seg_loss": main head's}`` (+ ``"aux_loss"``, unweighted, when ``logits``
        has ``"aux"``); total = seg_loss + aux_weight * aux_loss, as CVNets' SegCrossEntropy."""
        losses = {"seg_loss": self.pixel_loss(logits["out"], target)}
        losses["loss"] = losses["seg_loss"]
        if "aux" in logits:
            losses["aux_loss"] = self.pixel_loss(logits["aux"], target)
            losses["loss"] = losses["seg_loss"] + self.aux_weight * losses["aux_loss"]
        return losses

    def training_loss(self, batch: dict, batch_idx: int) -> torch.Tensor:
        losses = self.losses(self(batch["image"]), batch["mask"])
        self.log("train/loss", losses["loss"], prog_bar=True, batch_size=len(batch["image"]))
        if "aux_loss" in losses:
            self.log("train/aux_loss", losses["aux_loss"], batch_size=len(batch["image"]))
        return losses["loss"]

    # -- evaluation (one image per step, scored at its original size) -------------------------------------------
    def _evaluate(self, batch: dict, stage: str, metric: SegmentationMetric) -> torch.Tensor:
        target = batch["mask"]
        logits = self(batch["image"], size=target.shape[-2:])["out"]
        preds = logits.argmax(1)
        metric.update(preds, target)
        if (target != self.ignore_index).any():  # an all-ignore image has no loss to average
            self.log_eval_loss(stage, self.pixel_loss(logits, target), weight=len(target))
        return preds

    def _log_scores(self, stage: str, metric: SegmentationMetric) -> dict[str, torch.Tensor]:
        return self._log_confusion_scores(stage, metric)[0]

    def _log_confusion_scores(self, stage: str, metric: SegmentationMetric
                              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        confmat = metric.compute()  # sums the matrix over ranks: every rank calls it
        scores = confusion_scores(confmat)
        metric.reset()
        logged = {f"{stage}/miou": scores["miou"].float(), f"{stage}/pixel_acc": scores["pixel_acc"].float()}
        self.log_dict({k: v.to(self.device) for k, v in logged.items()})
        logger = self.wandb_logger
        if stage == "val" and logger is not None and not self.trainer.sanity_checking:
            # one table per validation instead of a chart per class (150 on ADE20k)
            rows = [[name, float(iou)] for name, iou in zip(self.class_names, scores["iou"].tolist())]
            logger.log_table(key="val/per_class", columns=["class", "iou"], data=rows)
        return logged, confmat

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        if "image" not in batch:
            return
        preds = self._evaluate(batch, "val", self.val_metric)
        if batch_idx in self._sample_batches and not self.trainer.sanity_checking:
            self._samples.append({"image": batch["image"][0], "pred": preds[0], "mask": batch["mask"][0]})

    def on_validation_epoch_start(self) -> None:
        self._samples = []
        self._sample_batches = self.sample_batch_indices(self.num_sample_images)

    def on_validation_epoch_end(self) -> None:
        self._log_scores("val", self.val_metric)
        self._log_overlays()

    def test_step(self, batch: dict, batch_idx: int) -> None:
        if "image" not in batch:
            return
        preds = self._evaluate(batch, "test", self.test_metric)
        self._write_mask(preds[0], self.predictions_dir / "masks" / f"{output_name(batch, 0)}.png")
        score = image_miou(preds[0], batch["mask"][0], len(self.class_names), self.ignore_index)
        self.worst_examples.offer(score, int(batch["index"][0]), lambda: (
            batch["path"][0], displayable(batch["image"][0]), preds[0].cpu(), batch["mask"][0].cpu()))

    def on_test_epoch_end(self) -> None:
        logged, confmat = self._log_confusion_scores("test", self.test_metric)
        loss = self.eval_loss_value("test")  # on every rank: computing it syncs
        worst = self.gather_worst()
        if self.global_rank == 0:
            self.write_metrics_json({**logged, **loss})
            self.write_per_class(confmat)
            draw_after_metrics(lambda: self.write_worst(worst), "predictions/worst/")

    def write_worst(self, worst: list) -> None:
        """``predictions/worst/NN_<stem>.jpg``: the test images with the lowest per-image mIoU, side by
        side as the network saw the image, the prediction and the truth blended with the classes'
        colours (ignored pixels of the truth in white); ``worst.csv`` lists them (rank, image, miou, file)."""
        palette = torch.as_tensor(np.asarray(self.trainer.datamodule.palette), dtype=torch.float32)
        rows = []
        self.worst_dir.mkdir(parents=True, exist_ok=True)
        for rank, (miou, _, (path, image, pred, truth)) in enumerate(worst, start=1):
            size = image.shape[-2:]
            panels = [image]
            for labels in (pred, truth):
                labels = F.interpolate(labels[None, None].float(), size=size, mode="nearest")[0, 0].long()
                ignored = labels == self.ignore_index
                colours = palette[labels.clamp(0, len(palette) - 1)].permute(2, 0, 1)
                colours[:, ignored] = 255.0
                panels.append((0.5 * image.float() + 0.5 * colours).round().to(torch.uint8))
            name = f"{rank:02d}_{Path(path).stem}.jpg"
            Image.fromarray(torch.cat(panels, dim=2).permute(1, 2, 0).numpy()).save(self.worst_dir / name, quality=90)
            rows.append([rank, path, repr(miou), name])
        if rows:
            write_worst_csv(self.worst_dir / "worst.csv", ["rank", "image", "miou", "file"], rows)

    def write_per_class(self, confmat: torch.Tensor) -> None:
        """``predictions/per_class.csv``: per class ``iou`` (TP / (TP + FP + FN), ``nan`` when the class
        is in neither truth nor prediction), ``pixel_accuracy`` (recall: TP / ground-truth pixels,
        ``nan`` without ground truth) and ``support_pixels`` (ground-truth pixels), from the test
        split's confusion matrix, the one mIoU comes from."""
        confmat = confmat.cpu().long()
        iou = confusion_scores(confmat)["iou"].tolist()
        tp, support = confmat.diagonal().tolist(), confmat.sum(1).tolist()
        self.predictions_dir.mkdir(parents=True, exist_ok=True)
        with open(self.predictions_dir / "per_class.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["class", "iou", "pixel_accuracy", "support_pixels"])
            for name, class_iou, hits, pixels in zip(self.class_names, iou, tp, support):
                writer.writerow([name, repr(float(class_iou)), repr(hits / pixels if pixels else float("nan")), pixels])

    # -- outputs ---------------------------------------------------------------------------------------------
    def _write_mask(self, labels: torch.Tensor, path) -> np.ndarray:
        labels = labels.to(torch.uint8).cpu().numpy()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.trainer.datamodule.encode_prediction(labels).save(path)
        return labels

    def predict_step(self, batch: dict, batch_idx: int) -> None:
        """Writes ``predictions/predict/masks/<name>.png`` and ``overlays/<name>.jpg`` (image blended with the
        classes' colours), at the upright image's size; ``<name>`` is the image's stem, or its file name with the
        extension when two images share a stem (the batch's ``name``)."""
        if "image" not in batch:
            return
        datamodule = self.trainer.datamodule
        palette = datamodule.palette
        preds = label_maps(self(batch["image"])["out"], batch["orig_size"].tolist())
        for k, (path, pred) in enumerate(zip(batch["path"], preds)):
            name = output_name(batch, k)
            labels = self._write_mask(pred, self.predict_dir / "masks" / f"{name}.png")
            image = read_rgb_array(path)  # upright, as the network saw it
            overlay = (0.5 * image + 0.5 * palette[labels]).round().astype(np.uint8)
            overlay_path = self.predict_dir / "overlays" / f"{name}.jpg"
            overlay_path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(overlay).save(overlay_path, quality=90)

    def predict_inputs(self, inputs: list) -> list[np.ndarray]:
        """``model.predict(images)`` (:mod:`tasks.engine.predictor`): per image its (H, W) labels at the original size
        (uint8 up to 256 classes, else int64); label i is ``class_names[i]``. One image per forward, as
        evaluation and `predict` run."""
        images, read = self.prepared_images(inputs)
        dtype = np.uint8 if len(self.class_names) <= 256 else np.int64
        return [label_maps(self(image[None].to(self.device))["out"], [tuple(pixels.shape[-2:])])[0].cpu().numpy()
                .astype(dtype) for image, (pixels, _) in zip(images, read)]

    def _log_overlays(self) -> None:
        """Validation images with predicted and true masks as wandb mask overlays."""
        logger = self.wandb_logger
        samples, self._samples = self._samples, []
        if logger is None or not samples:
            return
        labels = {i: name for i, name in enumerate(self.class_names)} | {self.ignore_index: "ignore"}
        images, masks = [], []
        for sample in samples:
            image = sample["image"].float()
            image = ((image - image.min()) / (image.max() - image.min()).clamp_min(1e-6)).permute(1, 2, 0)
            size = image.shape[:2]
            # masks are at the original size; show them at the network's input size
            pred = F.interpolate(sample["pred"][None, None].float(), size=size, mode="nearest")[0, 0]
            true = F.interpolate(sample["mask"][None, None].float(), size=size, mode="nearest")[0, 0]
            images.append((image.cpu().numpy() * 255).astype(np.uint8))
            masks.append({"prediction": {"mask_data": pred.cpu().numpy().astype(np.uint8), "class_labels": labels},
                          "ground_truth": {"mask_data": true.cpu().numpy().astype(np.uint8), "class_labels": labels}})
        logger.log_image("val/overlays", images, step=self.global_step, masks=masks)


def main(args=None) -> None:
    from datamodules.segmentation import SegmentationDataModule
    from tasks.engine.cli import SuiteCLI

    SuiteCLI(SegmentationTask, SegmentationDataModule, task="segment", default_config="demo_deeplabv3_convmixer.yaml",
             monitor="val/miou", mode="max", args=args)


if __name__ == "__main__":
    main()
