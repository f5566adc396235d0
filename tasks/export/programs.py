"""What the ``torch.export`` targets share (``--format executorch|aoti|coreml``): the graph(s) a task hands
them, the refusal a target gives when it cannot apply, the metadata beside each file and the tensor parity
of a lowered program against the eager graph.

Each task module (:mod:`tasks.export.classification`, ...) says once, in ``program(request)``, which
module is its graph, with its example and parity inputs and the shapes that may vary
(:class:`TaskProgram`); each target module (:mod:`tasks.export.executorch`,
:mod:`tasks.export.aoti`, :mod:`tasks.export.coreml_target`) lowers such a graph
(``lower(graph, path, calibration)``) and loads it back as a callable (``load(path)``), and
:func:`export_program` joins the two.
"""
from __future__ import annotations

import importlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from tasks.export.onnx import ATOL, Check, ExportReport, ExportRequest

#: ``--format`` values and the module of each target; ``all`` is every one of them
TARGET_MODULES = {"onnx": "tasks.export.onnx", "executorch": "tasks.export.executorch", "aoti": "tasks.export.aoti",
                  "coreml": "tasks.export.coreml_target"}
FORMATS = (*TARGET_MODULES, "all")
#: the largest batch a bounded program (ExecuTorch plans its memory for it) takes; bigger batches are split
MAX_BATCH = 16


class Refused(Exception):
    """A target that cannot apply to a checkpoint: one line naming the target and why (never a traceback)."""


@dataclass
class ProgramGraph:
    """One graph a target lowers.

    ``module`` takes ``example_inputs`` (positional tensors named ``input_names``) and returns a tuple of
    tensors named ``output_names``; ``dynamic_shapes`` gives, per input, the axes that may vary
    (``{axis: torch.export.Dim or Dim.AUTO}``); ``parity_inputs`` are ``(inputs, description)`` pairs the
    lowered program is compared with the module on; ``compare(expected, got, where)`` turns one such
    comparison into checks (default: the largest difference of each float output, :data:`ATOL`)."""

    name: str
    module: nn.Module
    example_inputs: tuple
    input_names: Sequence[str]
    output_names: Sequence[str]
    dynamic_shapes: tuple
    parity_inputs: list[tuple[tuple, str]]
    compare: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], str], list[Check]] | None = None
    #: inputs at the largest shapes the dynamic axes allow (ExecuTorch plans its memory for the example's)
    bound_inputs: tuple | None = None
    #: ExecuTorch: a static program at ``bound_inputs``' shapes, smaller batches padded (see executorch.py)
    static_for_executorch: bool = False

    def checks(self, expected: Sequence[torch.Tensor], got: Sequence[torch.Tensor], where: str) -> list[Check]:
        if self.compare is not None:
            return self.compare(expected, got, where)
        return [Check(f"max |{name}| difference, {where}", float((e.float() - g.float()).abs().max()), ATOL)
                for name, e, g in zip(self.output_names, expected, got) if e.is_floating_point()]


@dataclass
class TaskProgram:
    """A task's graphs for the ``torch.export`` targets, the metadata every file carries (``suite.*`` in
    ONNX) and files written beside them (translation's tokenizer). ``int8`` is why INT8 does not apply
    (``None``: it does); ``notes`` go into the report as they are."""

    graphs: list[ProgramGraph]
    metadata: dict[str, Any]
    docs: dict[str, str]
    side_files: dict[str, bytes] = field(default_factory=dict)
    int8_refusal: str | None = None
    notes: list[str] = field(default_factory=list)


def target_module(name: str):
    return importlib.import_module(TARGET_MODULES[name])


def as_tuple(outputs) -> tuple:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def eager(graph: ProgramGraph, inputs: tuple) -> tuple:
    with torch.no_grad():
        return as_tuple(graph.module(*inputs))


def export_graph(graph: ProgramGraph, at_bounds: bool = False, static: bool = False) -> torch.export.ExportedProgram:
    """``torch.export`` of ``graph`` with its dynamic shapes, traced on its example inputs or, ``at_bounds``,
    on its inputs at the largest shapes (where it has them)."""
    if not isinstance(graph.module, torch.fx.GraphModule):  # an exported module (PT2E) has no eval mode to set
        graph.module.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.export's notes on internals are not for the user
        inputs = graph.bound_inputs if at_bounds and graph.bound_inputs is not None else graph.example_inputs
        return torch.export.export(graph.module, inputs, dynamic_shapes=None if static else graph.dynamic_shapes,
                                   strict=False)


def file_of(stem: Path, graph: ProgramGraph, suffix: str, int8: bool) -> Path:
    """``<stem>[.<graph name>][.int8]<suffix>``."""
    parts = [stem.name] + ([graph.name] if graph.name else []) + (["int8"] if int8 else [])
    return stem.with_name(".".join(parts) + suffix)


def write_sidecar(path: Path, graph: ProgramGraph, metadata: dict, docs: dict, target: str, int8: bool,
                  files: dict[str, str]) -> Path:
    """``<file>.json`` beside a program whose format has no metadata slot: the ONNX file's ``suite.*``
    metadata, plus the target, the graph's inputs and outputs with their docs and the other files."""
    sidecar = path.with_name(path.name + ".json")
    meta = {**metadata, "format": target, "int8": int8, "graph": graph.name or "model",
            "inputs": {n: docs.get(n, "") for n in graph.input_names},
            "outputs": {n: docs.get(n, "") for n in graph.output_names}, "files": files}
    sidecar.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return sidecar


def read_sidecar(path: str | Path) -> dict[str, Any]:
    """The metadata :func:`write_sidecar` wrote beside ``path``."""
    return json.loads(Path(str(path) + ".json").read_text(encoding="utf-8"))


def one_line(err: Exception) -> str:
    """An exception's type and the first line of its message (at most 300 characters)."""
    first = next((line for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {first[:300]}"


def in_batches(run: Callable[..., tuple], batch_limit: int | None) -> Callable[..., tuple]:
    """``run`` over inputs of any batch size: split along axis 0 into batches of at most ``batch_limit``."""
    if batch_limit is None:
        return run

    def split_run(*inputs):
        size = inputs[0].shape[0]
        if size <= batch_limit:
            return run(*inputs)
        starts = range(0, size, batch_limit)
        parts = [run(*(x[i:i + batch_limit] for x in inputs)) for i in starts]
        batches = [min(batch_limit, size - i) for i in starts]
        # outputs with a batch axis are joined; one without (detection's anchors) is the same in every part
        return tuple(torch.cat(outs) if all(len(o) == b for o, b in zip(outs, batches)) else outs[0]
                     for outs in zip(*parts))

    return split_run


def export_program(target: str, program: TaskProgram, stem: Path, calibration: list[tuple] | None = None
                   ) -> tuple[ExportReport, dict[str, Callable[..., tuple]]]:
    """Lower every graph of ``program`` with ``target`` (INT8 when ``calibration`` inputs are given), write
    each file's metadata, load each back and compare it with the eager graph on its parity inputs.

    Returns the report and, per graph name, the loaded program (``None`` for a target that cannot run
    here, CoreML off macOS). Raises :class:`Refused` when the target does not apply."""
    module = target_module(target)
    int8 = calibration is not None
    if int8 and program.int8_refusal:
        raise Refused(f"{target} int8: {program.int8_refusal}")
    module.require()
    exported = {}
    for graph in program.graphs:
        try:
            exported[graph.name] = export_graph(graph, at_bounds=module.AT_BOUNDS)
        except Exception as err:  # torch.export does not take it with these bounds: one line, its own
            raise Refused(f"{target}: the {graph.name or 'graph'} does not export ({one_line(err)})") from err
        reason = module.refusal(graph, exported[graph.name], int8)
        if reason:
            raise Refused(f"{target}{' int8' if int8 else ''}: {reason}")
    report, runners = ExportReport(notes=list(program.notes)), {}
    names = {g.name or "model": file_of(stem, g, module.SUFFIX, int8).name for g in program.graphs}
    for side_name, data in program.side_files.items():
        side = stem.with_name(f"{stem.name}.{side_name}")
        side.write_bytes(data)
        names[side_name] = side.name
    for graph in program.graphs:
        path = file_of(stem, graph, module.SUFFIX, int8)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            module.lower(graph, exported[graph.name], path, calibration if graph is program.graphs[0] else None,
                         program.metadata)
        except Exception as err:  # a graph the target's compiler does not take: one line, the compiler's own
            raise Refused(f"{target}{' int8' if int8 else ''}: the {graph.name or 'graph'} does not lower "
                          f"({one_line(err)})") from err
        report.files.append(path)
        if module.SIDECAR:
            extra = module.sidecar_fields(graph) if hasattr(module, "sidecar_fields") else {}
            report.files.append(write_sidecar(path, graph, {**program.metadata, **extra}, program.docs, target,
                                              int8, names))
        run = module.load(path)
        runners[graph.name or "model"] = run
        io = f"{', '.join(graph.input_names)} -> {', '.join(graph.output_names)}"
        report.notes.append(f"{graph.name or 'graph'}: {io}")
        if run is None:
            report.notes.append(f"{path.name}: {module.CANNOT_RUN}")
            continue
        for inputs, where in graph.parity_inputs:
            try:
                got = as_tuple(run(*inputs))
            except ValueError as err:  # a static program's other size: said, not compared
                report.notes.append(f"not compared, {where}: {err}")
                continue
            except RuntimeError as err:  # written, but its runtime fails on it: one line, the files kept
                raise Refused(f"{target}{' int8' if int8 else ''}: {path.name} was written but fails at run "
                              f"time on {where} ({one_line(err)})") from err
            expected = eager(graph, inputs)
            checks = graph.checks(expected, got, where)
            if int8:  # quantized outputs are not the float ones: reported here, bounded by the score
                report.notes += [f"int8 {c.what}: {c.difference:.3g}" for c in checks]
            else:
                report.checks += checks
    return report, runners


def custom_ops(exported: torch.export.ExportedProgram, namespace: str = "suite") -> list[str]:
    """The ``namespace::`` custom ops ``exported`` calls (registered from Python: no runtime kernel)."""
    return sorted({str(node.target) for node in exported.graph.nodes
                   if node.op == "call_function" and str(node.target).startswith(f"{namespace}.")})


def image_dims(multiple: int | None, size: int) -> dict:
    """``images``' dynamic axes: the batch (1 .. :data:`MAX_BATCH`) and, where the backbone takes other
    sizes (``multiple``), height and width up to twice the export size (a bound ExecuTorch plans memory for)."""
    dims = {0: torch.export.Dim("batch", min=1, max=MAX_BATCH)}
    if multiple is not None:
        side = torch.export.Dim.AUTO(min=multiple, max=2 * size)
        dims.update({2: side, 3: side})
    return dims


def image_program(request: ExportRequest, graph: nn.Module, outputs: Sequence[str], docs: dict[str, str],
                  metadata: dict[str, Any], compare=None, fixed_reason: str | None = None) -> TaskProgram:
    """The program of an image task: ``graph`` of ``images (B, 3, H, W)`` at the export size, the batch
    dynamic and the sides where the backbone takes other sizes (``fixed_reason``: why not, overriding the
    backbone's own), parity on seeded images at the export size and one multiple above it."""
    from tasks.export.onnx import image_metadata, image_plan, parity_images, run_torch, seeded_images, size_note

    model = request.model
    # a memory layout, not a value: the programs take contiguous images (ExecuTorch 1.5 plans the
    # channels-last copy of the input with a static shape, which breaks the dynamic batch)
    model.channels_last = False
    size, trained = request.image_size()
    multiple = None if fixed_reason else image_plan(model.backbone, size)[0]
    images = seeded_images(2, size, size)
    run_torch(graph, images, model.backbone, trained)
    sides = [size] + ([size + multiple] if multiple else [])
    parity = [((x,), where) for x, where in parity_images(sides)]
    largest = 2 * size if multiple else size
    graph_spec = ProgramGraph("", graph.eval(), (images,), ["images"], list(outputs), (image_dims(multiple, size),),
                              parity, compare, (seeded_images(MAX_BATCH, size, size),), static_for_executorch=True)
    note = size_note(multiple, size, fixed_reason or model.backbone.fixed_size_reason)
    note += f"; batch up to {MAX_BATCH}{f', sides up to {largest}' if multiple else ''} (larger batches are split)"
    return TaskProgram([graph_spec], {**metadata, **image_metadata(request.spec, size, multiple)}, docs, notes=[note])
