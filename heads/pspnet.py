"""PSPNet head (Zhao et al. 2017, "Pyramid Scene Parsing Network"), configured as CVNets
uses it on MobileViTv2.

The pyramid pooling module average-pools the deepest feature map to 1x1, 2x2, 3x3
and 6x6 grids, reduces each with a 1x1 conv-BN-ReLU, upsamples them back and
concatenates them with the map itself; a 3x3 conv-BN-ReLU fuses the result, then
dropout and a 1x1 classifier. Each branch gets ``in_channels / len(pool_sizes)``
channels rounded down to a multiple of 16 (CVNets' rule, which the paper's
parameter counts follow, e.g. 3.6M for PSPNet-MobileViTv2-0.5).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from heads.seg_common import SegmentationHead, conv_bn_relu


class PyramidPooling(nn.Module):
    """(B, in_channels, H, W) -> (B, out_channels, H, W): pooled branches + identity, concat, 3x3 fusion, dropout."""

    def __init__(self, in_channels: int, out_channels: int = 512, pool_sizes: Sequence[int] = (1, 2, 3, 6),
                 dropout: float = 0.1):
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"PSP dropout must be in [0, 1), got {dropout}")
        branch_channels = max(16, in_channels // len(pool_sizes) // 16 * 16)
        self.branches = nn.ModuleList(
            nn.Sequential(nn.AdaptiveAvgPool2d(int(size)), conv_bn_relu(in_channels, branch_channels))
            for size in pool_sizes
        )
        self.fuse = conv_bn_relu(in_channels + len(pool_sizes) * branch_channels, out_channels, kernel_size=3)
        self.dropout = nn.Dropout2d(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        pooled = [F.interpolate(branch(x), size=size, mode="bilinear", align_corners=False) for branch in self.branches]
        return self.dropout(self.fuse(torch.cat([x, *pooled], dim=1)))


class PSPNet(SegmentationHead):
    """PSPNet head over a backbone's feature pyramid.

    Args:
        feature_channels: the backbone's ``{stride: channels}``.
        num_classes: output classes (the ignore label is not a class).
        channels: width of the fusion conv (512 in the MobileViTv2 recipes).
        pool_sizes: grid sizes of the pooled branches.
        dropout: dropout after the fusion conv.
        in_stride, aux, aux_stage, aux_stride, aux_dropout, stage_channels: see
            :class:`~heads.seg_common.SegmentationHead` (``stage_channels`` comes from the task).

    ``forward(features, stages=None)``: ``{stride: (B, C_s, H/s, W/s)}`` -> ``{"out": (B, num_classes,
    H/in_stride, W/in_stride)}`` (+ ``"aux"`` while training with ``aux=True``).
    """

    def __init__(self, feature_channels: dict[int, int], num_classes: int, channels: int = 512,
                 pool_sizes: Sequence[int] = (1, 2, 3, 6), dropout: float = 0.1, in_stride: int | None = None,
                 aux: bool = False, aux_stage: int | None = None, aux_stride: int | None = None,
                 aux_dropout: float = 0.1, stage_channels: dict[int, int] | None = None):
        super().__init__(feature_channels, num_classes, in_stride, aux, aux_stage, aux_stride, aux_dropout,
                         stage_channels)
        self.decoder = PyramidPooling(self.in_channels, channels, pool_sizes, dropout)
        self._finish(channels)
