"""ExecuTorch target (``--format executorch``): ``<stem>.pte``, every op XNNPACK can take delegated to it,
run back here with ExecuTorch's Python runtime (``executorch.runtime.Runtime``); ``<stem>.pte.json`` holds
the metadata (a ``.pte`` has no slot for it).

torch.export -> ``to_edge_transform_and_lower`` with the ``XnnpackPartitioner`` -> ``to_executorch``.
Memory is planned for the shapes the graph is traced at, so it is traced at the largest it allows.
Image programs are static: ExecuTorch 1.5.1 planned the copies outside the XNNPACK delegate (the
MobileViT graphs' ``_clone_dim_order``) with the traced shape, so a dynamic batch failed at run time
("Attempted to resize a static tensor"). They take a batch of :data:`tasks.export.programs.MAX_BATCH`
images at the export size (``static_batch`` and ``image_size`` in the sidecar); the runner pads a
smaller batch and splits a larger one. Translation's encoder and decoder step need a dynamic batch and
lengths, which ExecuTorch 1.5.1 does not run (the embedding outside the delegate is planned at the
traced shape): translation is refused by name. ``--int8``: post-training static quantization in PT2E form with
ExecuTorch's ``XNNPACKQuantizer`` (symmetric, per-channel weights), calibrated on the calibration images,
then lowered the same way (the quantized convolutions and linears run as XNNPACK int8 kernels).
"""
from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import torch

from tasks.export.programs import MAX_BATCH, ProgramGraph, as_tuple, custom_ops, export_graph, in_batches

SUFFIX = ".pte"
SIDECAR = True
#: memory is planned for the shapes the graph is traced at: trace it at the largest it takes
AT_BOUNDS = True
CANNOT_RUN = ""


def require() -> None:
    for name in ("executorch", "torchao"):
        if importlib.util.find_spec(name) is None:
            raise ImportError(f"--format executorch needs {name}, which is not installed. Install the extra: "
                              "pip install -e '.[deploy]'")


def refusal(graph: ProgramGraph, exported: torch.export.ExportedProgram, int8: bool) -> str | None:
    """Why ``graph`` (``exported``) cannot become a .pte, or ``None``."""
    custom = custom_ops(exported)
    if custom:
        return (f"the {graph.name or 'graph'} calls {', '.join(custom)}, a custom op with no ExecuTorch kernel "
                "(it runs in Python only)")
    if not graph.static_for_executorch:
        # run here on the demo translator: the decoder step's embedding, outside the delegate, failed at
        # batch 4 ("Attempted to resize a static tensor. Expected shape (16, 1, 32)"), as the image
        # programs' input copy did before they became static
        return (f"the {graph.name or 'graph'} takes a batch and lengths that change from call to call, and "
                "ExecuTorch 1.5.1 plans the ops outside the XNNPACK delegate (the embedding) at the traced "
                "shape, so any other shape fails at run time")
    return None


def quantized(exported: torch.export.ExportedProgram, calibration: list[tuple]) -> torch.nn.Module:
    """The exported graph after PT2E static quantization with the XNNPACK quantizer, calibrated on
    ``calibration``."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (XNNPACKQuantizer,
                                                                         get_symmetric_quantization_config)
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    prepared = prepare_pt2e(exported.module(), quantizer)
    with torch.no_grad():
        for inputs in calibration:
            prepared(*inputs)
    return convert_pt2e(prepared)


def lower(graph: ProgramGraph, exported: torch.export.ExportedProgram, path: Path, calibration: list[tuple] | None,
          metadata: dict) -> Path:
    """Write ``graph`` (``exported``; quantized first with ``calibration``) as an XNNPACK-delegated ``.pte``."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    if calibration is not None or graph.static_for_executorch:
        module = quantized(exported, calibration) if calibration is not None else graph.module
        exported = export_graph(dataclasses.replace(graph, module=module), at_bounds=True,
                                static=graph.static_for_executorch)
    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    program = edge.to_executorch()
    path.write_bytes(program.buffer)
    return path


def sidecar_fields(graph: ProgramGraph) -> dict:
    """What the sidecar says of a static program: the one batch size and input shape it takes."""
    if not graph.static_for_executorch:
        return {}
    return {"static_batch": MAX_BATCH, "static_input_shape": list(graph.bound_inputs[0].shape)}


def load(path: Path):
    """The ``.pte``'s ``forward`` as a callable of tensors -> tuple of tensors (batches split at
    :data:`MAX_BATCH`; for a static program, a smaller batch padded with zeros and the outputs cut back)."""
    from executorch.runtime import Runtime
    from tasks.export.programs import read_sidecar

    method = Runtime.get().load_program(Path(path)).load_method("forward")
    shape = read_sidecar(path).get("static_input_shape")

    def run(*inputs: torch.Tensor) -> tuple:
        if shape is None:
            return as_tuple(method.execute([x.contiguous() for x in inputs]))
        images = inputs[0]
        if list(images.shape[1:]) != shape[1:]:
            raise ValueError(f"{Path(path).name} is a static program of {shape[2]}x{shape[3]} images, got "
                             f"{images.shape[-2]}x{images.shape[-1]}: export at that size (--data.image_size)")
        n = len(images)
        padded = torch.cat([images, images.new_zeros(shape[0] - n, *shape[1:])]) if n < shape[0] else images
        return tuple(out[:n] if out.shape[:1] == (shape[0],) else out
                     for out in as_tuple(method.execute([padded.contiguous()])))

    return in_batches(run, MAX_BATCH)
