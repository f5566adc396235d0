"""The Transformer decoder: target prefix + encoder memory -> next-token logits.

A decoder layer is causal self-attention, cross-attention over the encoder output,
and a feed-forward network, each in a residual block (post- or pre-norm, as the
encoder). Both attentions are the zoo's standard :class:`MultiHeadAttention`.

Incremental decoding keeps one :class:`DecoderCache` per batch: per layer, the
self-attention keys/values of the tokens decoded so far (grown by one position
per step) and the cross-attention keys/values of the memory (projected on the
first step, reused afterwards). Beam search reorders the cache rows with
:meth:`DecoderCache.reorder`.

The output projection is tied to the token embedding (``logits = h E^T``), which
is the decoder's input table and, with a shared vocabulary, the encoder's too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from layers.attention import KVCache, MultiHeadAttention
from layers.feedforward import FeedForward
from layers.transformer import Residual, TokenEmbedding, init_transformer_weights

Tensor = torch.Tensor


@dataclass
class DecoderCache:
    """Decoding state of a batch: one (self, cross) pair of :class:`KVCache` per layer and
    the number of target positions processed so far."""

    self_attn: list[KVCache] = field(default_factory=list)
    cross_attn: list[KVCache] = field(default_factory=list)
    steps: int = 0

    @classmethod
    def empty(cls, num_layers: int) -> "DecoderCache":
        return cls([KVCache() for _ in range(num_layers)], [KVCache(static=True) for _ in range(num_layers)])

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (B',) of the self-attention states, in that order. The
        cross-attention states stay: beam search only reorders beams of one source, which
        share their memory."""
        for c in self.self_attn:
            if c.key is not None:
                c.key = c.key.index_select(0, index)
                c.value = c.value.index_select(0, index)


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, ffn_dim: int, dropout: float = 0.1, attention_dropout: float = 0.0,
                 activation_dropout: float = 0.0, pre_norm: bool = False):
        super().__init__()
        self.self_attn = MultiHeadAttention(dim, num_heads, dropout=attention_dropout)
        self.self_block = Residual(dim, dropout, pre_norm)
        self.cross_attn = MultiHeadAttention(dim, num_heads, dropout=attention_dropout)
        self.cross_block = Residual(dim, dropout, pre_norm)
        self.ffn = FeedForward(dim, ffn_dim, nn.ReLU, activation_dropout, out_dropout=0.0)
        self.ffn_block = Residual(dim, dropout, pre_norm)

    def forward(self, x: Tensor, memory: Tensor | None, memory_padding_mask: Tensor | None,
                self_cache: KVCache | None = None, cross_cache: KVCache | None = None) -> Tensor:
        # causal: with a cache, the new positions see the cached ones plus themselves; a single
        # position sees everything there is, which lets SDPA skip the mask
        causal = x.shape[1] > 1
        x = self.self_block(x, lambda h: self.self_attn(h, is_causal=causal, kv_cache=self_cache))
        x = self.cross_block(x, lambda h: self.cross_attn(h, memory, key_padding_mask=memory_padding_mask,
                                                          kv_cache=cross_cache))
        return self.ffn_block(x, self.ffn)


class TransformerDecoder(nn.Module):
    """Target ids (B, T) + memory (B, S, D) -> logits (B, T, V).

    Args:
        vocab_size, dim, depth, num_heads, ffn_dim, dropout, attention_dropout,
        activation_dropout, pre_norm, max_positions, learned_positions, pad_id: as
            :class:`backbones.transformer.TransformerEncoder`.
        embed_tokens: the encoder's token table to share (shared vocabulary); ``None``
            gives the decoder its own. The output layer is always tied to the decoder's table.
    """

    def __init__(self, vocab_size: int, dim: int = 512, depth: int = 6, num_heads: int = 8, ffn_dim: int = 2048,
                 dropout: float = 0.1, attention_dropout: float = 0.0, activation_dropout: float = 0.0,
                 pre_norm: bool = False, max_positions: int = 1024, learned_positions: bool = False, pad_id: int = 0,
                 embed_tokens: nn.Embedding | None = None):
        super().__init__()
        self.depth = depth
        self.embed = TokenEmbedding(vocab_size, dim, max_positions, pad_id, learned_positions, dropout)
        if embed_tokens is not None:
            if embed_tokens.weight.shape != self.embed.tokens.weight.shape:
                raise ValueError(f"shared embedding has shape {tuple(embed_tokens.weight.shape)}, "
                                 f"the decoder needs {tuple(self.embed.tokens.weight.shape)}")
            self.embed.tokens = embed_tokens
        self.layers = nn.ModuleList(
            DecoderLayer(dim, num_heads, ffn_dim, dropout, attention_dropout, activation_dropout, pre_norm)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim) if pre_norm else nn.Identity()
        init_transformer_weights(self.layers)

    @property
    def output_weight(self) -> Tensor:
        return self.embed.tokens.weight

    def new_cache(self) -> DecoderCache:
        return DecoderCache.empty(self.depth)

    def forward(self, tgt: Tensor, memory: Tensor, memory_padding_mask: Tensor | None = None,
                cache: DecoderCache | None = None) -> Tensor:
        """tgt (B, T) ids; with ``cache``, only the new positions (usually T = 1), which are
        appended to it. memory (B, S, D); memory_padding_mask (B, S) True = pad.
        Returns logits (B, T, V)."""
        offset = 0 if cache is None else cache.steps
        x = self.embed(tgt, offset)
        if memory_padding_mask is not None and not memory_padding_mask.any():
            memory_padding_mask = None
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, memory_padding_mask,
                      None if cache is None else cache.self_attn[i], None if cache is None else cache.cross_attn[i])
        if cache is not None:
            cache.steps += tgt.shape[1]
        return F.linear(self.norm(x), self.output_weight)
