"""Core ML target (``--format coreml``): ``<stem>.mlpackage`` (an ML program, float32), converted on Linux
by coremltools from the ``torch.export`` program; the ``suite.*`` metadata is in the model's
``user_defined_metadata``. Running it needs macOS (Core ML): here only the conversion is checked.

The package takes one image at the export size (batch 1, fixed sides). Core ML tensors have rank <= 5:
the graph is exported with the MobileViT blocks in their rank <= 5 layout
(``backbones.mobilevit_common.coreml_layout``, equal in PyTorch to the default path), and a graph that
still holds a rank-6 tensor is refused, naming the op and the module.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path

import torch

from tasks.export.programs import ProgramGraph, export_graph

try:  # the MobileViT blocks' rank <= 5 layout, where the backbones have it
    from backbones.mobilevit_common import coreml_layout
except ImportError:
    coreml_layout = None

SUFFIX = ".mlpackage"
AT_BOUNDS = False
SIDECAR = False
CANNOT_RUN = "needs macOS to run (Core ML); the conversion is checked, the outputs are not"
#: the largest tensor rank Core ML holds
MAX_RANK = 5


def require() -> None:
    if importlib.util.find_spec("coremltools") is None:
        raise ImportError("--format coreml needs coremltools, which is not installed. Install the extra: "
                          "pip install -e '.[deploy]'")


def first_high_rank(exported: torch.export.ExportedProgram) -> str | None:
    """The first op of ``exported`` whose output has rank > :data:`MAX_RANK`, with the module it is in."""
    for node in exported.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dim() > MAX_RANK:
            stack = node.meta.get("nn_module_stack") or {}
            where = next(reversed(stack.values()))[0] if stack else "the graph"
            return f"{node.target} in {where} makes a rank-{value.dim()} tensor"
    return None


def core_ml_layout(module: torch.nn.Module):
    """The context in which ``module``'s blocks run with tensors of rank <= 5 (nothing to change without it)."""
    return coreml_layout(module) if coreml_layout is not None else contextlib.nullcontext(module)


def refusal(graph: ProgramGraph, exported: torch.export.ExportedProgram, int8: bool) -> str | None:
    if int8:
        return "INT8 is built for executorch and onnx, not for Core ML"
    high = first_high_rank(exported)
    if high and coreml_layout is not None:  # the default layout has a rank-6 tensor: the Core ML one?
        with core_ml_layout(graph.module):
            high = first_high_rank(export_graph(graph))
    if high:
        return f"Core ML tensors have rank <= {MAX_RANK}: {high}"
    return None


def lower(graph: ProgramGraph, exported: torch.export.ExportedProgram, path: Path, calibration, metadata: dict) -> Path:
    """Convert ``graph`` at batch 1 and its example size into a float32 ML program at ``path``
    (:func:`tasks.export.coreml.convert`, which runs the blocks in their Core ML layout)."""
    from tasks.export.coreml import convert

    one = tuple(x[:1] for x in graph.example_inputs)
    return convert(graph.module, one, path, {f"suite.{k}": v if isinstance(v, str) else json.dumps(v)
                                             for k, v in metadata.items()})


def load(path: Path):
    return None  # Core ML runs on macOS only
