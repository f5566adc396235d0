"""Pieces the DeepLabv3 and PSPNet heads share: conv-BN-ReLU, the auxiliary head, and
the base class that picks the feature maps a head reads out of a backbone's pyramid.

A segmentation head is built from ``backbone.feature_channels`` (stride -> channels)
and ``num_classes``; ``forward`` takes the backbone's ``{stride: map}`` dict and, like
torchvision's segmentation models, returns ``{"out": logits}`` plus ``"aux"`` when the
auxiliary head is on and the module is training. Logits stay at the feature
resolution; the task upsamples them to the image (or original) size.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from layers.conv import ConvNormAct


def conv_bn_relu(in_channels: int, out_channels: int, kernel_size: int = 1, dilation: int = 1) -> ConvNormAct:
    """(B, in_channels, H, W) -> (B, out_channels, H, W): conv (no bias), BN, ReLU, children
    ``0``, ``1``, ``2`` (the layout of the heads' checkpoints)."""
    return ConvNormAct(in_channels, out_channels, kernel_size, dilation=dilation, act="relu", positional=True)


class AuxHead(nn.Sequential):
    """The auxiliary classifier of PSPNet/DeepLab training recipes (CVNets, mmsegmentation).

    (B, in_channels, h, w) -> (B, num_classes, h, w): 3x3 conv-BN-ReLU to
    ``max(in_channels // 4, 128)`` channels, dropout, 1x1 classifier. Used only for the
    training loss (weight 0.4 in the recipes); it is not part of the inference model.
    """

    def __init__(self, in_channels: int, num_classes: int, dropout: float = 0.1):
        hidden = max(in_channels // 4, 128)
        super().__init__(
            conv_bn_relu(in_channels, hidden, kernel_size=3),
            nn.Dropout2d(dropout),
            nn.Conv2d(hidden, num_classes, kernel_size=1),
        )


class SegmentationHead(nn.Module):
    """Base of the dense heads: reads the map at ``in_stride`` (default: the deepest the
    backbone offers) and, with ``aux=True``, runs :class:`AuxHead` on the map at
    ``aux_stride`` (default 16, the stage before the last in MobileViT/ResNet backbones).

    CVNets puts the auxiliary head on the stage before the last. A dilated backbone
    whose dict keeps one map per stride (our MobileViTv2 at output stride 8 or 16 keeps
    only the last stage's map there) offers no such map at that stride: pick
    ``aux_stride`` among ``feature_channels`` (e.g. the output stride itself).

    Subclasses build ``self.decoder`` ((B, C_in, h, w) -> (B, C, h, w)) and call
    :meth:`_finish` with ``C`` to add the classifier and initialise the weights.
    """

    def __init__(self, feature_channels: dict[int, int], num_classes: int, in_stride: int | None = None,
                 aux: bool = False, aux_stride: int = 16, aux_dropout: float = 0.1):
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        feature_channels = {int(s): int(c) for s, c in feature_channels.items()}
        self.in_stride = max(feature_channels) if in_stride is None else int(in_stride)
        self._require_stride(feature_channels, self.in_stride, "in_stride")
        self.in_channels = feature_channels[self.in_stride]
        self.num_classes = num_classes
        self.aux_stride = int(aux_stride) if aux else None
        self.aux_head: AuxHead | None = None
        if aux:
            self._require_stride(feature_channels, self.aux_stride, "aux_stride")
            self.aux_head = AuxHead(feature_channels[self.aux_stride], num_classes, aux_dropout)

    @staticmethod
    def _require_stride(feature_channels: dict[int, int], stride: int, what: str) -> None:
        if stride not in feature_channels:
            raise ValueError(
                f"{what}={stride} but the backbone gives feature maps at strides {sorted(feature_channels)}; "
                f"pick one of those (single-scale backbones: set their pyramid_strides)"
            )

    def _finish(self, decoder_channels: int) -> None:
        self.classifier = nn.Conv2d(decoder_channels, self.num_classes, kernel_size=1)
        classifiers = [self.classifier] + ([self.aux_head[-1]] if self.aux_head is not None else [])
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for m in classifiers:  # small logits at the start (mmsegmentation's std 0.01): loss starts near log K
            nn.init.normal_(m.weight, std=0.01)

    def forward(self, features: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{stride: (B, C_s, H/s, W/s)}`` -> ``{"out": (B, K, H/in_stride, W/in_stride)}``
        (+ ``"aux": (B, K, H/aux_stride, W/aux_stride)`` while training with ``aux=True``)."""
        out = {"out": self.classifier(self.decoder(features[self.in_stride]))}
        if self.aux_head is not None and self.training:
            out["aux"] = self.aux_head(features[self.aux_stride])
        return out

    def inference_parameters(self) -> int:
        """Parameters used at inference (the auxiliary head excluded), as papers count them."""
        aux = sum(p.numel() for p in self.aux_head.parameters()) if self.aux_head is not None else 0
        return sum(p.numel() for p in self.parameters()) - aux
