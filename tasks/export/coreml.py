"""Convert a module to a Core ML ML program (``.mlpackage``) with coremltools, on any OS.

:func:`convert` exports the module with ``torch.export`` (MobileViTv2 blocks switched to their rank <= 5
layout, :func:`backbones.mobilevit_common.coreml_layout`: Core ML tensors have rank <= 5), converts it
in float32 and records ``metadata`` in the model's ``user_defined_metadata``. Only the conversion runs
here: running the package needs macOS (Core ML).
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from backbones.mobilevit_common import coreml_layout

#: suffixes coremltools appends to the name of the torch node a MIL op comes from
_MIL_SUFFIX = re.compile(r"(_cast_fp(16|32))+$")


def convert(module: nn.Module, example_inputs: tuple, path: Path, metadata: dict[str, str]) -> Path:
    """Write ``module`` (in eval mode, at the fixed shapes of ``example_inputs``) to ``path``, an
    ``.mlpackage`` directory, and return ``path``.

    Raises ``ValueError`` for a path without the ``.mlpackage`` suffix, metadata that is not
    ``str -> str``, or a graph coremltools refuses (naming the op and the module it is in);
    ``ImportError`` when coremltools is missing."""
    path = Path(path)
    if path.suffix != ".mlpackage":
        raise ValueError(f"a Core ML ML program is an .mlpackage directory, got path {str(path)!r}")
    bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise ValueError(f"Core ML metadata maps str to str, got {bad!r}")
    try:
        import coremltools as ct
    except ImportError as error:
        raise ImportError("Core ML conversion needs coremltools: pip install -e '.[deploy]'") from error

    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), coreml_layout(module), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # coremltools warns about every untested torch version
            exported = torch.export.export(module, tuple(example_inputs), strict=False).run_decompositions({})
            try:
                model = ct.convert(exported, convert_to="mlprogram", compute_precision=ct.precision.FLOAT32)
            except (ValueError, RuntimeError, NotImplementedError, AssertionError) as error:
                raise ValueError(f"coremltools cannot convert {type(module).__name__}"
                                 f"{_where(exported, str(error))}: {error}") from error
    finally:
        module.train(was_training)
    model.user_defined_metadata.update(metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(str(path))
    return path


def _where(exported: torch.export.ExportedProgram, message: str) -> str:
    """' at <torch op> in <module path>' for the graph node a coremltools message names, else ''."""
    nodes = {node.name: node for node in exported.graph.nodes}
    for quoted in re.findall(r"[\"']([\w.]+)[\"']", message):
        node = nodes.get(_MIL_SUFFIX.sub("", quoted))
        if node is not None:
            stack = node.meta.get("nn_module_stack") or {}
            owner = next(reversed(stack.values()))[0] if stack else "the top module"
            return f" at {node.target} in {owner or 'the top module'}"
    return ""
