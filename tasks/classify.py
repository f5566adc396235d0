"""Image classification: ``python -m tasks.classify {fit,validate,test,predict}``.

Top-1/top-5 accuracy with torchmetrics; `test` writes ``predictions/predictions.csv``
(image, label, prediction, score), ``predictions/metrics.json``, ``predictions/per_class.csv``
(class, precision, recall, f1, support), ``predictions/confusion_matrix.csv`` (rows: true
class, columns: predicted class) and its picture ``confusion_matrix.png``, all from one confusion
matrix over the test split, and ``predictions/worst/``: the images whose true class got the lowest
probability, captioned, with ``worst.csv``; `predict` writes
``predictions/predict/predictions.csv`` (image, prediction, score, top-5 classes) for any
image or folder of images (``--data.predict_path``), labelled or not.
"""
from __future__ import annotations

import csv
from pathlib import Path

import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

from backbones import Backbone
from backbones.weights import classifier_state, load_pretrained
from datamodules.input_spec import classification_spec, input_spec_of
from heads.classifier import ClassifierHead
from tasks.engine.analysis import (displayable, draw_after_metrics, with_caption, write_confusion_matrix_png,
                            write_worst_csv)
from tasks.export import classification as onnx_classification
from tasks.engine.predictor import Predictor
from tasks.engine.base import TaskModule


class ClassificationTask(Predictor, TaskModule):
    """Backbone + :class:`ClassifierHead` trained with (label-smoothed, possibly soft-target) cross-entropy.

    Args:
        backbone: any image backbone (YAML ``class_path: backbones.MobileViTv2``).
        class_names: class folder names, linked from the datamodule (label i = ``class_names[i]``).
        head_dropout: dropout before the classifier.
        label_smoothing: cross-entropy label smoothing.
        weights: a whole-classifier checkpoint to start from (ours, timm or CVNets; see
            ``backbones.weights``): the backbone must fit it exactly; its classifier is kept
            when the class count matches and dropped with a warning otherwise. For a
            backbone-only start use the backbone's own ``pretrained`` argument.
        num_sample_images: images logged to wandb with their predictions each validation epoch,
            drawn from batches spread over the split.
        Remaining arguments: see :class:`tasks.engine.base.TaskModule`.
    """

    DATA_LINKS = {"classes": "class_names"}
    #: the input specification of an image-folder datamodule's arguments (see :class:`tasks.engine.predictor.Predictor`)
    input_spec_rule = staticmethod(classification_spec)
    #: the module that writes this task's ONNX graph and checks it (``python -m tasks.classify export``)
    onnx_export = onnx_classification

    def __init__(self, backbone: Backbone, class_names: list[str], head_dropout: float = 0.0,
                 label_smoothing: float = 0.0, weights: str | None = None, num_sample_images: int = 16,
                 **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone
        self.class_names = list(class_names)
        num_classes = len(self.class_names)
        self.head = ClassifierHead(backbone.num_features, num_classes, head_dropout)
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
        self.test_confusion = MulticlassConfusionMatrix(num_classes)
        self._test_rows: list[tuple] = []
        self._predict_rows: list[tuple] = []
        self._samples: list[tuple] = []

    def example_input(self, datamodule) -> torch.Tensor | None:
        spec = input_spec_of(datamodule, self.input_spec_rule)
        return torch.zeros(1, 3, spec.image_size, spec.image_size) if spec is not None else None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> logits (B, num_classes)."""
        return self.head(self.backbone.forward_pooled(self.to_memory_format(images)))

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # soft targets (MixUp/CutMix) are (B, C) probabilities; cross_entropy takes both forms
        return F.cross_entropy(logits.float(), target, label_smoothing=self.label_smoothing)

    def training_loss(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(self(batch["image"]), batch["target"])
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["image"]))
        return loss

    def _eval_step(self, batch: dict, stage: str, top1, top5) -> torch.Tensor:
        logits = self(batch["image"])
        target = batch["target"]
        self.log_eval_loss(stage, self._loss(logits, target), weight=len(target))
        top1.update(logits, target)
        top5.update(logits, target)
        return logits

    def on_validation_epoch_start(self) -> None:
        self._samples = []
        self._sample_batches = self.sample_batch_indices(self.num_sample_images)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        if "image" not in batch:
            return
        logits = self._eval_step(batch, "val", self.val_top1, self.val_top5)
        self.log("val/top1", self.val_top1, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/top5", self.val_top5, on_step=False, on_epoch=True)
        if batch_idx in self._sample_batches and not self.trainer.sanity_checking:
            self._samples.append((batch["image"][0], logits[0].argmax().item(), int(batch["target"][0])))

    def on_validation_epoch_end(self) -> None:
        self._log_samples()

    def test_step(self, batch: dict, batch_idx: int) -> None:
        if "image" not in batch:
            return
        logits = self._eval_step(batch, "test", self.test_top1, self.test_top5)
        probs = logits.float().softmax(-1)
        scores, preds = probs.max(-1)
        self.test_confusion.update(preds, batch["target"])
        self._test_rows += zip(batch["index"].tolist(), batch["path"], batch["target"].tolist(), preds.tolist(),
                               scores.tolist())
        true_probs = probs.gather(1, batch["target"][:, None])[:, 0].tolist()
        for k, (index, path, target, pred, score) in enumerate(zip(
                batch["index"].tolist(), batch["path"], batch["target"].tolist(), preds.tolist(), scores.tolist())):
            self.worst_examples.offer(true_probs[k], index, lambda k=k, p=path, t=target, c=pred, s=score: (
                p, t, c, s, displayable(batch["image"][k])))

    def on_test_epoch_start(self) -> None:
        super().on_test_epoch_start()
        self._test_rows = []

    def on_test_epoch_end(self) -> None:
        metrics = {"test/top1": self.test_top1.compute(), "test/top5": self.test_top5.compute()}
        self.log_dict(metrics)
        self.test_top1.reset()
        self.test_top5.reset()
        confusion = self.test_confusion.compute().cpu().long()  # on every rank: computing it syncs
        self.test_confusion.reset()
        rows = sorted(self.all_gather_objects(self._test_rows))
        loss = self.eval_loss_value("test")  # on every rank: computing it syncs
        worst = self.gather_worst()
        if self.global_rank != 0:
            return
        self.write_per_class(confusion.tolist())
        self.predictions_dir.mkdir(parents=True, exist_ok=True)
        with open(self.predictions_dir / "predictions.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["image", "label", "prediction", "score"])
            for _, path, target, pred, score in rows:
                writer.writerow([path, self.class_names[target], self.class_names[pred], f"{score:.6f}"])
        self.write_metrics_json({**metrics, **loss})
        # pictures last: the numbers are on disk whatever happens to them
        draw_after_metrics(lambda: write_confusion_matrix_png(confusion, self.class_names,
                                                              self.predictions_dir / "confusion_matrix.png"),
                           "predictions/confusion_matrix.png")
        draw_after_metrics(lambda: self.write_worst(worst), "predictions/worst/")

    def write_per_class(self, confusion: list[list[int]]) -> None:
        """``predictions/per_class.csv`` (class, precision, recall, f1, support) and
        ``predictions/confusion_matrix.csv`` (rows: true class, columns: predicted class), both
        from the confusion matrix of the whole test split. A class never predicted has precision 0,
        one without test images recall 0; f1 is 0 when precision and recall are."""
        self.predictions_dir.mkdir(parents=True, exist_ok=True)
        with open(self.predictions_dir / "confusion_matrix.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["true/predicted", *self.class_names])
            for name, row in zip(self.class_names, confusion):
                writer.writerow([name, *row])
        with open(self.predictions_dir / "per_class.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["class", "precision", "recall", "f1", "support"])
            for k, name in enumerate(self.class_names):
                tp = confusion[k][k]
                predicted = sum(row[k] for row in confusion)
                support = sum(confusion[k])
                precision = tp / predicted if predicted else 0.0
                recall = tp / support if support else 0.0
                f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
                writer.writerow([name, repr(precision), repr(recall), repr(f1), support])

    def write_worst(self, worst: list) -> None:
        """``predictions/worst/NN_<image stem>.png``: the test images whose true class got the lowest
        probability, as the network saw them, captioned; ``worst.csv`` lists them (rank, image,
        label, prediction, score of the prediction, probability of the label, file)."""
        rows = []
        for rank, (true_prob, _, (path, target, pred, score, image)) in enumerate(worst, start=1):
            name = f"{rank:02d}_{Path(path).stem}.png"
            caption = [f"true {self.class_names[target]} (p={true_prob:.3f})",
                       f"pred {self.class_names[pred]} (p={score:.3f})"]
            self.worst_dir.mkdir(parents=True, exist_ok=True)
            with_caption(image, caption).save(self.worst_dir / name)
            rows.append([rank, path, self.class_names[target], self.class_names[pred], repr(score), repr(true_prob), name])
        if rows:
            write_worst_csv(self.worst_dir / "worst.csv",
                            ["rank", "image", "label", "prediction", "score", "label_probability", "file"], rows)

    # -- predict ------------------------------------------------------------------------------------
    def on_predict_epoch_start(self) -> None:
        self._predict_rows = []

    def top_classes(self, images: torch.Tensor, k: int = 5) -> tuple[list[list[float]], list[list[int]]]:
        """(B, 3, S, S) network inputs -> per image the ``k`` highest probabilities and their labels, best first."""
        probs = self(images).float().softmax(-1)
        top = probs.topk(min(k, probs.shape[-1]), dim=-1)
        return top.values.tolist(), top.indices.tolist()

    def predict_step(self, batch: dict, batch_idx: int) -> None:
        if "image" not in batch:
            return
        top_scores, top_labels = self.top_classes(batch["image"])
        for index, path, scores, labels in zip(batch["index"].tolist(), batch["path"], top_scores, top_labels):
            self._predict_rows.append((index, path, scores, labels))

    def predict_inputs(self, inputs: list, top_k: int = 5) -> list[list[tuple[str, float]]]:
        """``model.predict(images, top_k=5)`` (:mod:`tasks.engine.predictor`): per image ``[(class name, probability), ...]``,
        the ``top_k`` most probable classes, best first."""
        images, _ = self.prepared_images(inputs)
        top_scores, top_labels = self.top_classes(torch.stack(images).to(self.device), top_k)
        return [[(self.class_names[label], score) for label, score in zip(labels, scores)]
                for scores, labels in zip(top_scores, top_labels)]

    def on_predict_epoch_end(self) -> None:
        rows = sorted(self.all_gather_objects(self._predict_rows))
        if self.global_rank != 0:
            return
        self.predict_dir.mkdir(parents=True, exist_ok=True)
        with open(self.predict_dir / "predictions.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["image", "prediction", "score", "top5"])
            for _, path, scores, labels in dict((r[0], r) for r in rows).values():  # a padding sampler repeats
                top5 = " ".join(f"{self.class_names[c]}:{s:.4f}" for c, s in zip(labels, scores))
                writer.writerow([path, self.class_names[labels[0]], f"{scores[0]:.6f}", top5])

    def _log_samples(self) -> None:
        logger = self.wandb_logger
        samples, self._samples = self._samples, []
        if logger is None or not samples:
            return
        shown = torch.stack([image.float() for image, _, _ in samples])
        lo = shown.amin(dim=(1, 2, 3), keepdim=True)
        hi = shown.amax(dim=(1, 2, 3), keepdim=True)
        shown = ((shown - lo) / (hi - lo).clamp_min(1e-6)).cpu()
        captions = [f"pred {self.class_names[p]} / true {self.class_names[t]}" for _, p, t in samples]
        logger.log_image("val/samples", list(shown), caption=captions)


def main(args=None) -> None:
    from datamodules.imagefolder import ImageFolderDataModule
    from tasks.engine.cli import SuiteCLI

    SuiteCLI(ClassificationTask, ImageFolderDataModule, task="classify", default_config="demo_mobilevitv2.yaml",
             monitor="val/top1", args=args)


if __name__ == "__main__":
    main()
