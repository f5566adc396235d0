"""Pieces the DeepLabv3 and PSPNet heads share: conv-BN-ReLU, the auxiliary head, and
the base class that picks the feature maps a head reads out of a backbone.

A segmentation head is built from channel counts alone: ``feature_channels`` (the
backbone's stride -> channels), ``num_classes`` and, for an auxiliary head read by
stage, ``stage_channels`` (the backbone's stage index -> channels; the task passes
it). ``forward(features, stages)`` takes the backbone's ``{stride: map}`` dict and the
``{stage index: map}`` maps it asked for in ``input_stages`` and, like torchvision's
segmentation models, returns ``{"out": logits}`` plus ``"aux"`` when the auxiliary
head is on and the module is training. Logits stay at the feature resolution; the
task upsamples them to the image (or original) size.
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
    ``max(in_channels // 4, 128)`` channels, dropout (CVNets' ``aux_dropout``, 0.1), 1x1
    classifier with bias: CVNets' ``BaseSegHead.aux_head``
    (cvnets/models/segmentation/heads/base_seg_head.py; ReLU, the segmentation activation
    of its recipes). Used only for the training loss (weight 0.4:
    ``loss.segmentation.cross_entropy.aux_weight``); it is not part of the inference model.
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
    backbone offers) and, with ``aux=True``, runs :class:`AuxHead` on one more map,
    chosen by stage or by stride:

    - ``aux_stage``: the output of that stage of a multi-stage backbone, whatever its
      stride after dilation. CVNets reads ``layer_4`` (``aux_stage: 4``, the stage before
      the last; cvnets/models/segmentation/heads/base_seg_head.py, ``out_l4``), which at
      output stride 8 is a stride-8 map that the backbone's ``{stride: map}`` dict hides
      behind stage 5's. Needs ``stage_channels``.
    - ``aux_stride``: the map of the backbone's dict at that stride, for backbones without
      numbered stages (ViT, ConvMixer, MLP-Mixer through their pyramid); also what a
      checkpoint without ``aux_stage`` in its arguments carries (``aux_stride: 16``).

    ``aux=True`` needs exactly one of the two; with ``aux=False`` neither is read.

    Subclasses build ``self.decoder`` ((B, C_in, h, w) -> (B, C, h, w)) and call
    :meth:`_finish` with ``C`` to add the classifier and initialise the weights.
    """

    def __init__(self, feature_channels: dict[int, int], num_classes: int, in_stride: int | None = None,
                 aux: bool = False, aux_stage: int | None = None, aux_stride: int | None = None,
                 aux_dropout: float = 0.1, stage_channels: dict[int, int] | None = None):
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        feature_channels = {int(s): int(c) for s, c in feature_channels.items()}
        stage_channels = {int(i): int(c) for i, c in (stage_channels or {}).items()}
        self.in_stride = max(feature_channels) if in_stride is None else int(in_stride)
        self._require_stride(feature_channels, self.in_stride, "in_stride")
        self.in_channels = feature_channels[self.in_stride]
        self.num_classes = num_classes
        self.aux_stage: int | None = None
        self.aux_stride: int | None = None
        self.aux_head: AuxHead | None = None
        if aux:
            aux_channels = self._aux_input_channels(feature_channels, stage_channels, aux_stage, aux_stride)
            self.aux_head = AuxHead(aux_channels, num_classes, aux_dropout)

    def _aux_input_channels(self, feature_channels: dict[int, int], stage_channels: dict[int, int],
                            aux_stage: int | None, aux_stride: int | None) -> int:
        """Record which map the auxiliary head reads; return its channels."""
        if (aux_stage is None) == (aux_stride is None):
            given = "both aux_stage and aux_stride are set" if aux_stage is not None else "neither is set"
            raise ValueError(
                f"aux=True reads one map, chosen by aux_stage or by aux_stride, but {given}: write aux_stage: 4 "
                f"(CVNets' layer_4, the stage before the last) for MobileViT backbones, or aux_stride: <one of "
                f"{sorted(feature_channels)}> for backbones without numbered stages"
            )
        if aux_stride is not None:
            self.aux_stride = int(aux_stride)
            self._require_stride(feature_channels, self.aux_stride, "aux_stride")
            return feature_channels[self.aux_stride]
        self.aux_stage = int(aux_stage)
        if self.aux_stage not in stage_channels:
            available = (f"stages {sorted(stage_channels)}" if stage_channels else
                         f"no numbered stages (only maps by stride: write aux_stride: <one of {sorted(feature_channels)}>)")
            raise ValueError(f"aux_stage={self.aux_stage} but the backbone has {available}")
        return stage_channels[self.aux_stage]

    @staticmethod
    def _require_stride(feature_channels: dict[int, int], stride: int, what: str) -> None:
        if stride not in feature_channels:
            raise ValueError(
                f"{what}={stride} but the backbone gives feature maps at strides {sorted(feature_channels)}; "
                f"pick one of those (single-scale backbones: set their pyramid_strides)"
            )

    @property
    def input_stages(self) -> tuple[int, ...]:
        """The stage maps :meth:`forward` reads in the current mode (the auxiliary head's, while
        training): pass ``backbone.forward_stages(x, head.input_stages)``'s second dict as ``stages``."""
        return (self.aux_stage,) if self.training and self.aux_head is not None and self.aux_stage is not None else ()

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

    def forward(self, features: dict[int, torch.Tensor],
                stages: dict[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """``{stride: (B, C_s, H/s, W/s)}`` (and, while training with ``aux_stage``, ``{aux_stage: map}``)
        -> ``{"out": (B, K, H/in_stride, W/in_stride)}`` (+ ``"aux": (B, K, h, w)`` at the auxiliary
        map's resolution, while training with ``aux=True``)."""
        out = {"out": self.classifier(self.decoder(features[self.in_stride]))}
        if self.aux_head is not None and self.training:
            out["aux"] = self.aux_head(self._aux_input(features, stages or {}))
        return out

    def _aux_input(self, features: dict[int, torch.Tensor], stages: dict[int, torch.Tensor]) -> torch.Tensor:
        if self.aux_stage is None:
            return features[self.aux_stride]
        if self.aux_stage not in stages:
            raise ValueError(
                f"the auxiliary head reads stage {self.aux_stage}, but forward got stages {sorted(stages)}: call "
                f"head(*backbone.forward_stages(x, head.input_stages))"
            )
        return stages[self.aux_stage]

    def inference_parameters(self) -> int:
        """Parameters used at inference (the auxiliary head excluded), as papers count them."""
        aux = sum(p.numel() for p in self.aux_head.parameters()) if self.aux_head is not None else 0
        return sum(p.numel() for p in self.parameters()) - aux
