"""SSD matching of anchors to ground-truth boxes."""
from __future__ import annotations

import torch
from torchvision.ops import box_iou


class SSDMatcher:
    """Each anchor takes the ground truth it overlaps most if that IoU reaches ``iou_threshold``;
    then every ground truth is forced onto its best anchor, so no object goes unmatched
    however odd its shape (SSD, sec. 2.2 "Matching strategy").

    A batch of images is matched at once, their boxes padded to the same count: every step is a
    tensor op whose output size is known in advance, so a GPU matches without the host waiting."""

    def __init__(self, iou_threshold: float = 0.5):
        self.iou_threshold = iou_threshold

    def __call__(self, gt_boxes: torch.Tensor, anchor_boxes: torch.Tensor,
                 gt_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Ground truths (G, 4) or a padded batch (B, G, 4), anchors (A, 4), all ``x1, y1, x2, y2``;
        ``gt_valid`` (B, G) bool marks the real boxes of a padded batch (default: all).
        Returns (A,) or (B, A): the index of each anchor's matched ground truth, -1 for background."""
        single = gt_boxes.ndim == 2
        boxes = gt_boxes[None] if single else gt_boxes
        batch, num_gt = boxes.shape[:2]
        matches = torch.full((batch, anchor_boxes.shape[0]), -1, dtype=torch.long, device=anchor_boxes.device)
        if num_gt:
            iou = box_iou(boxes.reshape(-1, 4).float(), anchor_boxes.float()).view(batch, num_gt, -1)  # (B, G, A)
            gt_index = torch.arange(num_gt, device=anchor_boxes.device).expand(batch, num_gt)
            if gt_valid is not None:  # padding overlaps nothing and is forced nowhere
                iou = iou.masked_fill(~gt_valid[..., None], -1.0)
                gt_index = gt_index.masked_fill(~gt_valid, -1)
            best_iou, best_gt = iou.max(dim=1)
            matches = torch.where(best_iou >= self.iou_threshold, best_gt, matches)
            # forced matches; with two ground truths sharing a best anchor the later one wins, as in SSD
            forced = torch.full_like(matches, -1).scatter_reduce(1, iou.argmax(dim=2), gt_index, reduce="amax")
            matches = torch.where(forced >= 0, forced, matches)
        return matches[0] if single else matches
