"""The feature contract every image backbone honours.

``forward(x)`` returns a dict of feature maps keyed by output stride, e.g.
``{8: (B, C8, H/8, W/8), 16: (B, C16, H/16, W/16), 32: (B, C32, H/32, W/32)}``,
and ``feature_channels`` gives the channel count for each stride, so a dense head
is built from ``feature_channels`` alone and plugs into any backbone.

``forward_pooled(x)`` returns the ``(B, num_features)`` embedding that the
reference architecture's classifier consumes (global average pool for convnets
and MobileViT, the class token for ViT, the token mean for MLP-Mixer), so the
classification path reproduces the reference exactly.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class Backbone(nn.Module):
    #: stride -> channels of the map ``forward`` returns at that stride, ascending strides
    feature_channels: dict[int, int]
    #: width of the embedding ``forward_pooled`` returns
    num_features: int
    #: channels the input must have
    in_chans: int = 3

    def forward(self, x: torch.Tensor) -> dict[int, torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward_pooled(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_features): global average of the deepest map."""
        feats = self(x)
        return feats[max(feats)].mean(dim=(2, 3))

    def load_pretrained(self, path: str) -> None:
        """Load a checkpoint (ours, timm or CVNets naming) into this backbone, strictly; see
        :mod:`backbones.weights`. Backbones take it as their ``pretrained=<path>`` argument."""
        from backbones.weights import load_pretrained

        load_pretrained(self, path)

    def check_input(self, x: torch.Tensor) -> None:
        """Fail with the expected shape instead of a cryptic conv error deep inside."""
        if x.ndim != 4 or x.shape[1] != self.in_chans:
            raise ValueError(
                f"{type(self).__name__} expects input of shape (B, {self.in_chans}, H, W), got {tuple(x.shape)}"
            )
