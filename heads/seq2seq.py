"""The Transformer decoder: target prefix + encoder memory -> next-token logits.

A decoder layer is causal self-attention, cross-attention over the encoder output,
and a feed-forward network, each in a residual block (post- or pre-norm, as the
encoder). Both attentions are the zoo's standard :class:`MultiHeadAttention`.

Hypotheses share their sentence's memory: the target batch may hold ``K`` rows per
memory row (sentence i's hypotheses at rows ``iK .. iK + K - 1``, as beam search lays
them out). Cross-attention takes a sentence's K hypotheses as K more queries over its
one memory, so the memory is neither repeated nor projected K times.

Incremental decoding keeps one :class:`DecoderCache` per batch: the self-attention
keys/values of every layer in one buffer that each step writes into (no concatenation),
and the cross-attention keys/values of the memory (projected on the first step, reused
afterwards). Beam search reorders the hypotheses with :meth:`DecoderCache.reorder`.

The output projection is tied to the token embedding (``logits = h E^T``), which
is the decoder's input table and, with a shared vocabulary, the encoder's too.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from layers.attention import KVCache, MultiHeadAttention
from layers.feedforward import FeedForward, fused_linear, linear
from layers.transformer import Residual, TokenEmbedding, init_transformer_weights

Tensor = torch.Tensor


def padding_bias(padding_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, S) bool, True = pad -> (B, 1, 1, S) attention bias: 0 for tokens, -inf for padding."""
    bias = torch.zeros(padding_mask.shape, dtype=dtype, device=padding_mask.device)
    return bias.masked_fill(padding_mask, float("-inf"))[:, None, None]


#: positions the self-attention cache holds before it first grows: most sentences' outputs fit,
#: and each growth copies the whole cache (at 16, growing to 64 cost 2 % of a 64-token beam search)
INITIAL_CAPACITY = 64


class DecoderCache:
    """Decoding state of a batch of N hypotheses.

    - ``self_kv`` (L, 2, N, H, capacity, head_dim): layer l's self-attention keys at ``[l, 0]``
      and values at ``[l, 1]`` for the ``steps`` positions decoded so far. Each step writes its
      position in place; the buffer doubles when full. A layer's keys are one (N, H, steps,
      head_dim) slice whose hypothesis and head axes merge, so attention reads them as one batch
      of matrices without copying (hypothesis-major, the layout a reorder copies fastest, made
      every step's attention copy its keys and values first).
    - ``cross_attn``: per layer, a static :class:`KVCache` with the keys/values of the memory
      (sentences, H, S, head_dim), projected at the first step.
    - ``memory_bias``: (sentences, 1, 1, S) attention bias of the memory's padding, or None.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.cross_attn = [KVCache(static=True) for _ in range(num_layers)]
        self.memory_bias: Tensor | None = None
        self.self_kv: Tensor | None = None
        self.steps = 0

    def append(self, layer: int, kv: Tensor) -> tuple[Tensor, Tensor]:
        """Store layer ``layer``'s keys/values ``kv`` (N, T, 2, H, head_dim) of the T new positions;
        returns the keys and values (N, H, steps + T, head_dim) of all positions (views)."""
        n, new, _, heads, head_dim = kv.shape
        end = self.steps + new
        if self.self_kv is None or self.self_kv.shape[4] < end:
            self._grow(max(end, INITIAL_CAPACITY if self.self_kv is None else 2 * self.self_kv.shape[4]), kv)
        self.self_kv[layer, :, :, :, self.steps:end] = kv.permute(2, 0, 3, 1, 4)
        return self.self_kv[layer, 0, :, :, :end], self.self_kv[layer, 1, :, :, :end]

    def _grow(self, capacity: int, kv: Tensor) -> None:
        n, _, _, heads, head_dim = kv.shape
        buffer = kv.new_empty(self.num_layers, 2, n, heads, capacity, head_dim)
        if self.self_kv is not None:
            buffer[..., : self.steps, :] = self.self_kv[..., : self.steps, :]
        self.self_kv = buffer

    def reorder(self, index: Tensor, whole: bool | None = None) -> None:
        """Hypothesis i continues hypothesis ``index[i]`` (N,). Every index must stay within its
        sentence's block of rows (as beam search's do): the memory's keys/values are per sentence.

        ``whole`` (default: on CUDA) copies every row: finding the rows that changed (``nonzero``) would make
        the host wait for the device at every decoded token. On the CPU, where that costs nothing, only the
        rows that change are copied (beams often continue themselves: fewer bytes)."""
        if self.self_kv is None:
            return
        hypotheses = self.self_kv.shape[2]
        if index.shape != (hypotheses,):
            raise ValueError(f"reorder needs one index per hypothesis, ({hypotheses},), got {tuple(index.shape)}")
        past = self.self_kv[..., : self.steps, :]
        if index.device.type == "cuda" if whole is None else whole:
            past.copy_(past.index_select(2, index))
            return
        moved = (index != torch.arange(len(index), device=index.device)).nonzero().squeeze(1)
        if len(moved):
            past.index_copy_(2, moved, past.index_select(2, index[moved]))


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

    def forward(self, x: Tensor, memory: Tensor | None, memory_padding_mask: Tensor | None = None,
                cache: DecoderCache | None = None, index: int = 0) -> Tensor:
        """x (N, T, D), N a multiple of the number of sentences; memory (sentences, S, D), None when
        ``cache`` holds its keys/values; memory_padding_mask (sentences, S) bool, True = pad, or its
        :func:`padding_bias` (which the decoder computes once for all layers and steps);
        ``index``: this layer's number in ``cache``."""
        memory_bias = memory_padding_mask
        if memory_bias is not None and memory_bias.dtype == torch.bool:
            memory_bias = padding_bias(memory_bias, x.dtype)
        if cache is None:
            x = self.self_block(x, lambda h: self.self_attn(h, is_causal=True))
        else:
            x = self.self_block(x, lambda h: self._cached_self_attention(h, cache, index))
        cross_cache = None if cache is None else cache.cross_attn[index]
        x = self.cross_block(x, lambda h: self._cross_attention(h, memory, memory_bias, cross_cache))
        return self.ffn_block(x, self.ffn)

    def _cached_self_attention(self, h: Tensor, cache: DecoderCache, index: int) -> Tensor:
        """The self-attention module's computation, with its keys/values kept in ``cache``'s buffer
        rather than the zoo's :class:`KVCache`, which concatenates a new tensor every step."""
        attn = self.self_attn
        n, new, dim = h.shape
        q, kv = fused_linear(h, attn.qkv).view(n, new, 3, attn.num_heads, attn.head_dim).split([1, 2], dim=2)
        keys, values = cache.append(index, kv)
        q = q.squeeze(2).transpose(1, 2)
        dropout_p = attn.dropout if self.training else 0.0
        allowed = None
        if new > 1:  # causal among the new positions, which all see the cached ones
            allowed = torch.ones(new, keys.shape[2], dtype=torch.bool, device=h.device).tril(keys.shape[2] - new)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, dropout_p=dropout_p)
        return fused_linear(out.transpose(1, 2).reshape(n, new, dim), attn.proj)

    def _cross_attention(self, h: Tensor, memory: Tensor | None, memory_bias: Tensor | None,
                         cache: KVCache | None) -> Tensor:
        n, new, dim = h.shape
        sentences = (memory if cache is None or cache.key is None else cache.key).shape[0]
        queries = h.reshape(sentences, -1, dim)  # a sentence's hypotheses: more queries over the same memory
        out = self.cross_attn(queries, memory, attn_mask=memory_bias, kv_cache=cache)
        return out.reshape(n, new, dim)


class TransformerDecoder(nn.Module):
    """Target ids (B, T) + memory (B, S, D) -> logits (B, T, V).

    Args:
        vocab_size, dim, depth, num_heads, ffn_dim, dropout, attention_dropout,
        activation_dropout, pre_norm, max_positions, learned_positions, pad_id: as
            :class:`backbones.transformer.TransformerEncoder`.
        embed_tokens: the encoder's token table to share (shared vocabulary); ``None``
            gives the decoder its own. The output layer is always tied to the decoder's table.
    """

    repeated_blocks = (DecoderLayer,)  # the units of --model.compile regional

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
        return DecoderCache(self.depth)

    def forward(self, tgt: Tensor, memory: Tensor | None, memory_padding_mask: Tensor | None = None,
                cache: DecoderCache | None = None) -> Tensor:
        """tgt (N, T) ids, K hypotheses per sentence in consecutive rows (N = K * sentences; K = 1
        for teacher forcing); with ``cache``, only the new positions (usually T = 1), which are
        appended to it. memory (sentences, S, D), may be None once ``cache`` holds its keys/values;
        memory_padding_mask (sentences, S) True = pad, or None when no sentence is padded: it is applied
        as given (deciding from its values would make the host wait for a GPU), so a caller that knows
        there is no padding passes None and the attention takes its unmasked kernels. Returns logits (N, T, V)."""
        if memory is not None and tgt.shape[0] % memory.shape[0]:
            raise ValueError(f"{tgt.shape[0]} target rows are not a whole number of hypotheses for each of "
                             f"the {memory.shape[0]} sentences of the memory")
        offset = 0 if cache is None else cache.steps
        x = self.embed(tgt, offset)
        if cache is not None and cache.cross_attn[0].key is not None:
            memory_bias = cache.memory_bias  # of the memory projected at an earlier step
        else:
            memory_bias = None if memory_padding_mask is None else padding_bias(memory_padding_mask, x.dtype)
            if cache is not None:
                cache.memory_bias = memory_bias
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, memory_bias, cache, i)
        if cache is not None:
            cache.steps += tgt.shape[1]
        return linear(self.norm(x), self.output_weight)
