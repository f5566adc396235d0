"""SSD default boxes ("anchors" / "priors"), one set per feature level.

Level k of n gets scale ``s_k`` from ``linspace(min_scale, max_scale, n + 1)`` (fractions of
the image side). Each location carries, in this order:

- a square box of side ``s_k``,
- a square box of side ``sqrt(s_k * s_{k+1})``,
- for each aspect ratio ``r`` of the level, the boxes ``s_k * (sqrt(r), 1/sqrt(r))`` and
  ``s_k * (1/sqrt(r), sqrt(r))``,

so ratios {2, 3} give 6 boxes per location and {2} gives 4 (Liu et al., SSD, sec. 2.2, with
the scale range and layout of CVNets' SSD for MobileViT). Boxes are ``(cx, cy, w, h)``
normalised to [0, 1] and clipped to it, in row-major location order -- the order in which
the prediction convs' outputs are flattened.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn


class SSDAnchorGenerator(nn.Module):
    """Default boxes for a list of feature levels.

    Args:
        aspect_ratios: per level, the ratios ``r > 1`` (each adds two boxes per location).
        min_scale, max_scale: the scale of the first level and the upper end of the linear range.
        clip: clamp ``(cx, cy, w, h)`` to [0, 1] (boxes never exceed the image side).

    ``forward(feature_sizes)`` returns the ``(A, 4)`` float32 anchors of all levels, concatenated.
    They depend only on the feature sizes, so each size tuple is computed once and cached.
    """

    def __init__(self, aspect_ratios: Sequence[Sequence[float]], min_scale: float = 0.1, max_scale: float = 1.05,
                 clip: bool = True):
        super().__init__()
        self.aspect_ratios = [tuple(float(r) for r in dict.fromkeys(level)) for level in aspect_ratios]
        scales = torch.linspace(min_scale, max_scale, len(self.aspect_ratios) + 1).tolist()
        self.scales = scales[:-1]
        self.extra_scales = [math.sqrt(a * b) for a, b in zip(scales[:-1], scales[1:])]
        self.clip = clip
        self._cache: dict[tuple, torch.Tensor] = {}

    @property
    def num_anchors_per_location(self) -> list[int]:
        return [2 + 2 * len(ratios) for ratios in self.aspect_ratios]

    def _location_shapes(self, level: int) -> torch.Tensor:
        """(anchors per location, 2) widths and heights of level ``level``."""
        s, s_extra = self.scales[level], self.extra_scales[level]
        shapes = [(s, s), (s_extra, s_extra)]
        for r in self.aspect_ratios[level]:
            shapes += [(s * math.sqrt(r), s / math.sqrt(r)), (s / math.sqrt(r), s * math.sqrt(r))]
        return torch.tensor(shapes, dtype=torch.float32)

    def level_anchors(self, level: int, height: int, width: int) -> torch.Tensor:
        """(height * width * anchors per location, 4) ``cx, cy, w, h`` of one level."""
        cy = (torch.arange(height, dtype=torch.float32) + 0.5) / height
        cx = (torch.arange(width, dtype=torch.float32) + 0.5) / width
        centres = torch.stack(torch.meshgrid(cx, cy, indexing="xy"), dim=-1).reshape(-1, 1, 2)  # row-major (y, x)
        shapes = self._location_shapes(level).unsqueeze(0)
        anchors = torch.cat(torch.broadcast_tensors(centres, shapes), dim=-1).reshape(-1, 4)
        return anchors.clamp(0.0, 1.0) if self.clip else anchors

    def forward(self, feature_sizes: Sequence[tuple[int, int]], device: torch.device | str = "cpu") -> torch.Tensor:
        if len(feature_sizes) != len(self.aspect_ratios):
            raise ValueError(f"got {len(feature_sizes)} feature maps for {len(self.aspect_ratios)} anchor levels")
        key = (tuple(tuple(int(v) for v in hw) for hw in feature_sizes), str(device))
        if key not in self._cache:
            self._cache[key] = torch.cat(
                [self.level_anchors(i, h, w) for i, (h, w) in enumerate(feature_sizes)]).to(device)
        return self._cache[key]

    def extra_repr(self) -> str:
        return f"aspect_ratios={self.aspect_ratios}, scales={[round(s, 4) for s in self.scales]}, clip={self.clip}"
