"""The Transformer sequence encoder of "Attention is all you need" (Vaswani et al. 2017).

Tokens -> embeddings scaled by sqrt(d) + positions (sinusoidal as in the paper, or
learned) -> dropout -> N encoder layers. A layer is self-attention then a position-wise
feed-forward network, each wrapped in a residual connection with layer norm: after the
residual (post-norm, the paper) or before the sub-layer (pre-norm, with a final norm
over the stack; trains without warm-up tricks at depth).

The self-attention is built by name from the attention zoo
(:func:`backbones.attention.build_attention`), so the same encoder runs with standard,
separable, Linformer, Synthesizer or additive attention.

Sizes of the paper (Table 3):

=====  ======  =====  ====  =====  =======  ==================================
name   layers  d      h     d_ff   dropout  parameters (enc+dec, 37k vocab)
base   6+6     512    8     2048   0.1      ~63M (paper: 65M)
big    6+6     1024   16    4096   0.3      ~214M (paper: 213M)
=====  ======  =====  ====  =====  =======  ==================================
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from backbones.attention import build_attention
from backbones.registry import register_backbone

Tensor = torch.Tensor

#: (layers, dim, heads, ffn_dim, dropout) of the paper's models, per side
TRANSFORMER_SIZES = {
    "base": dict(depth=6, dim=512, num_heads=8, ffn_dim=2048, dropout=0.1),
    "big": dict(depth=6, dim=1024, num_heads=16, ffn_dim=4096, dropout=0.3),
}


def sinusoidal_table(num_positions: int, dim: int) -> Tensor:
    """(num_positions, dim): PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same)."""
    position = torch.arange(num_positions, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(num_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: dim // 2])
    return table.float()


class TokenEmbedding(nn.Module):
    """ids (B, N) -> (B, N, D): ``sqrt(D) * E[ids] + P[offset : offset + N]``, then dropout.

    ``tokens.weight`` (V, D) is the table the decoder shares and ties to its output layer;
    it is initialised N(0, D^-0.5) so the scaled embedding has unit variance, with the
    padding row at zero. Positions are counted from 0 for every sequence; padding only
    ever follows the tokens, so a sentence's positions do not depend on its batch.
    """

    def __init__(self, vocab_size: int, dim: int, max_positions: int = 1024, pad_id: int = 0,
                 learned_positions: bool = False, dropout: float = 0.1):
        super().__init__()
        self.dim = dim
        self.scale = math.sqrt(dim)
        self.max_positions = max_positions
        self.tokens = nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        nn.init.normal_(self.tokens.weight, std=dim ** -0.5)
        with torch.no_grad():
            self.tokens.weight[pad_id].zero_()
        if learned_positions:
            self.positions = nn.Parameter(torch.randn(max_positions, dim) * dim ** -0.5)
        else:
            self.register_buffer("positions", sinusoidal_table(max_positions, dim), persistent=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: Tensor, offset: int = 0) -> Tensor:
        n = ids.shape[1]
        if offset + n > self.max_positions:
            raise ValueError(f"sequence of {offset + n} positions exceeds max_positions={self.max_positions}")
        x = self.tokens(ids) * self.scale + self.positions[offset : offset + n].to(self.tokens.weight.dtype)
        return self.dropout(x)


class FeedForward(nn.Module):
    """Position-wise FFN: Linear(D, F) -> ReLU -> dropout -> Linear(F, D)."""

    def __init__(self, dim: int, ffn_dim: int, activation_dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(activation_dropout)
        self.fc2 = nn.Linear(ffn_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(self.act(self.fc1(x))))


class Residual(nn.Module):
    """``x + dropout(f(x))`` with layer norm after it (post-norm) or on f's input (pre-norm)."""

    def __init__(self, dim: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.pre_norm:
            return x + self.drop(sublayer(self.norm(x)))
        return self.norm(x + self.drop(sublayer(x)))


class EncoderLayer(nn.Module):
    """Self-attention (any zoo variant) + FFN, each in a :class:`Residual`."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int, dropout: float = 0.1, attention: str = "mha",
                 attention_kwargs: dict | None = None, attention_dropout: float = 0.0,
                 activation_dropout: float = 0.0, pre_norm: bool = False):
        super().__init__()
        self.self_attn = build_attention(attention, dim, num_heads, dropout=attention_dropout,
                                         **(attention_kwargs or {}))
        self.attn_block = Residual(dim, dropout, pre_norm)
        self.ffn = FeedForward(dim, ffn_dim, activation_dropout)
        self.ffn_block = Residual(dim, dropout, pre_norm)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        x = self.attn_block(x, lambda h: self.self_attn(h, key_padding_mask=padding_mask))
        return self.ffn_block(x, self.ffn)


def init_transformer_weights(module: nn.Module) -> None:
    """Xavier-uniform Linear weights and zero biases (fairseq's Transformer init). The fused
    (3D, D) ``qkv`` weight thereby gets fairseq's 1/sqrt(2) gain of separate q/k/v weights."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


@register_backbone("transformer_encoder")
class TransformerEncoder(nn.Module):
    """Token ids (B, S) -> contextual features (B, S, D) and the padding mask (B, S).

    Args:
        vocab_size: rows of the token table (shared with the decoder when tied).
        dim, depth, num_heads, ffn_dim: d_model, N, h, d_ff of the paper.
        dropout: on embeddings and every residual branch (P_drop).
        attention: zoo name of the self-attention (``mha``, ``separable``, ``linformer``,
            ``synthesizer_dense``, ``synthesizer_random``, ``additive``).
        attention_kwargs: extra arguments of that variant (e.g. ``{proj_len: 64}``; ``max_len``
            defaults to ``max_positions`` for the variants that take one).
        attention_dropout, activation_dropout: dropout on attention weights / inside the FFN.
        pre_norm: layer norm before each sub-layer (+ a final norm) instead of after.
        max_positions: longest input; learned_positions: a learned table instead of sinusoids.
    """

    def __init__(self, vocab_size: int, dim: int = 512, depth: int = 6, num_heads: int = 8, ffn_dim: int = 2048,
                 dropout: float = 0.1, attention: str = "mha", attention_kwargs: dict | None = None,
                 attention_dropout: float = 0.0, activation_dropout: float = 0.0, pre_norm: bool = False,
                 max_positions: int = 1024, learned_positions: bool = False, pad_id: int = 0):
        super().__init__()
        self.dim = self.num_features = dim
        self.pad_id = pad_id
        kwargs = dict(attention_kwargs or {})
        if attention.lower() in ("linformer", "synthesizer_dense", "synthesizer_random"):
            kwargs.setdefault("max_len", max_positions)
        self.embed = TokenEmbedding(vocab_size, dim, max_positions, pad_id, learned_positions, dropout)
        self.layers = nn.ModuleList(
            EncoderLayer(dim, num_heads, ffn_dim, dropout, attention, kwargs, attention_dropout, activation_dropout,
                         pre_norm)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim) if pre_norm else nn.Identity()
        init_transformer_weights(self.layers)

    def forward(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) ids, padded with ``pad_id`` after the tokens -> (memory (B, S, D), padding (B, S) bool)."""
        padding = src.eq(self.pad_id)
        x = self.embed(src)
        mask = padding if padding.any() else None  # no mask lets SDPA use its fused kernels
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x), padding
