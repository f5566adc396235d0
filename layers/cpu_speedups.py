"""The one switch for the CPU speed paths of the shared layers.

Each path gives the plain path's results (to float32 rounding) and is kept only while it gains
at least 5 % on a number a user sees (``benchmarks/RESULTS.md``, "CPU speed paths";
``benchmarks/bench_cpu_paths.py`` measures them):

- ``fold_batchnorm``: BatchNorm folded into the convolution before it (:class:`layers.conv.ConvNormAct`),
  at CPU inference;
- ``depthwise_weight_grad``: the weight gradient of 5x5 and larger depthwise convs as one grouped
  convolution (:class:`layers.conv.DepthwiseConv2d`), in CPU training: the one training path, kept
  for the segmentation demo's fit time.

``tasks.cli.runtime.reuse_freed_memory`` (glibc's ``mallopt``, process-wide) obeys the same switch.
Removed for gaining less than 5 %: oneDNN's fused linear with its epilogue, and explicit attention
for small score matrices.

The inference path runs on float32 CPU tensors with autograd off, outside any tracer, exporter,
compiler or dispatch mode (such as the FLOP counter), which all need the standard ops. GPUs always
take the plain ops.

``SUITE_CPU_SPEEDUPS=0`` turns them off for the process; :func:`cpu_speedups` turns them (or some
of them) off or on for a block::

    with cpu_speedups(False):
        reference = model(images)
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
from layers.compat import in_dispatch_mode

PATHS = ("fold_batchnorm", "depthwise_weight_grad")

#: path -> on; all on unless ``SUITE_CPU_SPEEDUPS=0``
_enabled: dict[str, bool] = dict.fromkeys(PATHS, os.environ.get("SUITE_CPU_SPEEDUPS", "1") != "0")


def enabled(path: str) -> bool:
    """Whether ``path`` (a name of :data:`PATHS`) is switched on."""
    return _enabled[path]


@contextmanager
def cpu_speedups(on: bool, paths: tuple[str, ...] = PATHS) -> Iterator[None]:
    """Switch ``paths`` (all by default) on or off inside the block; the previous setting comes back after."""
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown CPU speed path(s) {sorted(unknown)}; valid: {', '.join(PATHS)}")
    before = dict(_enabled)
    _enabled.update(dict.fromkeys(paths, on))
    try:
        yield
    finally:
        _enabled.update(before)


def cpu_inference(path: str, x: torch.Tensor) -> bool:
    """Whether ``path`` may run on ``x``: switched on, a float32 CPU tensor, autograd off, and no
    tracer, exporter, compiler or dispatch mode watching the ops."""
    return (
        _enabled[path]
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()
        and not torch.jit.is_tracing()
        and not torch.onnx.is_in_onnx_export()
        and not torch.compiler.is_compiling()
        and not torch.compiler.is_exporting()
        and not in_dispatch_mode()
    )
