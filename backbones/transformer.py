"""The Transformer sequence encoder of "Attention is all you need" (Vaswani et al. 2017).

Tokens -> embeddings scaled by sqrt(d) + positions (sinusoidal as in the paper, or
learned) -> dropout -> N encoder layers. A layer is self-attention then a position-wise
feed-forward network, each wrapped in a residual connection with layer norm: after the
residual (post-norm, the paper) or before the sub-layer (pre-norm, with a final norm
over the stack; trains without warm-up tricks at depth).

The embedding, residual blocks and feed-forward come from :mod:`layers` (the
decoder, ``heads.seq2seq``, is built from the same pieces). The self-attention is
built by name from the attention zoo (:func:`layers.attention.build_attention`),
so the same encoder runs with standard, separable, Linformer, Synthesizer or
additive attention.

Sizes of the paper (Table 3):

=====  ======  =====  ====  =====  =======  ==================================
name   layers  d      h     d_ff   dropout  parameters (enc+dec, 37k vocab)
base   6+6     512    8     2048   0.1      ~63M (paper: 65M)
big    6+6     1024   16    4096   0.3      ~214M (paper: 213M)
=====  ======  =====  ====  =====  =======  ==================================
"""
from __future__ import annotations

import torch
import torch.nn as nn

from layers.attention import build_attention
from layers.feedforward import FeedForward
from layers.transformer import Residual, TokenEmbedding, init_transformer_weights

Tensor = torch.Tensor

#: (layers, dim, heads, ffn_dim, dropout) of the paper's models, per side
TRANSFORMER_SIZES = {
    "base": dict(depth=6, dim=512, num_heads=8, ffn_dim=2048, dropout=0.1),
    "big": dict(depth=6, dim=1024, num_heads=16, ffn_dim=4096, dropout=0.3),
}


class EncoderLayer(nn.Module):
    """Self-attention (any zoo variant) + FFN, each in a :class:`Residual`."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int, dropout: float = 0.1, attention: str = "mha",
                 attention_kwargs: dict | None = None, attention_dropout: float = 0.0,
                 activation_dropout: float = 0.0, pre_norm: bool = False):
        super().__init__()
        self.self_attn = build_attention(attention, dim, num_heads, dropout=attention_dropout,
                                         **(attention_kwargs or {}))
        self.attn_block = Residual(dim, dropout, pre_norm)
        self.ffn = FeedForward(dim, ffn_dim, nn.ReLU, activation_dropout, out_dropout=0.0)
        self.ffn_block = Residual(dim, dropout, pre_norm)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        x = self.attn_block(x, lambda h: self.self_attn(h, key_padding_mask=padding_mask))
        return self.ffn_block(x, self.ffn)


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

    repeated_blocks = (EncoderLayer,)  # the units of --model.compile regional

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

    def layer_order(self, name: str) -> tuple[int, ...]:
        """Layer-wise lr decay layers: the embeddings, each encoder layer in order, the final norm (pre-norm)
        with the last layer, as timm's ViT."""
        if name.startswith("embed."):
            return (0,)
        if name.startswith("layers."):
            return (1, int(name.split(".")[1]))
        return (1, len(self.layers) - 1)

    def forward(self, src: Tensor, padded: bool | None = None) -> tuple[Tensor, Tensor]:
        """src (B, S) ids, padded with ``pad_id`` after the tokens -> (memory (B, S, D), padding (B, S) bool).

        ``padded``: whether any row of ``src`` is padded, from a caller that knows it without reading
        the device (a batch collated on the host); ``None`` reads it from ``src``, which on a GPU makes
        the host wait. Without padding no mask is passed, which lets SDPA use its fused kernels."""
        padding = src.eq(self.pad_id)
        x = self.embed(src)
        if padded is None:
            padded = bool(padding.any())
        mask = padding if padded else None
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x), padding
