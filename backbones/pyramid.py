"""A simple feature pyramid for single-scale backbones (ViT, ConvMixer, MLP-Mixer).

Plain backbones produce one map at the patch stride. Detection and segmentation
heads want several strides, so, following ViTDet (Li et al. 2022, "Exploring
Plain Vision Transformer Backbones for Object Detection", Fig. 2c), every
pyramid level is built from that one map alone: transposed convs to go up,
max-pooling to go down, then a 1x1 and a 3x3 conv, each with a norm. There is no
top-down path: the paper shows it is not needed when the backbone is plain.

:class:`SingleScaleBackbone` holds the plumbing that the three plain backbones
share: ``forward`` returns ``{patch_stride: map}``, or the pyramid's maps when
``pyramid_strides`` is given.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from backbones.base import Backbone

PYRAMID_NORMS = ("layernorm", "batchnorm")


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a (B, C, H, W) map, at every position (ViTDet's and ConvNeXt's norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


def _norm(name: str, channels: int) -> nn.Module:
    if name == "layernorm":
        return LayerNorm2d(channels, eps=1e-6)
    if name == "batchnorm":
        return nn.BatchNorm2d(channels)
    raise ValueError(f"unknown pyramid norm {name!r}; valid names: {', '.join(PYRAMID_NORMS)}")


def _octaves(stride: int, in_stride: int) -> int:
    """k such that stride == in_stride * 2**k, or a ValueError naming the strides that are possible."""
    k = round(math.log2(stride / in_stride)) if stride > 0 else 0
    if stride <= 0 or in_stride * 2.0**k != stride:
        possible = [int(in_stride * 2.0**k) for k in range(-2, 4) if (in_stride * 2.0**k).is_integer()]
        raise ValueError(
            f"pyramid stride {stride} cannot be built from a stride-{in_stride} map: strides must be "
            f"{in_stride} times a power of two, e.g. {possible}"
        )
    return k


class PyramidLevel(nn.Module):
    """One level: resample the stride-s map by 2**k, then 1x1 conv + norm, 3x3 conv + norm.

    (B, in_channels, H, W) -> (B, out_channels, H * 2**-k, W * 2**-k); going down the
    size is rounded up (``ceil_mode``), as a stride-2 conv with padding would.
    """

    def __init__(self, in_channels: int, out_channels: int, octaves: int, norm: str = "layernorm"):
        super().__init__()
        resample: list[nn.Module] = []
        channels = in_channels
        for i in range(-octaves):  # going up: each transposed conv doubles the size and halves the width
            if i > 0:
                resample += [_norm(norm, channels), nn.GELU()]
            resample.append(nn.ConvTranspose2d(channels, channels // 2, kernel_size=2, stride=2))
            channels //= 2
        if octaves > 0:
            resample.append(nn.MaxPool2d(kernel_size=2**octaves, stride=2**octaves, ceil_mode=True))
        self.resample = nn.Sequential(*resample)
        self.lateral = nn.Conv2d(channels, out_channels, kernel_size=1, bias=False)
        self.lateral_norm = _norm(norm, out_channels)
        self.output = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.output_norm = _norm(norm, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lateral_norm(self.lateral(self.resample(x)))
        return self.output_norm(self.output(x))


class SimpleFeaturePyramid(nn.Module):
    """ViTDet-style pyramid: one (B, in_channels, H, W) map at ``in_stride`` -> ``{stride: (B, out_channels, h, w)}``.

    Each requested stride must be ``in_stride * 2**k``: k < 0 uses |k| stride-2
    transposed convs, k = 0 the map itself, k > 0 a 2**k max-pool. With a patch-16
    ViT, ``strides=(4, 8, 16, 32)`` is ViTDet's pyramid and ``(8, 16, 32, 64)`` the
    one SSDLite-style heads use.
    """

    def __init__(
        self,
        in_channels: int,
        in_stride: int,
        strides: Sequence[int] = (8, 16, 32, 64),
        out_channels: int = 256,
        norm: str = "layernorm",
    ):
        super().__init__()
        strides = sorted(int(s) for s in strides)
        if not strides or len(set(strides)) != len(strides):
            raise ValueError(f"pyramid strides must be distinct and non-empty, got {list(strides)}")
        _norm(norm, 1)  # fail early on an unknown norm name
        self.in_stride = in_stride
        self.levels = nn.ModuleDict(
            {str(s): PyramidLevel(in_channels, out_channels, _octaves(s, in_stride), norm) for s in strides}
        )
        self.feature_channels = {s: out_channels for s in strides}

    def forward(self, x: torch.Tensor) -> dict[int, torch.Tensor]:
        return {int(stride): level(x) for stride, level in self.levels.items()}


class SingleScaleBackbone(Backbone):
    """A backbone whose trunk yields one map at ``feature_stride``, optionally expanded into a pyramid.

    Subclasses implement :meth:`forward_map` and call :meth:`_finish_init` at the end of
    ``__init__``. The pyramid's parameters are extra: the classification path
    (:meth:`forward_pooled`) never touches them.
    """

    pyramid: SimpleFeaturePyramid | None

    def _finish_init(
        self,
        stride: int,
        channels: int,
        pyramid_strides: Sequence[int] | None,
        pyramid_channels: int,
        pyramid_norm: str,
        pretrained: str | None,
    ) -> None:
        """Attach the pyramid (if any), then load ``pretrained`` (registered weights or a checkpoint path: ours, timm's) if given."""
        self.feature_stride = stride
        if pyramid_strides is None:
            self.pyramid = None
            self.feature_channels = {stride: channels}
        else:
            self.pyramid = SimpleFeaturePyramid(channels, stride, pyramid_strides, pyramid_channels, pyramid_norm)
            self.feature_channels = dict(self.pyramid.feature_channels)
        if pretrained:
            self.load_pretrained(pretrained)

    def adapt_checkpoint(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fit a checkpoint's tensors to this model's shapes where that is well defined (nothing here);
        :func:`backbones.weights.load_pretrained` calls it before its strict check."""
        return weights

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """(B, in_chans, H, W) -> (B, C, H / stride, W / stride), the trunk's single feature map."""
        raise NotImplementedError

    def layer_order(self, name: str) -> tuple[int, ...] | None:
        """Layer-wise decay layers as timm's ``group_matcher`` of ViT and the mixers: the stem
        (:attr:`stem_parameters`), each of ``blocks`` in order, the final norm with the last block
        (timm's ``MATCH_PREV_GROUP``); the pyramid, new on top of the trunk, sits with the head (``None``)."""
        if name.startswith("pyramid."):
            return None
        if name.startswith(self.stem_parameters):
            return (0,)
        if name.startswith("blocks."):
            return (1, int(name.split(".")[1]))
        return (1, len(self.blocks) - 1)  # the final norm

    #: name prefixes of the parameters before the first block
    stem_parameters: tuple[str, ...] = ("patch_embed.",)

    def forward(self, x: torch.Tensor) -> dict[int, torch.Tensor]:
        fmap = self.forward_map(x)
        if self.pyramid is None:
            return {self.feature_stride: fmap}
        return self.pyramid(fmap)

    def forward_pooled(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_features): global average of the trunk's map (never the pyramid's)."""
        return self.forward_map(x).mean(dim=(2, 3))
