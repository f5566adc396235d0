"""ONNX export of every task: ``python -m tasks.<task> export --ckpt_path CKPT [--output FILE] [--opset N]``.

The checkpoint supplies the model (as for ``validate``/``test``/``predict``); data options it
recorded may be overridden (``--data.image_size 256``). The command writes the graph next to
the checkpoint (``<ckpt stem>.onnx``) unless ``--output`` says otherwise, runs it with ONNX
Runtime against the PyTorch model on seeded random inputs, and prints where it wrote and the
difference it measured. What each task's graph computes (every input and output is named and
the batch size is dynamic):

- classification: ``images (B, 3, H, W) -> logits (B, K)``, plus ``probabilities (B, K)``
  with ``--probabilities true``;
- detection: ``images (B, 3, S, S) -> boxes (B, D, 4)`` (x1, y1, x2, y2 in input pixels),
  ``scores (B, D)``, ``labels (B, D)`` (0 .. K-1) and ``num_detections (B,)``. Box decoding,
  the per-class top-k, the score threshold, per-class non-maximum suppression (ONNX
  ``NonMaxSuppression``) and the best ``D = detections_per_image`` all run inside the graph;
  row ``i >= num_detections`` is padding (score 0, label -1, box 0). Nothing is left to do
  outside but scaling the boxes to the original image;
- segmentation: ``images (B, 3, H, W) -> labels (B, H, W)`` (the arg-max class per pixel at
  the input resolution), plus ``logits (B, K, H, W)`` with ``--logits true``;
- translation: three files named after ``--output``: ``<stem>.encoder.onnx``
  (``src (B, S) -> cross_kv (B, 2L, H, S, d), source_padding (B, S)``: the source's keys and
  values of every decoder layer's cross-attention), ``<stem>.decoder_step.onnx`` (one cached
  step: ``tokens (N, 1), cross_kv, source_padding, past_kv (N, 2L, H, t, d) -> logits (N, V),
  present_kv (N, 2L, H, t + 1, d)``) and ``<stem>.spm.model`` (the sentencepiece model).
  :mod:`tasks.onnx_translation` runs greedy and beam search on them with ONNX Runtime.

Images enter as the model was trained: float32 RGB, ``(pixel / 255 - mean) / std``; every file
carries what a deployer needs in its metadata (``suite.*`` keys: class names or category ids
and names, mean, std, the image size, the post-processing settings, token ids and search
settings for translation).

Image size. MobileViT and MobileViTv2 graphs take any height and width that are multiples of
:func:`size_multiple` (64 at output stride 32, 32 at 16, 16 at 8): there no block resizes its
input, which is the branch the graph holds. ConvMixer graphs take any multiple of its deepest
stride (the patch size without a pyramid). Parity is checked at the export size and at one
multiple above it. ViT (position embeddings) and MLP-Mixer (token-mixing MLPs) take only the
size they were built for, and so do detection graphs (the anchors are constants of the graph)
and a size that is not such a multiple.
"""
from __future__ import annotations

import importlib
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torchvision.ops import batched_nms

from heads.seq2seq import padding_bias
from layers.attention import KVCache

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


def size_multiple(backbone: nn.Module) -> int | None:
    """The multiple that input height and width must be of for one exported graph to take them
    all; ``None``: the backbone takes one fixed size (or is not known to take others).

    MobileViT v1/v2: no block resizes its input when the map at each block's stride splits into
    whole patches and the deepest stride divides the image (the graph holds the branch that
    resizes nothing). ConvMixer: only convolutions and poolings, so any multiple of its deepest
    output stride (its patch size, or the largest pyramid stride)."""
    from backbones.convmixer import ConvMixer
    from backbones.mobilevit_common import StagedBackbone

    if isinstance(backbone, ConvMixer):
        return max(backbone.feature_channels)
    if isinstance(backbone, StagedBackbone):
        multiple = max(backbone.stage_strides)
        for stride, stage in zip(backbone.stage_strides, backbone.stages):
            for block in stage:
                patch = getattr(block, "patch_size", None)
                if patch is not None:
                    multiple = math.lcm(multiple, stride * patch[0], stride * patch[1])
        return multiple
    return None


# -- an exportable non-maximum suppression ---------------------------------------------------------------
@torch.library.custom_op("suite::nms_keep_mask", mutates_args=())
def nms_keep_mask(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float,
                  score_threshold: float) -> torch.Tensor:
    """Per-group NMS as a fixed-shape mask. boxes (G, N, 4) x1y1x2y2, scores (G, N) -> (G, N) bool:
    True for the boxes with score > ``score_threshold`` that no higher-scoring box of their group
    overlaps with IoU > ``iou_threshold``. Exported as ONNX ``NonMaxSuppression`` (one batch entry
    per group), whose output is scattered back into the mask."""
    groups, n = scores.shape
    flat_scores = scores.reshape(-1)
    candidate = (flat_scores > score_threshold).nonzero().squeeze(1)
    kept = candidate[batched_nms(boxes.reshape(-1, 4)[candidate].float(), flat_scores[candidate].float(),
                                 candidate // n, iou_threshold)]
    keep = torch.zeros(groups * n, dtype=torch.bool, device=scores.device)
    keep[kept] = True
    return keep.view(groups, n)


@nms_keep_mask.register_fake
def _nms_keep_mask_shape(boxes, scores, iou_threshold, score_threshold):
    return torch.empty_like(scores, dtype=torch.bool)


def _nms_keep_mask_onnx(boxes, scores, iou_threshold: float, score_threshold: float):
    """ONNX graph of :func:`nms_keep_mask` (onnxscript, traced when the exporter meets the op)."""
    import onnx_ir
    from onnxscript import opset18 as op

    n = op.Shape(scores, start=1, end=2)
    selected = op.NonMaxSuppression(boxes, op.Unsqueeze(scores, [1]), n, op.Constant(value_floats=[iou_threshold]),
                                    op.Constant(value_floats=[score_threshold]))  # (K, 3): group, class 0, box
    flat_index = op.Add(op.Mul(op.Gather(selected, 0, axis=1), n), op.Gather(selected, 2, axis=1))
    one = onnx_ir.tensor(np.ones(1, dtype=np.float32))
    hits = op.ScatterND(op.ConstantOfShape(op.Shape(op.Reshape(scores, [-1]))), op.Unsqueeze(flat_index, [1]),
                        op.ConstantOfShape(op.Shape(flat_index), value=one))
    return op.Reshape(op.Greater(hits, op.Constant(value_float=0.0)), op.Shape(scores))


CUSTOM_TRANSLATIONS = {torch.ops.suite.nms_keep_mask.default: _nms_keep_mask_onnx}


# -- the graphs -------------------------------------------------------------------------------------------
class ClassifierGraph(nn.Module):
    """images (B, 3, H, W) -> logits (B, K) [, probabilities (B, K)]."""

    def __init__(self, task: nn.Module, probabilities: bool = False):
        super().__init__()
        self.task, self.probabilities = task, probabilities

    def forward(self, images: torch.Tensor):
        logits = self.task(images)
        return (logits, logits.float().softmax(-1)) if self.probabilities else logits


class SegmenterGraph(nn.Module):
    """images (B, 3, H, W) -> labels (B, H, W) int64 [, logits (B, K, H, W)], at the input resolution."""

    def __init__(self, task: nn.Module, logits: bool = False):
        super().__init__()
        self.task, self.logits = task, logits

    def forward(self, images: torch.Tensor):
        logits = self.task(images)["out"]
        labels = logits.argmax(1)
        return (labels, logits) if self.logits else labels


class DetectorGraph(nn.Module):
    """images (B, 3, S, S) -> ``boxes (B, D, 4)`` x1y1x2y2 in input pixels, ``scores (B, D)``,
    ``labels (B, D)`` int64 and ``num_detections (B,)`` int64, best first; rows past
    ``num_detections`` are padding (box 0, score 0, label -1).

    The same selection as :meth:`heads.ssdlite.SSDLiteHead.postprocess` in fixed shapes: the
    ``topk_candidates`` best anchors per class, score > ``score_threshold``, per-class NMS, the
    best ``detections_per_image`` per image."""

    def __init__(self, task: nn.Module):
        super().__init__()
        self.task = task

    def forward(self, images: torch.Tensor):
        head = self.task.head
        cls_logits, box_regression, anchors = self.task(images)
        height, width = images.shape[-2:]
        batch, num_anchors, _ = cls_logits.shape
        num_classes = head.num_classes
        scores = F.softmax(cls_logits.float(), dim=-1)[..., 1:]  # (B, A, C)
        boxes = head.box_coder.decode(box_regression, anchors).clamp(0.0, 1.0)
        boxes = boxes * boxes.new_tensor([width, height, width, height])  # (B, A, 4)

        k = min(head.topk_candidates, num_anchors)
        top_scores, top_anchor = scores.transpose(1, 2).topk(k, dim=2)  # (B, C, k)
        candidates = boxes.gather(1, top_anchor.reshape(batch, -1, 1).expand(-1, -1, 4))  # (B, C * k, 4)
        keep = nms_keep_mask(candidates.view(-1, k, 4), top_scores.reshape(-1, k), head.nms_threshold,
                             head.score_threshold).view(batch, -1)
        keep = keep & (top_scores.reshape(batch, -1) > head.score_threshold)
        kept_scores = torch.where(keep, top_scores.reshape(batch, -1), -1.0)

        d = min(head.detections_per_image, num_classes * k)
        best, index = kept_scores.topk(d, dim=1)  # (B, D)
        valid = best > -1.0
        det_boxes = candidates.gather(1, index.unsqueeze(-1).expand(-1, -1, 4)) * valid.unsqueeze(-1)
        det_labels = torch.where(valid, index // k, -1)
        return det_boxes, best.clamp(min=0.0), det_labels, valid.sum(dim=1)


class TranslationEncoderGraph(nn.Module):
    """src (B, S) int64 padded with pad_id -> ``cross_kv (B, 2L, H, S, d)`` (layer i's cross-attention
    keys at 2i, values at 2i + 1) and ``source_padding (B, S)`` bool (True = pad)."""

    def __init__(self, task: nn.Module):
        super().__init__()
        self.encoder, self.decoder = task.encoder, task.decoder

    def forward(self, src: torch.Tensor):
        padding = src.eq(self.encoder.pad_id)
        x = self.encoder.embed(src)
        for layer in self.encoder.layers:  # the mask always applies: a graph has no data-dependent branch
            x = layer(x, padding)
        memory = self.encoder.norm(x)
        kv = []
        for layer in self.decoder.layers:  # what the first cached step of PyTorch's search projects
            attention = layer.cross_attn
            kv += attention._project_kv(attention.qkv, attention.dim, memory, memory)
        return torch.stack(kv, dim=1), padding


class GraphDecoderCache:
    """:class:`heads.seq2seq.DecoderCache`'s interface over the decoder step graph's inputs: the past
    self-attention keys/values are concatenated with the new ones (a graph output is a new tensor)
    and collected in ``present``; the memory's keys/values and padding come from the encoder graph."""

    def __init__(self, past_kv: torch.Tensor, cross_kv: torch.Tensor, source_padding: torch.Tensor, num_layers: int):
        self.past_kv, self.steps = past_kv, past_kv.shape[3]
        self.cross_attn = [KVCache(key=cross_kv[:, 2 * i], value=cross_kv[:, 2 * i + 1], static=True)
                           for i in range(num_layers)]
        self.memory_bias = padding_bias(source_padding, cross_kv.dtype)  # always applied: no data-dependent branch
        self.present: list[torch.Tensor] = []

    def append(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new_keys, new_values = kv.permute(2, 0, 3, 1, 4)  # (N, T, 2, H, d) -> 2 x (N, H, T, d)
        keys = torch.cat([self.past_kv[:, 2 * layer], new_keys], dim=2)
        values = torch.cat([self.past_kv[:, 2 * layer + 1], new_values], dim=2)
        self.present += [keys, values]
        return keys, values


class TranslationDecoderStep(nn.Module):
    """One cached decoder step: ``tokens (N, 1)`` (the newest token of each hypothesis),
    ``cross_kv (N, 2L, H, S, d)``, ``source_padding (N, S)``, ``past_kv (N, 2L, H, t, d)`` (the
    self-attention keys/values of the t tokens before; t = 0 at the first step) ->
    ``logits (N, V)`` of the next token and ``present_kv (N, 2L, H, t + 1, d)``."""

    def __init__(self, task: nn.Module):
        super().__init__()
        self.decoder = task.decoder

    def forward(self, tokens: torch.Tensor, cross_kv: torch.Tensor, source_padding: torch.Tensor,
                past_kv: torch.Tensor):
        cache = GraphDecoderCache(past_kv, cross_kv, source_padding, self.decoder.depth)
        logits = self.decoder(tokens, None, None, cache)
        return logits[:, -1], torch.stack(cache.present, dim=1)


# -- writing and running graphs ------------------------------------------------------------------------------
def export_graph(module: nn.Module, inputs: tuple, path: Path, input_names: Sequence[str],
                 output_names: Sequence[str], dynamic_shapes: dict, opset: int, metadata: dict[str, Any],
                 docs: dict[str, str]) -> Path:
    """Export ``module`` with torch's ONNX exporter (torch.export + onnxscript), with ``metadata``
    (``suite.*`` keys, JSON values) and a doc string per input/output (``docs``), into one file."""
    module.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.export's notes on internals are not for the user
        program = torch.onnx.export(module, inputs, dynamo=True, opset_version=opset, input_names=list(input_names),
                                    output_names=list(output_names), dynamic_shapes=dynamic_shapes,
                                    custom_translation_table=CUSTOM_TRANSLATIONS, verbose=False)
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


# -- per task ----------------------------------------------------------------------------------------------
@dataclass
class ExportRequest:
    """What an exporter gets: the model, the data options (``recorded`` by the checkpoint, and with the
    command line's overrides in ``data``), where to write, the opset and the task's own flags."""

    model: nn.Module
    data: dict
    recorded: dict
    output: Path
    opset: int
    options: dict

    def image_size(self, key: str) -> tuple[int, str]:
        """(the size to export at, the size the checkpoint recorded, as text) from data option ``key``."""
        size = self.data.get(key)
        if size is None:
            raise ValueError(f"the checkpoint records no data.{key} (the input size to export at): give --data.{key} N")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"--data.{key} must be a positive whole number of pixels, got {size!r}")
        recorded = self.recorded.get(key)
        return size, f"{recorded}x{recorded}" if recorded is not None else "an unrecorded size"


def _seeded_images(batch: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


def _run_torch(model: nn.Module, images: torch.Tensor, backbone: nn.Module, trained_size: str):
    """The PyTorch output for ``images``, or an error naming the size the backbone refused."""
    try:
        with torch.no_grad():
            return model(images)
    except (ValueError, RuntimeError) as err:
        raise ValueError(f"{type(backbone).__name__} cannot take {images.shape[-2]}x{images.shape[-1]} images: {err}. "
                         f"Export at a size it takes: the checkpoint was trained at {trained_size} "
                         "(--data.image_size / --data.crop_size).") from None


def _image_plan(backbone: nn.Module, size: int) -> tuple[int | None, dict]:
    """(the multiple the graph's sides may be, the dynamic axes of ``images``) for an export at ``size``."""
    multiple = size_multiple(backbone)
    if multiple is not None and size % multiple:
        multiple = None  # the graph would hold a resize branch that fits only sizes like this one
    axes = {0: "batch"} if multiple is None else {0: "batch", 2: "height", 3: "width"}
    return multiple, axes


def _size_note(multiple: int | None, size: int, why_fixed: str) -> str:
    if multiple is None:
        return f"input size fixed at {size}x{size} ({why_fixed}); batch size dynamic"
    return f"height and width: any multiples of {multiple} (exported at {size}x{size}); batch size dynamic"


def _image_metadata(data: dict, size: int, multiple: int | None) -> dict:
    return {"image_size": [size, size], "size_multiple": multiple, "channel_order": "RGB",
            "mean": data.get("mean"), "std": data.get("std"),
            "normalisation": "images = (pixels / 255 - mean) / std, float32, (B, 3, H, W)"}


def _fixed_reason(backbone: nn.Module) -> str:
    from backbones.mlp_mixer import MlpMixer
    from backbones.vit import ViT

    if isinstance(backbone, ViT):
        return "ViT's position embeddings are built for one grid"
    if isinstance(backbone, MlpMixer):
        return "MLP-Mixer's token-mixing MLPs are sized for one grid"
    return f"{type(backbone).__name__} is not known to take other sizes in one graph"


def export_classification(request: ExportRequest) -> ExportReport:
    model, data, output, opset = request.model, request.data, request.output, request.opset
    size, trained = request.image_size("image_size")
    multiple, axes = _image_plan(model.backbone, size)
    graph = ClassifierGraph(model, request.options.get("probabilities", False)).eval()
    images = _seeded_images(2, size, size)
    _run_torch(graph, images, model.backbone, trained)
    outputs = ["logits", "probabilities"] if graph.probabilities else ["logits"]
    docs = {"images": "float32 (batch, 3, height, width), RGB, (pixels / 255 - mean) / std",
            "logits": "float32 (batch, classes), class i = suite.class_names[i]",
            "probabilities": "float32 (batch, classes), softmax of logits"}
    metadata = {"task": "classification", "class_names": model.class_names, **_image_metadata(data, size, multiple)}
    export_graph(graph, (images,), output, ["images"], outputs, {"images": axes}, opset, metadata, docs)
    report = ExportReport([output], [_size_note(multiple, size, _fixed_reason(model.backbone))])
    session = ort_session(output)
    report.notes.append(_io_note(session))
    sizes = [size] + ([size + multiple] if multiple else [])
    for i, side in enumerate(sizes):
        images = _seeded_images(2 if i == 0 else 1, side, side, seed=i)
        with torch.no_grad():
            expected = graph(images)
        expected = expected if isinstance(expected, tuple) else (expected,)
        got = session.run(None, {"images": images.numpy()})
        for name, e, g in zip(outputs, expected, got):
            report.checks.append(Check(f"max |{name}| difference, {len(images)} random {side}x{side} image(s)",
                                       float(np.abs(e.numpy() - g).max()), ATOL))
    return report


def export_segmentation(request: ExportRequest) -> ExportReport:
    model, data, output, opset = request.model, request.data, request.output, request.opset
    size, trained = request.image_size("crop_size")
    multiple, axes = _image_plan(model.backbone, size)
    graph = SegmenterGraph(model, request.options.get("logits", False)).eval()
    images = _seeded_images(2, size, size)
    _run_torch(graph, images, model.backbone, trained)
    outputs = ["labels", "logits"] if graph.logits else ["labels"]
    docs = {"images": "float32 (batch, 3, height, width), RGB, (pixels / 255 - mean) / std",
            "labels": "int64 (batch, height, width), the arg-max class per pixel, class i = suite.class_names[i]",
            "logits": "float32 (batch, classes, height, width), upsampled bilinearly to the input size"}
    metadata = {"task": "segmentation", "class_names": model.class_names, **_image_metadata(data, size, multiple)}
    export_graph(graph, (images,), output, ["images"], outputs, {"images": axes}, opset, metadata, docs)
    report = ExportReport([output], [_size_note(multiple, size, _fixed_reason(model.backbone))])
    session = ort_session(output)
    report.notes.append(_io_note(session))
    sizes = [size] + ([size + multiple] if multiple else [])
    for i, side in enumerate(sizes):
        images = _seeded_images(2 if i == 0 else 1, side, side, seed=i)
        with torch.no_grad():
            logits = model(images)["out"]
        got = session.run(None, {"images": images.numpy()})
        where = f"{len(images)} random {side}x{side} image(s)"
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


def export_detection(request: ExportRequest) -> ExportReport:
    model, data, output, opset = request.model, request.data, request.output, request.opset
    size, trained = request.image_size("image_size")
    graph = DetectorGraph(model).eval()
    images = _seeded_images(2, size, size)
    _run_torch(model, images, model.backbone, trained)  # also caches the anchors for this size
    head = model.head
    docs = {"images": "float32 (batch, 3, size, size), RGB, (pixels / 255 - mean) / std",
            "boxes": "float32 (batch, detections, 4) x1, y1, x2, y2 in input pixels; rows >= num_detections are 0",
            "scores": "float32 (batch, detections), best first; rows >= num_detections are 0",
            "labels": "int64 (batch, detections), label i = suite.category_ids[i] / suite.category_names[i]; "
                      "rows >= num_detections are -1",
            "num_detections": "int64 (batch,), how many rows of each image are detections"}
    metadata = {"task": "detection", "category_ids": model.category_ids, "category_names": model.category_names,
                "score_threshold": head.score_threshold, "nms_threshold": head.nms_threshold,
                "topk_candidates": head.topk_candidates, "detections_per_image": head.detections_per_image,
                **_image_metadata(data, size, None)}
    export_graph(graph, (images,), output, ["images"], ["boxes", "scores", "labels", "num_detections"],
                 {"images": {0: "batch"}}, opset, metadata, docs)
    report = ExportReport([output], [_size_note(None, size, "the anchors are constants of the graph")])
    session = ort_session(output)
    report.notes.append(_io_note(session))
    got = session.run(None, {"images": images.numpy()})
    report.checks += detection_checks(model, images, got, f"{len(images)} random {size}x{size} images")
    return report


def match_detections(expected: dict[str, torch.Tensor], boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray,
                     capacity: int, tie: float = ATOL) -> tuple[int, float, float]:
    """Compare one image's graph detections (the first ``num_detections`` rows) with PyTorch's
    (``SSDLiteHead.postprocess``). Each graph detection must have a PyTorch twin with the same
    label, its box within :data:`BOX_ATOL` and its score within ``tie``, at the same rank up to
    swaps among scores within ``tie`` of each other (float noise orders near-ties). Returns
    (detections without a twin, max box difference, max score difference); a detection whose
    score ties the last one kept when the list is full (``capacity``) may be swapped for another
    and is not counted."""
    e_boxes, e_scores, e_labels = (expected[k].float().numpy() if k != "labels" else expected[k].numpy()
                                   for k in ("boxes", "scores", "labels"))
    cut = e_scores[-1] if len(e_scores) >= capacity else -np.inf
    used = np.zeros(len(e_scores), dtype=bool)
    unmatched, box_diff, score_diff = abs(len(scores) - len(e_scores)), 0.0, 0.0
    for j in range(len(scores)):
        near = ((e_labels == labels[j]) & ~used & (np.abs(e_scores - scores[j]) <= tie)
                & (np.abs(e_boxes - boxes[j]).max(axis=1, initial=0.0) <= BOX_ATOL))
        if j < len(e_scores):
            near &= np.abs(e_scores - e_scores[j]) <= tie  # the same rank, up to near-ties
        if near.any():
            p = int(np.flatnonzero(near)[0])
            used[p] = True
            box_diff = max(box_diff, float(np.abs(e_boxes[p] - boxes[j]).max()))
            score_diff = max(score_diff, float(abs(e_scores[p] - scores[j])))
        elif scores[j] > cut + tie:
            unmatched += 1
    return unmatched, box_diff, score_diff


def detection_checks(model, images: torch.Tensor, got: Sequence[np.ndarray], where: str) -> list[Check]:
    """PyTorch's detections (``model.detect``) against the graph's padded outputs for ``images``."""
    with torch.no_grad():
        expected = model.detect(images)
    boxes, scores, labels, counts = got
    unmatched, box_diff, score_diff = 0, 0.0, 0.0
    for i, det in enumerate(expected):
        n = int(counts[i])
        u, b, s = match_detections(det, boxes[i, :n], scores[i, :n], labels[i, :n], model.head.detections_per_image)
        unmatched, box_diff, score_diff = unmatched + u, max(box_diff, b), max(score_diff, s)
    total = sum(len(d["scores"]) for d in expected)
    return [Check(f"detections without the same label and box in PyTorch's, {where} ({total} detections)",
                  unmatched, 0),
            Check(f"max |box| difference (pixels), {where}", box_diff, BOX_ATOL),
            Check(f"max |score| difference, {where}", score_diff, ATOL)]


def translation_files(output: Path) -> dict[str, Path]:
    """The files a translation export writes for ``--output``: encoder, decoder step, tokenizer."""
    stem = output.with_suffix("") if output.suffix == ".onnx" else output
    return {"encoder": stem.with_name(stem.name + ".encoder.onnx"),
            "decoder_step": stem.with_name(stem.name + ".decoder_step.onnx"),
            "tokenizer": stem.with_name(stem.name + ".spm.model")}


def export_translation(request: ExportRequest) -> ExportReport:
    from tasks.onnx_translation import OnnxTranslator

    model, opset = request.model, request.opset
    files = translation_files(request.output)
    decoder = model.decoder
    layers, heads = decoder.depth, decoder.layers[0].cross_attn.num_heads
    head_dim = decoder.layers[0].cross_attn.head_dim
    generator = torch.Generator().manual_seed(0)
    src = random_sources(4, 12, model, generator)
    encoder_graph = TranslationEncoderGraph(model).eval()
    with torch.no_grad():
        cross_kv, padding = encoder_graph(src)
    step_graph = TranslationDecoderStep(model).eval()
    tokens = torch.full((len(src), 1), model.bos_id, dtype=torch.long)
    past = torch.randn(len(src), 2 * layers, heads, 3, head_dim, generator=generator)
    metadata = {"task": "translation", "bos_id": model.bos_id, "eos_id": model.eos_id, "pad_id": model.pad_id,
                "max_positions": model.max_positions, "max_len_a": model.max_len_a, "max_len_b": model.max_len_b,
                "beam_size": model.beam_size, "length_penalty": model.length_penalty,
                "length_penalty_form": model.length_penalty_form, "num_layers": layers,
                "num_heads": heads, "head_dim": head_dim, "vocab_size": decoder.embed.tokens.num_embeddings,
                "encoder": files["encoder"].name, "decoder_step": files["decoder_step"].name,
                "tokenizer": files["tokenizer"].name}
    kv_doc = "float32 (N, 2 * layers, heads, {}, head_dim): layer i's keys at 2i, values at 2i + 1"
    docs = {"src": "int64 (batch, source_length) token ids ending in eos, then pad_id",
            "cross_kv": kv_doc.format("source_length") + " (cross-attention over the source)",
            "source_padding": "bool (batch, source_length), True at padding",
            "tokens": "int64 (N, 1), the newest token of each hypothesis (bos at the first step)",
            "past_kv": kv_doc.format("t") + " of the t tokens before (t = 0 at the first step)",
            "logits": "float32 (N, vocab_size), scores of the next token",
            "present_kv": kv_doc.format("t + 1") + ", the next step's past_kv"}
    source_axes = {0: "batch", 1: "source_length"}
    export_graph(encoder_graph, (src,), files["encoder"], ["src"], ["cross_kv", "source_padding"],
                 {"src": source_axes}, opset, metadata, docs)
    step_axes = {"tokens": {0: "batch"}, "cross_kv": {0: "batch", 3: "source_length"},
                 "source_padding": source_axes, "past_kv": {0: "batch", 3: "past_length"}}
    export_graph(step_graph, (tokens, cross_kv, padding, past), files["decoder_step"],
                 ["tokens", "cross_kv", "source_padding", "past_kv"], ["logits", "present_kv"], step_axes, opset,
                 metadata, docs)
    files["tokenizer"].write_bytes(model.tokenizer.serialized())
    translator = OnnxTranslator(files["encoder"])
    report = ExportReport(list(files.values()), [
        "batch, source length and decoded length dynamic",
        f"encoder: {_io_note(translator.encoder)}", f"decoder step: {_io_note(translator.decoder_step)}",
        f"translate with: python -m tasks.onnx_translation {files['encoder']} < source.txt"])
    encoded = translator.encoder.run(None, {"src": src.numpy()})
    report.checks.append(Check("max |cross_kv| difference, 4 random sources",
                               float(np.abs(encoded[0] - cross_kv.numpy()).max()), ATOL))
    with torch.no_grad():
        step = step_graph(tokens, cross_kv, padding, past)
    got = translator.decoder_step.run(None, {"tokens": tokens.numpy(), "cross_kv": cross_kv.numpy(),
                                             "source_padding": padding.numpy(), "past_kv": past.numpy()})
    report.checks.append(Check("max |logits| difference of a decoder step", float(np.abs(got[0] - step[0].numpy()).max()),
                               ATOL))
    for beam in sorted({1, model.beam_size}):
        expected = model.translate(src, beam_size=beam).tokens
        hypotheses = translator.translate_ids(src, beam_size=beam).tokens
        report.checks.append(Check(f"hypotheses that differ, 4 random sources, {'greedy' if beam == 1 else f'beam {beam}'}",
                                   hypothesis_differences(expected, hypotheses, model.pad_id), 0))
    return report


def random_sources(count: int, longest: int, model, generator: torch.Generator) -> torch.Tensor:
    """(count, longest) padded random sources of decreasing lengths, ending in eos: ordinary tokens only."""
    special = {model.pad_id, model.bos_id, model.eos_id}
    vocab = model.decoder.embed.tokens.num_embeddings
    src = torch.full((count, longest), model.pad_id, dtype=torch.long)
    for row in range(count):
        length = max(2, longest - 3 * row)
        ids = torch.randint(0, vocab, (length - 1,), generator=generator)
        ids = torch.where(torch.isin(ids, torch.tensor(sorted(special))), max(special) + 1, ids)
        src[row, : length - 1] = ids
        src[row, length - 1] = model.eos_id
    return src


def hypothesis_differences(a: torch.Tensor, b: torch.Tensor, pad_id: int) -> int:
    """Rows of two (B, L) padded token batches that differ (ignoring padding width)."""
    width = max(a.shape[1], b.shape[1])
    a = F.pad(a, (0, width - a.shape[1]), value=pad_id)
    b = F.pad(b, (0, width - b.shape[1]), value=pad_id)
    return int((a != b).any(dim=1).sum())


def _io_note(session) -> str:
    shapes = graph_shapes(session)
    inputs = ", ".join(f"{v.name} {_shape_text(shapes[v.name])}" for v in session.get_inputs())
    outputs = ", ".join(f"{v.name} {_shape_text(shapes[v.name])}" for v in session.get_outputs())
    return f"{inputs} -> {outputs}"


#: task class (qualified name) -> (exporter, its own flags with their help)
EXPORTERS: dict[str, tuple[Callable, dict[str, str]]] = {
    "tasks.classify.ClassificationTask": (export_classification, {
        "probabilities": "also output softmax probabilities (B, K)"}),
    "tasks.detect.DetectionTask": (export_detection, {}),
    "tasks.segment.SegmentationTask": (export_segmentation, {
        "logits": "also output the upsampled logits (B, K, H, W)"}),
    "tasks.translate.TranslationTask": (export_translation, {}),
}


# -- the command -----------------------------------------------------------------------------------------------
def export_parser(task_name: str, prog: str):
    """The ``export`` subcommand's parser. ``--data.KEY VALUE`` arguments are read apart (see :func:`run_export`)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog=prog, description=(
        "Export the checkpoint's model to ONNX, check it with ONNX Runtime against PyTorch, and print where it "
        "wrote and the difference measured. --data.KEY VALUE overrides a data option the checkpoint recorded "
        "(--data.image_size for classification and detection, --data.crop_size for segmentation)."),
        exit_on_error=True)
    parser.add_argument("--ckpt_path", type=str, required=True, help="a checkpoint of this task, written by fit")
    parser.add_argument("--output", type=str | None, default=None,
                        help="the .onnx file to write (null: <ckpt stem>.onnx next to the checkpoint; translation "
                             "writes <stem>.encoder.onnx, <stem>.decoder_step.onnx and <stem>.spm.model)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET,
                        help=f"ONNX opset, {MIN_OPSET} to {MAX_OPSET} ({DEFAULT_OPSET} is read by ONNX Runtime >= 1.14)")
    for flag, text in EXPORTERS.get(task_name, (None, {}))[1].items():
        parser.add_argument(f"--{flag}", type=bool, default=False, help=text)
    return parser


def split_data_overrides(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """(the other arguments, {KEY: value}) from ``--data.KEY VALUE`` / ``--data.KEY=VALUE`` (YAML values)."""
    rest, data = [], {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--data."):
            key, has_value, value = arg[len("--data."):].partition("=")
            if not has_value:
                if i + 1 >= len(args):
                    raise ValueError(f"{arg} needs a value")
                value = args[i + 1]
                i += 1
            data[key] = yaml.safe_load(value)
        else:
            rest.append(arg)
        i += 1
    return rest, data


def run_export(argv: Sequence[str], model_class: type, prog: str = "export") -> ExportReport:
    """``export`` for ``model_class``'s task: parse ``argv`` (the arguments after ``export``), export, check, print."""
    from tasks.base import qualified_name
    from tasks.cli import check_checkpoint_file

    task_name = qualified_name(model_class)
    if task_name not in EXPORTERS:
        raise ValueError(f"{task_name} has no ONNX export (tasks with one: {', '.join(EXPORTERS)})")
    exporter, flags = EXPORTERS[task_name]
    rest, overrides = split_data_overrides(argv)
    args = export_parser(task_name, prog).parse_args(rest)
    require_export_extra()
    check_opset(args.opset)
    checkpoint = check_checkpoint_file(args.ckpt_path, model_class)
    if not checkpoint.get("hyper_parameters"):
        raise ValueError(f"{args.ckpt_path} holds no constructor arguments, so the model cannot be rebuilt from it: "
                         "export a checkpoint written by this suite's fit")
    data = dict(checkpoint.get("datamodule_hyper_parameters") or {})
    unknown = sorted(set(overrides) - set(data)) if data else []
    if unknown:
        known = ", ".join(k for k in data if not k.startswith("_"))
        raise ValueError(f"--data.{unknown[0]} is not a data option of this checkpoint's datamodule "
                         f"({data.get('_class_path', '?')}: {known})")
    recorded, data = data, {**data, **overrides}
    del checkpoint
    # the class from its module, also under `python -m tasks.<task>` (where model_class lives in __main__,
    # whose forward references Lightning's rebuild of the arguments cannot resolve)
    module_name, class_name = task_name.rsplit(".", 1)
    task_class = getattr(importlib.import_module(module_name), class_name)
    model = task_class.load_from_checkpoint(args.ckpt_path, map_location="cpu", weights_only=True).eval()
    output = Path(args.output) if args.output else Path(args.ckpt_path).with_suffix(".onnx")
    options = {flag: getattr(args, flag) for flag in flags}
    report = exporter(ExportRequest(model, data, recorded, output, args.opset, options))
    report.notes.insert(0, f"opset {args.opset}, from {Path(args.ckpt_path).resolve()}")
    print(report, flush=True)
    if not report.ok:
        raise SystemExit(f"the exported graph does not compute what the checkpoint computes (see FAILED above); "
                         f"the files are kept for inspection: {', '.join(str(f) for f in report.files)}")
    return report
