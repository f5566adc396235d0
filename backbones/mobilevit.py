"""MobileViT v1 (Mehta & Rastegari, "MobileViT: Light-weight, General-purpose, and
Mobile-friendly Vision Transformer", ICLR 2022), sizes xxs / xs / s.

Built like apple/ml-cvnets and timm's ``mobilevit_*`` so their checkpoints load::

    stem      3x3 conv, stride 2, 16 channels                        stride 2
    stage 1   MV2                                                    stride 2
    stage 2   3 x MV2 (first stride 2)                               stride 4
    stage 3   MV2 (stride 2), MobileViT block, 2 transformer layers  stride 8
    stage 4   MV2 (stride 2), MobileViT block, 4 transformer layers  stride 16
    stage 5   MV2 (stride 2), MobileViT block, 3 transformer layers  stride 32
    final     1x1 conv expansion (4x channels) -> global pool -> classifier

A MobileViT block: 3x3 conv -> 1x1 to the transformer width d -> transformer
layers (LayerNorm, multi-head attention with 4 heads, SiLU FFN of 2d) over 2x2
patches -> LayerNorm -> 1x1 conv back -> 3x3 fusion conv over [input, output].
Input sizes that are not a multiple of the patch size are resized (bilinear,
align_corners=False) to the next multiple before the transformer and back after
it, as the reference does.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from backbones.mobilevit_common import Stage, StagedBackbone, register_mobilevit_converters, resize_to_multiple
from backbones.registry import register_backbone
from layers.conv import ConvNormAct
from layers.transformer import TransformerBlock

# size -> (stage channels, transformer widths of stages 3-5, MV2 expansion, final expansion channels)
SIZES = {
    "xxs": ((16, 24, 48, 64, 80), (64, 80, 96), 2.0, 320),
    "xs": ((32, 48, 64, 80, 96), (96, 120, 144), 4.0, 384),
    "s": ((32, 64, 96, 128, 160), (144, 192, 240), 4.0, 640),
}
STAGE_STRIDES = (1, 2, 2, 2, 2)
STAGE_MV2_BLOCKS = (1, 3, 1, 1, 1)
STAGE_DEPTHS = (0, 0, 2, 4, 3)  # transformer layers per stage


class MobileViTBlock(nn.Module):
    """(B, C, H, W) -> (B, C, H, W): local conv, global transformer over patches, fusion."""

    def __init__(
        self,
        channels: int,
        dim: int,
        depth: int,
        num_heads: int = 4,
        patch_size: int = 2,
        mlp_ratio: float = 2.0,
        dilation: int = 1,
        attention: str = "mha",
        attention_kwargs: dict | None = None,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        drop_path: list[float] | None = None,
    ):
        super().__init__()
        self.patch_size = (patch_size, patch_size)
        self.local_conv = ConvNormAct(channels, channels, 3, dilation=dilation)
        self.to_tokens = nn.Linear(channels, dim, bias=False)
        self.transformer = nn.Sequential(
            *[
                TransformerBlock(
                    dim,
                    int(dim * mlp_ratio),
                    attention,
                    num_heads,
                    norm="layer",
                    dropout=dropout,
                    attn_dropout=attn_dropout,
                    drop_path=rate,
                    attention_kwargs=attention_kwargs,
                )
                for rate in (drop_path or [0.0] * depth)
            ]
        )
        self.norm = nn.LayerNorm(dim)
        self.proj = ConvNormAct(dim, channels, 1)
        self.fusion = ConvNormAct(2 * channels, channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        h, w = x.shape[-2:]
        y = self.to_tokens(self.local_conv(x).permute(0, 2, 3, 1))  # (B, H, W, d)
        y = resize_to_multiple(y.permute(0, 3, 1, 2), self.patch_size, align_corners=False).permute(0, 2, 3, 1)
        b, new_h, new_w, d = y.shape
        (ph, pw), nh, nw = self.patch_size, new_h // self.patch_size[0], new_w // self.patch_size[1]
        # unfold: (B, H, W, d) -> (B * P, N, d), one sequence per pixel position inside the patches
        tokens = y.reshape(b, nh, ph, nw, pw, d).permute(0, 2, 4, 1, 3, 5).reshape(b * ph * pw, nh * nw, d)
        tokens = self.norm(self.transformer(tokens))
        # fold back to a channels-last (B, d, H, W) map
        y = tokens.view(b, ph, pw, nh, nw, d).permute(0, 3, 1, 4, 2, 5).reshape(b, new_h, new_w, d).permute(0, 3, 1, 2)
        if (new_h, new_w) != (h, w):
            y = nn.functional.interpolate(y, size=(h, w), mode="bilinear", align_corners=False)
        y = self.proj(y)
        return self.fusion(torch.cat([shortcut, y], dim=1))


@register_backbone("mobilevit")
class MobileViT(StagedBackbone):
    """MobileViT v1, ``size`` in {"xxs", "xs", "s"}.

    ``forward(x)``: (B, in_chans, H, W) -> ``{2, 4, 8, 16, 32: stage outputs}``
    (``feature_channels``); ``output_stride`` 16 or 8 dilates the later stages
    instead of downsampling, the dict then stops at ``output_stride`` (deepest map);
    ``stage_info`` / ``forward_stages`` give every stage's map by index (1..5), as
    in :class:`~backbones.mobilevitv2.MobileViTv2`.
    ``forward_pooled(x)``: the 1x1 expansion conv on the deepest map, globally
    averaged: (B, num_features), the classifier's input as in the reference.
    ``attention``: any variant of ``layers.attention`` (paper: "mha", 4 heads).
    """

    repeated_blocks = (TransformerBlock,)  # the units of --model.compile regional

    def __init__(
        self,
        size: str = "xs",
        in_chans: int = 3,
        output_stride: int = 32,
        attention: str = "mha",
        num_heads: int = 4,
        attention_kwargs: dict | None = None,
        drop_path_rate: float = 0.0,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        pretrained: str | None = None,
    ):
        super().__init__()
        if size not in SIZES:
            raise KeyError(f"unknown MobileViT size {size!r}; valid sizes: {', '.join(SIZES)}")
        channels, dims, expand_ratio, num_features = SIZES[size]
        self.in_chans = in_chans
        self.size = size
        self.stem = ConvNormAct(in_chans, 16, 3, stride=2)
        stages = [Stage(*spec) for spec in zip(channels, STAGE_MV2_BLOCKS, STAGE_STRIDES, STAGE_DEPTHS, (0, 0, *dims))]
        in_chs = self._build_stages(
            16, stages, expand_ratio, output_stride, drop_path_rate, MobileViTBlock, attention=attention,
            num_heads=num_heads, attention_kwargs=attention_kwargs, dropout=dropout, attn_dropout=attn_dropout,
        )
        self.final_conv = ConvNormAct(in_chs, num_features, 1)
        self.num_features = num_features

        if pretrained:
            self.load_pretrained(pretrained)

    def forward_pooled(self, x: torch.Tensor) -> torch.Tensor:
        features = self(x)
        return self.final_conv(features[max(features)]).mean(dim=(2, 3))


register_mobilevit_converters("mobilevit")
