"""What classification's `test` and `predict` write (:class:`tasks.classify.ClassificationTask` computes it).

Under ``predictions/``: ``predictions.csv`` (image, label, prediction, score), ``per_class.csv`` (class,
precision, recall, f1, support), ``confusion_matrix.csv`` (rows: true class, columns: predicted class) and
``confused_pairs.csv`` (the most frequent mistakes), all from the one confusion matrix of the split, its picture ``confusion_matrix.png``, and ``worst/``: the
images whose true class got the lowest probability, captioned, listed in ``worst.csv``. `predict` writes
``predictions/predict/predictions.csv`` (image, prediction, score, top-5 classes). Validation images with
their predictions go to the run's loggers (:mod:`tasks.outputs.media`).
"""
from __future__ import annotations

import csv
from pathlib import Path

import torch
from lightning.pytorch import Callback

from tasks.outputs.common import (PredictWriter, TestRows, ValidationSamples, WorstSamples, draw_after_metrics,
                                  open_atomically, predictions_dir, with_caption, write_confusion_matrix_png,
                                  write_worst_csv)
from tasks.outputs.media import stretched


class PredictionsCsv(TestRows):
    """``predictions/predictions.csv``: one row per test image (image, label, prediction, score), in the
    split's order. Step rows: ``(index, path, target, prediction, score)``."""

    def write(self, folder: Path, rows: list, pl_module) -> None:
        names = pl_module.class_names
        folder.mkdir(parents=True, exist_ok=True)
        with open_atomically(folder / "predictions.csv") as f:
            writer = csv.writer(f)
            writer.writerow(["image", "label", "prediction", "score"])
            for _, path, target, pred, score in sorted(rows):
                writer.writerow([path, names[target], names[pred], f"{score:.6f}"])


class PerClassCsv(Callback):
    """``predictions/per_class.csv`` (class, precision, recall, f1, support) and
    ``predictions/confusion_matrix.csv`` (rows: true class, columns: predicted class), both from the
    confusion matrix of the whole test split (the task's ``test_confusion_counts``). A class never
    predicted has precision 0, one without test images recall 0; f1 is 0 when precision and recall are."""

    def on_test_end(self, trainer, pl_module) -> None:
        confusion = getattr(pl_module, "test_confusion_counts", None)
        if trainer.global_rank != 0 or confusion is None:
            return
        names = pl_module.class_names
        folder = predictions_dir(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        with open_atomically(folder / "confusion_matrix.csv") as f:
            writer = csv.writer(f)
            writer.writerow(["true/predicted", *names])
            for name, row in zip(names, confusion):
                writer.writerow([name, *row])
        with open_atomically(folder / "per_class.csv") as f:
            writer = csv.writer(f)
            writer.writerow(["class", "precision", "recall", "f1", "support"])
            for k, name in enumerate(names):
                tp = confusion[k][k]
                predicted = sum(row[k] for row in confusion)
                support = sum(confusion[k])
                precision = tp / predicted if predicted else 0.0
                recall = tp / support if support else 0.0
                f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
                writer.writerow([name, repr(precision), repr(recall), repr(f1), support])


class ConfusedPairsCsv(Callback):
    """``predictions/confused_pairs.csv``: the ``max_pairs`` most frequent mistakes of the test split, one row per
    (true class, predicted class) pair with ``count`` images and ``share`` of the true class's images, most
    frequent first (ties: by the classes' order), from the same confusion matrix as ``per_class.csv``; pairs
    that never occur are left out."""

    def __init__(self, max_pairs: int = 20):
        self.max_pairs = max_pairs

    def on_test_end(self, trainer, pl_module) -> None:
        confusion = getattr(pl_module, "test_confusion_counts", None)
        if trainer.global_rank != 0 or confusion is None:
            return
        names = pl_module.class_names
        pairs = sorted(((-count, true, pred) for true, row in enumerate(confusion) for pred, count in enumerate(row)
                        if true != pred and count > 0))[:self.max_pairs]
        folder = predictions_dir(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        with open_atomically(folder / "confused_pairs.csv") as f:
            writer = csv.writer(f)
            writer.writerow(["label", "prediction", "count", "share"])
            for negative_count, true, pred in pairs:
                writer.writerow([names[true], names[pred], -negative_count, repr(-negative_count / sum(confusion[true]))])


class ConfusionMatrixPng(Callback):
    """``predictions/confusion_matrix.png``: the test confusion matrix, readable for any class count."""

    def on_test_end(self, trainer, pl_module) -> None:
        confusion = getattr(pl_module, "test_confusion_counts", None)
        if trainer.global_rank != 0 or confusion is None:
            return
        path = predictions_dir(trainer) / "confusion_matrix.png"
        draw_after_metrics(lambda: write_confusion_matrix_png(torch.tensor(confusion), pl_module.class_names, path),
                           "predictions/confusion_matrix.png")


class WorstClassifications(WorstSamples):
    """``predictions/worst/NN_<image stem>.png``: the test images whose true class got the lowest
    probability, as the network saw them, captioned; ``worst.csv`` lists them (rank, image, label,
    prediction, score of the prediction, probability of the label, file). Payload: ``(path, target,
    prediction, score, displayable image)``."""

    def draw(self, folder: Path, worst: list, pl_module) -> None:
        names = pl_module.class_names
        rows = []
        for rank, (true_prob, _, (path, target, pred, score, image)) in enumerate(worst, start=1):
            name = f"{rank:02d}_{Path(path).stem}.png"
            caption = [f"true {names[target]} (p={true_prob:.3f})", f"pred {names[pred]} (p={score:.3f})"]
            folder.mkdir(parents=True, exist_ok=True)
            with_caption(image, caption).save(folder / name)
            rows.append([rank, path, names[target], names[pred], repr(score), repr(true_prob), name])
        write_worst_csv(folder / "worst.csv",
                        ["rank", "image", "label", "prediction", "score", "label_probability", "file"], rows)


class ClassPredictions(PredictWriter):
    """``predictions/predict/predictions.csv``: image, prediction, score, and the top-5 classes with their
    probabilities. Rows: ``(index, path, top scores, top labels)``."""

    def write(self, trainer, folder: Path, rows: list, pl_module) -> None:
        names = pl_module.class_names
        folder.mkdir(parents=True, exist_ok=True)
        with open_atomically(folder / "predictions.csv") as f:
            writer = csv.writer(f)
            writer.writerow(["image", "prediction", "score", "top5"])
            for _, path, scores, labels in dict((r[0], r) for r in sorted(rows)).values():  # a padding sampler repeats
                top5 = " ".join(f"{names[c]}:{s:.4f}" for c, s in zip(labels, scores))
                writer.writerow([path, names[labels[0]], f"{scores[0]:.6f}", top5])


class ValidationImages(ValidationSamples):
    """``val/samples`` to the run's loggers: validation images from batches spread over the split, as the
    network saw them, captioned with their prediction and label. Step output ``"sample"``: ``(image,
    prediction, target)``."""

    def log_samples(self, media, samples: list, pl_module) -> None:
        names = pl_module.class_names
        media.log_image("val/samples", stretched(torch.stack([image for image, _, _ in samples])),
                        captions=[f"pred {names[int(p)]} / true {names[int(t)]}" for _, p, t in samples])
