"""The token-wise feed-forward network of transformers and MLP-Mixers, and the fused linear
layer that the shared layers run at inference.

Inference on CPU (float32, autograd off) spends a good part of a transformer's time outside
its GEMMs: copying the bias into the output before the GEMM, the activation and the residual
add, each one more pass over a (tokens x features) tensor. oneDNN's linear kernel does the
bias, one activation or one add in the GEMM's epilogue, while the tile is still in cache.
:func:`fused_linear` uses it where it may and the plain ops everywhere else (training,
GPUs, other dtypes, and under tracing, export, compilation or any dispatch mode such as
the FLOP counter, which all need the standard ops). Results agree with the plain ops to
float32 rounding (the kernels sum in another order).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

Tensor = torch.Tensor

#: whether this torch has oneDNN's fused linear kernel (x86 builds do)
ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_activation(activation: nn.Module) -> tuple[str, str] | None:
    """(post-op name, algorithm) of the oneDNN epilogue equal to ``activation``, or None."""
    if isinstance(activation, nn.GELU):
        return "gelu", activation.approximate
    if isinstance(activation, nn.ReLU):
        return "relu", ""
    if isinstance(activation, nn.SiLU):
        return "swish", ""
    return None


def onednn_inference(x: Tensor) -> bool:
    """Whether oneDNN's fused linear kernels may stand in for the plain ops on ``x``: a float32
    CPU tensor with autograd off (the kernels have no backward), outside any tracer, exporter,
    compiler or dispatch mode (they need the standard ops; Inductor fuses on its own)."""
    return (
        ONEDNN_LINEAR
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()
        and not torch.jit.is_tracing()
        and not torch.onnx.is_in_onnx_export()
        and not torch.compiler.is_compiling()
        and not torch.compiler.is_exporting()
        and not is_in_torch_dispatch_mode()
    )


def fused_linear(
    x: Tensor, layer: nn.Linear, activation: nn.Module | None = None, residual: Tensor | None = None
) -> Tensor:
    """``activation(layer(x)) + residual`` (both optional): (..., in) -> (..., out).

    One oneDNN kernel does the GEMM with the bias and either the activation (GELU, ReLU,
    SiLU) or the residual add when :func:`onednn_inference` allows; everything else runs
    as the plain ops.
    """
    return linear(x, layer.weight, layer.bias, activation, residual)


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: nn.Module | None = None,
    residual: Tensor | None = None,
) -> Tensor:
    """:func:`fused_linear` on a (out, in) weight and an optional (out,) bias rather than a layer:
    some rows of a fused projection, or an output layer tied to an embedding table. oneDNN's
    kernel also beats the plain GEMM on small row counts (128 x 256 -> 768: 10 % faster)."""
    if onednn_inference(x) and weight.dtype == torch.float32:
        post_op = None if activation is None else _onednn_activation(activation)
        if activation is None and residual is not None and residual.shape[-1] == weight.shape[0]:
            out_shape = (*x.shape[:-1], weight.shape[0])
            if residual.shape == out_shape and residual.dtype == torch.float32:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")
        if activation is None or post_op is not None:
            name, algorithm = post_op or ("none", "")
            out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, name, [], algorithm)
            return out if residual is None else out + residual
    out = F.linear(x, weight, bias)
    if activation is not None:
        out = activation(out)
    return out if residual is None else out + residual


class FeedForward(nn.Module):
    """(..., D) -> (..., D) on the last dim: Linear(D, F) -> act -> dropout -> Linear(F, D) -> dropout.

    ``out_dropout`` is the rate after the second Linear, by default ``dropout`` (timm's
    ``Mlp``); the Transformer of Vaswani et al. uses 0 there (its residual block drops
    the sub-layer's output instead) and ``dropout`` as the "activation dropout".
    Parameters: ``fc1``, ``fc2`` (timm's and fairseq's names).

    ``forward(x, residual)`` adds ``residual`` (..., D) to the output; in eval mode the
    activation and the add ride on the Linears' kernels (:func:`fused_linear`).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        act_layer: type[nn.Module] = nn.GELU,
        dropout: float = 0.0,
        out_dropout: float | None = None,
    ):
        super().__init__()
        out_dropout = dropout if out_dropout is None else out_dropout
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = act_layer()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.out_drop = nn.Dropout(out_dropout) if out_dropout > 0 else nn.Identity()

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        if self.training:
            out = self.out_drop(self.fc2(self.drop(self.act(self.fc1(x)))))
            return out if residual is None else out + residual
        return fused_linear(fused_linear(x, self.fc1, self.act), self.fc2, residual=residual)
