"""ONNX graph of a detection checkpoint: ``images (B, 3, S, S) -> boxes (B, D, 4)`` (x1, y1, x2, y2 in input
pixels), ``scores (B, D)``, ``labels (B, D)`` (0 .. K-1) and ``num_detections (B,)``. Box decoding, the
per-class top-k, the score threshold, per-class non-maximum suppression (ONNX ``NonMaxSuppression``) and the
best ``D = detections_per_image`` all run inside the graph; row ``i >= num_detections`` is padding (score 0,
label -1, box 0). Nothing is left to do outside but scaling the boxes to the original image. The input size
is fixed: the anchors are constants of the graph."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
from torchvision.ops import batched_nms

from tasks.export.onnx import (ATOL, BOX_ATOL, Check, ExportReport, ExportRequest, export_graph, image_metadata,
                               io_note, ort_session, run_torch, seeded_images, size_note)

#: the command's own flags, with their help
FLAGS: dict[str, str] = {}


@torch.library.custom_op("suite::nms_keep_mask", mutates_args=())
def nms_keep_mask(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float,
                  score_threshold: float) -> torch.Tensor:
    """Per-group NMS as a fixed-shape mask. boxes (G, N, 4) x1y1x2y2, scores (G, N) -> (G, N) bool:
    True for the boxes with score > ``score_threshold`` that no higher-scoring box of their group
    overlaps with IoU > ``iou_threshold``. Exported as ONNX ``NonMaxSuppression`` (one batch entry
    per group), whose output is scattered back into the mask."""
    groups, n = scores.shape
    flat_scores = scores.reshape(-1)
    candidate = (flat_scores > score_threshold).nonzero().squeeze(1)
    kept = candidate[batched_nms(boxes.reshape(-1, 4)[candidate].float(), flat_scores[candidate].float(),
                                 candidate // n, iou_threshold)]
    keep = torch.zeros(groups * n, dtype=torch.bool, device=scores.device)
    keep[kept] = True
    return keep.view(groups, n)


@nms_keep_mask.register_fake
def _nms_keep_mask_shape(boxes, scores, iou_threshold, score_threshold):
    return torch.empty_like(scores, dtype=torch.bool)


def _nms_keep_mask_onnx(boxes, scores, iou_threshold: float, score_threshold: float):
    """ONNX graph of :func:`nms_keep_mask` (onnxscript, traced when the exporter meets the op)."""
    import onnx_ir
    from onnxscript import opset18 as op

    n = op.Shape(scores, start=1, end=2)
    selected = op.NonMaxSuppression(boxes, op.Unsqueeze(scores, [1]), n, op.Constant(value_floats=[iou_threshold]),
                                    op.Constant(value_floats=[score_threshold]))  # (K, 3): group, class 0, box
    flat_index = op.Add(op.Mul(op.Gather(selected, 0, axis=1), n), op.Gather(selected, 2, axis=1))
    one = onnx_ir.tensor(np.ones(1, dtype=np.float32))
    hits = op.ScatterND(op.ConstantOfShape(op.Shape(op.Reshape(scores, [-1]))), op.Unsqueeze(flat_index, [1]),
                        op.ConstantOfShape(op.Shape(flat_index), value=one))
    return op.Reshape(op.Greater(hits, op.Constant(value_float=0.0)), op.Shape(scores))


CUSTOM_TRANSLATIONS = {torch.ops.suite.nms_keep_mask.default: _nms_keep_mask_onnx}


class DetectorGraph(nn.Module):
    """images (B, 3, S, S) -> ``boxes (B, D, 4)`` x1y1x2y2 in input pixels, ``scores (B, D)``,
    ``labels (B, D)`` int64 and ``num_detections (B,)`` int64, best first; rows past
    ``num_detections`` are padding (box 0, score 0, label -1).

    The same selection as :meth:`heads.ssdlite.SSDLiteHead.postprocess` in fixed shapes: the
    ``topk_candidates`` best anchors per class, score > ``score_threshold``, per-class NMS, the
    best ``detections_per_image`` per image."""

    def __init__(self, task: nn.Module):
        super().__init__()
        self.task = task

    def forward(self, images: torch.Tensor):
        head = self.task.head
        scores, boxes = head.scores_and_boxes(self.task(images), images.shape[-2:])  # (B, A, C), (B, A, 4)
        batch, num_anchors, num_classes = scores.shape

        k = min(head.topk_candidates, num_anchors)
        top_scores, top_anchor = scores.transpose(1, 2).topk(k, dim=2)  # (B, C, k)
        candidates = boxes.gather(1, top_anchor.reshape(batch, -1, 1).expand(-1, -1, 4))  # (B, C * k, 4)
        keep = nms_keep_mask(candidates.view(-1, k, 4), top_scores.reshape(-1, k), head.nms_threshold,
                             head.score_threshold).view(batch, -1)
        keep = keep & (top_scores.reshape(batch, -1) > head.score_threshold)
        kept_scores = torch.where(keep, top_scores.reshape(batch, -1), -1.0)

        d = min(head.detections_per_image, num_classes * k)
        best, index = kept_scores.topk(d, dim=1)  # (B, D)
        valid = best > -1.0
        det_boxes = candidates.gather(1, index.unsqueeze(-1).expand(-1, -1, 4)) * valid.unsqueeze(-1)
        det_labels = torch.where(valid, index // k, -1)
        return det_boxes, best.clamp(min=0.0), det_labels, valid.sum(dim=1)


def export(request: ExportRequest) -> ExportReport:
    """Write the graph(s) of ``request.model`` to ``request.output``, run them with ONNX Runtime and compare."""
    model, output, opset = request.model, request.output, request.opset
    size, trained = request.image_size()
    graph = DetectorGraph(model).eval()
    images = seeded_images(2, size, size)
    run_torch(model, images, model.backbone, trained)  # also caches the anchors for this size
    head = model.head
    docs = {"images": "float32 (batch, 3, size, size), RGB, (pixels / 255 - mean) / std",
            "boxes": "float32 (batch, detections, 4) x1, y1, x2, y2 in input pixels; rows >= num_detections are 0",
            "scores": "float32 (batch, detections), best first; rows >= num_detections are 0",
            "labels": "int64 (batch, detections), label i = suite.category_ids[i] / suite.category_names[i]; "
                      "rows >= num_detections are -1",
            "num_detections": "int64 (batch,), how many rows of each image are detections"}
    metadata = {"task": "detection", "category_ids": model.category_ids, "category_names": model.category_names,
                "score_threshold": head.score_threshold, "nms_threshold": head.nms_threshold,
                "topk_candidates": head.topk_candidates, "detections_per_image": head.detections_per_image,
                **image_metadata(request.spec, size, None)}
    export_graph(graph, (images,), output, ["images"], ["boxes", "scores", "labels", "num_detections"],
                 {"images": {0: "batch"}}, opset, metadata, docs, CUSTOM_TRANSLATIONS)
    report = ExportReport([output], [size_note(None, size, "the anchors are constants of the graph")])
    session = ort_session(output)
    report.notes.append(io_note(session))
    got = session.run(None, {"images": images.numpy()})
    report.checks += detection_checks(model, images, got, f"{len(images)} random {size}x{size} images")
    return report


def match_detections(expected: dict[str, torch.Tensor], boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray,
                     capacity: int, tie: float = ATOL) -> tuple[int, float, float]:
    """Compare one image's graph detections (the first ``num_detections`` rows) with PyTorch's
    (``SSDLiteHead.postprocess``). Each graph detection must have a PyTorch twin with the same
    label, its box within :data:`BOX_ATOL` and its score within ``tie``, at the same rank up to
    swaps among scores within ``tie`` of each other (float noise orders near-ties). Returns
    (detections without a twin, max box difference, max score difference); a detection whose
    score ties the last one kept when the list is full (``capacity``) may be swapped for another
    and is not counted."""
    e_boxes, e_scores, e_labels = (expected[k].float().numpy() if k != "labels" else expected[k].numpy()
                                   for k in ("boxes", "scores", "labels"))
    cut = e_scores[-1] if len(e_scores) >= capacity else -np.inf
    used = np.zeros(len(e_scores), dtype=bool)
    unmatched, box_diff, score_diff = abs(len(scores) - len(e_scores)), 0.0, 0.0
    for j in range(len(scores)):
        near = ((e_labels == labels[j]) & ~used & (np.abs(e_scores - scores[j]) <= tie)
                & (np.abs(e_boxes - boxes[j]).max(axis=1, initial=0.0) <= BOX_ATOL))
        if j < len(e_scores):
            near &= np.abs(e_scores - e_scores[j]) <= tie  # the same rank, up to near-ties
        if near.any():
            p = int(np.flatnonzero(near)[0])
            used[p] = True
            box_diff = max(box_diff, float(np.abs(e_boxes[p] - boxes[j]).max()))
            score_diff = max(score_diff, float(abs(e_scores[p] - scores[j])))
        elif scores[j] > cut + tie:
            unmatched += 1
    return unmatched, box_diff, score_diff


def detection_checks(model, images: torch.Tensor, got: Sequence[np.ndarray], where: str) -> list[Check]:
    """PyTorch's detections (``model.detect``) against the graph's padded outputs for ``images``."""
    with torch.no_grad():
        expected = model.detect(images)
    boxes, scores, labels, counts = got
    unmatched, box_diff, score_diff = 0, 0.0, 0.0
    for i, det in enumerate(expected):
        n = int(counts[i])
        u, b, s = match_detections(det, boxes[i, :n], scores[i, :n], labels[i, :n], model.head.detections_per_image)
        unmatched, box_diff, score_diff = unmatched + u, max(box_diff, b), max(score_diff, s)
    total = sum(len(d["scores"]) for d in expected)
    return [Check(f"detections without the same label and box in PyTorch's, {where} ({total} detections)",
                  unmatched, 0),
            Check(f"max |box| difference (pixels), {where}", box_diff, BOX_ATOL),
            Check(f"max |score| difference, {where}", score_diff, ATOL)]
