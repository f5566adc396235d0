"""ConvMixer (Trockman & Kolter, "Patches Are All You Need?", 2022).

A patch-embedding conv, then ``depth`` blocks of a residual depthwise conv (spatial
mixing) and a pointwise conv (channel mixing), each followed by activation and
BatchNorm. The resolution never changes, so the backbone is single-scale: one map
at stride ``patch_size``. Any input size works; like the reference, a side that is
not a multiple of ``patch_size`` loses its remainder in the patch conv.

The paper's models (parameters with a 1000-class head, matching its Table 1 and timm):

- ConvMixer-1536/20: dim 1536, depth 20, kernel 9, patch 7: 51.6M
- ConvMixer-768/32: dim 768, depth 32, kernel 7, patch 7, ReLU (as in the paper and timm): 21.1M
- ConvMixer-1024/20: dim 1024, depth 20, kernel 9, patch 14: 24.4M

``ConvMixer(**PRESETS["768/32"])`` builds one; GELU is the default activation.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from backbones.pyramid import SingleScaleBackbone
from backbones.registry import register_backbone
from backbones.weights import StateDict, register_converter, rename_keys
from layers.conv import DepthwiseConv2d, activation_layer

#: ``ConvMixer(**PRESETS[name])`` builds the paper's models
PRESETS: dict[str, dict] = {
    "1536/20": dict(dim=1536, depth=20, kernel_size=9, patch_size=7),
    "768/32": dict(dim=768, depth=32, kernel_size=7, patch_size=7, act="relu"),
    "1024/20": dict(dim=1024, depth=20, kernel_size=9, patch_size=14),
}

class ConvMixerBlock(nn.Module):
    """(B, dim, H, W) -> (B, dim, H, W): x + BN(act(depthwise(x))), then BN(act(pointwise(.)))."""

    def __init__(self, dim: int, kernel_size: int, act_layer: type[nn.Module] = nn.GELU):
        super().__init__()
        self.depthwise = DepthwiseConv2d(dim, kernel_size)
        self.act1 = act_layer()
        self.norm1 = nn.BatchNorm2d(dim)
        self.pointwise = nn.Conv2d(dim, dim, kernel_size=1)
        self.act2 = act_layer()
        self.norm2 = nn.BatchNorm2d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.norm1(self.act1(self.depthwise(x)))
        return self.norm2(self.act2(self.pointwise(x)))


@register_backbone("convmixer")
class ConvMixer(SingleScaleBackbone):
    """ConvMixer-``dim``/``depth`` with any odd kernel size and any patch size.

    ``forward``: (B, in_chans, H, W) -> ``{patch_size: (B, dim, H/p, W/p)}``, or the
    :class:`~backbones.pyramid.SimpleFeaturePyramid` maps when ``pyramid_strides`` is
    given (each must be ``patch_size`` times a power of two, e.g. 7, 14, 28, 56 for p7;
    use ``patch_size=8`` or 16 for the usual 8..64 pyramid). ``forward_pooled``:
    (B, dim), the global average the reference classifier consumes.
    """

    repeated_blocks = (ConvMixerBlock,)  # the units of --model.compile regional
    stem_parameters = ("patch_embed.", "stem_norm.")  # layer 0 of layer-wise lr decay (timm's `stem`)

    @property
    def size_multiple(self) -> int:
        """Convolutions and poolings only: any multiple of the deepest output stride."""
        return max(self.feature_channels)

    def __init__(
        self,
        dim: int = 768,
        depth: int = 32,
        kernel_size: int = 7,
        patch_size: int = 7,
        in_chans: int = 3,
        act: str = "gelu",
        pyramid_strides: Sequence[int] | None = None,
        pyramid_channels: int = 256,
        pyramid_norm: str = "layernorm",
        pretrained: str | None = None,
    ):
        super().__init__()
        act_layer = activation_layer(act)
        self.in_chans = in_chans
        self.num_features = dim
        self.patch_size = patch_size
        self.patch_embed = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)
        self.stem_act = act_layer()
        self.stem_norm = nn.BatchNorm2d(dim)
        self.blocks = nn.Sequential(*[ConvMixerBlock(dim, kernel_size, act_layer) for _ in range(depth)])
        self._finish_init(patch_size, dim, pyramid_strides, pyramid_channels, pyramid_norm, pretrained)

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, dim, H // p, W // p)."""
        self.check_input(x)
        if x.shape[-2] < self.patch_size or x.shape[-1] < self.patch_size:
            raise ValueError(
                f"ConvMixer with patch_size={self.patch_size} needs images of at least "
                f"(B, {self.in_chans}, {self.patch_size}, {self.patch_size}), got {tuple(x.shape)}"
            )
        # channels-last once, here: oneDNN's depthwise convolution computes its gradients twice as
        # fast on channels-last maps (7x7, dim 768: 35 vs 72 ms per block), a training step 1.4x
        x = self.stem_norm(self.stem_act(self.patch_embed(x.contiguous(memory_format=torch.channels_last))))
        return self.blocks(x)


_TIMM_CONVMIXER_RULES = [
    (r"^stem\.0\.", "patch_embed."),
    (r"^stem\.2\.", "stem_norm."),
    (r"^blocks\.(\d+)\.0\.fn\.0\.", r"blocks.\1.depthwise."),
    (r"^blocks\.(\d+)\.0\.fn\.2\.", r"blocks.\1.norm1."),
    (r"^blocks\.(\d+)\.1\.", r"blocks.\1.pointwise."),
    (r"^blocks\.(\d+)\.3\.", r"blocks.\1.norm2."),
    (r"^head\.", "head.fc."),
    (r"^(?!head\.)", "backbone."),
]


@register_converter("convmixer", "timm", detect=lambda sd: "stem.0.weight" in sd)
def convmixer_timm_to_ours(state_dict: StateDict, backbone: nn.Module | None = None) -> StateDict:
    """timm ``convmixer_*`` state dict -> canonical keys (``backbone.*`` of :class:`ConvMixer`, ``head.fc.*``)."""
    return rename_keys(state_dict, _TIMM_CONVMIXER_RULES)
