"""Semantic segmentation: ``python -m tasks.segment {fit,validate,test,predict}``.

A backbone's feature pyramid feeds a DeepLabv3 or PSPNet head; cross-entropy with
the ignore label (plus, in training only, the auxiliary head's loss, weight ``aux_weight``
0.4, when the head has one: CVNets reads it from stage 4, ``head.aux_stage: 4``).

Scores: mIoU and pixel accuracy of one dataset-wide confusion matrix over every evaluated pixel at
the original resolution (:mod:`tasks.metrics.miou`). Evaluation feeds one image per step (resized by
the datamodule), upsamples its logits to the original size and counts every image once under DDP (the
datamodule's unrepeated sampler), so 1-process and N-process numbers are the same. What `test` and
`predict` write (masks, the per-class table, the worst images, overlays) is
:mod:`tasks.outputs.segmentation`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from backbones import Backbone
from datamodules.input_spec import input_spec_of, segmentation_spec
from datamodules.segmentation_transforms import IGNORE_INDEX
from heads.deeplabv3 import DeepLabV3
from heads.seg_common import SegmentationHead
from tasks.outputs.common import displayable
from tasks.engine.base import TaskModule
from tasks.engine.distillation import Distillation, LearnsFromTeacher, distillation_loss, mixed_loss
from tasks.engine.predictor import Predictor
from tasks.metrics.miou import MeanIoU, image_miou
from tasks.outputs import segmentation as outputs

#: builds a head from ``(backbone.feature_channels, num_classes, stage_channels=backbone.stage_channels)``;
#: YAML: ``class_path: heads.pspnet.PSPNet``. ``stage_channels`` (stage index -> channels, empty for
#: single-scale backbones) is what an auxiliary head read by stage needs; the task always passes it.
HeadFactory = Callable[[dict[int, int], int], SegmentationHead]


def label_maps(logits: torch.Tensor, orig_sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """(B, K, h, w) logits of images of ``orig_sizes`` (height, width) -> per image its (H, W) labels: the
    logits upsampled bilinearly to the original size, then the best class of each pixel (`predict` and
    ``model.predict``)."""
    return [F.interpolate(logits[k:k + 1], size=(int(height), int(width)), mode="bilinear",
                          align_corners=False).argmax(1)[0] for k, (height, width) in enumerate(orig_sizes)]


class SegmentationTask(LearnsFromTeacher, Predictor, TaskModule):
    """Backbone + segmentation head, trained with pixel-wise cross-entropy, optionally distilled pixel by
    pixel from a teacher's logits (:mod:`tasks.engine.distillation`; the teacher is a checkpoint of this task
    on the same classes).

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
        num_sample_images: validation images logged with prediction / truth masks each epoch (media loggers).
        distillation: the teacher (a segmentation checkpoint) and the loss, applied to the main head's logits at
            every labelled pixel: ``(1 - alpha) * (seg_loss + aux_weight * aux_loss) + alpha * distill``;
            ``None``: none.
        Remaining arguments: see :class:`tasks.engine.base.TaskModule`.
    """

    DATA_LINKS = {"class_names": "class_names"}
    teacher_is_image_classifier = False  # a teacher is a checkpoint of this task
    #: the input specification of a segmentation datamodule's arguments (see :class:`tasks.engine.predictor.Predictor`)
    input_spec_rule = staticmethod(segmentation_spec)

    def __init__(self, backbone: Backbone, class_names: list[str], head: HeadFactory | None = None,
                 ignore_index: int = IGNORE_INDEX, aux_weight: float = 0.4, class_weights: list[float] | None = None,
                 num_sample_images: int = 4, distillation: Distillation | None = None, **kwargs):
        super().__init__(**kwargs)
        self.init_distillation(distillation)
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
        self.val_miou = MeanIoU(num_classes, ignore_index)
        self.test_miou = MeanIoU(num_classes, ignore_index)
        #: per-class IoU of the last validation, for its logged table
        self.val_class_iou: torch.Tensor | None = None
        #: the test split's (K, K) confusion matrix summed over ranks (rows: truth), for ``per_class.csv``
        self.test_confusion: torch.Tensor | None = None

    def output_callbacks(self) -> list:
        return [outputs.TestMasks(), outputs.PerClassIoUCsv(), outputs.PredictMasks(),
                outputs.PerClassIoUTable(), outputs.ValidationOverlays(self.num_sample_images),
                outputs.WorstSegmentations(self.num_worst_examples)]

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
        images, mask = batch["image"], batch["mask"]
        logits = self(images)
        losses = self.losses(logits, mask)
        if self.distillation is not None:
            distill = distillation_loss(self.distillation, logits["out"], self.teacher_output(images)["out"],
                                        valid=mask != self.ignore_index)
            self.log("train/task_loss", losses["loss"], batch_size=len(images))
            self.log("train/distill_loss", distill, batch_size=len(images))
            losses["loss"] = mixed_loss(self.distillation, losses["loss"], distill)
        # not prog_bar: Lightning turns progress-bar values into floats every batch (a host sync); the bars
        # read the loss from callback_metrics at their own interval (tasks.cli.progress.training_loss)
        self.log("train/loss", losses["loss"], prog_bar=False, batch_size=len(images))
        if "aux_loss" in losses:
            self.log("train/aux_loss", losses["aux_loss"], batch_size=len(images))
        return losses["loss"]

    # -- evaluation (one image per step, scored at its original size) -------------------------------------------
    def _evaluate(self, batch: dict, stage: str, metric: MeanIoU) -> torch.Tensor:
        """Scores the batch at the original size; returns its (B, H, W) predicted labels."""
        target = batch["mask"]
        logits = self(batch["image"], size=target.shape[-2:])["out"]
        preds = logits.argmax(1)
        metric.update(preds, target)
        if (target != self.ignore_index).any():  # an all-ignore image has no loss to average
            self.log_eval_loss(stage, self.pixel_loss(logits, target), weight=len(target))
        return preds

    def _log_scores(self, stage: str, metric: MeanIoU) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Logs the split's ``<stage>/miou``, ``<stage>/pixel_acc`` and ``<stage>/macc``; returns them and the
        metric's results."""
        scores = metric.compute()  # sums the matrix over ranks: every rank calls it
        metric.reset()
        logged = {f"{stage}/{name}": scores[name].float() for name in ("miou", "pixel_acc", "macc")}
        self.log_dict(logged)
        return logged, scores

    def validation_step(self, batch: dict, batch_idx: int) -> dict | None:
        if "image" not in batch:
            return None
        preds = self._evaluate(batch, "val", self.val_miou)
        return {"sample": (batch["image"][0], preds[0], batch["mask"][0])}

    def on_validation_epoch_end(self) -> None:
        self.val_class_iou = self._log_scores("val", self.val_miou)[1]["iou"]

    def test_step(self, batch: dict, batch_idx: int) -> dict | None:
        """Scores the image; returns its labels for the masks and its worst-sample candidate (its mIoU)."""
        if "image" not in batch:
            return None
        preds = self._evaluate(batch, "test", self.test_miou)
        score = image_miou(preds[0], batch["mask"][0], len(self.class_names), self.ignore_index)
        worst = (score, int(batch["index"][0]), lambda: (
            batch["path"][0], displayable(batch["image"][0]), preds[0].cpu(), batch["mask"][0].cpu()))
        return {"preds": preds, "worst": [worst]}

    def on_test_epoch_end(self) -> None:
        logged, scores = self._log_scores("test", self.test_miou)
        self.test_confusion = scores["confmat"].cpu()
        self.test_metrics = {**logged, **self.eval_loss_value("test")}  # every rank: computing the loss syncs

    # -- predict ----------------------------------------------------------------------------------------------
    @property
    def label_dtype(self) -> torch.dtype:
        """The smallest integer type that holds every label: uint8 up to 256 classes, else int64."""
        return torch.uint8 if len(self.class_names) <= 256 else torch.int64

    def predict_step(self, batch: dict, batch_idx: int) -> list[torch.Tensor]:
        """Per image its (H, W) labels (:attr:`label_dtype`) at the upright image's size."""
        if "image" not in batch:
            return []
        return [labels.to(self.label_dtype) for labels in label_maps(self(batch["image"])["out"],
                                                                     batch["orig_size"].tolist())]

    def predict_inputs(self, inputs: list) -> list[np.ndarray]:
        """``model.predict(images)`` (:mod:`tasks.engine.predictor`): per image its (H, W) labels at the original size
        (uint8 up to 256 classes, else int64); label i is ``class_names[i]``. One image per forward, as
        evaluation and `predict` run."""
        images, read = self.prepared_images(inputs)
        return [label_maps(self(image[None].to(self.device))["out"], [tuple(pixels.shape[-2:])])[0]
                .to(self.label_dtype).cpu().numpy() for image, (pixels, _) in zip(images, read)]


def main(args=None):
    """``python -m tasks.segment fit|validate|test|predict|export``; returns what the command built."""
    from tasks.cli.suite import main as run_command

    return run_command("segment", args)


if __name__ == "__main__":
    main()
