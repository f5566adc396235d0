"""GPU cost proxies without a GPU: the kernels a training step and an inference pass launch, and the
bytes they move, for our backbones beside timm's same networks.

    python benchmarks/bench_kernels.py --batch 128 --out benchmarks/results_kernels.md

On a GPU at the paper's sizes (classification 128 x 256), a step is bound by the number of kernels
and the memory they read and write, not by arithmetic. Both can be counted on a CPU:

- the network runs on fake CUDA tensors (``FakeTensorMode``: shapes, strides and dtypes, no data, no
  device, so the paper's batch costs what batch 1 does), and every op goes through CUDA's side of the
  dispatcher: bf16 autocast's CUDA op lists (norms, softmax and ``sum`` in float32), cuDNN's layout for a
  convolution, ``linear``'s choice between ``addmm`` and ``matmul``. Where PyTorch would ask the device,
  the choice of an sm80+ GPU is made here (:class:`FlashAttentionOnCuda`, :func:`cuda_output_layout`);
- the training step is forward, cross-entropy loss (label smoothing 0.1, as the paper's recipe),
  backward and a fused AdamW step. Autograd's engine needs a real CUDA context, so the backward runs
  through :func:`run_backward`, which calls each autograd node in dependency order and does what the
  engine does between nodes (the broadcast gradient's ``sum_to``, dtype casts, accumulation of
  gradients that meet);
- each dispatched aten op is a *kernel* (:func:`cuda_launches` says where one op launches more) or a
  *view* (views, ``_unsafe_view``, allocations: host-side work only, counted apart);
- what a CUDA kernel copies inside itself, which no dispatch shows, comes from
  :func:`cuda_internal_copies` (each op's layouts in ATen's CUDA sources): a copy is one more kernel
  that reads and writes the tensor once;
- bytes of a kernel = the bytes of every tensor it reads plus every tensor it writes (numel x element
  size; a broadcast operand counts at its broadcast size).

Op counts do not depend on the batch; bytes scale with it (all but the parameters' and the optimizer's
share). Every op lands in the block type whose module ran it (forward hooks; the backward of an op
belongs to the module whose forward created its autograd node), the innermost category winning.
"""
from __future__ import annotations

import argparse
import copy
import sys
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from backbones import create_backbone  # noqa: E402
from heads.classifier import ClassifierHead  # noqa: E402
from layers.attention import Attention  # noqa: E402
from layers.compat import (autograd_input_metadata, fake_tensor_mode, op_arguments,  # noqa: E402
                           torch_dispatch_mode)
from layers.cpu_speedups import cpu_speedups  # noqa: E402

aten = torch.ops.aten

#: table name -> (timm model, our backbone, its arguments, the paper's input size)
NETWORKS: dict[str, tuple[str, str, dict, int]] = {
    **{
        f"MobileViTv2-{w / 100:g}": (f"mobilevitv2_{w:03d}", "mobilevitv2", {"width": w / 100}, 256)
        for w in (50, 75, 100, 125, 150, 175, 200)
    },
    **{f"MobileViT-{s}": (f"mobilevit_{s}", "mobilevit", {"size": s}, 256) for s in ("xxs", "xs", "s")},
    **{
        f"ViT-{s}": (f"vit_{s}_patch16_224", "vit", {"size": s, "img_size": 224}, 224)
        for s in ("tiny", "small", "base")
    },
}
DEFAULT_NETWORKS = ("MobileViTv2-0.5", "MobileViTv2-1", "MobileViT-xs", "ViT-tiny")

# ------------------------------------------------------------------------------------------ block types
STEM, MV2, VIT_BLOCK, NORM = "stem", "MV2 blocks", "MobileViT blocks: local conv, 1x1s, fold, fusion", "norms"
ATTN_PROJ, ATTN_MIX = "attention: projections", "attention: mixing"
MLP, LAYER = "MLP", "transformer layers: the rest"
HEAD, OPTIMIZER = "pooling, head, loss", "optimizer"
CATEGORIES = (STEM, MV2, VIT_BLOCK, NORM, ATTN_PROJ, ATTN_MIX, MLP, LAYER, HEAD, OPTIMIZER)

#: module class name (ours and timm's) -> block type
CLASS_CATEGORIES = {
    "InvertedResidual": MV2, "BottleneckBlock": MV2,
    "MobileViTv2Block": VIT_BLOCK, "MobileViTBlock": VIT_BLOCK,
    "MobileVitV2Block": VIT_BLOCK, "MobileVitBlock": VIT_BLOCK,
    "TransformerBlock": LAYER, "LinearTransformerBlock": LAYER, "Block": LAYER,
    "FeedForward": MLP, "Mlp": MLP, "ConvMlp": MLP,
    "LinearSelfAttention": ATTN_MIX, "Attention": ATTN_MIX,
}
#: ops (forward) and autograd nodes (backward) that are an attention's projections, not its mixing
PROJECTION_OPS = {"mm", "addmm", "convolution"}
PROJECTION_NODES = {"AddmmBackward0", "MmBackward0", "ConvolutionBackward0"}


def block_category(name: str, module: nn.Module) -> str | None:
    """The block type of a module by its qualified ``name`` and class, None for a module that only groups others."""
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm)):
        return NORM
    if isinstance(module, Attention):
        return ATTN_MIX
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("stem", "patch_embed"):
        return STEM
    if leaf in ("final_conv", "head"):
        return HEAD
    return CLASS_CATEGORIES.get(type(module).__name__)


# ------------------------------------------------------------------------------------------ the count
@dataclass
class Tally:
    """CUDA kernels (:func:`cuda_launches` of each op, internal copies included), aten ops dispatched, the
    bytes they move, views; ``ops``: aten ops by name."""

    kernels: int = 0
    aten_ops: int = 0
    bytes: int = 0
    views: int = 0
    internal_copies: int = 0
    ops: Counter = field(default_factory=Counter)

    def add(self, other: "Tally") -> None:
        self.kernels += other.kernels
        self.aten_ops += other.aten_ops
        self.bytes += other.bytes
        self.views += other.views
        self.internal_copies += other.internal_copies
        self.ops.update(other.ops)


@dataclass
class Counts:
    """One :class:`Tally` per block type."""

    by_category: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))

    def total(self) -> Tally:
        total = Tally()
        for tally in self.by_category.values():
            total.add(tally)
        return total


#: ops that do no work on the device: views, metadata and allocations
HOST_ONLY = {
    "_unsafe_view", "detach", "alias", "lift_fresh", "_reshape_alias", "empty", "empty_strided", "empty_like",
    "new_empty", "new_empty_strided", "_local_scalar_dense", "is_same_size", "_has_compatible_shallow_copy_type",
    "as_strided_",
}
#: ops that write their first argument without reading it
WRITE_ONLY_SELF = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_"}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tensors(tree) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (nested tuples, lists and dicts), in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = tree.values()
    if isinstance(tree, (tuple, list, type({}.values()))):
        return [t for item in tree for t in tensors(item)]
    return []


def traffic(func, args: tuple, kwargs: dict, out) -> int:
    """Bytes an op reads (its tensor arguments) and writes (its results and the arguments it mutates)."""
    name = func.overloadpacket.__name__
    read = tensors((args, kwargs))
    if name in WRITE_ONLY_SELF and read:
        read = read[1:]
    written = tensors(out)
    returned = {id(t) for t in written}
    for arg, value in zip(op_arguments(func), args):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written += [t for t in tensors(value) if id(t) not in returned]
    return sum(map(nbytes, read)) + sum(map(nbytes, written))


def is_host_only(func) -> bool:
    """Views, metadata and allocations."""
    return func.is_view or func.overloadpacket.__name__ in HOST_ONLY


class KernelCounter(torch_dispatch_mode()):
    """Counts every aten op below it into ``counts`` under the current block type ``category``, plus the
    copies CUDA kernels make inside (:func:`cuda_internal_copies`)."""

    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts
        self.category = HEAD
        self.node_name: str | None = None  # the autograd node running, in the backward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "aten":  # the profiler's markers, fake tensors' device queries
            return out
        name = func.overloadpacket.__name__
        out = cuda_output_layout(name, args, out)
        category = self._refined(name)
        tally = self.counts.by_category[category]
        if is_host_only(func):
            tally.views += 1
            return out
        tally.aten_ops += 1
        tally.kernels += cuda_launches(name, args)
        tally.bytes += traffic(func, args, kwargs, out)
        tally.ops[name] += 1
        for copied in cuda_internal_copies(name, args, out):
            tally.kernels += 1
            tally.internal_copies += 1
            tally.bytes += 2 * nbytes(copied)
            tally.ops[f"{name} (internal copy)"] += 1
        return out

    def _refined(self, name: str) -> str:
        if self.category != ATTN_MIX:
            return self.category
        projection = self.node_name in PROJECTION_NODES if self.node_name else name in PROJECTION_OPS
        return ATTN_PROJ if projection else ATTN_MIX


# ------------------------------------------------------------------------------------------ CUDA layouts
def _is_blas_operand(t: torch.Tensor) -> bool:
    """cuBLAS reads a matrix (or a batch of them) row- or column-major: one of the last two dims has stride 1."""
    rows, cols = t.shape[-2], t.shape[-1]
    row_major = t.stride(-1) == 1 or cols == 1
    col_major = t.stride(-2) == 1 or rows == 1
    return (row_major and t.stride(-2) >= max(cols, 1)) or (col_major and t.stride(-1) >= max(rows, 1))


def suggests_channels_last(t: torch.Tensor) -> bool:
    """``Tensor::suggest_memory_format() == ChannelsLast`` (c10's ``is_channels_last_strides_2d``): the strides
    grow C, W, H, N; ambiguous cases (size-1 dims) count as contiguous."""
    if t.dim() != 4 or t.stride(1) == 0:
        return False
    smallest = 0
    for d in (1, 3, 2, 0):
        if t.shape[d] == 0 or t.stride(d) < smallest or (d == 0 and smallest == t.stride(1)):
            return False
        smallest = t.stride(d) * max(t.shape[d], 1)
    return True


def _conv_format(x: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """cuDNN's layout for a convolution (``cudnn_conv_suggest_memory_format``): channels-last when the input
    or the weight suggests it."""
    channels_last = suggests_channels_last(x) or suggests_channels_last(weight)
    return torch.channels_last if channels_last else torch.contiguous_format


def cuda_output_layout(name: str, args: tuple, out):
    """``out`` in the layout the CUDA kernel writes where fake tensors guess otherwise: a convolution and its
    gradients in cuDNN's layout (on sm80+ cuDNN takes bf16; without a device, PyTorch's backend choice
    falls back to an NCHW kernel for it)."""
    if name not in ("convolution", "convolution_backward"):
        return out
    x, weight = (args[0], args[1]) if name == "convolution" else (args[1], args[2])
    fmt = _conv_format(x, weight)
    if name == "convolution":
        return out.contiguous(memory_format=fmt)
    grad_input, grad_weight, grad_bias = out
    return (None if grad_input is None else grad_input.contiguous(memory_format=fmt),
            None if grad_weight is None else grad_weight.contiguous(memory_format=fmt), grad_bias)


class FlashAttentionOnCuda(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` as it runs on an sm80+ GPU (A100, H100, H200): flash attention for
    half-precision inputs without a mask and head dims up to 256 (``sdp_utils.cpp``), the head dim padded
    to a multiple of 8 and the output cut back (``attention.cpp``). On fake tensors PyTorch cannot ask the
    device and takes the math path (two batched GEMMs and a softmax)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self.flash_attention(*args, **kwargs) if func is F.scaled_dot_product_attention else None
        return func(*args, **kwargs) if out is None else out

    @staticmethod
    def flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False) -> torch.Tensor | None:
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query.dtype
        head_dim = query.shape[-1]
        if query.device.type != "cuda" or attn_mask is not None or enable_gqa or head_dim > 256 or \
                dtype not in (torch.float16, torch.bfloat16):
            return None
        query, key, value = (t.to(dtype) for t in (query, key, value))  # autocast's cast
        pad = -head_dim % 8
        if pad:
            query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
        scale = head_dim ** -0.5 if scale is None else scale
        out = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
        return out[..., :head_dim] if pad else out


def cuda_launches(name: str, args: tuple) -> int:
    """Kernels one aten op launches on CUDA where it is more than one (ATen's CUDA sources):
    ``convolution`` adds the bias after cuDNN; ``convolution_backward`` runs cuDNN once per gradient asked
    (input, weight) and reduces the bias gradient apart; ``native_group_norm`` (``group_norm_kernel.cu``):
    moments, fused affine parameters, normalisation; its backward: internal gradients, then for the input
    gradient rstd * gamma, fused parameters and the element-wise pass, then gamma and beta;
    ``native_layer_norm_backward`` (``layer_norm_kernel.cu``): input gradient, then gamma and beta;
    ``select_backward`` / ``slice_backward``: zeros, then the gradient copied into its slice; flash attention's
    backward (``flash_api.cpp``, ``mha_bwd``): dO . O per row, the backward, dQ converted from float32."""
    if name == "convolution":
        return 1 + (args[2] is not None)
    if name == "convolution_backward":
        return max(sum(args[-1]), 1)
    if name == "native_group_norm":
        return 2 + (args[1] is not None or args[2] is not None)
    if name == "native_group_norm_backward":
        grad_input, grad_weight, grad_bias = args[-1]
        return 1 + grad_input * (2 + (args[4] is not None)) + (grad_weight or grad_bias)
    if name == "native_layer_norm_backward":
        grad_input, grad_weight, grad_bias = args[-1]
        return max(grad_input + (grad_weight or grad_bias), 1)
    if name in ("select_backward", "slice_backward"):
        return 2
    if name == "_scaled_dot_product_flash_attention_backward":
        return 3
    return 1


def cuda_internal_copies(name: str, args: tuple, out) -> list[torch.Tensor]:
    """The tensors the CUDA kernel of ``name`` copies into another layout before it runs (ATen's CUDA sources):

    - ``_softmax`` / ``_log_softmax`` and their backward (``SoftMax.cu``, ``host_softmax``): input, output and
      gradient made contiguous;
    - ``native_layer_norm`` and backward (``layer_norm_kernel.cu``): input, weight, bias ``expect_contiguous``;
      ``native_group_norm`` and backward (``group_norm.cpp``): on CUDA contiguous NCHW only;
    - ``convolution`` / ``convolution_backward`` (cuDNN): input, weight and gradient in the layout
      :func:`_conv_format` picks;
    - ``mm``, ``addmm``, ``bmm``, ``baddbmm`` (cuBLAS): each matrix row- or column-major;
    - SDPA's fused kernels (flash, memory-efficient, cuDNN): query, key, value, output and its gradient with a
      unit stride in the head dimension.
    Element-wise ops, reductions, ``cat``, pooling, batch norm and upsampling run on any strides.
    """
    tensor_args = [a for a in args if isinstance(a, torch.Tensor)]
    if name in ("_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
                "native_layer_norm", "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward"):
        return [t for t in tensor_args if not t.is_contiguous()]
    if name == "convolution":
        fmt = _conv_format(args[0], args[1])
        return [t for t in args[:2] if not t.is_contiguous(memory_format=fmt)]
    if name == "convolution_backward":
        grad, x, weight = args[:3]
        fmt = _conv_format(x, weight)
        return [t for t in (grad, x, weight) if not t.is_contiguous(memory_format=fmt)]
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        matrices = tensor_args[-2:]
        return [t for t in matrices if not _is_blas_operand(t)]
    if name.startswith("_scaled_dot_product") or name.startswith("_efficient_attention") or name.startswith("_flash"):
        return [t for t in tensor_args if t.dim() == 4 and t.stride(-1) != 1]
    return []


# ------------------------------------------------------------------------------------------ fake CUDA
@contextmanager
def cuda_bf16_autocast() -> Iterator[None]:
    """``torch.autocast("cuda", torch.bfloat16)`` without a GPU (the context manager refuses to start then):
    the same switches it sets, so ops on fake CUDA tensors take CUDA's autocast lists."""
    was_enabled, was_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", was_enabled)
        torch.set_autocast_dtype("cuda", was_dtype)


def run_backward(loss: torch.Tensor, counter: KernelCounter, labels: dict) -> None:
    """``loss.backward()`` on fake CUDA tensors: each autograd node called once all the gradients it receives
    have arrived, with what the engine does between nodes (``validate_outputs``: a gradient summed to its
    input's shape when the forward broadcast it, cast to its input's dtype; gradients meeting at one input
    added). ``counter.category`` follows each node's block type (``labels``)."""
    pending: dict = defaultdict(int)
    stack, seen = [loss.grad_fn], {loss.grad_fn}
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is not None:
                pending[node] += 1
                if node not in seen:
                    seen.add(node)
                    stack.append(node)
    counter.category, counter.node_name = HEAD, None
    buffers = {loss.grad_fn: [torch.ones_like(loss)]}
    ready = [loss.grad_fn]
    with torch.no_grad():
        while ready:
            node = ready.pop()
            counter.category, counter.node_name = labels.get(node, HEAD), node.name()
            inputs = buffers.pop(node, None)  # None: no gradient reached the node, nothing to run
            if node.name() == "torch::autograd::AccumulateGrad":
                if inputs is not None:
                    accumulate_grad(node.variable, *inputs)
                continue
            grads = (None,) * len(node.next_functions) if inputs is None else node(*inputs)
            grads = grads if isinstance(grads, tuple) else (grads,)
            for (target, slot), grad in zip(node.next_functions, grads):
                if target is None:
                    continue
                if grad is not None:
                    grad = _as_input(grad, autograd_input_metadata(target)[slot])
                    buffer = buffers.setdefault(target, [None] * len(autograd_input_metadata(target)))
                    buffer[slot] = grad if buffer[slot] is None else buffer[slot] + grad
                pending[target] -= 1
                if pending[target] == 0:
                    ready.append(target)
    counter.category, counter.node_name = OPTIMIZER, None


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """What ``AccumulateGrad`` does with the first gradient of a step (the optimizer set ``.grad`` to None):
    keep it when its strides are the parameter's, else copy it into the parameter's strides (autograd's
    layout contract). Called as a node from Python, it would see the extra references Python holds and
    always copy."""
    if grad is None:
        return
    if any(g != p for g, p, n in zip(grad.stride(), param.stride(), param.shape) if n > 1):
        grad = torch.empty_strided(param.shape, param.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)
    param.grad = grad.detach()


def _as_input(grad: torch.Tensor, metadata) -> torch.Tensor:
    if tuple(grad.shape) != tuple(metadata.shape):
        grad = grad.sum_to_size(metadata.shape)
    return grad if grad.dtype == metadata.dtype else grad.to(metadata.dtype)


# ------------------------------------------------------------------------------------------ block labels
class BlockTracker:
    """Keeps ``counter.category`` at the innermost block type running (forward hooks), and labels each
    autograd node the forward creates with the block type whose module created it (``labels``).

    A module's methods that its parent calls instead of ``forward`` (``ENTRY_POINTS``) are wrapped for as
    long as the tracker is open, so their work lands in the module's block type too."""

    ENTRY_POINTS = ("forward_grid",)

    def __init__(self, model: nn.Module, counter: KernelCounter):
        self.counter = counter
        self.labels: dict = {}
        self.order: dict = {}  # node -> when it was labelled
        self.stack: list[tuple[str, int, set]] = []
        self.handles = []
        self.wrapped: list[tuple[nn.Module, str]] = []
        for name, module in model.named_modules():
            category = block_category(name, module)
            if category is None:
                continue
            self.handles.append(module.register_forward_pre_hook(lambda m, args, c=category: self.enter(c, args)))
            self.handles.append(module.register_forward_hook(lambda m, args, out: self.leave(out)))
            for method in self.ENTRY_POINTS:
                if hasattr(module, method):
                    setattr(module, method, self._tracked(category, getattr(module, method)))
                    self.wrapped.append((module, method))

    def _tracked(self, category: str, method: Callable) -> Callable:
        def run(*args, **kwargs):
            self.enter(category, (args, kwargs))
            out = method(*args, **kwargs)
            self.leave(out)
            return out

        return run

    def enter(self, category: str, inputs) -> None:
        boundary = {t.grad_fn for t in tensors(inputs) if t.grad_fn is not None}
        self.stack.append((category, len(self.order), boundary))
        self.counter.category = category

    def leave(self, output) -> None:
        category, start, boundary = self.stack.pop()
        self._label(category, start, boundary, [t.grad_fn for t in tensors(output) if t.grad_fn is not None])
        self.counter.category = self.stack[-1][0] if self.stack else HEAD

    def _label(self, category: str, start: int, boundary: set, roots: list) -> None:
        """Label the nodes created inside the module: walk back from its outputs to its inputs; a node
        labelled before the module began belongs to an earlier block, one labelled since to a child."""
        stack, seen = list(roots), set()
        while stack:
            node = stack.pop()
            if node is None or node in seen or node in boundary:
                continue
            seen.add(node)
            if node in self.order:
                if self.order[node] < start:
                    continue
            else:
                self.labels[node] = category
                self.order[node] = len(self.order)
            stack.extend(n for n, _ in node.next_functions)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        for module, method in self.wrapped:
            delattr(module, method)


# ------------------------------------------------------------------------------------------ networks
class OursClassifier(nn.Module):
    """Our classification network: the backbone's pooled features into the classifier head, as
    ``tasks.classify`` runs it."""

    def __init__(self, backbone: nn.Module, num_classes: int = 1000):
        super().__init__()
        self.backbone = backbone
        self.head = ClassifierHead(backbone.num_features, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone.forward_pooled(images))


def build_networks(name: str) -> dict[str, nn.Module]:
    """{"ours": ..., "timm": ...} for a :data:`NETWORKS` entry, random weights, on the CPU."""
    import timm

    timm_name, backbone, kwargs, _ = NETWORKS[name]
    return {"ours": OursClassifier(create_backbone(backbone, **kwargs)), "timm": timm.create_model(timm_name)}


def training_step(model: nn.Module, images: torch.Tensor, target: torch.Tensor, optimizer, counter: KernelCounter,
                  tracker: BlockTracker) -> None:
    with cuda_bf16_autocast():
        logits = model(images)
        counter.category = HEAD
        loss = F.cross_entropy(logits.float(), target, label_smoothing=0.1)
    run_backward(loss, counter, tracker.labels)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def count(model: nn.Module, batch: int, size: int, train: bool) -> Counts:
    """Kernels, bytes and views of one steady training step (``train``: after a first step that creates the
    optimizer's state) or one inference pass of ``model`` on a (batch, 3, size, size) channels-last input
    under bf16 autocast, on fake CUDA tensors."""
    counts = Counts()
    model = copy.deepcopy(model)  # the fake mode takes its parameters
    with cpu_speedups(False), fake_tensor_mode()(allow_non_fake_inputs=True):
        model = model.to("cuda", memory_format=torch.channels_last).train(train)
        images = torch.randn(batch, 3, size, size, device="cuda").contiguous(memory_format=torch.channels_last)
        target = torch.zeros(batch, dtype=torch.long, device="cuda")
        with KernelCounter(counts) as counter, FlashAttentionOnCuda():
            tracker = BlockTracker(model, counter)
            try:
                if train:
                    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, fused=True)
                    training_step(model, images, target, optimizer, counter, tracker)
                    counter.counts = counts = Counts()  # the steady step
                    training_step(model, images, target, optimizer, counter, tracker)
                else:
                    with torch.no_grad(), cuda_bf16_autocast():
                        model(images)
            finally:
                tracker.close()
    return counts


# ------------------------------------------------------------------------------------------ the table
def gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def table(name: str, phase: str, ours: Counts, theirs: Counts) -> list[str]:
    rows = [f"#### {name}, {phase}", "",
            "| block type | kernels ours / timm | aten ops ours / timm | GB ours / timm | internal copies ours / timm "
            "| views ours / timm |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]

    def row(label: str, a: Tally, b: Tally) -> str:
        return (f"| {label} | {a.kernels} / {b.kernels} | {a.aten_ops} / {b.aten_ops} | {gb(a.bytes)} / {gb(b.bytes)} "
                f"| {a.internal_copies} / {b.internal_copies} | {a.views} / {b.views} |")

    for category in CATEGORIES:
        a, b = ours.by_category.get(category, Tally()), theirs.by_category.get(category, Tally())
        if a.aten_ops or b.aten_ops or a.views or b.views:
            rows.append(row(category, a, b))
    rows.append(row("**total**", ours.total(), theirs.total()))
    return rows + [""]


SUMMARY_HEADER = [
    "| network | pass | kernels ours | kernels timm | ratio | aten ops ours | aten ops timm | GB ours | GB timm "
    "| ratio | views ours | views timm |",
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
]


def summary_row(name: str, phase: str, ours: Counts, theirs: Counts) -> str:
    a, b = ours.total(), theirs.total()
    return (f"| {name} | {phase} | {a.kernels} | {b.kernels} | {a.kernels / b.kernels:.2f} | {a.aten_ops} | "
            f"{b.aten_ops} | {gb(a.bytes)} | {gb(b.bytes)} | {a.bytes / b.bytes:.2f} | {a.views} | {b.views} |")


#: a section of the output file that a new run keeps (numbers of earlier code, measured by hand)
KEPT_SECTION = "## Before and after"

RESULTS_INTRO = """# GPU cost proxies: kernels and bytes per step, ours beside timm

    {command}

torch {torch}, timm {timm}; counted on fake CUDA tensors, no GPU (`benchmarks/bench_kernels.py` says how).
A training step is forward, cross-entropy, backward and a fused AdamW step, after a first step that
creates the optimizer's state; an inference pass is one forward under `no_grad`. Both run channels-last
under bf16 autocast (CUDA's op lists), with the CPU speed paths off (`SUITE_CPU_SPEEDUPS=0`: they never
run on CUDA tensors). *Kernels* are CUDA launches: each aten op, plus the launches of ops that run more
than one kernel and the copies CUDA kernels make inside (`cuda_launches`, `cuda_internal_copies`:
ATen's CUDA sources); *aten ops* the ops dispatched; *GB* what the kernels read and write; *views*
views, metadata and allocations, host-side work only. Op counts do not depend on the batch; bytes grow
with it (all but the parameters' and the optimizer's share).

Why ours has more aten ops than timm's MobileViTv2 at fewer kernels: a `Linear`'s backward is three aten
ops (two `mm` and the bias gradient's `sum`), a 1x1 convolution's is one `convolution_backward` that
launches the same three kernels; its forward adds the bias in a second kernel where `addmm` fuses it.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--networks", nargs="+", default=list(DEFAULT_NETWORKS), choices=list(NETWORKS))
    parser.add_argument("--batch", type=int, default=128, help="images per step (the paper's: 128)")
    parser.add_argument("--out", type=Path, help=f"write the markdown tables here (keeping its '{KEPT_SECTION}')")
    args = parser.parse_args(argv)
    summary = list(SUMMARY_HEADER)
    details = []
    for name in args.networks:
        size = NETWORKS[name][3]
        networks = build_networks(name)
        for phase, train in (("training step", True), ("inference pass", False)):
            counted = {side: count(model, args.batch, size, train) for side, model in networks.items()}
            summary.append(summary_row(name, phase, counted["ours"], counted["timm"]))
            details += table(f"{name} ({args.batch} x {size})", phase, counted["ours"], counted["timm"])
            print(summary[-1], flush=True)
    text = "\n".join(summary + ["", "## Per block type", ""] + details)
    if args.out:
        import timm

        command = "python benchmarks/bench_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:])
        intro = RESULTS_INTRO.format(command=command, torch=torch.__version__, timm=timm.__version__)
        kept = args.out.read_text().partition(KEPT_SECTION) if args.out.exists() else ("", "", "")
        report = f"{intro}\n## Totals\n\n{text}\n"
        args.out.write_text(report + (f"\n{kept[1]}{kept[2]}" if kept[1] else ""))
    print(text)


if __name__ == "__main__":
    main()
