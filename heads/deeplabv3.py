"""DeepLabv3 head (Chen et al. 2017, "Rethinking Atrous Convolution for Semantic Image
Segmentation"), configured as CVNets uses it on MobileViT/MobileViTv2.

Atrous Spatial Pyramid Pooling on the deepest feature map: a 1x1 conv, three dilated
3x3 convs and an image-pooling branch run in parallel, their outputs are concatenated,
projected back with a 1x1 conv, passed through dropout and classified with a 1x1 conv.
The dilation rates follow the output stride: (6, 12, 18) at OS 16, (12, 24, 36) at
OS 8. The MobileViTv2 recipes use 512 ASPP channels and dense (not separable) 3x3
convs; that is what the paper's parameter counts (e.g. 9.6M for MobileViTv2-0.75)
need. ``separable=True`` gives the light depthwise-separable variant.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from heads.seg_common import SegmentationHead, conv_bn_relu

#: ASPP dilation rates for the two output strides the MobileViT recipes use
ATROUS_RATES = {16: (6, 12, 18), 8: (12, 24, 36)}


class SeparableConvBNReLU(nn.Sequential):
    """Depthwise dilated 3x3 conv (no norm), then pointwise conv-BN-ReLU: (B, C_in, H, W) -> (B, C_out, H, W)."""

    def __init__(self, in_channels: int, out_channels: int, dilation: int):
        super().__init__(
            nn.Conv2d(in_channels, in_channels, 3, padding=dilation, dilation=dilation, groups=in_channels,
                      bias=False),
            conv_bn_relu(in_channels, out_channels),
        )


class ImagePooling(nn.Module):
    """Global context branch: (B, C_in, H, W) -> mean -> 1x1 conv-BN-ReLU -> broadcast to (B, C_out, H, W)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.project = conv_bn_relu(in_channels, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.project(x.mean(dim=(2, 3), keepdim=True))
        # a 1x1 map upsampled bilinearly is a constant; expand says so without the interpolation
        return pooled.expand(-1, -1, *x.shape[-2:])


class ASPP(nn.Module):
    """(B, in_channels, H, W) -> (B, out_channels, H, W): five parallel branches, concat,
    1x1 projection, dropout."""

    def __init__(self, in_channels: int, out_channels: int = 256, atrous_rates: Sequence[int] = (6, 12, 18),
                 separable: bool = False, dropout: float = 0.1):
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"ASPP dropout must be in [0, 1), got {dropout}")
        dilated = SeparableConvBNReLU if separable else (lambda i, o, d: conv_bn_relu(i, o, 3, dilation=d))
        self.branches = nn.ModuleList(
            [conv_bn_relu(in_channels, out_channels)]
            + [dilated(in_channels, out_channels, int(rate)) for rate in atrous_rates]
            + [ImagePooling(in_channels, out_channels)]
        )
        self.project = conv_bn_relu(len(self.branches) * out_channels, out_channels)
        self.dropout = nn.Dropout2d(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([branch(x) for branch in self.branches], dim=1)
        return self.dropout(self.project(x))


class DeepLabV3(SegmentationHead):
    """DeepLabv3 head over a backbone's feature pyramid.

    Args:
        feature_channels: the backbone's ``{stride: channels}``.
        num_classes: output classes (the ignore label is not a class).
        channels: ASPP width (CVNets default 256; the MobileViTv2 recipes use 512).
        atrous_rates: dilations of the three 3x3 branches; see :data:`ATROUS_RATES`.
        separable: depthwise-separable dilated convs instead of dense ones.
        dropout: dropout after the ASPP projection.
        in_stride, aux, aux_stage, aux_stride, aux_dropout, stage_channels: see
            :class:`~heads.seg_common.SegmentationHead` (``stage_channels`` comes from the task).

    ``forward(features, stages=None)``: ``{stride: (B, C_s, H/s, W/s)}`` -> ``{"out": (B, num_classes,
    H/in_stride, W/in_stride)}`` (+ ``"aux"`` while training with ``aux=True``).
    """

    def __init__(self, feature_channels: dict[int, int], num_classes: int, channels: int = 256,
                 atrous_rates: Sequence[int] = (6, 12, 18), separable: bool = False, dropout: float = 0.1,
                 in_stride: int | None = None, aux: bool = False, aux_stage: int | None = None,
                 aux_stride: int | None = None, aux_dropout: float = 0.1, stage_channels: dict[int, int] | None = None):
        super().__init__(feature_channels, num_classes, in_stride, aux, aux_stage, aux_stride, aux_dropout,
                         stage_channels)
        if len(atrous_rates) != 3:
            raise ValueError(f"DeepLabv3 uses three atrous rates, got {list(atrous_rates)}")
        self.decoder = ASPP(self.in_channels, channels, atrous_rates, separable, dropout)
        self._finish(channels)

