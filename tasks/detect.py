"""Object detection: ``python -m tasks.detect {fit,validate,test,predict}``.

SSDLite on any backbone, scored with the benchmark's metric: COCO mAP for COCO-layout data
(:class:`tasks.metrics.coco_map.CocoMeanAveragePrecision`: pycocotools' COCOeval numbers, computed by
faster_coco_eval), VOC mAP@0.5 for Pascal VOC (``--data datamodules.voc_detection.VocDetectionDataModule``,
:class:`tasks.metrics.voc_map.VocMeanAveragePrecision`). The datamodule says which (``evaluation_metric``).
What `test` and `predict` write (COCO results, per-category AP, the worst images, one JSON per predicted
image) is :mod:`tasks.outputs.detection`. Images are read upright (EXIF orientation applied): boxes,
``width`` and ``height`` are those of the image as viewers show it.

The head is a component like the backbone: ``model.head`` builds it from
``(backbone.feature_channels, num_classes)`` (YAML ``class_path: heads.ssdlite.SSDLiteHead`` with
its anchor/pyramid arguments as ``init_args``). It owns the anchors, the matching, the loss and the
post-processing down to boxes in original-image pixels; the task hands it outputs and sizes.
"""
from __future__ import annotations

from typing import Callable

import torch

from backbones import Backbone
from datamodules.input_spec import detection_spec, input_spec_of
from heads.ssdlite import ImageSizes, SSDLiteHead, SSDLiteOutputs
from tasks.outputs.common import displayable
from tasks.engine.base import TaskModule
from tasks.engine.predictor import Predictor
from tasks.metrics.coco_map import MAP_KEYS, CocoMeanAveragePrecision
from tasks.metrics.voc_map import VocMeanAveragePrecision
from tasks.outputs import detection as outputs

#: builds a head from ``(backbone.feature_channels, num_classes)``; YAML: ``class_path: heads.ssdlite.SSDLiteHead``
DetectionHeadFactory = Callable[[dict[int, int], int], SSDLiteHead]
MapMetric = CocoMeanAveragePrecision | VocMeanAveragePrecision


def map_metric(kind: str, num_classes: int, per_class: bool = False) -> MapMetric:
    """The benchmark's own mAP, as a datamodule's ``evaluation_metric`` names it: ``"coco"`` (COCOeval's twelve
    numbers; ``per_class`` keeps the arrays its per-category numbers come from) or ``"voc"`` (VOC mAP@0.5)."""
    if kind == "coco":
        return CocoMeanAveragePrecision(extended_summary=per_class)
    if kind == "voc":
        return VocMeanAveragePrecision(num_classes=num_classes)
    raise ValueError(f"the datamodule asks for evaluation_metric={kind!r}; detection scores 'coco' or 'voc'")


def image_f1(det_boxes: torch.Tensor, det_labels: torch.Tensor, gt_boxes: torch.Tensor, gt_labels: torch.Tensor,
             gt_crowd: torch.Tensor | None = None, iou_threshold: float = 0.5) -> float:
    """One image's F1 of detections against ground truth: detections (already cut at a display
    score, sorted by score) are matched greedily to the unmatched same-class box of highest IoU
    >= ``iou_threshold``. A detection matching only a crowd region counts neither way, as in COCO.
    1.0 for an image with neither objects nor detections. Boxes (N, 4) xyxy, labels (N,)."""
    from torchvision.ops import box_iou

    crowd = gt_crowd.bool() if gt_crowd is not None else torch.zeros(len(gt_boxes), dtype=torch.bool)
    num_gt = int((~crowd).sum())
    if len(det_boxes) == 0:
        return 1.0 if num_gt == 0 else 0.0
    if len(gt_boxes) == 0:
        return 0.0
    iou = box_iou(det_boxes.float(), gt_boxes.float())
    iou[det_labels[:, None] != gt_labels[None, :]] = 0.0
    matched = torch.zeros(len(gt_boxes), dtype=torch.bool)
    true_pos = false_pos = 0
    for row in iou:
        candidates = row.masked_fill(matched | crowd, 0.0)
        best = int(candidates.argmax())
        if candidates[best] >= iou_threshold:
            matched[best] = True
            true_pos += 1
        elif not (row.masked_fill(~crowd, 0.0) >= iou_threshold).any():
            false_pos += 1
    missed = num_gt - true_pos
    return 2 * true_pos / (2 * true_pos + false_pos + missed) if true_pos + false_pos + missed else 1.0



class DetectionTask(Predictor, TaskModule):
    """Backbone + detection head (SSDLite), trained with the multibox loss, scored with COCO or VOC mAP.

    Args:
        backbone: any image backbone (YAML ``class_path: backbones.MobileViTv2``) providing the
            head's first strides (plain backbones via their pyramid argument).
        num_classes: object classes, linked from the datamodule.
        category_ids, category_names: the annotation file's id and name of each label, linked from
            the datamodule; ids go into ``detections.json``, names into logged images.
        head: builds the head from ``(backbone.feature_channels, num_classes)``; ``None`` is
            :class:`heads.ssdlite.SSDLiteHead` with its defaults (the COCO pyramid). Its arguments
            (output strides, projection channels, aspect ratios, anchor scales, box-coder variances,
            matching threshold, hard-negative ratio, post-processing) are the head's own.
        num_sample_images: validation images logged (to every logger that shows media) with predicted and true boxes.
        display_score_threshold: lowest score drawn on logged images, counted in the worst images' F1
            and kept by `predict`.
        draw_predictions: `predict` also writes each image with its boxes drawn.
        Remaining arguments: see :class:`tasks.engine.base.TaskModule`.
    """

    DATA_LINKS = {"num_classes": "num_classes", "category_ids": "category_ids", "category_names": "category_names"}
    #: the input specification of a detection datamodule's arguments (see :class:`tasks.engine.predictor.Predictor`)
    input_spec_rule = staticmethod(detection_spec)

    def __init__(self, backbone: Backbone, num_classes: int, category_ids: list[int] | None = None,
                 category_names: list[str] | None = None, head: DetectionHeadFactory | None = None,
                 num_sample_images: int = 8, display_score_threshold: float = 0.3, draw_predictions: bool = False,
                 **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone
        self.num_classes = num_classes
        self.category_ids = list(category_ids) if category_ids is not None else list(range(num_classes))
        self.category_names = list(category_names) if category_names is not None else [str(i) for i in self.category_ids]
        if not (len(self.category_ids) == len(self.category_names) == num_classes):
            raise ValueError(f"num_classes={num_classes} but {len(self.category_ids)} category ids and "
                             f"{len(self.category_names)} names")
        self.head = (head or SSDLiteHead)(dict(backbone.feature_channels), num_classes)
        self.num_sample_images = num_sample_images
        self.display_score_threshold = display_score_threshold
        self.draw_predictions = draw_predictions
        # built in setup, when the datamodule names its metric; their states are not in the state dict
        self.val_map: MapMetric | None = None
        self.test_map: MapMetric | None = None
        #: per-category numbers of the test split, column -> one value per label (``per_class.csv``)
        self.test_per_class: dict[str, list[float]] | None = None

    def output_callbacks(self) -> list:
        return [outputs.DetectionsJson(), outputs.PerClassAP(), outputs.DetectionPredictions(self.draw_predictions),
                outputs.ValidationBoxes(self.num_sample_images), outputs.WorstDetections(self.num_worst_examples)]

    def example_input(self, datamodule) -> torch.Tensor | None:
        spec = input_spec_of(datamodule, self.input_spec_rule)
        return torch.zeros(1, 3, spec.image_size, spec.image_size) if spec is not None else None

    def setup(self, stage: str) -> None:
        super().setup(stage)
        kind = getattr(getattr(self.trainer, "datamodule", None), "evaluation_metric", "coco")
        self.val_map = map_metric(kind, self.num_classes)
        self.test_map = map_metric(kind, self.num_classes, per_class=True)

    # -- network ----------------------------------------------------------------------------------
    def forward(self, images: torch.Tensor) -> SSDLiteOutputs:
        """(B, 3, S, S) -> the head's outputs (class logits, box codes and their anchors)."""
        return self.head(self.backbone(self.to_memory_format(images)))

    def detect(self, images: torch.Tensor, original_sizes: ImageSizes | None = None) -> list[dict[str, torch.Tensor]]:
        """(B, 3, S, S) network inputs -> per image ``{"boxes" (D, 4) x1y1x2y2, "scores", "labels"}``, boxes in
        the pixels of the original images of ``original_sizes`` (per image ``(height, width)``), else of the input."""
        return self.head.postprocess(self(images), images.shape[-2:], original_sizes)

    def confident(self, detections: list[dict], score_threshold: float | None = None) -> list[dict]:
        """The detections scoring at least ``score_threshold`` (default ``display_score_threshold``)."""
        threshold = self.display_score_threshold if score_threshold is None else score_threshold
        return [{k: v[det["scores"] >= threshold] for k, v in det.items()} for det in detections]

    # -- training ---------------------------------------------------------------------------------
    def training_loss(self, batch: dict, batch_idx: int) -> torch.Tensor:
        images, targets = batch["image"], batch["targets"]
        losses = self.head.loss(self(images), targets, images.shape[-2:])
        # not prog_bar: Lightning turns progress-bar values into floats every batch (a host sync); the bars
        # read the loss from callback_metrics at their own interval (tasks.cli.progress.training_loss)
        self.log("train/loss", losses["loss"], prog_bar=False, batch_size=len(images))
        self.log_dict({"train/loss_cls": losses["loss_cls"], "train/loss_box": losses["loss_box"]},
                      batch_size=len(images))
        return losses["loss"]

    # -- evaluation -------------------------------------------------------------------------------
    def _eval_step(self, batch: dict, stage: str, metric: MapMetric) -> list[dict[str, torch.Tensor]]:
        """Logs the batch's loss, adds it to ``metric``; its detections in original pixels."""
        images, targets = batch["image"], batch["targets"]
        predicted = self(images)
        losses = self.head.loss(predicted, targets, images.shape[-2:])
        # the loss is a sum over the batch divided by its positive anchors: weighing each batch by that
        # count makes the split's mean the same ratio whatever the batching and the number of ranks
        self.log_eval_loss(stage, losses["loss"], weight=losses["num_positive"])
        detections = self.head.postprocess(predicted, images.shape[-2:], [t["orig_size"] for t in targets])
        ground_truth = [{"boxes": t["gt_boxes"], "labels": t["gt_labels"], "iscrowd": t["gt_iscrowd"],
                         "area": t["gt_area"], **({"difficult": t["gt_difficult"]} if "gt_difficult" in t else {})}
                        for t in targets]
        metric.update(detections, ground_truth, [t["image_id"] for t in targets])
        return detections

    def validation_step(self, batch: dict, batch_idx: int) -> dict | None:
        """Scores the batch; returns it with its detections for the logged samples."""
        if "image" not in batch:
            return None
        detections = self._eval_step(batch, "val", self.val_map)
        return {"samples": (batch["image"], detections, batch["targets"])}

    def on_validation_epoch_end(self) -> None:
        self._compute_map("val", self.val_map)

    def _compute_map(self, stage: str, metric: MapMetric) -> tuple[dict[str, torch.Tensor], dict]:
        """Logs ``<stage>/map`` and the other numbers of ``metric``, which it resets; (logged, computed values)."""
        # compute() already gathers over ranks and counts each image once: every rank calls it
        values = metric.compute()
        metric.reset()
        logged = {f"{stage}/{k}": values[k].float() for k in MAP_KEYS if k in values}
        self.log(f"{stage}/map", logged[f"{stage}/map"], prog_bar=True)
        self.log_dict({k: v for k, v in logged.items() if k != f"{stage}/map"})
        return logged, values

    def test_step(self, batch: dict, batch_idx: int) -> dict | None:
        """Scores the batch; returns its detections for ``detections.json`` and its worst-image candidates
        (F1 at IoU 0.5 of the detections scoring at least ``display_score_threshold``)."""
        if "image" not in batch:
            return None
        images, targets = batch["image"], batch["targets"]
        detections = [{k: v.cpu() for k, v in det.items()} for det in self._eval_step(batch, "test", self.test_map)]
        worst = []
        for k, (det, target) in enumerate(zip(self.confident(detections), targets)):
            gt_boxes, gt_labels = target["gt_boxes"].cpu(), target["gt_labels"].cpu()
            score = image_f1(det["boxes"], det["labels"], gt_boxes, gt_labels, target["gt_iscrowd"].cpu())
            worst.append((score, target["image_id"], lambda k=k, det=det, target=target, gt=(gt_boxes, gt_labels): (
                target["path"], displayable(images[k]), det, *gt, target["orig_size"])))
        return {"detections": [(t["image_id"], det) for t, det in zip(targets, detections)], "worst": worst}

    def on_test_epoch_end(self) -> None:
        metrics, values = self._compute_map("test", self.test_map)
        self.test_per_class = self.test_map.per_class(values, self.num_classes)
        self.test_metrics = {**metrics, **self.eval_loss_value("test")}  # every rank: computing the loss syncs

    # -- predict ----------------------------------------------------------------------------------
    def predict_step(self, batch: dict, batch_idx: int) -> list[tuple]:
        """Per image ``(path, (height, width), detections in its pixels scoring at least display_score_threshold)``."""
        if "image" not in batch:
            return []
        sizes = batch["orig_size"].tolist()
        detections = self.confident(self.detect(batch["image"], sizes))
        return [(path, tuple(size), {k: v.cpu() for k, v in det.items()})
                for path, size, det in zip(batch["path"], sizes, detections)]

    def predict_inputs(self, inputs: list, score_threshold: float | None = None) -> list[list[dict]]:
        """``model.predict(images, score_threshold=None)`` (:mod:`tasks.engine.predictor`): per image ``[{"box": [x1, y1, x2,
        y2] in original pixels, "score", "category_id", "category_name"}, ...]``, best first, scoring at least
        ``score_threshold`` (default ``display_score_threshold``, as `predict` writes)."""
        images, read = self.prepared_images(inputs)
        sizes = [tuple(pixels.shape[-2:]) for pixels, _ in read]
        detections = self.confident(self.detect(torch.stack(images).to(self.device), sizes), score_threshold)
        return [[{"box": box, "score": score, "category_id": self.category_ids[label],
                  "category_name": self.category_names[label]}
                 for box, score, label in zip(det["boxes"].float().cpu().tolist(), det["scores"].float().cpu().tolist(),
                                              det["labels"].cpu().tolist())]
                for det in detections]


def main(args=None):
    """``python -m tasks.detect fit|validate|test|predict|export``; returns what the command built."""
    from tasks.cli.suite import main as run_command

    return run_command("detect", args)


if __name__ == "__main__":
    main()
