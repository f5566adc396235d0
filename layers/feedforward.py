"""The token-wise feed-forward network of transformers and MLP-Mixers, and the linear helpers the
shared layers call with an optional activation and residual add."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

Tensor = torch.Tensor


def fused_linear(
    x: Tensor, layer: nn.Linear, activation: nn.Module | None = None, residual: Tensor | None = None
) -> Tensor:
    """``activation(layer(x)) + residual`` (both optional): (..., in) -> (..., out)."""
    return linear(x, layer.weight, layer.bias, activation, residual)


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: nn.Module | None = None,
    residual: Tensor | None = None,
) -> Tensor:
    """:func:`fused_linear` on a (out, in) weight and an optional (out,) bias rather than a layer:
    some rows of a fused projection, or an output layer tied to an embedding table."""
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

    ``forward(x, residual)`` adds ``residual`` (..., D) to the output.
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
        out = self.out_drop(self.fc2(self.drop(self.act(self.fc1(x)))))
        return out if residual is None else out + residual
