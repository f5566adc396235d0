"""Pascal VOC box mAP: average precision at IoU 0.5 per class, averaged over the classes.

The metric of the VOC devkit (``VOCevaldet.m``), as mmdetection's ``eval_map`` and the VOC
leaderboards compute it:

- per class, all detections of the evaluated images sorted by descending score; each is
  matched, in that order, to the ground-truth box of its class and image with which it has
  the highest IoU (the first such box on ties). IoU >= ``iou_threshold`` with a box not yet
  matched: true positive, and the box is taken; with a box already taken, or IoU below the
  threshold (or no box of its class in the image): false positive. The best box is chosen
  among all boxes of the class, taken or not, as the devkit does: a duplicate does not fall
  back to the second-best box;
- ``difficult`` ground truth: a detection whose best box is difficult counts neither as a true
  nor as a false positive (however many detections hit it), and difficult boxes are not counted
  in recall (``n_pos`` is the number of non-difficult boxes of the class);
- AP is the area under the interpolated precision-recall curve (precision made monotone from
  the right, summed over the recall steps): the VOC2010+ "area" method. ``use_11_points=True``
  gives the VOC2007 method instead: the mean over recall r in {0, 0.1, ..., 1} of the highest
  precision at recall >= r (a recall of exactly r counts: the thresholds are ``k / 10``, not
  ``np.arange``'s ``0.1 * k``, which mmdetection and py-faster-rcnn compare with). The SSD paper's and mmdetection's VOC2007-test numbers (voc0712
  configs) use the 11-point method; compare with them under that option;
- classes with no non-difficult ground truth in the evaluated images are left out of the mean
  (``nan`` in ``ap_per_class``); with no such class at all ``map`` is -1, as torchmetrics'
  COCO mAP reports a metric without ground truth.

Coordinates are continuous (no ``+1`` in widths and IoU): boxes are ``x1, y1, x2, y2`` pixel
edges, as :mod:`datamodules.voc_detection` converts VOC's 1-based inclusive pixel indices
(``x1 = xmin - 1``, ``x2 = xmax``). The devkit's ``+1`` on inclusive indices and continuous
edges with this conversion give the same widths and the same IoU, so nothing is lost. (mmdetection
reads VOC as ``xmin - 1 .. xmax - 1``, inclusive, and evaluates with ``use_legacy_coordinate=True``,
the same thing once more.)

Like :class:`tasks.metrics.coco_map.CocoMeanAveragePrecision` the metric keeps one state per image with
its image id; under DDP the states are gathered as Python objects (ranks may hold different
numbers of images) and an image scored twice (a padding sampler) is counted once, so 1 and N
processes agree. Images are evaluated in image-id order, so the result does not depend on the
order in which ranks or batches delivered them (not even for tied scores).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torchmetrics import Metric

from layers.compat import GathersOwnStates

#: the per-image states, each a list with one tensor per image
_STATES = ("det_boxes", "det_scores", "det_labels", "gt_boxes", "gt_labels", "gt_difficult", "image_ids")


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(D, 4) x (G, 4) xyxy -> (D, G) IoU, continuous coordinates (areas ``(x2 - x1) * (y2 - y1)``)."""
    area_a = (a[:, 2] - a[:, 0]).clip(0) * (a[:, 3] - a[:, 1]).clip(0)
    area_b = (b[:, 2] - b[:, 0]).clip(0) * (b[:, 3] - b[:, 1]).clip(0)
    wh = (np.minimum(a[:, None, 2:], b[None, :, 2:]) - np.maximum(a[:, None, :2], b[None, :, :2])).clip(0)
    inter = wh[..., 0] * wh[..., 1]
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def match_image(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, gt_boxes: np.ndarray,
                gt_labels: np.ndarray, gt_difficult: np.ndarray, iou_threshold: float = 0.5
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One image's detections against its ground truth.

    Returns ``(order, tp, fp)``: ``order`` sorts the detections by descending score (stable), and
    ``tp`` / ``fp`` (bool, in that order) mark true and false positives; a detection that is
    neither hit a difficult box."""
    order = np.argsort(-scores, kind="stable")
    count = len(order)
    tp = np.zeros(count, bool)
    if len(gt_boxes) == 0 or count == 0:
        return order, tp, np.ones(count, bool)
    iou = box_iou(boxes[order], gt_boxes)
    iou[labels[order][:, None] != gt_labels[None, :]] = -1.0  # only boxes of the detection's class
    best = iou.argmax(axis=1)  # the first of equal maxima, as the devkit's max()
    hit = iou[np.arange(count), best] >= iou_threshold
    ignored = hit & gt_difficult[best]
    candidates = np.flatnonzero(hit & ~ignored)
    # the best box does not depend on which boxes are taken, so "the first detection (in score
    # order) to reach a box takes it" is the first occurrence of each box among the candidates
    _, first = np.unique(best[candidates], return_index=True)
    tp[candidates[first]] = True
    return order, tp, ~tp & ~ignored


def average_precision(recall: np.ndarray, precision: np.ndarray, use_11_points: bool = False) -> float:
    """AP of one class from its cumulative ``recall`` and ``precision`` (in score order)."""
    if use_11_points:
        # t = k / 10, correctly rounded, so a recall of exactly k / n = t counts as reaching t (np.arange's
        # 0.1 * 3 = 0.30000000000000004 would leave a recall of 3/10 short of it)
        points = [precision[recall >= t].max() if (recall >= t).any() else 0.0 for t in (k / 10 for k in range(11))]
        return float(np.mean(points))
    mrec = np.concatenate([[0.0], recall, [1.0]])
    mpre = np.concatenate([[0.0], precision, [0.0]])
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]  # the precision envelope
    steps = np.flatnonzero(mrec[1:] != mrec[:-1])
    return float(np.sum((mrec[steps + 1] - mrec[steps]) * mpre[steps + 1]))


class VocMeanAveragePrecision(GathersOwnStates, Metric):
    """Pascal VOC mAP@0.5 (see the module docstring), with the interface of
    :class:`tasks.metrics.coco_map.CocoMeanAveragePrecision`.

    Args:
        num_classes: length of ``ap_per_class``; ``None``: one more than the largest label seen
            (in detections or ground truth). Labels outside ``0 .. num_classes - 1`` are an error.
        iou_threshold: the IoU a detection needs to match a box (VOC: 0.5, inclusive).
        use_11_points: the VOC2007 11-point AP instead of the area under the curve.
        **kwargs: torchmetrics ``Metric`` options (``process_group``, ``compute_on_cpu``, ...).

    ``update(preds, target, image_ids)``: ``preds`` per image ``{"boxes" (D, 4) xyxy, "scores" (D,),
    "labels" (D,)}``; ``target`` per image ``{"boxes" (N, 4) xyxy, "labels" (N,), "difficult" (N,)
    bool}`` (``difficult`` optional, other keys such as ``iscrowd``/``area`` ignored); ``image_ids`` one
    int per image, unique within the evaluation set.

    ``compute()`` -> ``{"map": (), "map_50": () (the same value; ``map_<100 x iou_threshold>`` under another
    threshold), "ap_per_class": (K,) (0-dim when K = 1: torchmetrics squeezes one-element results)}``, float32.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, num_classes: int | None = None, iou_threshold: float = 0.5, use_11_points: bool = False,
                 **kwargs):
        super().__init__(**kwargs)
        if num_classes is not None and num_classes < 1:
            raise ValueError(f"num_classes must be positive, got {num_classes}")
        if not 0.0 < iou_threshold <= 1.0:
            raise ValueError(f"iou_threshold must be in (0, 1], got {iou_threshold}")
        self.num_classes = num_classes
        self.iou_threshold = float(iou_threshold)
        self.use_11_points = bool(use_11_points)
        for name in _STATES:
            self.add_state(name, default=[], dist_reduce_fx=None)

    @staticmethod
    def _checked(value, name: str, index: int, shape: tuple[int | None, ...]) -> torch.Tensor:
        tensor = torch.as_tensor(value).detach()
        if tensor.numel() == 0 and len(shape) == 2:
            tensor = tensor.reshape(0, shape[1])
        if tensor.dim() != len(shape) or any(s is not None and s != t for s, t in zip(shape, tensor.shape)):
            raise ValueError(f"image {index}: {name} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple('N' if s is None else s for s in shape)}")
        return tensor

    def update(self, preds: list[dict[str, torch.Tensor]], target: list[dict[str, torch.Tensor]],
               image_ids: Sequence[int]) -> None:  # type: ignore[override]
        if not (len(preds) == len(target) == len(image_ids)):
            raise ValueError(f"got {len(preds)} predictions, {len(target)} targets and {len(image_ids)} image ids")
        for k, (pred, gt, image_id) in enumerate(zip(preds, target, image_ids)):
            boxes = self._checked(pred["boxes"], "preds boxes", k, (None, 4))
            scores = self._checked(pred["scores"], "preds scores", k, (len(boxes),))
            labels = self._checked(pred["labels"], "preds labels", k, (len(boxes),))
            gt_boxes = self._checked(gt["boxes"], "target boxes", k, (None, 4))
            gt_labels = self._checked(gt["labels"], "target labels", k, (len(gt_boxes),))
            difficult = gt.get("difficult")
            difficult = (torch.zeros(len(gt_boxes), dtype=torch.bool, device=gt_boxes.device) if difficult is None
                         else self._checked(difficult, "target difficult", k, (len(gt_boxes),)).bool())
            for name, value in (("det_boxes", boxes), ("det_scores", scores), ("det_labels", labels.long()),
                                ("gt_boxes", gt_boxes), ("gt_labels", gt_labels.long()), ("gt_difficult", difficult),
                                ("image_ids", torch.tensor(int(image_id), device=self.device))):
                getattr(self, name).append(value)

    def sync_states(self, group) -> None:
        """Gather every rank's states (:class:`layers.compat.GathersOwnStates`, before ``compute()``)."""
        # ranks hold different numbers of images: gather the per-image lists as objects
        world_size = dist.get_world_size(group)
        for name in _STATES:
            gathered: list[list] = [None] * world_size  # type: ignore[list-item]
            dist.all_gather_object(gathered, [t.cpu() for t in getattr(self, name)], group=group)
            setattr(self, name, [t.to(self.device) for rank_items in gathered for t in rank_items])

    def _images(self) -> list[dict[str, np.ndarray]]:
        """The per-image states as numpy, each image once (its first copy), in image-id order."""
        states = {name: getattr(self, name) for name in _STATES}
        first: dict[int, int] = {}
        for position, image_id in enumerate(states["image_ids"]):
            first.setdefault(int(image_id), position)
        images = []
        for image_id in sorted(first):
            k = first[image_id]
            images.append({name: states[name][k].cpu().numpy() for name in _STATES if name != "image_ids"})
        for image in images:
            for name in ("det_boxes", "det_scores", "gt_boxes"):
                image[name] = image[name].astype(np.float64)
        return images

    def compute(self) -> dict[str, torch.Tensor]:
        images = self._images()
        largest = max((int(image[name].max()) for image in images for name in ("det_labels", "gt_labels")
                        if image[name].size), default=-1)
        smallest = min((int(image[name].min()) for image in images for name in ("det_labels", "gt_labels")
                        if image[name].size), default=0)
        num_classes = self.num_classes if self.num_classes is not None else largest + 1
        if smallest < 0 or largest >= max(num_classes, 1):
            raise ValueError(f"labels must lie in 0..{num_classes - 1}; got labels from {smallest} to {largest}")

        labels, scores, tps, fps = [], [], [], []
        n_pos = np.zeros(num_classes, np.int64)
        for image in images:
            order, tp, fp = match_image(image["det_boxes"], image["det_scores"], image["det_labels"],
                                        image["gt_boxes"], image["gt_labels"], image["gt_difficult"],
                                        self.iou_threshold)
            labels.append(image["det_labels"][order])
            scores.append(image["det_scores"][order])
            tps.append(tp)
            fps.append(fp)
            np.add.at(n_pos, image["gt_labels"][~image["gt_difficult"]], 1)
        labels = np.concatenate(labels) if labels else np.zeros(0, np.int64)
        scores = np.concatenate(scores) if scores else np.zeros(0)
        tps = np.concatenate(tps) if tps else np.zeros(0, bool)
        fps = np.concatenate(fps) if fps else np.zeros(0, bool)

        ap = np.full(num_classes, np.nan)
        for c in np.flatnonzero(n_pos):
            mine = np.flatnonzero(labels == c)
            order = mine[np.argsort(-scores[mine], kind="stable")]  # ties: image-id order, then score order
            tp, fp = np.cumsum(tps[order]), np.cumsum(fps[order])
            recall = tp / n_pos[c]
            precision = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
            ap[c] = average_precision(recall, precision, self.use_11_points)
        scored = ap[~np.isnan(ap)]
        mean = float(scored.mean()) if scored.size else -1.0
        value = torch.tensor(mean, dtype=torch.float32)
        return {"map": value, f"map_{round(100 * self.iou_threshold)}": value.clone(),
                "ap_per_class": torch.tensor(ap, dtype=torch.float32)}

    def per_class(self, values: dict, num_classes: int | None = None) -> dict[str, list[float]]:
        """``compute()``'s ``ap_per_class`` as the one per-label column ``ap50`` (``ap<100 x iou_threshold>``),
        ``nan`` for a class without non-difficult ground truth."""
        return {f"ap{round(100 * self.iou_threshold)}": values["ap_per_class"].reshape(-1).tolist()}
