"""AOTInductor target (``--format aoti``): ``<stem>.pt2``, a package of C++ code compiled by Inductor for
this machine's CPU, which ``torch._inductor.aoti_load_package`` (Python) or
``torch::inductor::AOTIModelPackageLoader`` (C++, no Python) runs; ``<stem>.pt2.json`` holds the metadata.

torch.export with the graph's dynamic shapes -> ``torch._inductor.aoti_compile_and_package``. The package
is compiled for the CPU it was built on (a GPU package needs the graph exported on the GPU). Compiling
takes 30 s and more even for a small graph. No INT8 here: Inductor's x86 quantizer is another recipe than
the XNNPACK one; ``--int8`` is for ``executorch`` and ``onnx``.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from tasks.export.programs import MAX_BATCH, ProgramGraph, as_tuple, custom_ops, in_batches

SUFFIX = ".pt2"
AT_BOUNDS = False
SIDECAR = True
CANNOT_RUN = ""


def require() -> None:
    pass  # torch itself; a C++ compiler is found (or its absence reported) by Inductor


def refusal(graph: ProgramGraph, exported: torch.export.ExportedProgram, int8: bool) -> str | None:
    if int8:
        return ("INT8 is built for executorch (XNNPACK quantizer) and onnx (ONNX Runtime static quantization), "
                "not for AOTInductor")
    custom = custom_ops(exported)
    if custom:
        return (f"the {graph.name or 'graph'} calls {', '.join(custom)}, a custom op implemented in Python, "
                "which a compiled package cannot call")
    return None


def lower(graph: ProgramGraph, exported: torch.export.ExportedProgram, path: Path, calibration, metadata: dict) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Path(torch._inductor.aoti_compile_and_package(exported, package_path=str(path)))


def load(path: Path):
    """The package as a callable of tensors -> tuple of tensors (batches split at :data:`MAX_BATCH`, the
    bound of the exported batch dimension)."""
    runner = torch._inductor.aoti_load_package(str(path))

    def run(*inputs: torch.Tensor) -> tuple:
        with torch.no_grad():
            return as_tuple(runner(*inputs))

    return in_batches(run, MAX_BATCH)
