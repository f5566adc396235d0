"""Transformer building blocks shared by the vision backbones and the sequence models.

- :class:`TransformerBlock`: the pre-norm block of ViT and MobileViT (v1 and v2), on
  token sequences or on channels-last maps cut into patches;
- :class:`Residual`, :class:`TokenEmbedding`, :func:`init_transformer_weights`: the
  pieces the translation encoder (``backbones.transformer``) and decoder
  (``heads.seq2seq``) are built from.
"""
from __future__ import annotations

import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.ops import StochasticDepth

from layers.attention import SeparableSelfAttention, build_attention
from layers.feedforward import FeedForward

Tensor = torch.Tensor


class ChannelsLastGroupNorm(nn.GroupNorm):
    """GroupNorm with one group for channels-last maps (B, H, W, C): statistics over (H, W, C) per image,
    per-channel affine; the parameters (and checkpoint keys) are those of ``nn.GroupNorm(1, C)``.

    One group's statistics are layer norm's over the map's last three dims, so it runs as ``layer_norm``
    with the affine spread over (H, W, C): one fused kernel on the map as it lies, whose output stays
    channels-last. (CUDA's group norm has an NCHW kernel only: it would copy the map in, copy the input
    and the gradient again in the backward, and hand the next layer an NCHW map;
    ``benchmarks/bench_kernels.py`` counts both.) The spread affine is materialised once per call, a
    tensor of one image's size, which the backward reuses.
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True, **kwargs):
        if num_groups != 1:
            raise ValueError(f"ChannelsLastGroupNorm normalises with one group, got num_groups={num_groups}")
        super().__init__(num_groups, num_channels, eps, affine, **kwargs)

    #: ``"layer_norm"`` (above) or ``"var_mean"`` (:func:`group_norm_by_var_mean`): which one is faster on a GPU
    #: depends on the batch (``benchmarks/gpu_groupnorm.py`` times both); the default stays until it is measured
    statistics = "layer_norm"

    def forward(self, x: Tensor) -> Tensor:
        if self.statistics == "var_mean":
            return group_norm_by_var_mean(x, self.weight, self.bias, self.eps)
        map_shape = x.shape[-3:]
        weight = None if self.weight is None else self.weight.expand(map_shape).contiguous()
        bias = None if self.bias is None else self.bias.expand(map_shape).contiguous()
        return F.layer_norm(x, map_shape, weight, bias, self.eps)


def group_norm_by_var_mean(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """One-group GroupNorm of a channels-last map (B, H, W, C) from ``torch.var_mean`` over (H, W, C) and one
    per-channel affine. CUDA's layer norm gives each row (here: each image, up to 1.6 MB) one thread block, so
    at a batch of 4 or 32 most of a large GPU idles; a reduction over the last three dims is split over many
    blocks. The price is more elementwise kernels in eager mode (which ``torch.compile`` fuses)."""
    var, mean = torch.var_mean(x, dim=(-3, -2, -1), correction=0, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``; both
    residual branches pass dropout (``dropout``) and stochastic depth (``drop_path``).

    ``x`` is either token sequences (B, N, D), or, when ``patch_size`` is given, a
    channels-last map (B, H, W, D) cut into patches, where pixels at the same
    position inside their patches attend to each other (MobileViT's scheme:
    N = HW / P tokens in P = patch-area sequences per image). On a map, the
    separable attention mixes the free view (B, H/ph, ph, W/pw, pw, D) directly;
    any other attention of the zoo gets (B*P, N, D) sequences (a copy each way).

    ``attention`` names the zoo variant (``attention_kwargs`` go to it, ``attn_dropout``
    is its dropout). ``norm``: "layer" (LayerNorm per token) or "group" (GroupNorm with
    one group over the whole map, as MobileViTv2; needs the map layout), with epsilon
    ``norm_eps``. The feed-forward is ``dim -> mlp_dim -> dim`` with ``act_layer``.
    """

    def __init__(
        self,
        dim: int,
        mlp_dim: int,
        attention: str = "mha",
        num_heads: int = 1,
        norm: str = "layer",
        patch_size: tuple[int, int] | None = None,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        drop_path: float = 0.0,
        attention_kwargs: dict | None = None,
        act_layer: type[nn.Module] = nn.SiLU,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        if norm not in ("layer", "group"):
            raise ValueError(f"norm must be 'layer' or 'group', got {norm!r}")
        self.patch_size = patch_size

        def norm_layer() -> nn.Module:
            return ChannelsLastGroupNorm(1, dim, eps=norm_eps) if norm == "group" else nn.LayerNorm(dim, eps=norm_eps)

        self.norm1 = norm_layer()
        self.attn = build_attention(attention, dim, num_heads, dropout=attn_dropout, **(attention_kwargs or {}))
        self.proj_drop = nn.Dropout(dropout)  # timm's name: after the attention's output projection
        self.norm2 = norm_layer()
        self.mlp = FeedForward(dim, mlp_dim, act_layer, dropout)
        self.drop_path = StochasticDepth(drop_path, "row") if drop_path > 0 else nn.Identity()

    def attend(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """The attention sub-layer on normed ``x``, plus ``residual`` (x's shape) if given."""
        if self.patch_size is None:
            return self.attn(x, residual=residual)
        b, h, w, d = x.shape
        ph, pw = self.patch_size
        grid = x.reshape(b, h // ph, ph, w // pw, pw, d)  # a view for contiguous maps
        if isinstance(self.attn, SeparableSelfAttention):
            if residual is not None:
                residual = residual.reshape(grid.shape)
            return self.attn.forward_grid(grid, token_dims=(1, 3), residual=residual).view(b, h, w, d)
        tokens = grid.permute(0, 2, 4, 1, 3, 5).reshape(b * ph * pw, -1, d)
        out = self.attn(tokens).view(b, ph, pw, h // ph, w // pw, d)
        out = out.permute(0, 3, 1, 4, 2, 5).reshape(b, h, w, d)
        return out if residual is None else out + residual

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            x = x + self.drop_path(self.proj_drop(self.attend(self.norm1(x))))
            return x + self.drop_path(self.mlp(self.norm2(x)))
        # dropout and stochastic depth are identities in eval mode: the residual adds go to the sub-layers
        x = self.attend(self.norm1(x), residual=x)
        return self.mlp(self.norm2(x), residual=x)


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


def init_transformer_weights(module: nn.Module) -> None:
    """Xavier-uniform Linear weights and zero biases (fairseq's Transformer init). The fused
    (3D, D) ``qkv`` weight thereby gets fairseq's 1/sqrt(2) gain of separate q/k/v weights."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
