"""COCO box mAP: the twelve numbers pycocotools' COCOeval prints, computed by faster_coco_eval.

:class:`CocoMeanAveragePrecision` keeps the batches as a few flat tensors and, at ``compute()``,
hands them to faster_coco_eval's ``COCO`` / ``COCOeval_faster`` (COCOeval's matching and
accumulation in C++) as plain annotation dicts built in one pass over numpy arrays. That is
COCOeval's own evaluation without torchmetrics' per-image states and per-element tensor
conversions, which cost its ``MeanAveragePrecision`` about as much time as the evaluation itself.

What COCOeval would see for the same detections written to a results file: one image per image
id (sorted), boxes ``[x, y, w, h]`` from the ``x1, y1, x2, y2`` given (in float64), the object
area given with the ground truth, categories = the labels present in detections or ground truth.
"""
from __future__ import annotations

import gc
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torchmetrics import Metric

from layers.compat import GathersOwnStates

#: ``compute()``'s keys, in the order of ``COCOeval.stats``
MAP_KEYS = ("map", "map_50", "map_75", "map_small", "map_medium", "map_large", "mar_1", "mar_10", "mar_100",
            "mar_small", "mar_medium", "mar_large")

#: the states: per image (image_ids, det_counts, gt_counts), per detection (det_*), per object (gt_*)
_STATES = ("image_ids", "det_counts", "gt_counts", "det_boxes", "det_scores", "det_labels",
           "gt_boxes", "gt_labels", "gt_iscrowd", "gt_area")


def _checked(value, name: str, image_id: int, shape: tuple[int | None, ...], dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.as_tensor(value).detach()
    if tensor.numel() == 0 and len(shape) == 2:  # an image without boxes may come as shape (0,)
        tensor = tensor.reshape(0, shape[1])
    if tensor.dim() != len(shape) or any(s is not None and s != t for s, t in zip(shape, tensor.shape)):
        expected = str(tuple("N" if s is None else s for s in shape)).replace("'", "")
        raise ValueError(f"image {image_id}: {name} has shape {tuple(tensor.shape)}, expected {expected}")
    return tensor.to(dtype)


def _xywh(xyxy: np.ndarray) -> np.ndarray:
    return np.concatenate([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], axis=1)


class CocoMeanAveragePrecision(GathersOwnStates, Metric):
    """COCO box mAP that counts every image once, however the evaluation set was split across ranks.

    Args:
        extended_summary: ``compute()`` also returns COCOeval's accumulated ``precision``
            (T, R, K, A, M), ``recall`` (T, K, A, M) and ``scores`` (T, R, K, A, M) arrays, float64
            (T IoU thresholds, R recall thresholds, K = ``classes``, A areas all/small/medium/large,
            M max detections 1/10/100), for per-class numbers (:func:`coco_per_class`).
        iou_thresholds, rec_thresholds: COCOeval's ``iouThrs`` / ``recThrs``; default COCO's.
        **kwargs: torchmetrics ``Metric`` options (``process_group``, ``compute_on_cpu``, ...).

    ``update(preds, target, image_ids)``: ``preds`` per image ``{"boxes" (D, 4) xyxy, "scores" (D,),
    "labels" (D,)}``; ``target`` per image ``{"boxes" (N, 4) xyxy, "labels" (N,), "iscrowd" (N,)
    optional, "area" (N,) optional: COCO's object area, where missing or <= 0 the box's}``; ``image_ids``
    one int per image, unique within the evaluation set. As in COCOeval, the best 100 detections of
    each image and category count.

    ``compute()`` -> ``MAP_KEYS`` (float32 scalars, COCOeval's ``stats``; -1 without ground truth),
    ``classes`` (K,) int32 (the labels seen, COCOeval's ``catIds``) and, with ``extended_summary``,
    the arrays above. Under DDP the states are gathered from every rank (ranks may hold different
    numbers of images) and an image scored twice by a padding sampler counts once (its first copy),
    so the result equals the single-process one.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, extended_summary: bool = False, iou_thresholds: Sequence[float] | None = None,
                 rec_thresholds: Sequence[float] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.extended_summary = extended_summary
        # COCOeval's thresholds in float64: from a float32 linspace a recall of exactly k/n could land
        # on the wrong side of e.g. 0.3 (0.30000001)
        iou_thresholds = np.linspace(0.5, 0.95, 10) if iou_thresholds is None else iou_thresholds
        rec_thresholds = np.linspace(0.0, 1.0, 101) if rec_thresholds is None else rec_thresholds
        self.iou_thresholds = [float(t) for t in iou_thresholds]
        self.rec_thresholds = [float(t) for t in rec_thresholds]
        for name in _STATES:
            self.add_state(name, default=[], dist_reduce_fx=None)

    def update(self, preds: list[dict[str, torch.Tensor]], target: list[dict[str, torch.Tensor]],
               image_ids: Sequence[int]) -> None:  # type: ignore[override]
        if not (len(preds) == len(target) == len(image_ids)):
            raise ValueError(f"got {len(preds)} predictions, {len(target)} targets and {len(image_ids)} image ids")
        if len(image_ids) == 0:  # not `not image_ids`: a numpy array of ids has no truth value
            return
        batch: dict[str, list[torch.Tensor]] = {name: [] for name in _STATES[3:]}
        for pred, gt, image_id in zip(preds, target, image_ids):
            boxes = _checked(pred["boxes"], "preds boxes", image_id, (None, 4), torch.float64)
            gt_boxes = _checked(gt["boxes"], "target boxes", image_id, (None, 4), torch.float64)
            d, n = len(boxes), len(gt_boxes)
            box_area = (gt_boxes[:, 2] - gt_boxes[:, 0]) * (gt_boxes[:, 3] - gt_boxes[:, 1])
            area = box_area if gt.get("area") is None else _checked(gt["area"], "target area", image_id, (n,),
                                                                     torch.float64)
            iscrowd = (torch.zeros(n, dtype=torch.long) if gt.get("iscrowd") is None
                       else _checked(gt["iscrowd"], "target iscrowd", image_id, (n,), torch.long))
            for name, value in (
                    ("det_boxes", boxes),
                    ("det_scores", _checked(pred["scores"], "preds scores", image_id, (d,), torch.float64)),
                    ("det_labels", _checked(pred["labels"], "preds labels", image_id, (d,), torch.long)),
                    ("gt_boxes", gt_boxes),
                    ("gt_labels", _checked(gt["labels"], "target labels", image_id, (n,), torch.long)),
                    ("gt_iscrowd", iscrowd), ("gt_area", torch.where(area > 0, area, box_area))):
                batch[name].append(value.to(self.device))
        # one tensor per state and batch: a few large tensors are cheap to gather and concatenate
        self.image_ids.append(torch.tensor([int(i) for i in image_ids], device=self.device))
        self.det_counts.append(torch.tensor([len(b) for b in batch["det_boxes"]], device=self.device))
        self.gt_counts.append(torch.tensor([len(b) for b in batch["gt_boxes"]], device=self.device))
        for name, values in batch.items():
            getattr(self, name).append(torch.cat(values))

    def sync_states(self, group) -> None:
        """Gather every rank's states (:class:`layers.compat.GathersOwnStates`, before ``compute()``)."""
        # ranks hold different numbers of images and boxes: gather each state, one tensor per rank, as an object
        world_size = dist.get_world_size(group)
        for name in _STATES:
            local = getattr(self, name)
            gathered: list = [None] * world_size
            dist.all_gather_object(gathered, torch.cat(local).cpu() if local else None, group=group)
            setattr(self, name, [t.to(self.device) for t in gathered if t is not None])

    def _arrays(self) -> dict[str, np.ndarray]:
        """The states as flat numpy arrays, each image once (its first copy), plus the image id of
        every detection (``det_image_ids``) and object (``gt_image_ids``)."""
        a = {name: torch.cat(getattr(self, name)).cpu().numpy() for name in _STATES}
        first = np.zeros(len(a["image_ids"]), dtype=bool)
        first[np.unique(a["image_ids"], return_index=True)[1]] = True
        for kind in ("det", "gt"):
            kept = np.repeat(first, a[f"{kind}_counts"])
            a[f"{kind}_image_ids"] = np.repeat(a["image_ids"], a[f"{kind}_counts"])
            for name in [n for n in a if n.startswith(f"{kind}_") and n != f"{kind}_counts"]:
                a[name] = a[name][kept]
        a["image_ids"] = a["image_ids"][first]
        return a

    def compute(self) -> dict[str, torch.Tensor]:
        # half a million annotation dicts would set off full garbage collections that walk them all
        # again and again; none of them is part of a reference cycle
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._evaluate(self._arrays() if self.image_ids else None)
        finally:
            if collecting:
                gc.enable()

    def _evaluate(self, a: dict[str, np.ndarray] | None) -> dict[str, torch.Tensor]:
        from faster_coco_eval import COCO, COCOeval_faster

        labels = np.unique(np.concatenate([a["det_labels"], a["gt_labels"]])) if a else np.zeros(0, np.int64)
        result = {"classes": torch.tensor(labels, dtype=torch.int32)}
        if len(labels) == 0:  # no image, or neither objects nor detections: COCOeval's "no value"
            return {**{k: torch.tensor(-1.0) for k in MAP_KEYS}, **result}

        images = [{"id": i} for i in a["image_ids"].tolist()]
        categories = [{"id": c} for c in labels.tolist()]
        truth, found = COCO(), COCO()
        truth.dataset = {"images": images, "categories": categories, "annotations": [
            {"id": k, "image_id": i, "category_id": c, "bbox": box, "area": area, "iscrowd": crowd}
            for k, (i, c, box, area, crowd) in enumerate(zip(
                a["gt_image_ids"].tolist(), a["gt_labels"].tolist(), _xywh(a["gt_boxes"]).tolist(),
                a["gt_area"].tolist(), a["gt_iscrowd"].tolist()), start=1)]}  # id 0 would read as "unmatched"
        xywh = _xywh(a["det_boxes"])
        found.dataset = {"images": images, "categories": categories, "annotations": [
            {"id": k, "image_id": i, "category_id": c, "bbox": box, "area": area, "score": score, "iscrowd": 0}
            for k, (i, c, box, area, score) in enumerate(zip(
                a["det_image_ids"].tolist(), a["det_labels"].tolist(), xywh.tolist(),
                (xywh[:, 2] * xywh[:, 3]).tolist(), a["det_scores"].tolist()), start=1)]}
        truth.createIndex()
        found.createIndex()

        evaluation = COCOeval_faster(truth, found, "bbox", print_function=lambda *args: None)
        evaluation.params.iouThrs = np.array(self.iou_thresholds, dtype=np.float64)
        evaluation.params.recThrs = np.array(self.rec_thresholds, dtype=np.float64)
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
        result.update({k: torch.tensor(float(v), dtype=torch.float32) for k, v in zip(MAP_KEYS, evaluation.stats)})
        if self.extended_summary:
            result.update({k: torch.from_numpy(np.asarray(evaluation.eval[k], dtype=np.float64))
                           for k in ("precision", "recall", "scores")})
        return result

    def per_class(self, values: dict, num_classes: int) -> dict[str, list[float]]:
        """Per-label columns ``ap, ap50, ap75, ar100`` for labels ``0 .. num_classes - 1`` from ``compute()``'s
        ``values`` (:func:`coco_per_class`; needs ``extended_summary``), -1 for a label without ground truth
        or detection in the evaluated images (COCOeval's "no value")."""
        rows = coco_per_class(values, self)
        return {key: [rows.get(label, {}).get(key, -1.0) for label in range(num_classes)]
                for key in ("ap", "ap50", "ap75", "ar100")}


def coco_per_class(values: dict, metric: CocoMeanAveragePrecision) -> dict[int, dict[str, float]]:
    """Per label ``{"ap", "ap50", "ap75", "ar100"}`` from ``metric``'s ``compute()`` with
    ``extended_summary=True``: COCOeval's ``summarize`` restricted to one category (area "all", the
    largest maxDets; the mean over entries > -1, else -1). Labels absent from both detections and
    ground truth are not in the evaluation and not in the result."""
    if "precision" not in values:  # nothing was evaluated (no image)
        return {}
    precision = values["precision"].double().cpu().numpy()  # (T, R, K, A, M)
    recall = values["recall"].double().cpu().numpy()  # (T, K, A, M)
    labels = values["classes"].reshape(-1).tolist()  # COCOeval's catIds: the sorted labels seen
    thresholds = np.asarray(metric.iou_thresholds, dtype=np.float64)

    def mean(array: np.ndarray) -> float:
        kept = array[array > -1]
        return float(kept.mean()) if kept.size else -1.0

    def at(iou: float) -> int | None:
        found = np.flatnonzero(np.isclose(thresholds, iou))
        return int(found[0]) if found.size else None

    i50, i75 = at(0.5), at(0.75)
    out = {}
    for k, label in enumerate(labels):
        p = precision[:, :, k, 0, -1]
        out[int(label)] = {"ap": mean(p), "ap50": mean(p[i50]) if i50 is not None else -1.0,
                           "ap75": mean(p[i75]) if i75 is not None else -1.0, "ar100": mean(recall[:, k, 0, -1])}
    return out
