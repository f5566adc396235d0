"""SSD box coding: ground-truth boxes as offsets from their anchors.

With anchor ``(cx_a, cy_a, w_a, h_a)`` and box ``(cx, cy, w, h)`` the code is
``((cx - cx_a) / (w_a * cv), (cy - cy_a) / (h_a * cv), log(w / w_a) / sv, log(h / h_a) / sv)``
with the SSD "variances" ``cv = 0.1`` and ``sv = 0.2`` (torchvision's ``BoxCoder`` with
weights ``(10, 10, 5, 5)`` is the same thing). Arithmetic is float32 whatever the inputs.
"""
from __future__ import annotations

import math

import torch
from torchvision.ops import box_convert

# exp() of a wild regression output must not overflow float32 (torchvision uses the same bound)
_MAX_LOG_SCALE = math.log(1000.0 / 16)


class SSDBoxCoder:
    def __init__(self, center_variance: float = 0.1, size_variance: float = 0.2):
        self.center_variance = center_variance
        self.size_variance = size_variance

    def encode(self, boxes: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """(..., 4) ``x1, y1, x2, y2`` boxes and (..., 4) ``cx, cy, w, h`` anchors -> (..., 4) codes."""
        boxes = box_convert(boxes.float(), "xyxy", "cxcywh")
        anchors = anchors.float()
        centre = (boxes[..., :2] - anchors[..., :2]) / (anchors[..., 2:] * self.center_variance)
        size = torch.log(boxes[..., 2:].clamp(min=1e-6) / anchors[..., 2:]) / self.size_variance
        return torch.cat([centre, size], dim=-1)

    def decode(self, codes: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """(..., 4) codes and (..., 4) ``cx, cy, w, h`` anchors -> (..., 4) ``x1, y1, x2, y2`` boxes."""
        codes, anchors = codes.float(), anchors.float()
        centre = anchors[..., :2] + codes[..., :2] * self.center_variance * anchors[..., 2:]
        size = anchors[..., 2:] * torch.exp((codes[..., 2:] * self.size_variance).clamp(max=_MAX_LOG_SCALE))
        return box_convert(torch.cat([centre, size], dim=-1), "cxcywh", "xyxy")
