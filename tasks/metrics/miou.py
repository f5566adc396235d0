"""Mean intersection over union (mIoU) of semantic segmentation, as mmsegmentation computes it.

One confusion matrix over every evaluated pixel of the split (rows: true class, columns: predicted
class), pixels whose truth is the ignore label left out. Per class IoU = TP / (TP + FP + FN); mIoU is
the mean over the classes whose union TP + FP + FN is non-empty; pixel accuracy = trace / total.

- mmsegmentation (``mmseg/evaluation/metrics/iou_metric.py``): per-class intersection and union areas
  summed over the dataset, IoU = intersection / union, ``np.nanmean`` over classes, so a class absent
  from both truth and prediction is left out. That is this metric.
- CVNets' successor CoreNet (``corenet/metrics/iou.py``, ``IOUMetric``) sums the same areas but
  divides by union + 1e-7 and averages over all classes, so such a class counts as 0: the two agree
  whenever every class occurs in the evaluated truth or predictions.
- torchmetrics' ``segmentation.MeanIoU`` averages per-image scores and has no ignore label: a different
  number.

Under DDP the matrix is summed over ranks (a sum-reduced state), so the score is exact as long as the
sampler gives each image to one rank once (the segmentation datamodule's evaluation sampler does).
"""
from __future__ import annotations

import torch
from torchmetrics import Metric


def confusion_scores(confmat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Scores of a (K, K) confusion matrix (rows: truth, columns: prediction), in float64.

    Returns ``iou`` (K,), NaN where a class is in neither truth nor prediction; ``miou``, the mean over
    the other classes; ``pixel_acc``, trace / total (mmsegmentation's aAcc); ``class_acc`` (K,), each
    class's share of its truth pixels predicted right, NaN for a class without truth pixels, and ``macc``
    their mean over the classes with truth pixels (mmsegmentation's mAcc); ``present`` (K,) bool. NaN
    scores when nothing was counted.
    """
    confmat = confmat.double()
    tp = confmat.diagonal()
    union = confmat.sum(0) + confmat.sum(1) - tp
    present = union > 0
    iou = torch.where(present, tp / union.clamp_min(1), torch.full_like(tp, float("nan")))
    truth = confmat.sum(1)
    class_acc = torch.where(truth > 0, tp / truth.clamp_min(1), torch.full_like(tp, float("nan")))
    total = confmat.sum()
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=confmat.device)
    return {
        "iou": iou,
        "miou": iou[present].mean() if present.any() else nan,
        "pixel_acc": tp.sum() / total if total > 0 else nan,
        "class_acc": class_acc,
        "macc": class_acc[truth > 0].mean() if (truth > 0).any() else nan,
        "present": present,
    }


def confusion_counts(preds: torch.Tensor, target: torch.Tensor, num_classes: int,
                     ignore_index: int = 255) -> torch.Tensor:
    """(..., H, W) predicted and true labels -> their (K, K) int64 confusion matrix (rows: truth),
    pixels whose truth is ``ignore_index`` left out.

    Every pixel adds one to a fixed-size counter, so no step depends on the data's values for its
    output size (no host read on a GPU), and under ``torch.use_deterministic_algorithms`` CUDA runs
    ``index_add`` deterministically where ``bincount`` raises (both in that function's documented lists).
    """
    k = num_classes
    target = target.long()
    # ignored pixels count in one extra cell, dropped below
    cells = torch.where(target != ignore_index, target * k + preds.long(), k * k).flatten()
    counts = torch.zeros(k * k + 1, dtype=torch.long, device=cells.device)
    counts.index_add_(0, cells, torch.ones_like(cells))
    return counts[:-1].reshape(k, k)


def image_miou(pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int = 255) -> float:
    """One image's mIoU: (H, W) labels -> the mean IoU over the classes in its truth or prediction
    (labelled pixels only); NaN for an image without a labelled pixel. Ranks images, not a split:
    the split's mIoU is :class:`MeanIoU`'s, not a mean of these."""
    return float(confusion_scores(confusion_counts(pred, target, num_classes, ignore_index))["miou"])


class ConfusionMatrix(Metric):
    """A (K, K) int64 confusion matrix (rows: truth) summed over updates and ranks, by
    :func:`confusion_counts` (no label ignored): its memory is the matrix, also under
    ``torch.use_deterministic_algorithms``, where torchmetrics' ``MulticlassConfusionMatrix`` counts through a
    (N, K * K) comparison mesh (128 images x 1,000,000 cells for ImageNet). ``update(preds, target)``: (N,)
    labels; ``compute()``: the matrix."""

    is_differentiable = False
    full_state_update = False

    confmat: torch.Tensor

    def __init__(self, num_classes: int, **kwargs):
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.add_state("confmat", torch.zeros(num_classes, num_classes, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.confmat += confusion_counts(preds, target, self.num_classes, ignore_index=-1)  # -1: no label is

    def compute(self) -> torch.Tensor:
        return self.confmat


class MeanIoU(Metric):
    """Dataset-wide mIoU from one confusion matrix summed over updates and ranks (see the module).

    ``update(preds, target)``: (N, H, W) integer labels of the same shape; target pixels equal to
    ``ignore_index`` are skipped. ``compute()``: ``{"confmat": (K, K) int64 (rows: truth), "iou": (K,),
    "miou", "pixel_acc", "class_acc": (K,), "macc", "present": (K,)}`` (:func:`confusion_scores` of the summed matrix).

    Args:
        num_classes: K; labels are 0..K-1.
        ignore_index: the truth label left out of every count (255, as the suite's datamodules and
            mmsegmentation mark unlabelled pixels).
        validate_args: check that every prediction and every labelled truth pixel is a class (a label
            outside 0..K-1 would count in another class's cell); the check reads one flag per update
            back to the host.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    confmat: torch.Tensor

    def __init__(self, num_classes: int, ignore_index: int = 255, validate_args: bool = True, **kwargs):
        super().__init__(**kwargs)
        if num_classes < 1:
            raise ValueError(f"num_classes must be at least 1, got {num_classes}")
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.validate_args = validate_args
        self.add_state("confmat", torch.zeros(num_classes, num_classes, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        if preds.shape != target.shape:
            raise ValueError(f"preds {tuple(preds.shape)} and target {tuple(target.shape)} must be label maps "
                             "of the same shape (N, H, W); take the argmax of logits first")
        if self.validate_args:
            self._check_labels(preds, target)
        self.confmat += confusion_counts(preds, target, self.num_classes, self.ignore_index)

    def compute(self) -> dict[str, torch.Tensor]:
        return {"confmat": self.confmat, **confusion_scores(self.confmat)}

    def _check_labels(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        k = self.num_classes
        bad_truth = (target != self.ignore_index) & ((target < 0) | (target >= k))
        bad_pred = (preds < 0) | (preds >= k)
        if bool(bad_truth.any() | bad_pred.any()):
            values = {"truth": target[bad_truth].unique().tolist(), "prediction": preds[bad_pred].unique().tolist()}
            found = "; ".join(f"{name} {labels[:10]}" for name, labels in values.items() if labels)
            raise ValueError(f"labels outside the {k} classes 0..{k - 1} (ignore label {self.ignore_index}): {found}; "
                             "give num_classes the model's class count and the data's ignore label as ignore_index")
