"""What every task's ONNX export shares: writing a graph with its metadata, running it with ONNX
Runtime, the parity checks and the report ``export`` prints.

Each task's graph and its parity checks live beside the task (:mod:`tasks.export.classification`,
:mod:`tasks.export.detection`, :mod:`tasks.export.segmentation`, :mod:`tasks.export.translation`); each
task's declaration names its exporter module (``export: tasks.export.detection`` in
``configs/detect/task.yaml``) and :mod:`tasks.export.command` runs the command.

Images enter a graph as the model was trained: float32 RGB, ``(pixel / 255 - mean) / std``; every file
carries what a deployer needs in its metadata (``suite.*`` keys). Which image sizes one graph takes is
the backbone's own :attr:`backbones.base.Backbone.size_multiple`.
"""
from __future__ import annotations

import importlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from datamodules.input_spec import InputSpec

#: the oldest opset the exporter writes without conversion (ONNX Runtime >= 1.14) and the newest it knows
MIN_OPSET, MAX_OPSET = 18, 23
DEFAULT_OPSET = 18
#: largest |ONNX Runtime - PyTorch| accepted for float32 logits and maps, and for detection boxes (pixels)
ATOL = 1e-4
BOX_ATOL = 1e-3
EXTRA_PACKAGES = ("onnx", "onnxscript", "onnxruntime")


# -- preconditions ---------------------------------------------------------------------------------
def require_export_extra() -> None:
    """Fail, naming what is missing and how to install it, unless onnx, onnxscript and onnxruntime import."""
    missing = []
    for name in EXTRA_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(f"`export` needs the optional packages {', '.join(EXTRA_PACKAGES)}; "
                          f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed. "
                          "Install the extra: pip install -e '.[export]' (or pip install 'visionlang-suite[export]').")


def check_opset(opset: int) -> None:
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"--opset {opset} is not supported: the exporter writes ONNX opsets {MIN_OPSET} to "
                         f"{MAX_OPSET} (torch {torch.__version__.split('+')[0]}). Use --opset {DEFAULT_OPSET} "
                         "(the default, read by ONNX Runtime >= 1.14) or a newer one your runtime reads.")


def export_graph(module: nn.Module, inputs: tuple, path: Path, input_names: Sequence[str],
                 output_names: Sequence[str], dynamic_shapes: dict, opset: int, metadata: dict[str, Any],
                 docs: dict[str, str], custom_translations: dict | None = None) -> Path:
    """Export ``module`` with torch's ONNX exporter (torch.export + onnxscript), with ``metadata``
    (``suite.*`` keys, JSON values) and a doc string per input/output (``docs``), into one file.
    ``custom_translations`` maps the graph's custom ops to their onnxscript functions."""
    module.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.export's notes on internals are not for the user
        program = torch.onnx.export(module, inputs, dynamo=True, opset_version=opset, input_names=list(input_names),
                                    output_names=list(output_names), dynamic_shapes=dynamic_shapes,
                                    custom_translation_table=custom_translations, verbose=False)
    model = program.model
    model.metadata_props.update({f"suite.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
    for value in [*model.graph.inputs, *model.graph.outputs]:
        value.doc_string = docs.get(value.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(path, external_data=False)
    return path


def ort_session(path: str | Path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def session_runner(session):
    """An ONNX Runtime session as a callable of tensors (its inputs in order) -> tuple of tensors."""
    names = [value.name for value in session.get_inputs()]

    def run(*inputs: torch.Tensor) -> tuple:
        return tuple(torch.from_numpy(out) for out in session.run(None, {n: x.numpy() for n, x in zip(names, inputs)}))

    return run


def read_metadata(session) -> dict[str, Any]:
    """The ``suite.*`` metadata of an ONNX Runtime session's model, JSON values decoded."""
    out = {}
    for key, value in session.get_modelmeta().custom_metadata_map.items():
        if key.startswith("suite."):
            try:
                out[key[6:]] = json.loads(value)
            except json.JSONDecodeError:
                out[key[6:]] = value
    return out


def graph_shapes(session) -> dict[str, list]:
    """name -> shape ([int or dimension name]) of every input and output of a session."""
    return {v.name: list(v.shape) for v in [*session.get_inputs(), *session.get_outputs()]}


def _shape_text(shape: list) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


# -- what an export reports ------------------------------------------------------------------------------------
@dataclass
class Check:
    """One parity measurement: ``what`` was compared, the largest difference and its tolerance."""

    what: str
    difference: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.difference <= self.tolerance

    def __str__(self) -> str:
        if self.tolerance == 0:  # a count
            return f"{self.what}: {int(self.difference)}{'' if self.ok else '  FAILED'}"
        return f"{self.what}: {self.difference:.1e} (tolerance {self.tolerance:.0e}){'' if self.ok else '  FAILED'}"


@dataclass
class ExportReport:
    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def __str__(self) -> str:
        lines = [f"exported:  {f.resolve()}" for f in self.files]
        lines += [f"           {n}" for n in self.notes]
        lines += [f"parity:    {c}" for c in self.checks]
        return "\n".join(lines)



# -- what an export gets --------------------------------------------------------------------------------
@dataclass
class ExportRequest:
    """What an exporter gets: the model, the input specification to export at (the checkpoint's,
    :attr:`tasks.engine.predictor.Predictor.input_spec`, with the command line's ``--data.*`` size / mean / std) and the one it
    was ``trained`` with, where to write, the opset and the task's own flags."""

    model: nn.Module
    spec: InputSpec | None
    trained: InputSpec | None
    output: Path
    opset: int
    options: dict

    def image_size(self) -> tuple[int, str]:
        """(the size to export at, the size the checkpoint was trained at, as text)."""
        size = self.spec.image_size if self.spec is not None else None
        if size is None:
            raise ValueError("the checkpoint records no input size (its input_spec) to export at: give "
                             "--data.image_size N (--data.crop_size N for segmentation)")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"the export size must be a positive whole number of pixels, got {size!r} "
                             "(--data.image_size / --data.crop_size)")
        trained = self.trained.image_size if self.trained is not None else None
        return size, f"{trained}x{trained}" if trained is not None else "an unrecorded size"


def seeded_images(batch: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


def run_torch(model: nn.Module, images: torch.Tensor, backbone: nn.Module, trained_size: str):
    """The PyTorch output for ``images``, or an error naming the size the backbone refused."""
    try:
        with torch.no_grad():
            return model(images)
    except (ValueError, RuntimeError) as err:
        raise ValueError(f"{type(backbone).__name__} cannot take {images.shape[-2]}x{images.shape[-1]} images: {err}. "
                         f"Export at a size it takes: the checkpoint was trained at {trained_size} "
                         "(--data.image_size / --data.crop_size).") from None


def image_plan(backbone: nn.Module, size: int) -> tuple[int | None, dict]:
    """(the multiple the graph's sides may be, the dynamic axes of ``images``) for an export at ``size``."""
    multiple = backbone.size_multiple
    if multiple is not None and size % multiple:
        multiple = None  # the graph would hold a resize branch that fits only sizes like this one
    axes = {0: "batch"} if multiple is None else {0: "batch", 2: "height", 3: "width"}
    return multiple, axes


def size_note(multiple: int | None, size: int, why_fixed: str) -> str:
    """What input sizes the graph takes, for the export report."""
    if multiple is None:
        return f"input size fixed at {size}x{size} ({why_fixed}); batch size dynamic"
    return f"height and width: any multiples of {multiple} (exported at {size}x{size}); batch size dynamic"


def image_metadata(spec: InputSpec, size: int, multiple: int | None) -> dict:
    return {"image_size": [size, size], "size_multiple": multiple, "channel_order": "RGB",
            "mean": list(spec.mean), "std": list(spec.std), "eval_resize": spec.resize,
            "resize_size": spec.resize_size,
            "normalisation": "images = (pixels / 255 - mean) / std, float32, (B, 3, H, W)"}


def io_note(session) -> str:
    shapes = graph_shapes(session)
    inputs = ", ".join(f"{v.name} {_shape_text(shapes[v.name])}" for v in session.get_inputs())
    outputs = ", ".join(f"{v.name} {_shape_text(shapes[v.name])}" for v in session.get_outputs())
    return f"{inputs} -> {outputs}"


def export_image_graph(request: ExportRequest, graph: nn.Module, outputs: Sequence[str],
                       docs: dict[str, str], metadata: dict[str, Any]) -> tuple[ExportReport, Any, list[int]]:
    """Export a graph of ``images (B, 3, H, W)`` at the input specification's size, with dynamic height
    and width where the backbone takes other sizes. Returns (the report with its size and I/O notes,
    the ONNX Runtime session, the sides to check parity at: the export size and one multiple above)."""
    model = request.model
    size, trained = request.image_size()
    multiple, axes = image_plan(model.backbone, size)
    images = seeded_images(2, size, size)
    run_torch(graph, images, model.backbone, trained)
    metadata = {**metadata, **image_metadata(request.spec, size, multiple)}
    export_graph(graph, (images,), request.output, ["images"], outputs, {"images": axes}, request.opset, metadata, docs)
    report = ExportReport([request.output], [size_note(multiple, size, model.backbone.fixed_size_reason)])
    session = ort_session(request.output)
    report.notes.append(io_note(session))
    return report, session, [size] + ([size + multiple] if multiple else [])


def parity_images(sides: Sequence[int]):
    """(images, description) per side: two seeded random images at the first side, one at each other."""
    for i, side in enumerate(sides):
        images = seeded_images(2 if i == 0 else 1, side, side, seed=i)
        yield images, f"{len(images)} random {side}x{side} image(s)"



#: the ops ONNX Runtime's static quantization turns into int8 (QDQ): the ones with weights, where the time goes.
#: Everything else (normalisation, the attention's element-wise ops, upsampling, detection's top-k, NMS
#: and box gathering) stays float, so a quantized score or coordinate never decides a selection.
INT8_OPS = ("Conv", "MatMul", "Gemm")


def quantize_onnx(source: Path, target: Path, calibration: Sequence[torch.Tensor]) -> Path:
    """``source``'s graph quantized statically by ONNX Runtime into ``target``: QDQ nodes around the
    :data:`INT8_OPS`, int8 activations (min-max calibrated on the ``images`` batches of ``calibration``)
    and symmetric per-channel int8 weights, as XNNPACK's quantizer does for ExecuTorch; the metadata is
    kept, with ``suite.int8 = true``."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.batches = iter(calibration)

        def get_next(self):
            images = next(self.batches, None)
            return None if images is None else {"images": images.numpy()}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_static(str(source), str(target), Batches(), quant_format=QuantFormat.QDQ, per_channel=True,
                        op_types_to_quantize=list(INT8_OPS), activation_type=QuantType.QInt8,
                        weight_type=QuantType.QInt8)
    model = onnx.load(str(target))
    kept = {p.key: p.value for p in onnx.load(str(source), load_external_data=False).metadata_props}
    kept["suite.int8"] = "true"
    del model.metadata_props[:]
    for key, value in kept.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(target))
    return target
