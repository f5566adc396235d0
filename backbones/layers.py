"""Small building blocks shared by the convolutional/hybrid backbones."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.ops import StochasticDepth

from backbones.attention import SeparableSelfAttention, build_attention
from backbones.base import Backbone


def make_divisible(value: float, divisor: int = 8, min_value: int | None = None, round_limit: float = 0.9) -> int:
    """Round ``value`` to a multiple of ``divisor`` without losing more than 10%
    (the MobileNet/CVNets rule that fixes every channel count of MobileViT)."""
    min_value = min_value or divisor
    rounded = max(min_value, int(value + divisor / 2) // divisor * divisor)
    if rounded < round_limit * value:
        rounded += divisor
    return rounded


class ConvNormAct(nn.Module):
    """Conv2d (no bias) -> BatchNorm2d -> SiLU (or no activation). 'Same' padding for odd kernels.

    In eval mode the BatchNorm is folded into the convolution's weight and bias
    (same parameters, same results up to rounding), so inference skips the
    normalisation pass over the map.
    """

    def __init__(
        self,
        in_chs: int,
        out_chs: int,
        kernel_size: int = 1,
        stride: int = 1,
        groups: int = 1,
        dilation: int = 1,
        act: bool = True,
    ):
        super().__init__()
        padding = dilation * (kernel_size - 1) // 2
        self.conv = nn.Conv2d(in_chs, out_chs, kernel_size, stride, padding, dilation, groups, bias=False)
        self.bn = nn.BatchNorm2d(out_chs)
        self.act = nn.SiLU(inplace=True) if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        if self.training or bn.running_mean is None:
            return self.act(bn(self.conv(x)))
        scale = bn.weight * torch.rsqrt(bn.running_var + bn.eps)
        weight = self.conv.weight * scale.view(-1, 1, 1, 1)
        return self.act(self.conv._conv_forward(x, weight, bn.bias - bn.running_mean * scale))


class InvertedResidual(nn.Module):
    """MobileNetv2 block (MV2): 1x1 expand -> 3x3 depthwise (stride, dilation) -> 1x1 linear project.

    (B, in_chs, H, W) -> (B, out_chs, H/stride, W/stride); residual only when the
    shapes allow it (stride 1 and in_chs == out_chs), as in MobileNetv2/CVNets.
    """

    def __init__(
        self,
        in_chs: int,
        out_chs: int,
        stride: int = 1,
        expand_ratio: float = 2.0,
        dilation: int = 1,
        drop_path: float = 0.0,
    ):
        super().__init__()
        mid_chs = make_divisible(in_chs * expand_ratio)
        self.expand = ConvNormAct(in_chs, mid_chs, 1)
        self.depthwise = ConvNormAct(mid_chs, mid_chs, 3, stride=stride, groups=mid_chs, dilation=dilation)
        self.project = ConvNormAct(mid_chs, out_chs, 1, act=False)
        self.has_residual = stride == 1 and in_chs == out_chs
        self.drop_path = StochasticDepth(drop_path, "row") if self.has_residual and drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.depthwise(self.expand(x)))
        return x + self.drop_path(out) if self.has_residual else out


class Mlp(nn.Module):
    """Token-wise feed-forward on the last dim: Linear -> act -> dropout -> Linear -> dropout."""

    def __init__(self, dim: int, hidden_dim: int, act_layer: type[nn.Module] = nn.SiLU, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class ChannelsLastGroupNorm(nn.GroupNorm):
    """GroupNorm for channels-last maps (B, H, W, C): statistics over (H, W, C)
    per group, per-channel affine; the parameters are those of ``nn.GroupNorm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a channels-last NCHW view: group_norm runs its channels-last kernel, no copy
        out = F.group_norm(x.permute(0, 3, 1, 2), self.num_groups, self.weight, self.bias, self.eps)
        return out.permute(0, 2, 3, 1)


def resize_to_multiple(x: torch.Tensor, multiple: tuple[int, int], align_corners: bool) -> torch.Tensor:
    """Bilinear resize (B, C, H, W) up to the next multiple of ``multiple`` (the MobileViT
    references do this instead of padding); a no-op, without a copy, when it already fits."""
    h, w = x.shape[-2:]
    new_h, new_w = -(-h // multiple[0]) * multiple[0], -(-w // multiple[1]) * multiple[1]
    if (new_h, new_w) == (h, w):
        return x
    return F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=align_corners)


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``.

    ``x`` is either token sequences (B, N, D), or, when ``patch_size`` is given, a
    channels-last map (B, H, W, D) cut into patches, where pixels at the same
    position inside their patches attend to each other (MobileViT's scheme:
    N = HW / P tokens in P = patch-area sequences per image). On a map, the
    separable attention mixes the free view (B, H/ph, ph, W/pw, pw, D) directly;
    any other attention of the zoo gets (B*P, N, D) sequences (a copy each way).

    ``norm``: "layer" (LayerNorm per token) or "group" (GroupNorm with one group over
    the whole map, as MobileViTv2; needs the map layout).
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
    ):
        super().__init__()
        if norm not in ("layer", "group"):
            raise ValueError(f"norm must be 'layer' or 'group', got {norm!r}")
        self.patch_size = patch_size
        norm_layer = (lambda d: ChannelsLastGroupNorm(1, d)) if norm == "group" else nn.LayerNorm
        self.norm1 = norm_layer(dim)
        self.attn = build_attention(attention, dim, num_heads, dropout=attn_dropout, **(attention_kwargs or {}))
        self.drop1 = nn.Dropout(dropout)
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, mlp_dim, nn.SiLU, dropout)
        self.drop_path = StochasticDepth(drop_path, "row") if drop_path > 0 else nn.Identity()

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        if self.patch_size is None:
            return self.attn(x)
        b, h, w, d = x.shape
        ph, pw = self.patch_size
        grid = x.reshape(b, h // ph, ph, w // pw, pw, d)  # a view for contiguous maps
        if isinstance(self.attn, SeparableSelfAttention):
            return self.attn(grid, token_dims=(1, 3)).view(b, h, w, d)
        tokens = grid.permute(0, 2, 4, 1, 3, 5).reshape(b * ph * pw, -1, d)
        out = self.attn(tokens).view(b, ph, pw, h // ph, w // pw, d)
        return out.permute(0, 3, 1, 4, 2, 5).reshape(b, h, w, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.drop1(self.attend(self.norm1(x))))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def dilated_stage_plan(
    stage_strides: list[int], output_stride: int, stem_stride: int = 2
) -> list[tuple[int, int, int, int]]:
    """Per stage ``(stride, first_dilation, dilation, output stride)``: once the
    network reaches ``output_stride``, a stage that would downsample keeps its
    resolution and doubles the dilation instead (DeepLab-style; the first block of
    that stage still uses the previous dilation, as CVNets and timm do)."""
    if output_stride not in (8, 16, 32):
        raise ValueError(f"output_stride must be 8, 16 or 32, got {output_stride}")
    plan, total, dilation = [], stem_stride, 1
    for stride in stage_strides:
        first_dilation = dilation
        if stride > 1 and total >= output_stride:
            dilation *= stride
            stride = 1
        total *= stride
        plan.append((stride, first_dilation, dilation, total))
    return plan


class StagedBackbone(Backbone):
    """A stem and a list of stages; the output of each stage is the feature map at
    its stride (``stage_strides``). Subclasses build ``stem``, ``stages``,
    ``stage_strides``, ``feature_channels`` and ``num_features``."""

    stem: nn.Module
    stages: nn.ModuleList
    stage_strides: list[int]

    def forward(self, x: torch.Tensor) -> dict[int, torch.Tensor]:
        self.check_input(x)
        # channels-last once, here: every convolution then runs its channels-last
        # kernel and the transformers' (B, H, W, C) views of the maps are free
        x = self.stem(x.contiguous(memory_format=torch.channels_last))
        features = {}
        for stride, stage in zip(self.stage_strides, self.stages):
            x = stage(x)
            features[stride] = x
        return features

