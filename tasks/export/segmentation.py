"""ONNX graph of a segmentation checkpoint: ``images (B, 3, H, W) -> labels (B, H, W)`` (the arg-max class
per pixel at the input resolution), plus ``logits (B, K, H, W)`` with ``--logits true``. Parity counts the
pixels whose class differs, at the export size and one size multiple above it where the backbone takes it."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from tasks.export.onnx import ATOL, Check, ExportReport, ExportRequest, export_image_graph, parity_images

#: the command's own flags, with their help
FLAGS = {"logits": "also output the upsampled logits (B, K, H, W)"}


class SegmenterGraph(nn.Module):
    """images (B, 3, H, W) -> labels (B, H, W) int64 [, logits (B, K, H, W)], at the input resolution."""

    def __init__(self, task: nn.Module, logits: bool = False):
        super().__init__()
        self.task, self.logits = task, logits

    def forward(self, images: torch.Tensor):
        logits = self.task(images)["out"]
        labels = logits.argmax(1)
        return (labels, logits) if self.logits else labels


def export(request: ExportRequest) -> ExportReport:
    """Write the graph of ``request.model`` to ``request.output``, run it with ONNX Runtime and compare."""
    model = request.model
    graph = SegmenterGraph(model, request.options.get("logits", False)).eval()
    outputs = ["labels", "logits"] if graph.logits else ["labels"]
    docs = {"images": "float32 (batch, 3, height, width), RGB, (pixels / 255 - mean) / std",
            "labels": "int64 (batch, height, width), the arg-max class per pixel, class i = suite.class_names[i]",
            "logits": "float32 (batch, classes, height, width), upsampled bilinearly to the input size"}
    metadata = {"task": "segmentation", "class_names": model.class_names}
    report, session, sides = export_image_graph(request, graph, outputs, docs, metadata)
    for images, where in parity_images(sides):
        with torch.no_grad():
            logits = model(images)["out"]
        got = session.run(None, {"images": images.numpy()})
        report.checks.append(Check(f"pixels whose class differs, {where} (ties within {ATOL:.0e} excepted)",
                                   float(label_disagreements(logits, torch.from_numpy(got[0]))), 0))
        if graph.logits:
            report.checks.append(Check(f"max |logits| difference, {where}", float(np.abs(logits.numpy() - got[1]).max()),
                                       ATOL))
    return report


def label_disagreements(logits: torch.Tensor, labels: torch.Tensor, tie: float = ATOL) -> int:
    """Pixels (or rows) where ``labels`` is not the arg-max of ``logits`` (B, K, ...), not counting
    those where the chosen class's logit is within ``tie`` of the best (float noise decides those)."""
    chosen = logits.gather(1, labels.unsqueeze(1).clamp(min=0)).squeeze(1)
    return int((chosen < logits.amax(1) - tie).sum())
