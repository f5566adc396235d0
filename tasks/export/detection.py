"""ONNX graph of a detection checkpoint: ``images (B, 3, S, S) -> boxes (B, D, 4)`` (x1, y1, x2, y2 in input
pixels), ``scores (B, D)``, ``labels (B, D)`` (0 .. K-1) and ``num_detections (B,)``. Box decoding, the
per-class top-k, the score threshold, per-class non-maximum suppression (ONNX ``NonMaxSuppression``) and the
best ``D = detections_per_image`` all run inside the graph; row ``i >= num_detections`` is padding (score 0,
label -1, box 0). Nothing is left to do outside but scaling the boxes to the original image. The input size
is fixed: the anchors are constants of the graph.

The selection is the head's own (:meth:`heads.ssdlite.SSDLiteHead.select`, which ``postprocess`` runs for
``test`` and ``predict``); this module only gives ONNX the two ops of it the exporter cannot translate."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn as nn

import heads.ssdlite  # noqa: F401  (registers torch.ops.suite.nms_keep_mask, which the graph calls)
from heads.ssdlite import SSDLiteOutputs
from tasks.export.onnx import (ATOL, BOX_ATOL, Check, ExportReport, ExportRequest, export_graph, image_metadata,
                               io_note, ort_session, run_torch, seeded_images, size_note)
from tasks.export.programs import TaskProgram, image_program

#: the command's own flags, with their help
FLAGS: dict[str, str] = {}


def _nms_keep_mask_onnx(boxes, scores, iou_threshold: float, score_threshold: float):
    """ONNX graph of :func:`heads.ssdlite.nms_keep_mask` (onnxscript, traced when the exporter meets the op)."""
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


def _stable_sort_onnx(values, stable: bool = False, dim: int = -1, descending: bool = False):
    """ONNX graph of ``torch.sort(values, dim, descending, stable=True)``, which torch's exporter does not
    translate: a TopK over the whole axis. ONNX defines TopK's order of equal values, the lower index
    first, which is a stable sort's."""
    from onnxscript import opset18 as op

    length = op.Gather(op.Shape(values), op.Constant(value_ints=[dim]))
    return op.TopK(values, length, axis=dim, largest=1 if descending else 0, sorted=1)


CUSTOM_TRANSLATIONS = {torch.ops.suite.nms_keep_mask.default: _nms_keep_mask_onnx,
                       torch.ops.aten.sort.stable: _stable_sort_onnx}


class DetectorGraph(nn.Module):
    """images (B, 3, S, S) -> ``boxes (B, D, 4)`` x1y1x2y2 in input pixels, ``scores (B, D)``,
    ``labels (B, D)`` int64 and ``num_detections (B,)`` int64, best first; rows past
    ``num_detections`` are padding (box 0, score 0, label -1).

    The head's own selection, :meth:`heads.ssdlite.SSDLiteHead.select`, the one
    ``SSDLiteHead.postprocess`` runs: the ``topk_candidates`` best anchors per class, score >
    ``score_threshold``, per-class NMS, the best ``detections_per_image`` per image."""

    def __init__(self, task: nn.Module):
        super().__init__()
        self.task = task

    def forward(self, images: torch.Tensor):
        head = self.task.head
        return tuple(head.select(*head.scores_and_boxes(self.task(images), images.shape[-2:])))


class RawDetectorGraph(nn.Module):
    """images (B, 3, S, S) -> the head's outputs, :class:`heads.ssdlite.SSDLiteOutputs`: ``cls_logits
    (B, A, K + 1)`` (background first), ``box_regression (B, A, 4)`` and ``anchors (A, 4)`` (cx, cy, w, h as
    fractions of the input's sides, a constant). The graph of the targets without the in-graph selection:
    decoding and NMS run outside (:meth:`heads.ssdlite.SSDLiteHead.postprocess`), since NMS is a custom op
    with no ExecuTorch kernel and implemented in Python, which an AOTInductor package cannot call."""

    def __init__(self, task: nn.Module):
        super().__init__()
        self.task = task

    def forward(self, images: torch.Tensor):
        return tuple(self.task(images))


#: the score ``test`` logs (a fraction) in points
SCORE_POINTS = 100.0
RAW_DOCS = {"images": "float32 (batch, 3, size, size), RGB, (pixels / 255 - mean) / std",
            "cls_logits": "float32 (batch, anchors, classes + 1), background first",
            "box_regression": "float32 (batch, anchors, 4), box codes relative to the anchors "
                              "(suite.center_variance, suite.size_variance)",
            "anchors": "float32 (anchors, 4), cx, cy, w, h as fractions of the input's sides"}


def metadata_of(model: nn.Module) -> dict:
    head = model.head
    return {"task": "detection", "category_ids": model.category_ids, "category_names": model.category_names,
            "score_threshold": head.score_threshold, "nms_threshold": head.nms_threshold,
            "topk_candidates": head.topk_candidates, "detections_per_image": head.detections_per_image}


def program(request: ExportRequest) -> TaskProgram:
    """The raw network for the torch.export targets: decoding and NMS run outside, as ``postprocess``."""
    model = request.model
    coder = model.head.box_coder
    metadata = {**metadata_of(model), "center_variance": coder.center_variance, "size_variance": coder.size_variance,
                "selection": "outside the graph: decode, per-class top-k, threshold, per-class NMS, best "
                             "detections_per_image (heads.ssdlite.SSDLiteHead.postprocess)"}
    found = image_program(request, RawDetectorGraph(model), ["cls_logits", "box_regression", "anchors"], RAW_DOCS,
                          metadata, fixed_reason="the anchors are constants of the graph")
    found.notes.append("decoding and NMS outside the graph (NMS is a Python custom op): SSDLiteHead.postprocess")
    return found


def score_with(model: nn.Module, runners: dict, target: str) -> None:
    """Make ``model``'s ``test`` run the exported graph. A program of the raw head (every target but ONNX)
    replaces the forward and ``test`` decodes and selects as ever; the ONNX graph selects inside, so the
    forward stays (``test``'s loss needs the raw outputs) and the graph's detections replace
    ``postprocess``'s, their boxes scaled from the input's pixels to each original image's."""
    run = runners["model"]
    if target != "onnx":
        model.forward = lambda images: SSDLiteOutputs(*run(images))
        return
    forward, inputs = model.forward, {}

    def keep_images(images: torch.Tensor):
        inputs["images"] = images
        return forward(images)

    def postprocess(outputs, image_size, original_sizes=None):
        boxes, scores, labels, counts = run(inputs["images"])
        if original_sizes is not None:
            sizes = torch.as_tensor(original_sizes, dtype=torch.float32).reshape(-1, 2)
            boxes = boxes * (sizes / torch.tensor(image_size, dtype=torch.float32))[:, [1, 0, 1, 0]].unsqueeze(1)
        return [{"boxes": b[:n], "scores": s[:n], "labels": c[:n]}
                for b, s, c, n in zip(boxes, scores, labels, counts.tolist())]

    model.forward, model.head.postprocess = keep_images, postprocess


def export(request: ExportRequest) -> ExportReport:
    """Write the graph(s) of ``request.model`` to ``request.output``, run them with ONNX Runtime and compare."""
    model, output, opset = request.model, request.output, request.opset
    size, trained = request.image_size()
    graph = DetectorGraph(model).eval()
    images = seeded_images(2, size, size)
    run_torch(model, images, model.backbone, trained)  # also caches the anchors for this size
    docs = {"images": "float32 (batch, 3, size, size), RGB, (pixels / 255 - mean) / std",
            "boxes": "float32 (batch, detections, 4) x1, y1, x2, y2 in input pixels; rows >= num_detections are 0",
            "scores": "float32 (batch, detections), best first; rows >= num_detections are 0",
            "labels": "int64 (batch, detections), label i = suite.category_ids[i] / suite.category_names[i]; "
                      "rows >= num_detections are -1",
            "num_detections": "int64 (batch,), how many rows of each image are detections"}
    metadata = {**metadata_of(model), **image_metadata(request.spec, size, None)}
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
