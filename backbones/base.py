"""The feature contract every image backbone honours.

``forward(x)`` returns a dict of feature maps keyed by output stride, e.g.
``{8: (B, C8, H/8, W/8), 16: (B, C16, H/16, W/16), 32: (B, C32, H/32, W/32)}``,
and ``feature_channels`` gives the channel count for each stride, so a dense head
is built from ``feature_channels`` alone and plugs into any backbone.

``forward_pooled(x)`` returns the ``(B, num_features)`` embedding that the
reference architecture's classifier consumes (global average pool for convnets
and MobileViT, the class token for ViT, the token mean for MLP-Mixer), so the
classification path reproduces the reference exactly.

Multi-stage backbones (MobileViT v1/v2) also describe their stages, as timm's
``feature_info`` does: ``stage_info`` lists each stage's ``index`` (1..5 for
CVNets' ``layer_1`` .. ``layer_5``), its output ``stride`` after dilation and its
``channels``. With dilation (output stride 8 or 16) several stages share a
stride, so ``forward``'s dict keeps only the deepest of them;
``forward_stages(x, stages)`` returns that same dict together with the maps of
the chosen stages, from one pass (the segmentation auxiliary head reads stage 4
that way, where CVNets puts it). Single-scale backbones (ViT, ConvMixer,
MLP-Mixer) have no numbered stages: asking them for one is an error naming them.

``size_multiple`` says which input sizes a built backbone takes: any height and width
that are multiples of it, or (``None``) only the size it was built for.

``repeated_blocks`` names the block classes the network repeats (MobileViT's and ViT's
transformer layers, ConvMixer's and MLP-Mixer's blocks), the units of regional compilation
and of activation checkpointing.

``layer_order(name)`` places a parameter for layer-wise learning-rate decay, as timm's
``group_matcher``: an ordinal tuple, shallow first (the stem, each block in order, a final norm
with the last block), equal tuples sharing a layer; ``None`` puts it at the top with the head (a feature
pyramid built on a plain backbone). ``tasks.engine.optim.layer_ids`` ranks them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn


@dataclass(frozen=True)
class StageInfo:
    """One stage of a multi-stage backbone (timm's ``feature_info`` entry)."""

    #: 1-based position in the trunk: stage ``i`` is CVNets' ``layer_i`` (timm's feature index ``i - 1``)
    index: int
    #: output stride of the stage's map, after dilation (stages past the output stride share it)
    stride: int
    channels: int
    #: the submodule whose output is the map, e.g. ``"stages.3"``
    module: str


class Backbone(nn.Module):
    #: stride -> channels of the map ``forward`` returns at that stride, ascending strides
    feature_channels: dict[int, int]
    #: width of the embedding ``forward_pooled`` returns
    num_features: int
    #: channels the input must have
    in_chans: int = 3
    #: the numbered stages, shallow to deep; empty for single-scale backbones
    stage_info: tuple[StageInfo, ...] = ()
    #: why the backbone takes only the input size it was built for (when :attr:`size_multiple` is ``None``)
    fixed_size_reason: str = "it is not known to take other input sizes"
    #: the block classes the network repeats: ``--model.compile regional`` compiles each instance of
    #: them and runs the rest eagerly (see :mod:`layers.compile`)
    repeated_blocks: tuple[type[nn.Module], ...] = ()

    @property
    def size_multiple(self) -> int | None:
        """The multiple that input height and width must be of for this network, unchanged, to take
        any such size (timm's ``dynamic_img_size``; an exported graph takes them all); ``None``: only
        the size it was built for (:attr:`fixed_size_reason` says why)."""
        return None

    def forward(self, x: torch.Tensor) -> dict[int, torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def layer_order(self, name: str) -> tuple[int, ...] | None:  # pragma: no cover - abstract
        """Where parameter ``name`` (of this backbone) sits for layer-wise lr decay (see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how its parameters map to layers")

    @property
    def stage_channels(self) -> dict[int, int]:
        """Stage index -> channels of its map (empty for single-scale backbones)."""
        return {stage.index: stage.channels for stage in self.stage_info}

    def forward_stages(
        self, x: torch.Tensor, stages: Sequence[int] = ()
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """(B, in_chans, H, W) -> (``forward(x)``'s ``{stride: map}``, ``{stage index: map}`` of
        ``stages``), in one pass. Multi-stage backbones override it; here only ``stages=()`` works."""
        self.check_stages(stages)
        return self(x), {}

    def check_stages(self, stages: Sequence[int]) -> None:
        """Fail, naming this backbone and the stages it has, when one of ``stages`` is not among them."""
        known = {stage.index for stage in self.stage_info}
        unknown = [index for index in stages if index not in known]
        if not unknown:
            return
        name = type(self).__name__
        if not known:
            raise ValueError(
                f"{name} has no numbered stages (it gives feature maps by stride only: "
                f"{sorted(self.feature_channels)}), so it cannot give stage {unknown[0]}; read a map by stride instead "
                f"(segmentation heads: aux_stride instead of aux_stage)"
            )
        described = ", ".join(f"{s.index} (stride {s.stride}, {s.channels} channels)" for s in self.stage_info)
        raise ValueError(f"{name} has no stage {unknown[0]}; its stages are {described}")

    def forward_pooled(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_features): global average of the deepest map."""
        feats = self(x)
        return feats[max(feats)].mean(dim=(2, 3))

    def load_pretrained(self, pretrained: str) -> None:
        """Load registered weights (:mod:`backbones.pretrained`) or a checkpoint (ours, timm or CVNets naming)
        into this backbone, strictly; see :mod:`backbones.weights`. Backbones take it as their ``pretrained``
        argument."""
        from backbones.weights import load_pretrained

        load_pretrained(self, pretrained)

    def check_input(self, x: torch.Tensor) -> None:
        """Fail with the expected shape instead of a cryptic conv error deep inside."""
        if x.ndim != 4 or x.shape[1] != self.in_chans:
            raise ValueError(
                f"{type(self).__name__} expects input of shape (B, {self.in_chans}, H, W), got {tuple(x.shape)}"
            )
