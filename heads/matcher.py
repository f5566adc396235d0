"""SSD matching of anchors to ground-truth boxes."""
from __future__ import annotations

import torch
from torchvision.ops import box_iou


class SSDMatcher:
    """Each anchor takes the ground truth it overlaps most if that IoU reaches ``iou_threshold``;
    then every ground truth is forced onto its best anchor, so no object goes unmatched
    however odd its shape (SSD, sec. 2.2 "Matching strategy")."""

    def __init__(self, iou_threshold: float = 0.5):
        self.iou_threshold = iou_threshold

    def __call__(self, gt_boxes: torch.Tensor, anchor_boxes: torch.Tensor) -> torch.Tensor:
        """(G, 4) and (A, 4) ``x1, y1, x2, y2`` boxes -> (A,) index of the matched ground truth, -1 for background."""
        matches = torch.full((anchor_boxes.shape[0],), -1, dtype=torch.long, device=anchor_boxes.device)
        if gt_boxes.numel() == 0:
            return matches
        iou = box_iou(gt_boxes.float(), anchor_boxes.float())  # (G, A)
        best_iou, best_gt = iou.max(dim=0)
        matches = torch.where(best_iou >= self.iou_threshold, best_gt, matches)
        # forced matches; with two ground truths sharing a best anchor the later one wins, as in SSD
        matches[iou.argmax(dim=1)] = torch.arange(gt_boxes.shape[0], device=anchor_boxes.device)
        return matches
