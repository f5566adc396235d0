"""ONNX graph of a segmentation checkpoint: ``images (B, 3, H, W) -> labels (B, H, W)`` (the arg-max class
per pixel at the input resolution), plus ``logits (B, K, H, W)`` with ``--logits true``. Parity counts the
pixels whose class differs, at the export size and one size multiple above it where the backbone takes it."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks.export.onnx import ATOL, Check, ExportReport, ExportRequest, export_image_graph, parity_images
from tasks.export.programs import TaskProgram, image_program

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


DOCS = {"images": "float32 (batch, 3, height, width), RGB, (pixels / 255 - mean) / std",
        "labels": "int64 (batch, height, width), the arg-max class per pixel, class i = suite.class_names[i]",
        "logits": "float32 (batch, classes, height, width), upsampled bilinearly to the input size"}
#: the score ``test`` logs (a fraction) in points
SCORE_POINTS = 100.0


def metadata_of(model: nn.Module) -> dict:
    return {"task": "segmentation", "class_names": model.class_names}


def label_checks(expected: tuple, got: tuple, where: str) -> list[Check]:
    """The graph's ``labels`` [and ``logits``] (``got``) against PyTorch's (``expected``, logits last)."""
    logits = expected[-1]
    checks = [Check(f"pixels whose class differs, {where} (ties within {ATOL:.0e} excepted)",
                    float(label_disagreements(logits, torch.as_tensor(got[0]))), 0)]
    if len(got) > 1:
        checks.append(Check(f"max |logits| difference, {where}",
                            float((logits - torch.as_tensor(got[1])).abs().max()), ATOL))
    return checks


def program(request: ExportRequest) -> TaskProgram:
    """The graph for the torch.export targets (:mod:`tasks.export.programs`): labels and logits always
    (the score needs the logits)."""
    graph = SegmenterGraph(request.model, logits=True)
    return image_program(request, graph, ["labels", "logits"], DOCS, metadata_of(request.model), label_checks)


def score_with(model: nn.Module, runners: dict, target: str) -> None:
    """Make ``model``'s ``test`` run the exported graph: its forward gives the program's logits, upsampled
    from the input size to the size ``test`` asks for where they differ (one-hot labels for an ONNX graph
    written without ``--logits``: the score reads only their arg-max)."""
    run = runners["model"]

    def forward(images: torch.Tensor, size=None) -> dict[str, torch.Tensor]:
        out = run(images)
        logits = out[1] if len(out) > 1 else F.one_hot(out[0], len(model.class_names)).permute(0, 3, 1, 2).float()
        if size is not None and tuple(size) != tuple(logits.shape[-2:]):
            logits = F.interpolate(logits, size=tuple(size), mode="bilinear", align_corners=False)
        return {"out": logits}

    model.forward = forward


def export(request: ExportRequest) -> ExportReport:
    """Write the graph of ``request.model`` to ``request.output``, run it with ONNX Runtime and compare."""
    model = request.model
    graph = SegmenterGraph(model, request.options.get("logits", False)).eval()
    outputs = ["labels", "logits"] if graph.logits else ["labels"]
    report, session, sides = export_image_graph(request, graph, outputs, DOCS, metadata_of(model))
    for images, where in parity_images(sides):
        with torch.no_grad():
            logits = model(images)["out"]
        got = session.run(None, {"images": images.numpy()})
        report.checks += label_checks((logits,), got, where)
    return report


def label_disagreements(logits: torch.Tensor, labels: torch.Tensor, tie: float = ATOL) -> int:
    """Pixels (or rows) where ``labels`` is not the arg-max of ``logits`` (B, K, ...), not counting
    those where the chosen class's logit is within ``tie`` of the best (float noise decides those)."""
    chosen = logits.gather(1, labels.unsqueeze(1).clamp(min=0)).squeeze(1)
    return int((chosen < logits.amax(1) - tie).sum())
