"""Image classification: ``python -m tasks.classify {fit,validate,test,predict}``.

Top-1/top-5 accuracy with torchmetrics and one confusion matrix over the test split. What `test` and
`predict` write (predictions, per-class table, confusion matrix, worst images, the predict CSV) is
:mod:`tasks.outputs.classification`; `predict` reads any image or folder of images
(``--data.predict_path``), labelled or not.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from backbones import Backbone
from backbones.weights import classifier_state, load_pretrained
from datamodules.input_spec import classification_spec, input_spec_of
from heads.classifier import ClassifierHead
from tasks.outputs.common import displayable
from tasks.engine.base import TaskModule
from tasks.engine.distillation import Distillation, LearnsFromTeacher, distillation_loss, mixed_loss
from tasks.engine.predictor import Predictor
from tasks.metrics.miou import ConfusionMatrix
from tasks.outputs import classification as outputs


class ClassificationTask(LearnsFromTeacher, Predictor, TaskModule):
    """Backbone + :class:`ClassifierHead` trained with (label-smoothed, possibly soft-target) cross-entropy,
    optionally distilled from a teacher (:mod:`tasks.engine.distillation`).

    A backbone with DeiT's distillation token (``ViT(distillation_token=True)``) gets a second classifier,
    ``head_dist``, on that token. With distillation it learns from the teacher and ``head`` from the label;
    the model's output (validation, test, predict, export, and training without a teacher) is the mean
    of the two heads' logits, as timm's ``VisionTransformerDistilled`` and DeiT's code average them (the
    DeiT paper, Sec. 4 "joint classifiers", describes adding the two softmax outputs instead).

    Args:
        backbone: any image backbone (YAML ``class_path: backbones.MobileViTv2``).
        class_names: class folder names, linked from the datamodule (label i = ``class_names[i]``).
        head_dropout: dropout before the classifier.
        label_smoothing: cross-entropy label smoothing.
        weights: a whole-classifier checkpoint to start from (ours, timm or CVNets; see
            ``backbones.weights``): the backbone must fit it exactly; its classifier is kept
            when the class count matches and dropped with a warning otherwise. For a
            backbone-only start use the backbone's own ``pretrained`` argument.
        num_sample_images: images logged with their predictions each validation epoch (to every logger that shows media),
            drawn from batches spread over the split.
        distillation: the teacher and the loss (``--model.distillation.teacher X --model.distillation.kind
            soft|hard --model.distillation.alpha A --model.distillation.temperature T``; see
            :class:`tasks.engine.distillation.Distillation`); ``None``: none.
        Remaining arguments: see :class:`tasks.engine.base.TaskModule`.
    """

    DATA_LINKS = {"classes": "class_names"}
    #: the input specification of an image-folder datamodule's arguments (see :class:`tasks.engine.predictor.Predictor`)
    input_spec_rule = staticmethod(classification_spec)

    def __init__(self, backbone: Backbone, class_names: list[str], head_dropout: float = 0.0,
                 label_smoothing: float = 0.0, weights: str | None = None, num_sample_images: int = 16,
                 distillation: Distillation | None = None, **kwargs):
        super().__init__(**kwargs)
        self.init_distillation(distillation)
        self.backbone = backbone
        self.class_names = list(class_names)
        num_classes = len(self.class_names)
        self.head = ClassifierHead(backbone.num_features, num_classes, head_dropout)
        # DeiT's distillation head, on the distillation token of a backbone that has one
        self.head_dist = (ClassifierHead(backbone.num_features, num_classes, head_dropout)
                          if getattr(backbone, "dist_token", None) is not None else None)
        if weights:
            head_state = load_pretrained(self.backbone, weights)
            self.head.fc.load_state_dict(classifier_state(head_state, num_classes) or self.head.fc.state_dict())
        self.label_smoothing = label_smoothing
        self.num_sample_images = num_sample_images
        top5 = min(5, num_classes)
        self.val_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top5 = MulticlassAccuracy(num_classes, top_k=top5, average="micro")
        self.test_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.test_top5 = MulticlassAccuracy(num_classes, top_k=top5, average="micro")
        # rows: true class, columns: predicted class; summed over ranks like the accuracies
        self.test_confusion = ConfusionMatrix(num_classes)
        #: the test split's confusion matrix as lists (rows: true class), for the output callbacks
        self.test_confusion_counts: list[list[int]] | None = None

    def output_callbacks(self) -> list:
        return [outputs.PredictionsCsv(), outputs.PerClassCsv(), outputs.ConfusedPairsCsv(), outputs.ClassPredictions(),
                outputs.ValidationImages(self.num_sample_images),
                outputs.ConfusionMatrixPng(), outputs.WorstClassifications(self.num_worst_examples)]

    def example_input(self, datamodule) -> torch.Tensor | None:
        spec = input_spec_of(datamodule, self.input_spec_rule)
        return torch.zeros(1, 3, spec.image_size, spec.image_size) if spec is not None else None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> logits (B, num_classes) (with a distillation head, the mean of the two heads')."""
        if self.head_dist is not None:
            logits, dist_logits = self.forward_heads(images)
            return (logits + dist_logits) / 2
        return self.head(self.backbone.forward_pooled(self.to_memory_format(images)))

    def forward_heads(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 3, H, W) -> the class head's and the distillation head's logits, (B, num_classes) each
        (a backbone with a distillation token only)."""
        tokens = self.backbone.forward_prefix(self.to_memory_format(images))
        return self.head(tokens[:, 0]), self.head_dist(tokens[:, 1])

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # soft targets (MixUp/CutMix) are (B, C) probabilities; cross_entropy takes both forms
        return F.cross_entropy(logits.float(), target, label_smoothing=self.label_smoothing)

    def training_loss(self, batch: dict, batch_idx: int) -> torch.Tensor:
        images, batch_size = batch["image"], len(batch["image"])
        if self.distillation is None:
            loss = self._loss(self(images), batch["target"])
        else:
            logits, dist_logits = self.forward_heads(images) if self.head_dist is not None else (self(images),) * 2
            task_loss = self._loss(logits, batch["target"])
            distill = distillation_loss(self.distillation, dist_logits, self.teacher_output(images))
            loss = mixed_loss(self.distillation, task_loss, distill)
            self.log("train/task_loss", task_loss, batch_size=batch_size)
            self.log("train/distill_loss", distill, batch_size=batch_size)
        # not prog_bar: Lightning turns progress-bar values into floats every batch (a host sync); the bars
        # read the loss from callback_metrics at their own interval (tasks.cli.progress.training_loss)
        self.log("train/loss", loss, prog_bar=False, batch_size=batch_size)
        return loss

    def _eval_step(self, batch: dict, stage: str, top1, top5) -> torch.Tensor:
        logits = self(batch["image"])
        target = batch["target"]
        self.log_eval_loss(stage, self._loss(logits, target), weight=len(target))
        top1.update(logits, target)
        top5.update(logits, target)
        return logits

    def validation_step(self, batch: dict, batch_idx: int) -> dict | None:
        if "image" not in batch:
            return None
        logits = self._eval_step(batch, "val", self.val_top1, self.val_top5)
        self.log("val/top1", self.val_top1, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/top5", self.val_top5, on_step=False, on_epoch=True)
        return {"sample": (batch["image"][0], logits[0].argmax(), batch["target"][0])}

    def test_step(self, batch: dict, batch_idx: int) -> dict | None:
        """Scores the batch; returns its rows for ``predictions.csv`` and its worst-sample candidates."""
        if "image" not in batch:
            return None
        logits = self._eval_step(batch, "test", self.test_top1, self.test_top5)
        probs = logits.float().softmax(-1)
        scores, preds = probs.max(-1)
        self.test_confusion.update(preds, batch["target"])
        rows = list(zip(batch["index"].tolist(), batch["path"], batch["target"].tolist(), preds.tolist(),
                        scores.tolist()))
        true_probs = probs.gather(1, batch["target"][:, None])[:, 0].tolist()
        worst = [(true_probs[k], index, lambda k=k, p=path, t=target, c=pred, s=score: (
                     p, t, c, s, displayable(batch["image"][k])))
                 for k, (index, path, target, pred, score) in enumerate(rows)]
        return {"rows": rows, "worst": worst}

    def on_test_epoch_end(self) -> None:
        metrics = {"test/top1": self.test_top1.compute(), "test/top5": self.test_top5.compute()}
        self.log_dict(metrics)
        self.test_top1.reset()
        self.test_top5.reset()
        self.test_confusion_counts = self.test_confusion.compute().cpu().long().tolist()  # every rank: it syncs
        self.test_confusion.reset()
        self.test_metrics = {**metrics, **self.eval_loss_value("test")}

    # -- predict ------------------------------------------------------------------------------------
    def top_classes(self, images: torch.Tensor, k: int = 5) -> tuple[list[list[float]], list[list[int]]]:
        """(B, 3, S, S) network inputs -> per image the ``k`` highest probabilities and their labels, best first."""
        probs = self(images).float().softmax(-1)
        top = probs.topk(min(k, probs.shape[-1]), dim=-1)
        return top.values.tolist(), top.indices.tolist()

    def predict_step(self, batch: dict, batch_idx: int) -> list[tuple]:
        """Per image ``(index, path, top-5 probabilities, their labels)``."""
        if "image" not in batch:
            return []
        top_scores, top_labels = self.top_classes(batch["image"])
        return list(zip(batch["index"].tolist(), batch["path"], top_scores, top_labels))

    def predict_inputs(self, inputs: list, top_k: int = 5) -> list[list[tuple[str, float]]]:
        """``model.predict(images, top_k=5)`` (:mod:`tasks.engine.predictor`): per image ``[(class name, probability), ...]``,
        the ``top_k`` most probable classes, best first (all of them when ``top_k`` exceeds their number)."""
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"predict: top_k={top_k!r}; give how many of the {len(self.class_names)} classes to "
                             "return, at least 1")
        images, _ = self.prepared_images(inputs)
        top_scores, top_labels = self.top_classes(torch.stack(images).to(self.device), top_k)
        return [[(self.class_names[label], score) for label, score in zip(labels, scores)]
                for scores, labels in zip(top_scores, top_labels)]


def main(args=None):
    """``python -m tasks.classify fit|validate|test|predict|export``; returns what the command built."""
    from tasks.cli.suite import main as run_command

    return run_command("classify", args)


if __name__ == "__main__":
    main()
