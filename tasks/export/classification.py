"""ONNX graph of a classification checkpoint: ``images (B, 3, H, W) -> logits (B, K)``, plus
``probabilities (B, K)`` with ``--probabilities true``. Parity is checked at the export size and, when
the backbone takes other sizes (:attr:`backbones.base.Backbone.size_multiple`), one multiple above it."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from tasks.export.onnx import ATOL, Check, ExportReport, ExportRequest, export_image_graph, parity_images
from tasks.export.programs import TaskProgram, image_program

#: the command's own flags, with their help
FLAGS = {"probabilities": "also output softmax probabilities (B, K)"}


class ClassifierGraph(nn.Module):
    """images (B, 3, H, W) -> logits (B, K) [, probabilities (B, K)]."""

    def __init__(self, task: nn.Module, probabilities: bool = False):
        super().__init__()
        self.task, self.probabilities = task, probabilities

    def forward(self, images: torch.Tensor):
        logits = self.task(images)
        return (logits, logits.float().softmax(-1)) if self.probabilities else logits


DOCS = {"images": "float32 (batch, 3, height, width), RGB, (pixels / 255 - mean) / std",
        "logits": "float32 (batch, classes), class i = suite.class_names[i]",
        "probabilities": "float32 (batch, classes), softmax of logits"}
#: the score ``test`` logs (a fraction) in points
SCORE_POINTS = 100.0


def graph_of(request: ExportRequest) -> tuple[ClassifierGraph, list[str], dict]:
    """(the graph, its output names, its metadata)."""
    model = request.model
    graph = ClassifierGraph(model, request.options.get("probabilities", False)).eval()
    outputs = ["logits", "probabilities"] if graph.probabilities else ["logits"]
    return graph, outputs, {"task": "classification", "class_names": model.class_names}


def program(request: ExportRequest) -> TaskProgram:
    """The graph for the torch.export targets (:mod:`tasks.export.programs`)."""
    graph, outputs, metadata = graph_of(request)
    return image_program(request, graph, outputs, DOCS, metadata)


def score_with(model: nn.Module, runners: dict, target: str) -> None:
    """Make ``model``'s ``test`` run the exported graph: its forward returns the program's logits."""
    model.forward = lambda images: runners["model"](images)[0]


def export(request: ExportRequest) -> ExportReport:
    """Write the graph of ``request.model`` to ``request.output``, run it with ONNX Runtime and compare."""
    graph, outputs, metadata = graph_of(request)
    report, session, sides = export_image_graph(request, graph, outputs, DOCS, metadata)
    for images, where in parity_images(sides):
        with torch.no_grad():
            expected = graph(images)
        expected = expected if isinstance(expected, tuple) else (expected,)
        got = session.run(None, {"images": images.numpy()})
        for name, e, g in zip(outputs, expected, got):
            report.checks.append(Check(f"max |{name}| difference, {where}", float(np.abs(e.numpy() - g).max()), ATOL))
    return report
