"""Object detection: ``python -m tasks.detect {fit,validate,test,predict}``.

SSDLite on any backbone, scored with the benchmark's metric: COCO mAP for COCO-layout data
(:class:`tasks.metrics.coco_map.CocoMeanAveragePrecision`: pycocotools' COCOeval numbers, computed by
faster_coco_eval), VOC mAP@0.5 for Pascal VOC (``--data datamodules.voc_detection.VocDetectionDataModule``,
:class:`tasks.metrics.voc_map.VocMeanAveragePrecision`). The datamodule says which (``evaluation_metric``). `test` writes
``predictions/detections.json`` (COCO results format: the annotation file's image and
category ids, ``[x, y, w, h]`` boxes in original-image pixels), ``predictions/metrics.json`` and
``predictions/per_class.csv`` (per category AP, AP50, AP75, AR100 from the same COCOeval run; VOC: AP50)
and ``predictions/worst/``: the images with the lowest F1 at IoU 0.5 (:func:`image_f1`), drawn with
their predicted (red) and true (green) boxes, listed in ``worst.csv`` (drawn last, once the numbers
are written: a picture that cannot be drawn is a warning, not a `test` without metrics);
`predict` writes one JSON per image (and, with ``model.draw_predictions``, the image with its
boxes) under ``predictions/predict/``, named after the image's stem, or after its file name with the
extension when two images share a stem (``photo.jpg.json`` and ``photo.png.json``). Images are read
upright (EXIF orientation applied): boxes, ``width`` and ``height`` are those of the image as viewers
show it.

The head is a component like the backbone: ``model.head`` builds it from
``(backbone.feature_channels, num_classes)`` (YAML ``class_path: heads.ssdlite.SSDLiteHead`` with
its anchor/pyramid arguments as ``init_args``).
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Callable

import torch

from backbones import Backbone
from datamodules.input_spec import detection_spec, input_spec_of
from datamodules.images import output_names, read_rgb
from heads.ssdlite import SSDLiteHead
from tasks.engine.analysis import displayable, draw_after_metrics, drawable_boxes, write_worst_csv
from tasks.export import detection as onnx_detection
from tasks.engine.predictor import Predictor
from tasks.engine.base import TaskModule
from tasks.metrics.coco_map import MAP_KEYS, CocoMeanAveragePrecision, coco_per_class

#: builds a head from ``(backbone.feature_channels, num_classes)``; YAML: ``class_path: heads.ssdlite.SSDLiteHead``
DetectionHeadFactory = Callable[[dict[int, int], int], SSDLiteHead]


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
    """Backbone + detection head (SSDLite), trained with the multibox loss, scored with COCO mAP.

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
        num_sample_images: validation images logged to wandb with predicted and true boxes.
        display_score_threshold: lowest score drawn on logged images and kept by `predict`.
        draw_predictions: `predict` also writes each image with its boxes drawn.
        Remaining arguments: see :class:`tasks.engine.base.TaskModule`.
    """

    DATA_LINKS = {"num_classes": "num_classes", "category_ids": "category_ids", "category_names": "category_names"}
    #: the input specification of a detection datamodule's arguments (see :class:`tasks.engine.predictor.Predictor`)
    input_spec_rule = staticmethod(detection_spec)
    #: the module that writes this task's ONNX graph and checks it (``python -m tasks.detect export``)
    onnx_export = onnx_detection

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
        self.val_map = CocoMeanAveragePrecision()
        # extended_summary: COCOeval's precision / recall arrays, sliced per category for per_class.csv
        self.test_map = CocoMeanAveragePrecision(extended_summary=True)
        self._test_results: list[tuple[int, list[dict]]] = []
        self._predictions: list[dict] = []

    def example_input(self, datamodule) -> torch.Tensor | None:
        spec = input_spec_of(datamodule, self.input_spec_rule)
        return torch.zeros(1, 3, spec.image_size, spec.image_size) if spec is not None else None

    def setup(self, stage: str) -> None:
        super().setup(stage)
        # the benchmark's own metric: COCO mAP for COCO-layout data, VOC mAP@0.5 for Pascal VOC
        kind = getattr(getattr(self.trainer, "datamodule", None), "evaluation_metric", "coco")
        if kind == "voc":
            from tasks.metrics.voc_map import VocMeanAveragePrecision

            self.val_map = VocMeanAveragePrecision(num_classes=self.num_classes)
            self.test_map = VocMeanAveragePrecision(num_classes=self.num_classes)
        elif kind != "coco":
            raise ValueError(f"the datamodule asks for evaluation_metric={kind!r}; detection scores 'coco' or 'voc'")

    # -- network ----------------------------------------------------------------------------------
    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, 3, S, S) -> ``(cls_logits (B, A, C + 1), box_regression (B, A, 4), anchors (A, 4))``."""
        return self.head(self.backbone(self.to_memory_format(images)))

    def detect(self, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Per image ``{"boxes" (D, 4) xyxy in input pixels, "scores", "labels"}``."""
        return self.head.postprocess(*self(images), image_size=tuple(images.shape[-2:]))

    def _losses(self, outputs, images: torch.Tensor, targets: list[dict]) -> dict[str, torch.Tensor]:
        cls_logits, box_regression, anchors = outputs
        labels, codes = self.head.assign_targets(targets, anchors, tuple(images.shape[-2:]))
        return self.head.loss(cls_logits, box_regression, labels, codes)

    # -- training ---------------------------------------------------------------------------------
    def training_loss(self, batch: dict, batch_idx: int) -> torch.Tensor:
        images, targets = batch["image"], batch["targets"]
        losses = self._losses(self(images), images, targets)
        self.log("train/loss", losses["loss"], prog_bar=True, batch_size=len(images))
        self.log_dict({"train/loss_cls": losses["loss_cls"], "train/loss_box": losses["loss_box"]},
                      batch_size=len(images))
        return losses["loss"]

    # -- evaluation -------------------------------------------------------------------------------
    @staticmethod
    def to_original_pixels(detections: list[dict], targets: list[dict], input_size: tuple[int, int]) -> list[dict]:
        """Scale boxes from the (square) network input back to each image's original size."""
        height, width = input_size
        out = []
        for det, target in zip(detections, targets):
            orig_h, orig_w = target["orig_size"]
            scale = det["boxes"].new_tensor([orig_w / width, orig_h / height, orig_w / width, orig_h / height])
            out.append({**det, "boxes": det["boxes"] * scale})
        return out

    def _eval_step(self, batch: dict, stage: str, metric: CocoMeanAveragePrecision):
        images, targets = batch["image"], batch["targets"]
        outputs = self(images)
        losses = self._losses(outputs, images, targets)
        # the loss is a sum over the batch divided by its positive anchors: weighing each batch by that
        # count makes the split's mean the same ratio whatever the batching and the number of ranks
        self.log_eval_loss(stage, losses["loss"], weight=losses["num_positive"])
        detections = self.head.postprocess(*outputs, image_size=tuple(images.shape[-2:]))
        detections_orig = self.to_original_pixels(detections, targets, tuple(images.shape[-2:]))
        ground_truth = [{"boxes": t["gt_boxes"], "labels": t["gt_labels"], "iscrowd": t["gt_iscrowd"],
                         "area": t["gt_area"], **({"difficult": t["gt_difficult"]} if "gt_difficult" in t else {})}
                        for t in targets]
        metric.update(detections_orig, ground_truth, [t["image_id"] for t in targets])
        return detections, detections_orig

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        if "image" not in batch:
            return
        detections, _ = self._eval_step(batch, "val", self.val_map)
        if batch_idx == 0:
            self._log_samples(batch["image"], detections, batch["targets"])

    def on_validation_epoch_end(self) -> None:
        self._log_map("val", self.val_map)

    def _log_map(self, stage: str, metric) -> dict[str, torch.Tensor]:
        return self._log_map_values(stage, metric)[0]

    def _log_map_values(self, stage: str, metric) -> tuple[dict[str, torch.Tensor], dict]:
        # compute() already gathers over ranks and counts each image once: every rank calls it
        values = metric.compute()
        metric.reset()
        logged = {f"{stage}/{k}": values[k].float() for k in MAP_KEYS if k in values}
        self.log(f"{stage}/map", logged[f"{stage}/map"], prog_bar=True)
        self.log_dict({k: v for k, v in logged.items() if k != f"{stage}/map"})
        return logged, values

    def test_step(self, batch: dict, batch_idx: int) -> None:
        if "image" not in batch:
            return
        detections_input, detections = self._eval_step(batch, "test", self.test_map)
        self._test_results += [(t["image_id"], self.records(d, image_id=t["image_id"]))
                               for d, t in zip(detections, batch["targets"])]
        for k, (det, target) in enumerate(zip(detections, batch["targets"])):
            keep = det["scores"] >= self.display_score_threshold
            score = image_f1(det["boxes"][keep].cpu(), det["labels"][keep].cpu(), target["gt_boxes"].cpu(),
                             target["gt_labels"].cpu(), target["gt_iscrowd"].cpu())
            self.worst_examples.offer(score, target["image_id"], lambda k=k, keep=keep, target=target: (
                target["path"], displayable(batch["image"][k]),
                {key: v[keep].cpu() for key, v in detections_input[k].items()},
                self._gt_in_input_pixels(target, tuple(batch["image"].shape[-2:])), target["gt_labels"].cpu()))

    @staticmethod
    def _gt_in_input_pixels(target: dict, input_size: tuple[int, int]) -> torch.Tensor:
        orig_h, orig_w = target["orig_size"]
        height, width = input_size
        scale = torch.tensor([width / orig_w, height / orig_h, width / orig_w, height / orig_h])
        return target["gt_boxes"].float().cpu() * scale

    def write_worst(self, worst: list) -> None:
        """``predictions/worst/NN_<image stem>.jpg``: the test images with the lowest F1 at IoU 0.5
        (detections scoring at least ``display_score_threshold``), as the network saw them, with
        predicted boxes in red (name and score) and true boxes in green; ``worst.csv`` lists them
        (rank, image, f1, detections drawn, objects, file)."""
        from torchvision.io import write_jpeg
        from torchvision.utils import draw_bounding_boxes

        rows = []
        self.worst_dir.mkdir(parents=True, exist_ok=True)
        for rank, (f1, _, (path, image, det, gt_boxes, gt_labels)) in enumerate(worst, start=1):
            name = f"{rank:02d}_{Path(str(path)).stem}.jpg"
            if len(gt_boxes):
                image = draw_bounding_boxes(image, drawable_boxes(gt_boxes),
                                            [self.category_names[i] for i in gt_labels.tolist()], colors="lime", width=1)
            if len(det["boxes"]):
                labels = [f"{self.category_names[c]} {s:.2f}" for c, s in zip(det["labels"].tolist(),
                                                                             det["scores"].tolist())]
                image = draw_bounding_boxes(image, det["boxes"].float(), labels, colors="red", width=1)
            write_jpeg(image, str(self.worst_dir / name), quality=90)
            rows.append([rank, path, repr(f1), len(det["boxes"]), len(gt_boxes), name])
        if rows:
            write_worst_csv(self.worst_dir / "worst.csv", ["rank", "image", "f1", "detections", "objects", "file"], rows)

    def records(self, det: dict[str, torch.Tensor], **extra) -> list[dict]:
        """One image's detections as COCO result records: ``bbox`` ``[x, y, w, h]``, ``score``, the
        annotation file's ``category_id`` (and any ``extra`` keys, e.g. ``image_id``)."""
        boxes = det["boxes"].float().cpu()
        xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], dim=1).tolist()
        return [{**extra, "category_id": self.category_ids[label], "bbox": box, "score": score}
                for box, score, label in zip(xywh, det["scores"].float().cpu().tolist(), det["labels"].cpu().tolist())]

    def on_test_epoch_start(self) -> None:
        super().on_test_epoch_start()
        self._test_results = []

    def on_test_epoch_end(self) -> None:
        metrics, values = self._log_map_values("test", self.test_map)
        results = self.all_gather_objects(self._test_results)
        loss = self.eval_loss_value("test")  # on every rank: computing it syncs
        worst = self.gather_worst()
        if self.global_rank != 0:
            return
        # a padding sampler may score an image twice: keep it once, as the metric does
        per_image = dict(reversed(results))
        detections = [d for image_id in sorted(per_image) for d in per_image[image_id]]
        self.predictions_dir.mkdir(parents=True, exist_ok=True)
        (self.predictions_dir / "detections.json").write_text(json.dumps(detections))
        self.write_metrics_json({**metrics, **loss})
        self.write_per_class(values)
        draw_after_metrics(lambda: self.write_worst(worst), "predictions/worst/")

    def write_per_class(self, values: dict) -> None:
        """``predictions/per_class.csv``, one row per category, from the evaluation that gave mAP.

        COCO: ``category_id, name, ap, ap50, ap75, ar100``, sliced from COCOeval's accumulated
        ``precision`` (T, R, K, A, M) and ``recall`` (T, K, A, M) arrays as its ``summarize`` does
        (area "all", 100 detections per image; the mean over entries > -1), -1 for a category
        without ground truth in the evaluated images (COCOeval's "no value"). VOC:
        ``category_id, name, ap50`` from the metric's ``ap_per_class`` (``nan`` without ground truth)."""
        self.predictions_dir.mkdir(parents=True, exist_ok=True)
        with open(self.predictions_dir / "per_class.csv", "w", newline="") as f:
            writer = csv.writer(f)
            if "ap_per_class" in values:  # VOC
                ap = values["ap_per_class"].reshape(-1).tolist()
                writer.writerow(["category_id", "name", "ap50"])
                for category_id, name, value in zip(self.category_ids, self.category_names, ap):
                    writer.writerow([category_id, name, repr(float(value))])
                return
            writer.writerow(["category_id", "name", "ap", "ap50", "ap75", "ar100"])
            per_class = coco_per_class(values, self.test_map)
            for label, (category_id, name) in enumerate(zip(self.category_ids, self.category_names)):
                row = per_class.get(label, {})
                writer.writerow([category_id, name,
                                 *(repr(float(row.get(k, -1.0))) for k in ("ap", "ap50", "ap75", "ar100"))])

    # -- predict ----------------------------------------------------------------------------------
    def on_predict_epoch_start(self) -> None:
        self._predictions = []

    def detections_in_original_pixels(self, images: torch.Tensor, orig_sizes: list[tuple[int, int]],
                                      score_threshold: float | None = None) -> list[dict[str, torch.Tensor]]:
        """(B, 3, S, S) network inputs of images of ``orig_sizes`` (height, width) -> per image ``{"boxes" (D, 4)
        xyxy in original pixels, "scores", "labels"}``, the detections scoring at least ``score_threshold``
        (default ``display_score_threshold``)."""
        threshold = self.display_score_threshold if score_threshold is None else score_threshold
        infos = [{"orig_size": tuple(int(v) for v in size)} for size in orig_sizes]
        detections = self.to_original_pixels(self.detect(images), infos, tuple(images.shape[-2:]))
        return [{k: v[det["scores"] >= threshold] for k, v in det.items()} for det in detections]

    def predict_step(self, batch: dict, batch_idx: int) -> list[dict]:
        if "image" not in batch:
            return []
        sizes = batch["orig_size"].tolist()
        rows = []
        for det, path, (height, width) in zip(self.detections_in_original_pixels(batch["image"], sizes),
                                              batch["path"], sizes):
            records = self.records(det)
            for r, label in zip(records, det["labels"].tolist()):
                r["category_name"] = self.category_names[label]
            rows.append({"image": path, "height": height, "width": width, "detections": records})
        self._predictions += rows
        return rows

    def predict_inputs(self, inputs: list, score_threshold: float | None = None) -> list[list[dict]]:
        """``model.predict(images, score_threshold=None)`` (:mod:`tasks.engine.predictor`): per image ``[{"box": [x1, y1, x2,
        y2] in original pixels, "score", "category_id", "category_name"}, ...]``, best first, scoring at least
        ``score_threshold`` (default ``display_score_threshold``, as `predict` writes)."""
        images, read = self.prepared_images(inputs)
        sizes = [tuple(pixels.shape[-2:]) for pixels, _ in read]
        detections = self.detections_in_original_pixels(torch.stack(images).to(self.device), sizes, score_threshold)
        return [[{"box": box, "score": score, "category_id": self.category_ids[label],
                  "category_name": self.category_names[label]}
                 for box, score, label in zip(det["boxes"].float().cpu().tolist(), det["scores"].float().cpu().tolist(),
                                              det["labels"].cpu().tolist())]
                for det in detections]

    def on_predict_epoch_end(self) -> None:
        rows = self.all_gather_objects(self._predictions)
        if self.global_rank != 0:
            return
        out = self.predict_dir
        out.mkdir(parents=True, exist_ok=True)
        # all ranks' images are known here: two that share a stem keep their extensions
        names = output_names(row["image"] for row in rows)
        for row in rows:
            name = names[str(row["image"])]
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / f"{name}.json").write_text(json.dumps(row, indent=1))
        if self.draw_predictions:  # every JSON is written whatever happens to the pictures
            draw_after_metrics(lambda: [self._draw(row, out / f"{names[str(row['image'])]}.jpg") for row in rows],
                               "the predicted boxes (model.draw_predictions)")

    def _draw(self, row: dict, path: Path) -> None:
        from torchvision.io import write_jpeg
        from torchvision.utils import draw_bounding_boxes

        image = read_rgb(row["image"])  # upright, the frame the boxes are in
        if row["detections"]:
            boxes = torch.tensor([d["bbox"] for d in row["detections"]])
            boxes[:, 2:] += boxes[:, :2]
            labels = [f"{d['category_name']} {d['score']:.2f}" for d in row["detections"]]
            image = draw_bounding_boxes(image, boxes, labels, colors="red", width=2)
        write_jpeg(image, str(path))

    # -- logging ----------------------------------------------------------------------------------
    def _log_samples(self, images: torch.Tensor, detections: list[dict], targets: list[dict]) -> None:
        logger = self.wandb_logger
        if logger is None or self.num_sample_images <= 0 or self.trainer.sanity_checking:
            return
        n = min(self.num_sample_images, len(images))
        shown = images[:n].float()
        lo, hi = shown.amin(dim=(1, 2, 3), keepdim=True), shown.amax(dim=(1, 2, 3), keepdim=True)
        shown = ((shown - lo) / (hi - lo).clamp_min(1e-6) * 255).byte().permute(0, 2, 3, 1).cpu().numpy()
        class_labels = dict(enumerate(self.category_names))

        def box_data(boxes, labels, scores=None):
            rows = []
            for i, (box, label) in enumerate(zip(boxes.tolist(), labels.tolist())):
                row = {"position": {"minX": box[0], "minY": box[1], "maxX": box[2], "maxY": box[3]},
                       "domain": "pixel", "class_id": int(label), "box_caption": class_labels[int(label)]}
                if scores is not None:
                    row["scores"] = {"score": float(scores[i])}
                    row["box_caption"] += f" {float(scores[i]):.2f}"
                rows.append(row)
            return {"box_data": rows, "class_labels": class_labels}

        boxes = []
        for det, target in zip(detections[:n], targets[:n]):
            keep = det["scores"] >= self.display_score_threshold
            boxes.append({"predictions": box_data(det["boxes"][keep].cpu(), det["labels"][keep].cpu(),
                                                  det["scores"][keep].cpu()),
                          "ground_truth": box_data(target["boxes"].cpu(), target["labels"].cpu())})
        logger.log_image("val/samples", list(shown), boxes=boxes)


def main(args=None) -> None:
    from datamodules.coco import CocoDataModule
    from tasks.engine.cli import SuiteCLI

    SuiteCLI(DetectionTask, CocoDataModule, task="detect", default_config="demo_ssdlite_mobilevitv2.yaml",
             monitor="val/map", args=args)


if __name__ == "__main__":
    main()
