"""The token-wise feed-forward network of transformers and MLP-Mixers."""
from __future__ import annotations

import torch
import torch.nn as nn


class FeedForward(nn.Module):
    """(..., D) -> (..., D) on the last dim: Linear(D, F) -> act -> dropout -> Linear(F, D) -> dropout.

    ``out_dropout`` is the rate after the second Linear, by default ``dropout`` (timm's
    ``Mlp``); the Transformer of Vaswani et al. uses 0 there (its residual block drops
    the sub-layer's output instead) and ``dropout`` as the "activation dropout".
    Parameters: ``fc1``, ``fc2`` (timm's and fairseq's names).
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_drop(self.fc2(self.drop(self.act(self.fc1(x)))))
