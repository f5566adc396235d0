"""The attention zoo: one interface, several ways to mix tokens.

Every implementation maps token sequences to token sequences::

    attn = build_attention("mha", dim=256, num_heads=4)
    y = attn(x)                                   # self-attention, (B, N, D) -> (B, N, D)
    y = attn(x, memory, key_padding_mask=pad)     # cross-attention over (B, S, D) memory

and has the same call signature ``forward(query, key=None, value=None, *,
key_padding_mask=None, attn_mask=None, is_causal=False, kv_cache=None,
residual=None)``:

- ``query`` (B, N, D); ``key``/``value`` (B, S, D) default to ``query``
  (``value`` defaults to ``key``).
- ``key_padding_mask`` (B, S) bool, True = padding: a padded key never changes
  the output of any position.
- ``attn_mask`` (N, S) or (B, N, S) or (B, H, N, S); bool with True = blocked
  (the same convention as ``key_padding_mask`` and ``torch.nn.MultiheadAttention``),
  or float, added to the attention logits.
- ``is_causal``: position i only sees keys 0..i (counted from the start of the
  cache when one is given).
- ``kv_cache``: a :class:`KVCache` for incremental decoding (see there).
- ``residual`` (B, N, D): added to the output.

A variant that cannot honour an argument (Linformer mixes the token axis, so it
has no causal mode) raises a ``ValueError`` saying so instead of ignoring it.
The output projection of every variant is named ``proj``; the input projection of
standard attention is one fused ``qkv`` Linear, as in timm's ViT, so timm
checkpoints map one to one.

Rows whose keys are *all* blocked have no defined softmax; avoid them (e.g. never
pad a whole sequence).

A new variant subclasses :class:`Attention`, implements ``_attend`` (it receives the
checked arguments of ``forward`` and returns the mixed tokens (B, N, D) that ``forward``
passes through the output projection ``proj``) and registers under a name with
``@register_attention("name")``, which makes it buildable everywhere an
``attention`` argument is taken.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import flop_counter

from layers.compat import cpu_sdpa_kernels
from layers.feedforward import fused_linear, linear
from layers.registry import Registry

__all__ = [
    "ATTENTION",
    "AdditiveAttention",
    "Attention",
    "DenseSynthesizerAttention",
    "KVCache",
    "LinformerAttention",
    "MultiHeadAttention",
    "RandomSynthesizerAttention",
    "SeparableSelfAttention",
    "build_attention",
    "list_attention",
    "register_attention",
    "register_cpu_sdpa_flops",
]

Tensor = torch.Tensor


def register_cpu_sdpa_flops() -> None:
    """Teach PyTorch's FLOP counter the flash kernel SDPA runs on CPU, forward and backward.

    The counter knows SDPA's CUDA kernels only, so attention's matrix products went uncounted on
    CPU (ViT-S/16 at 224: 4.25 of 4.6 GMACs). The FLOP-counting code calls this before it counts;
    it changes torch's global registry, so nothing does it at import. Safe to call more than once."""
    forward, backward = cpu_sdpa_kernels()
    for kernel, formula in ((forward, flop_counter.sdpa_flop), (backward, flop_counter.sdpa_backward_flop)):
        if kernel not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(kernel, get_raw=True)(formula)

def softmax_over(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """Softmax of ``x`` over the joint index of ``dims``, returned in ``x``'s shape and dim order.

    The dims are moved last and flattened into one contiguous axis (a copy of ``x``), so one fused
    softmax kernel runs forward and one backward; the result is a view back in ``x``'s order."""
    dims = sorted(d % x.ndim for d in dims)
    if torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting():
        # an exported graph takes any multiple of the size it was traced at, and ONNX Runtime's buffer
        # planner mis-sizes the flattened softmax of such a grid (a shape mismatch at 2x the traced size):
        # the graph gets the same numbers as max, exp and sum
        shifted = (x - x.amax(dim=dims, keepdim=True)).exp()
        return shifted / shifted.sum(dim=dims, keepdim=True)
    order = [d for d in range(x.ndim) if d not in dims] + dims
    moved = x.permute(order)
    flat = moved.reshape(*moved.shape[: x.ndim - len(dims)], -1).softmax(dim=-1)
    return flat.view(moved.shape).permute([order.index(d) for d in range(x.ndim)])


#: name -> attention class; ``@ATTENTION.register("name")`` adds a variant
ATTENTION: Registry[Callable[..., nn.Module]] = Registry("attention")
register_attention = ATTENTION.register


def list_attention() -> list[str]:
    return ATTENTION.names()


def build_attention(name: str, dim: int, num_heads: int, **kwargs) -> nn.Module:
    """Build a registered variant, e.g. ``build_attention("linformer", 512, 8, max_len=4096, proj_len=256)``."""
    return ATTENTION.get(name)(dim, num_heads, **kwargs)


@dataclass
class KVCache:
    """State carried between decoding steps of one attention layer (one cache per layer).

    Self-attention (``static=False``): each call appends the keys/values of the new
    tokens, so step t attends to tokens 0..t without re-projecting the past. Pass
    ``is_causal=True`` when feeding several new tokens at once; a
    ``key_padding_mask`` must then cover all keys, cached ones included (B, S_past + N).

    Cross-attention (``static=True``): the first call projects the encoder output
    (``key``/``value``) and stores it; later calls reuse it and may pass ``key=None``.

    ``key``/``value`` hold whatever the layer needs to resume: projected keys and
    values (B, H, S, head_dim) for standard attention (see each class for the
    others). ``length`` is the number of keys held; ``steps`` the number of query
    tokens processed so far (they differ for cross-attention).
    """

    key: Tensor | None = None
    value: Tensor | None = None
    static: bool = False
    length: int = 0
    steps: int = 0


class Attention(nn.Module):
    """Shared argument handling. Subclasses set ``supports_causal`` / ``supports_cache``."""

    supports_causal = True
    supports_cache = True
    self_only = False

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads

    def _check_args(self, query: Tensor, key: Tensor | None, is_causal: bool, kv_cache: KVCache | None) -> None:
        name = type(self).__name__
        if query.ndim != 3 or query.shape[-1] != self.dim:
            raise ValueError(f"{name} expects query of shape (B, N, {self.dim}), got {tuple(query.shape)}")
        if self.self_only and key is not None and key is not query:
            raise ValueError(f"{name} is self-attention only; do not pass a different key/value")
        if is_causal and not self.supports_causal:
            raise ValueError(f"{name} has no causal mode (it mixes the token axis before attending)")
        if kv_cache is not None and not self.supports_cache:
            raise ValueError(f"{name} does not support a KV cache")

    def _blocked(
        self,
        batch: int,
        n_query: int,
        n_key: int,
        offset: int,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
        device: torch.device,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Combine the masks into (blocked (B|1, H|1, N, S) bool, additive float bias) or Nones.

        ``offset`` is the absolute position of the first query (the cache length).
        """
        blocked = None
        bias = None
        if key_padding_mask is not None:
            if key_padding_mask.shape != (batch, n_key):
                raise ValueError(
                    f"key_padding_mask must have shape (B, S)=({batch}, {n_key}), got {tuple(key_padding_mask.shape)}"
                )
            blocked = key_padding_mask.bool()[:, None, None, :]
        if is_causal:
            rows = torch.arange(offset, offset + n_query, device=device)[:, None]
            future = torch.arange(n_key, device=device)[None, :] > rows
            blocked = future if blocked is None else blocked | future
        if attn_mask is not None:
            mask = attn_mask
            while mask.ndim < 4:
                mask = mask.unsqueeze(0 if mask.ndim != 3 else 1)
            if mask.dtype == torch.bool:
                blocked = mask if blocked is None else blocked | mask
            else:
                bias = mask
        return blocked, bias

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        kv_cache: KVCache | None = None,
        residual: Tensor | None = None,
    ) -> Tensor:
        """(B, N, D) queries attend to (B, S, D) keys/values -> (B, N, D); arguments as in the module docstring."""
        self._check_args(query, key, is_causal, kv_cache)
        mixed = self._attend(query, key, value, key_padding_mask, attn_mask, is_causal, kv_cache)
        return fused_linear(mixed, self.proj, residual=residual)

    def _attend(
        self,
        query: Tensor,
        key: Tensor | None,
        value: Tensor | None,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
        kv_cache: KVCache | None,
    ) -> Tensor:
        """The variant's token mixing up to its output projection: (B, N, D), given :meth:`forward`'s
        arguments once they passed its checks. Variants override it with the same parameters
        (unannotated: the types are these)."""
        raise NotImplementedError

    def _project_kv(self, layer: nn.Linear, start: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Keys from output rows ``start : start + D`` of ``layer``, values from the next D rows,
        both (B, H, S, head_dim); one GEMM when ``value is key``."""
        d = self.dim
        if value is key:
            k, v = self._rows(layer, key, start, start + 2 * d).chunk(2, dim=-1)
        else:
            k, v = self._rows(layer, key, start, start + d), self._rows(layer, value, start + d, start + 2 * d)
        return self._heads(k), self._heads(v)

    def _cached_keys_values(
        self,
        query: Tensor,
        key: Tensor | None,
        value: Tensor | None,
        kv_cache: KVCache | None,
        layer: nn.Linear,
        start: int,
    ) -> tuple[Tensor, Tensor, int]:
        """Keys and values (B, H, S, head_dim) to attend to, projected by :meth:`_project_kv` (``key``
        defaults to ``query``, ``value`` to ``key``), and the absolute position of the first query.

        KV cache as :class:`KVCache` describes: a static one (cross-attention) stores the first
        call's keys/values and hands them back afterwards; a growing one (self-attention) appends
        the new keys/values, and the first query sits at its previous length.
        """
        static = kv_cache is not None and kv_cache.static
        if static and kv_cache.key is not None:
            k, v = kv_cache.key, kv_cache.value
        else:
            source = query if key is None else key
            k, v = self._project_kv(layer, start, source, source if value is None else value)
            if static:  # read at every later step: worth one copy into the layout matmul reads without copying
                k, v = k.contiguous(), v.contiguous()
        offset = 0
        if kv_cache is not None:
            if not static:
                offset = kv_cache.length
                if kv_cache.key is not None:
                    k = torch.cat([kv_cache.key, k], dim=2)
                    v = torch.cat([kv_cache.value, v], dim=2)
            kv_cache.key, kv_cache.value, kv_cache.length = k, v, k.shape[2]
            kv_cache.steps += query.shape[1]
        return k, v, offset

    @staticmethod
    def _masked_softmax(logits: Tensor, blocked: Tensor | None, bias: Tensor | None) -> Tensor:
        if bias is not None:
            logits = logits + bias
        if blocked is not None:
            logits = logits.masked_fill(blocked, float("-inf"))
        return logits.softmax(dim=-1)

    @staticmethod
    def _rows(layer: nn.Linear, x: Tensor, start: int, stop: int) -> Tensor:
        """Apply output rows ``start:stop`` of a fused projection (e.g. only the key part of ``qkv``)."""
        return linear(x, layer.weight[start:stop], None if layer.bias is None else layer.bias[start:stop])

    def _heads(self, x: Tensor) -> Tensor:
        """(B, S, D) -> (B, H, S, head_dim)."""
        b, s, _ = x.shape
        return x.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

    def _merge(self, x: Tensor) -> Tensor:
        """(B, H, N, head_dim) -> (B, N, D)."""
        b, _, n, _ = x.shape
        return x.transpose(1, 2).reshape(b, n, self.dim)


@register_attention("mha")
class MultiHeadAttention(Attention):
    """Multi-head scaled dot-product attention on ``F.scaled_dot_product_attention``.

    Time O(N·S·D), memory O(N·S·H) for the score matrix (less with the fused
    SDPA kernels, which never materialise it).

    Parameters: ``qkv`` (Linear D -> 3D, rows ordered query|key|value, heads
    contiguous inside each) and ``proj`` (Linear D -> D): the names and layout of
    timm's ``Attention``. Cross-attention uses the same weights, applying the
    query rows to ``query`` and the key/value rows to ``key``/``value``.

    KV cache: ``key``/``value`` hold the projected keys/values (B, H, S, head_dim).
    """

    def __init__(self, dim: int, num_heads: int = 8, dropout: float = 0.0, bias: bool = True):
        super().__init__(dim, num_heads)
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.dropout = dropout

    def project_memory(self, memory: Tensor, value: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Keys and values (B, H, S, head_dim) that queries attend to over ``memory`` (B, S, D) (values from
        ``value`` (B, S, D) when given): what a static :class:`KVCache` holds after its first call, for a
        caller that computes them once ahead, such as an exported encoder."""
        return self._project_kv(self.qkv, self.dim, memory, memory if value is None else value)

    def _attend(self, query, key, value, key_padding_mask, attn_mask, is_causal, kv_cache) -> Tensor:
        b, n, _ = query.shape
        if (key is None or key is query) and kv_cache is None:
            # one GEMM for q, k and v, as timm's ViT does
            qkv = fused_linear(query, self.qkv)
            q, k, v = qkv.view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            offset = 0
        else:
            q = self._heads(self._rows(self.qkv, query, 0, self.dim))
            k, v, offset = self._cached_keys_values(query, key, value, kv_cache, self.qkv, self.dim)
        s = k.shape[2]
        dropout_p = self.dropout if self.training else 0.0
        if key_padding_mask is None and attn_mask is None and (not is_causal or offset == 0 and n == s):
            # fast path: let SDPA pick a fused kernel
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal)
        else:
            blocked, bias = self._blocked(b, n, s, offset, key_padding_mask, attn_mask, is_causal, q.device)
            mask = bias if blocked is None else (~blocked).to(q.dtype).log()  # 0 where allowed, -inf where blocked
            if blocked is not None and bias is not None:
                mask = mask + bias
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), dropout_p=dropout_p)
        return self._merge(out)


@register_attention("separable")
class SeparableSelfAttention(Attention):
    """Separable self-attention of MobileViTv2 (Mehta & Rastegari 2022, Eq. 3).

    A latent token L scores every token: ``c = softmax_k(x W_I)`` (one logit per
    token, W_I: D -> 1); the context vector is the score-weighted sum of the key
    branch ``cv = sum_k c_k (x W_K)_k`` (1 x D); it is broadcast onto the ReLU'd
    value branch and projected: ``y = (ReLU(x W_V) * cv) W_O``.

    Time O(N·D²) for the projections and O(N·D) for the mixing, memory O(N·D):
    linear in the number of tokens, no N x N matrix. Self-attention only;
    ``num_heads`` is accepted for interface compatibility and ignored (the
    operation has a single latent token).

    Parameters: ``qkv`` (Linear D -> 1 + 2D, rows ordered score|key|value) and
    ``proj`` (Linear D -> D), i.e. timm's ``qkv_proj``/``out_proj`` 1x1 convs as Linears.
    ``dropout`` drops context scores (as the reference's ``attn_drop``).

    Masks: padded tokens get no score (a padded key never reaches the context).
    Causal: token i's context only sums tokens 0..i (running softmax via cumsum).
    KV cache (causal decoding): ``key`` holds the running score-weighted key sum
    (B, 1, D) and ``value`` the running (max logit, normaliser) (B, 1, 2): O(1)
    state per step.
    """

    self_only = True

    def __init__(self, dim: int, num_heads: int = 1, dropout: float = 0.0, bias: bool = True):
        super().__init__(dim, 1)
        self.qkv = nn.Linear(dim, 1 + 2 * dim, bias=bias)
        self.attn_drop = nn.Dropout(dropout)
        self.proj = nn.Linear(dim, dim, bias=bias)

    def forward_grid(self, x: Tensor, token_dims: tuple[int, ...], residual: Tensor | None = None) -> Tensor:
        """Self-attention (unmasked, not causal) among the tokens that the dims ``token_dims`` of
        ``x`` (..., D) index jointly, plus ``residual`` (x's shape) if given. MobileViTv2 passes its
        channels-last patch grid (B, N_h, P_h, N_w, P_w, D) with ``token_dims=(1, 3)``, so every
        pixel position inside a patch attends over all patches without unfolding the map (no copy)."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"SeparableSelfAttention expects (..., {self.dim}) tokens, got {tuple(x.shape)}")
        logits, k, v = fused_linear(x, self.qkv).split([1, self.dim, self.dim], dim=-1)
        scores = self.attn_drop(softmax_over(logits, token_dims))
        context = (k * scores).sum(dim=token_dims, keepdim=True)
        return fused_linear(F.relu(v) * context, self.proj, residual=residual)

    def _attend(self, query, key, value, key_padding_mask, attn_mask, is_causal, kv_cache) -> Tensor:
        if attn_mask is not None:
            raise ValueError("SeparableSelfAttention has no pairwise scores, so it takes no attn_mask")
        logits, k, v = fused_linear(query, self.qkv).split([1, self.dim, self.dim], dim=-1)
        if key_padding_mask is not None:
            if kv_cache is not None:
                key_padding_mask = key_padding_mask[:, kv_cache.length :]
            logits = logits.masked_fill(key_padding_mask[..., None].bool(), float("-inf"))
        if kv_cache is not None:
            context = self._causal_context_cached(logits, k, kv_cache)
        elif is_causal:
            context = self._causal_context(logits, k)
        else:
            scores = self.attn_drop(logits.softmax(dim=1))  # (B, N, 1)
            context = (k * scores).sum(dim=1, keepdim=True)  # (B, 1, D)
        return F.relu(v) * context

    def _causal_context(self, logits: Tensor, k: Tensor) -> Tensor:
        """Context of each prefix, (B, N, D). Uses one max per sequence for stability."""
        m = logits.amax(dim=1, keepdim=True).clamp_min(-1e30)  # finite even if everything is padded
        w = self.attn_drop((logits - m).exp())
        num = (w * k).cumsum(dim=1)
        den = w.cumsum(dim=1)
        return num / den

    def _causal_context_cached(self, logits: Tensor, k: Tensor, cache: KVCache) -> Tensor:
        """Streaming softmax: fold new tokens into the running (max, sum) one at a time."""
        b = logits.shape[0]
        if cache.key is None:
            num = k.new_zeros(b, 1, self.dim)
            m = k.new_full((b, 1, 1), -1e30)
            den = k.new_zeros(b, 1, 1)
        else:
            num, (m, den) = cache.key, cache.value.split(1, dim=-1)
        contexts = []
        for t in range(logits.shape[1]):
            s = logits[:, t : t + 1]
            m_new = torch.maximum(m, s)
            decay, w = (m - m_new).exp(), self.attn_drop((s - m_new).exp())
            num = num * decay + w * k[:, t : t + 1]
            den = den * decay + w
            m = m_new
            contexts.append(num / den)
        cache.key, cache.value = num, torch.cat([m, den], dim=-1)
        cache.length += logits.shape[1]
        cache.steps += logits.shape[1]
        return torch.cat(contexts, dim=1)


@register_attention("linformer")
class LinformerAttention(Attention):
    """Linformer (Wang et al. 2020): keys and values projected along the token axis to p tokens.

    ``E, F`` (p x max_len) compress the S keys/values to p rows before standard
    attention, so time is O(N·p·D) and memory O(N·p·H): linear in N for fixed p.
    The projections are shared across heads (the paper's headwise sharing).
    Sequences up to ``max_len`` tokens (keys) are accepted; shorter ones use the
    first S columns of E and F.

    Padded keys are zeroed before compression, so they never reach the output.
    No causal mode and no KV cache: compressing the token axis mixes future keys
    into every projected row.
    """

    supports_causal = False
    supports_cache = False

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        max_len: int = 512,
        proj_len: int = 256,
        dropout: float = 0.0,
        bias: bool = True,
    ):
        super().__init__(dim, num_heads)
        self.max_len = max_len
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.key_compress = nn.Parameter(torch.randn(proj_len, max_len) / math.sqrt(proj_len))
        self.value_compress = nn.Parameter(torch.randn(proj_len, max_len) / math.sqrt(proj_len))
        self.dropout = dropout

    def _attend(self, query, key, value, key_padding_mask, attn_mask, is_causal, kv_cache) -> Tensor:
        if attn_mask is not None:
            raise ValueError("LinformerAttention attends to compressed tokens, so it takes no (N, S) attn_mask")
        key = query if key is None else key
        value = key if value is None else value
        s = key.shape[1]
        if s > self.max_len:
            raise ValueError(f"LinformerAttention was built for at most max_len={self.max_len} tokens, got {s}")
        d = self.dim
        q = self._rows(self.qkv, query, 0, d)
        k = self._rows(self.qkv, key, d, 2 * d)
        v = self._rows(self.qkv, value, 2 * d, 3 * d)
        if key_padding_mask is not None:
            keep = (~key_padding_mask.bool())[..., None].to(k.dtype)
            k, v = k * keep, v * keep
        k = self.key_compress[:, :s] @ k  # (B, p, D)
        v = self.value_compress[:, :s] @ v
        out = F.scaled_dot_product_attention(
            self._heads(q), self._heads(k), self._heads(v), dropout_p=self.dropout if self.training else 0.0
        )
        return self._merge(out)


class _SynthesizerBase(Attention):
    """Shared part of the Synthesizers: synthesised logits (B|1, H, N, S) -> softmax -> values."""

    def __init__(self, dim: int, num_heads: int, max_len: int, dropout: float, bias: bool):
        super().__init__(dim, num_heads)
        self.max_len = max_len
        self.value = nn.Linear(dim, dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.attn_drop = nn.Dropout(dropout)

    def _logits(self, query: Tensor, offset: int, n_key: int) -> Tensor:
        raise NotImplementedError

    def _attend(self, query, key, value, key_padding_mask, attn_mask, is_causal, kv_cache) -> Tensor:
        b, n, _ = query.shape
        static = kv_cache is not None and kv_cache.static
        if static and kv_cache.value is not None:
            v = kv_cache.value
        else:
            source = query if key is None else (key if value is None else value)
            v = self._heads(self.value(source))
        offset = 0  # absolute position of the first query token
        if kv_cache is not None:
            offset = kv_cache.steps
            if not static and kv_cache.value is not None:
                v = torch.cat([kv_cache.value, v], dim=2)
            kv_cache.value, kv_cache.length = v, v.shape[2]
            kv_cache.steps += n
        s = v.shape[2]
        if max(s, offset + n) > self.max_len:
            name, got = type(self).__name__, max(s, offset + n)
            raise ValueError(f"{name} was built for max_len={self.max_len} tokens, got {got}")
        logits = self._logits(query, offset, s)
        blocked, bias = self._blocked(b, n, s, offset, key_padding_mask, attn_mask, is_causal, query.device)
        attn = self.attn_drop(self._masked_softmax(logits, blocked, bias))
        return self._merge(attn @ v)


@register_attention("synthesizer_dense")
class DenseSynthesizerAttention(_SynthesizerBase):
    """Dense Synthesizer (Tay et al. 2021): each token predicts its own row of attention logits.

    ``B_i = W2 ReLU(W1 x_i)`` maps token i (D) to ``max_len`` logits per head, no
    query-key dot product; the first S are softmaxed and mix the values.
    Time O(N·D·H·max_len + N·S·D), memory O(N·H·max_len). Fixed ``max_len``.
    With cross-attention the logits come from the query, the values from ``value``.
    KV cache: ``value`` holds projected values (B, H, S, head_dim).
    """

    def __init__(self, dim: int, num_heads: int = 8, max_len: int = 512, dropout: float = 0.0, bias: bool = True):
        super().__init__(dim, num_heads, max_len, dropout, bias)
        self.synth = nn.Sequential(
            nn.Linear(dim, dim, bias=bias), nn.ReLU(), nn.Linear(dim, num_heads * max_len, bias=bias)
        )

    def _logits(self, query: Tensor, offset: int, n_key: int) -> Tensor:
        b, n, _ = query.shape
        logits = self.synth(query).view(b, n, self.num_heads, self.max_len)[..., :n_key]
        return logits.transpose(1, 2)


@register_attention("synthesizer_random")
class RandomSynthesizerAttention(_SynthesizerBase):
    """Random Synthesizer (Tay et al. 2021): a learned (or frozen, ``fixed=True``) logit
    matrix R (H x max_len x max_len) independent of the input.

    Row ``offset + i`` of R scores the keys for query i. Time O(N·S·D), memory
    O(H·max_len²) parameters. Fixed ``max_len``. KV cache as the dense variant.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        max_len: int = 512,
        dropout: float = 0.0,
        bias: bool = True,
        fixed: bool = False,
    ):
        super().__init__(dim, num_heads, max_len, dropout, bias)
        self.logits = nn.Parameter(torch.randn(num_heads, max_len, max_len) * 0.02, requires_grad=not fixed)

    def _logits(self, query: Tensor, offset: int, n_key: int) -> Tensor:
        return self.logits[None, :, offset : offset + query.shape[1], :n_key]


@register_attention("additive")
class AdditiveAttention(Attention):
    """Additive (Bahdanau) attention, per head: ``e_ij = w·tanh(W_q q_i + W_k k_j)``.

    Time O(N·S·D) and memory O(N·S·D) (the tanh argument is materialised for
    every pair, unlike dot-product attention). Masks, causal mode and KV cache
    (``key``/``value`` hold projected keys/values (B, H, S, head_dim)) behave as
    in :class:`MultiHeadAttention`. Parameters: ``q``, ``kv`` (Linear D -> 2D),
    ``score`` (H x head_dim), ``proj``.
    """

    def __init__(self, dim: int, num_heads: int = 8, dropout: float = 0.0, bias: bool = True):
        super().__init__(dim, num_heads)
        self.q = nn.Linear(dim, dim, bias=bias)
        self.kv = nn.Linear(dim, 2 * dim, bias=bias)
        self.score = nn.Parameter(torch.randn(num_heads, self.head_dim) / math.sqrt(self.head_dim))
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.attn_drop = nn.Dropout(dropout)

    def _attend(self, query, key, value, key_padding_mask, attn_mask, is_causal, kv_cache) -> Tensor:
        b, n, _ = query.shape
        q = self._heads(self.q(query))
        k, v, offset = self._cached_keys_values(query, key, value, kv_cache, self.kv, 0)
        # (B, H, N, 1, hd) + (B, H, 1, S, hd) -> (B, H, N, S)
        logits = torch.tanh(q.unsqueeze(3) + k.unsqueeze(2)) @ self.score[None, :, None, :, None]
        logits = logits.squeeze(-1)
        blocked, bias = self._blocked(b, n, k.shape[2], offset, key_padding_mask, attn_mask, is_causal, q.device)
        attn = self.attn_drop(self._masked_softmax(logits, blocked, bias))
        return self._merge(attn @ v)
