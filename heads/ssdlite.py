"""SSDLite: the single-shot detector head that MobileViT (v1 and v2) is evaluated with.

Structure (Sandler et al., MobileNetV2, sec. 6.3; the MobileViT papers' COCO setting):

- pyramid: the backbone's maps at strides 16 and 32, then separable (depthwise 3x3 +
  pointwise, each with BN, ReLU after the pointwise) stride-2 layers to strides 64, 128,
  256, then a global-average-pooled 1x1 map (stride ``-1`` below);
- per level: a 1x1 projection (conv + BN + ReLU) to ``proj_channels`` (skipped when the
  channels already match and on the 1x1 level) and one separable 3x3 conv predicting
  ``anchors * (4 + classes + 1)`` values per location (a plain 1x1 conv on the 1x1 level);
- anchors (:mod:`heads.anchors`), box coding (:mod:`heads.box_coder`), matching
  (:mod:`heads.matcher`), the multibox loss and the post-processing below.

The head owns everything between the backbone's features and boxes in pixels, as torchvision's
``SSD`` model does: its :meth:`SSDLiteHead.forward` returns :class:`SSDLiteOutputs` (the anchors
travel with the predictions), :meth:`SSDLiteHead.loss` matches them to the ground truth, and
:meth:`SSDLiteHead.postprocess` turns them into detections in the input's pixels or, given each
image's original size, in the original image's. A caller never handles anchors or scales boxes.
The selection itself (top-k per class, threshold, NMS, the best per image) is
:meth:`SSDLiteHead.select`, in fixed shapes, which the ONNX graph of :mod:`tasks.export.detection`
runs too: the exported detector and ``postprocess`` cannot select differently.

Classes are the dataset's contiguous labels ``0 .. num_classes - 1``; the head adds the
background class internally (index 0 of its logits) and never exposes it.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torchvision.ops import batched_nms, box_convert

from heads.anchors import SSDAnchorGenerator
from heads.box_coder import SSDBoxCoder
from heads.matcher import SSDMatcher
from layers.conv import ConvNormAct

GLOBAL_LEVEL = -1  #: the output stride that names the global-average-pooled 1x1 level

#: image sizes ``(height, width)``: a sequence of pairs or a (B, 2) tensor
ImageSizes = Sequence[Sequence[int]] | torch.Tensor


@torch.library.custom_op("suite::nms_keep_mask", mutates_args=())
def nms_keep_mask(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float,
                  score_threshold: float) -> torch.Tensor:
    """Per-group NMS as a fixed-shape mask. boxes (G, N, 4) x1y1x2y2, scores (G, N) -> (G, N) bool:
    True for the boxes with score > ``score_threshold`` that no higher-scoring box of their group
    overlaps with IoU > ``iou_threshold``.

    An op of its own because NMS keeps a data-dependent number of boxes, which an exported graph
    cannot trace; as one op with a fixed-shape result it exports, as ONNX ``NonMaxSuppression``
    (the lowering is in :mod:`tasks.export.detection`)."""
    groups, n = scores.shape
    flat_scores = scores.reshape(-1)
    candidate = (flat_scores > score_threshold).nonzero().squeeze(1)
    kept = candidate[batched_nms(boxes.reshape(-1, 4)[candidate], flat_scores[candidate], candidate // n,
                                 iou_threshold)]
    keep = torch.zeros(groups * n, dtype=torch.bool, device=scores.device)
    keep[kept] = True
    return keep.view(groups, n)


@nms_keep_mask.register_fake
def _nms_keep_mask_shape(boxes, scores, iou_threshold, score_threshold):
    return torch.empty_like(scores, dtype=torch.bool)


class Detections(NamedTuple):
    """A batch's detections in fixed shapes (:meth:`SSDLiteHead.select`), best first. Rows
    ``num_detections[b]`` and after of image ``b`` are padding: box 0, score 0, label -1."""

    boxes: torch.Tensor  #: (B, D, 4) x1y1x2y2, in the pixels of the boxes given to ``select``
    scores: torch.Tensor  #: (B, D)
    labels: torch.Tensor  #: (B, D) int64 in 0..num_classes-1
    num_detections: torch.Tensor  #: (B,) int64


class SSDLiteOutputs(NamedTuple):
    """What :meth:`SSDLiteHead.forward` returns, for :meth:`SSDLiteHead.loss` and :meth:`SSDLiteHead.postprocess`."""

    cls_logits: torch.Tensor  #: (B, A, num_classes + 1), background first
    box_regression: torch.Tensor  #: (B, A, 4) box codes relative to the anchors (:mod:`heads.box_coder`)
    anchors: torch.Tensor  #: (A, 4) ``cx, cy, w, h`` as fractions of the input's sides


class SeparableConv(nn.Sequential):
    """Depthwise kxk conv + BN, then pointwise 1x1 conv (+ BN + ReLU when ``norm_act``),
    as one flat sequence (children ``0`` to ``4``, the layout of the head's checkpoints)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1,
                 norm_act: bool = True):
        super().__init__(
            *ConvNormAct(in_channels, in_channels, kernel_size, stride, groups=in_channels, act=None),
            *ConvNormAct(in_channels, out_channels, 1, norm=norm_act, act="relu" if norm_act else None),
        )


class SSDLiteHead(nn.Module):
    """Extra pyramid levels, per-level predictors, anchors, loss and post-processing.

    Args:
        feature_channels: the backbone's ``{stride: channels}``; it must provide every stride of
            ``output_strides`` up to its deepest one (e.g. 16 and 32); deeper levels are built here.
        num_classes: object classes, background excluded.
        output_strides: pyramid levels, ascending, ``-1`` for the global 1x1 level (last).
        proj_channels: channels of each level's projection (and of each extra level).
        aspect_ratios: anchor aspect ratios per level (see :class:`SSDAnchorGenerator`).
        min_scale, max_scale: anchor scale range, fractions of the image side.
        center_variance, size_variance: SSD box-coding variances.
        iou_threshold: IoU for an anchor to match a ground truth.
        neg_pos_ratio: hard negatives kept per positive anchor in the classification loss.
        score_threshold, topk_candidates, nms_threshold, detections_per_image: post-processing.

    ``forward(features)`` takes the backbone's dict and returns :class:`SSDLiteOutputs`; :meth:`loss`
    and :meth:`postprocess` take them with the input's ``(height, width)``.
    """

    def __init__(self, feature_channels: dict[int, int], num_classes: int,
                 output_strides: Sequence[int] = (16, 32, 64, 128, 256, GLOBAL_LEVEL),
                 proj_channels: Sequence[int] = (512, 256, 256, 128, 128, 64),
                 aspect_ratios: Sequence[Sequence[float]] = ((2, 3),) * 5 + ((2,),),
                 min_scale: float = 0.1, max_scale: float = 1.05,
                 center_variance: float = 0.1, size_variance: float = 0.2, iou_threshold: float = 0.5,
                 neg_pos_ratio: float = 3.0, score_threshold: float = 0.01, topk_candidates: int = 400,
                 nms_threshold: float = 0.5, detections_per_image: int = 200):
        super().__init__()
        output_strides = [int(s) for s in output_strides]
        if not (len(output_strides) == len(proj_channels) == len(aspect_ratios)):
            raise ValueError(f"output_strides ({len(output_strides)}), proj_channels ({len(proj_channels)}) and "
                             f"aspect_ratios ({len(aspect_ratios)}) need one entry per pyramid level")
        from_backbone = [s for s in output_strides if s in feature_channels]
        if not from_backbone:
            raise ValueError(f"none of the head's strides {output_strides} is among the backbone's "
                             f"{sorted(feature_channels)}; give the backbone a pyramid (e.g. pyramid_strides)")
        missing = [s for s in output_strides if s != GLOBAL_LEVEL and s not in feature_channels and s < max(from_backbone)]
        if missing:
            raise ValueError(f"the backbone has no stride {missing} (it has {sorted(feature_channels)}); "
                             "levels past the backbone's deepest are built by the head, shallower ones are not")
        self.num_classes = num_classes
        self.output_strides = output_strides
        self.backbone_strides = from_backbone

        # extra levels: each one from the level before it
        self.extra_layers = nn.ModuleDict()
        level_channels, channels = [], None
        for stride, proj in zip(output_strides, proj_channels):
            if stride in feature_channels:
                channels = feature_channels[stride]
            elif stride == GLOBAL_LEVEL:
                self.extra_layers[self._key(stride)] = nn.Sequential(
                    nn.AdaptiveAvgPool2d(1), *ConvNormAct(channels, proj, norm=False, act="relu", bias=False))
                channels = proj
            else:
                self.extra_layers[self._key(stride)] = SeparableConv(channels, proj, stride=2)
                channels = proj
            level_channels.append(channels)

        self.anchor_generator = SSDAnchorGenerator(aspect_ratios, min_scale, max_scale)
        outputs_per_anchor = 4 + num_classes + 1
        self.predictors = nn.ModuleList()
        for stride, in_ch, proj, n_anchors in zip(output_strides, level_channels, proj_channels,
                                                 self.anchor_generator.num_anchors_per_location):
            if stride == GLOBAL_LEVEL:
                predictor = nn.Conv2d(in_ch, n_anchors * outputs_per_anchor, 1)
            else:
                project = ConvNormAct(in_ch, proj, act="relu", positional=True) if proj != in_ch else nn.Identity()
                predictor = nn.Sequential(project, SeparableConv(proj, n_anchors * outputs_per_anchor,
                                                                 norm_act=False))
            self.predictors.append(predictor)

        self.box_coder = SSDBoxCoder(center_variance, size_variance)
        self.matcher = SSDMatcher(iou_threshold)
        self.neg_pos_ratio = neg_pos_ratio
        self.score_threshold = score_threshold
        self.topk_candidates = topk_candidates
        self.nms_threshold = nms_threshold
        self.detections_per_image = detections_per_image
        self._pixel_scales: dict[tuple, torch.Tensor] = {}
        self.register_load_state_dict_pre_hook(self._rename_global_level)
        self.reset_parameters()

    @staticmethod
    def _key(stride: int) -> str:
        # not "global": torch.export writes submodule names as Python attributes, and a keyword fails there
        return "pooled" if stride == GLOBAL_LEVEL else f"stride{stride}"

    @staticmethod
    def _rename_global_level(module, state_dict, prefix, *args) -> None:
        """A checkpoint that names the global level ``extra_layers.global`` loads into ``extra_layers.pooled``."""
        old = f"{prefix}extra_layers.global."
        for key in [k for k in state_dict if k.startswith(old)]:
            state_dict[f"{prefix}extra_layers.pooled." + key[len(old):]] = state_dict.pop(key)

    def reset_parameters(self) -> None:
        for module in [self.extra_layers, self.predictors]:
            for m in module.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.xavier_uniform_(m.weight)
                    if m.bias is not None:
                        nn.init.zeros_(m.bias)

    # -- network ----------------------------------------------------------------------------------
    def pyramid(self, features: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """The backbone's maps plus the extra levels, one (B, C_k, H_k, W_k) map per output stride."""
        maps = []
        for stride in self.output_strides:
            maps.append(features[stride] if stride in self.backbone_strides
                        else self.extra_layers[self._key(stride)](maps[-1]))
        return maps

    def forward(self, features: dict[int, torch.Tensor]) -> SSDLiteOutputs:
        maps = self.pyramid(features)
        batch = maps[0].shape[0]
        outputs = [predict(x).permute(0, 2, 3, 1).reshape(batch, -1, 4 + self.num_classes + 1)
                   for predict, x in zip(self.predictors, maps)]
        outputs = torch.cat(outputs, dim=1)
        anchors = self.anchor_generator([m.shape[-2:] for m in maps], device=outputs.device)
        box_regression, cls_logits = outputs.split([4, self.num_classes + 1], dim=-1)
        return SSDLiteOutputs(cls_logits, box_regression, anchors)

    # -- training ---------------------------------------------------------------------------------
    @torch.no_grad()
    def assign_targets(self, targets: Sequence[dict[str, torch.Tensor]], anchors: torch.Tensor,
                       image_size: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Match anchors to each image's boxes, the whole batch at once (boxes padded to the longest list).

        Args:
            targets: per image ``{"boxes": (G, 4) x1y1x2y2 in input pixels, "labels": (G,) in 0..num_classes-1}``.
            anchors: (A, 4) ``cx, cy, w, h`` normalised.
            image_size: ``(height, width)`` of the network input.

        Returns:
            ``(labels (B, A) long with 0 = background and k + 1 for class k, box codes (B, A, 4) float32)``;
            the codes of background anchors are those of the image's first box (zeros without one).
        """
        batch, num_anchors = len(targets), anchors.shape[0]
        # padding label -1 marks the padded boxes; labels are >= 0
        labels = pad_sequence([t["labels"].long() for t in targets], batch_first=True, padding_value=-1)
        if labels.shape[1] == 0:
            return (torch.zeros(batch, num_anchors, dtype=torch.long, device=anchors.device),
                    anchors.new_zeros(batch, num_anchors, 4, dtype=torch.float32))
        boxes = pad_sequence([t["boxes"].float() for t in targets], batch_first=True)
        boxes = boxes / self._pixels_per_unit(image_size, boxes.device)  # (B, G, 4) normalised
        matches = self.matcher(boxes, box_convert(anchors, "cxcywh", "xyxy"), gt_valid=labels >= 0)  # (B, A)
        matched = matches.clamp(min=0)
        target_labels = torch.where(matches >= 0, labels.gather(1, matched) + 1, 0)
        codes = self.box_coder.encode(boxes.gather(1, matched[..., None].expand(-1, -1, 4)), anchors)
        has_boxes = labels[:, :1, None] >= 0
        return target_labels, torch.where(has_boxes, codes, 0.0)

    def _pixels_per_unit(self, image_size: Sequence[int], device: torch.device) -> torch.Tensor:
        """``(width, height, width, height)`` on ``device``, made once per size (a copy to a GPU waits)."""
        key = (tuple(int(v) for v in image_size), str(device))
        if key not in self._pixel_scales:
            height, width = key[0]
            self._pixel_scales[key] = torch.tensor([width, height, width, height], dtype=torch.float32).to(device)
        return self._pixel_scales[key]

    def loss(self, outputs: SSDLiteOutputs, targets: Sequence[dict[str, torch.Tensor]],
             image_size: Sequence[int]) -> dict[str, torch.Tensor]:
        """The multibox loss of ``outputs`` against ``targets`` (per image ``{"boxes": (G, 4) x1y1x2y2 in
        input pixels, "labels": (G,)}``) on inputs of ``image_size`` ``(height, width)``: the anchors are
        matched (:meth:`assign_targets`), then scored (:meth:`multibox_loss`, whose dict it returns)."""
        target_labels, target_codes = self.assign_targets(targets, outputs.anchors, image_size)
        return self.multibox_loss(outputs.cls_logits, outputs.box_regression, target_labels, target_codes)

    def multibox_loss(self, cls_logits: torch.Tensor, box_regression: torch.Tensor, target_labels: torch.Tensor,
                      target_codes: torch.Tensor) -> dict[str, torch.Tensor]:
        """Multibox loss: smooth L1 on positive anchors plus cross-entropy on positives and the
        ``neg_pos_ratio`` times as many hardest negatives per image, both summed and divided by the
        number of positives in the batch. Computed in float32 even under autocast, over the whole
        batch with masks (no data-dependent shapes, so a GPU computes it without the host waiting).

        Shapes: ``cls_logits (B, A, C + 1)``, ``box_regression (B, A, 4)``, ``target_labels (B, A)``,
        ``target_codes (B, A, 4)``. Returns ``{"loss", "loss_cls", "loss_box"}`` (scalars) and
        ``num_positive``, the normaliser: a mean over a dataset weighs each batch's loss by it.
        """
        with torch.autocast(cls_logits.device.type, enabled=False):
            cls_logits, box_regression = cls_logits.float(), box_regression.float()
            positive = target_labels > 0
            num_positive = positive.sum()
            normaliser = num_positive.clamp(min=1).float()

            box_loss = F.smooth_l1_loss(box_regression, target_codes.float(), reduction="none").sum(dim=-1)
            loss_box = torch.where(positive, box_loss, 0.0).sum()

            ce = F.cross_entropy(cls_logits.transpose(1, 2), target_labels, reduction="none")  # (B, A)
            negative = self.hard_negatives(ce.detach(), positive)
            loss_cls = torch.where(positive | negative, ce, 0.0).sum()
        return {"loss": (loss_box + loss_cls) / normaliser, "loss_cls": loss_cls / normaliser,
                "loss_box": loss_box / normaliser, "num_positive": num_positive}

    def hard_negatives(self, ce: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        """(B, A) bool: per image, the ``neg_pos_ratio`` x positives background anchors with the highest
        loss. ``ce`` (B, A) is each anchor's cross-entropy; a background anchor's is its background loss."""
        background_loss = ce.masked_fill(positive, -torch.inf)
        order = background_loss.argsort(dim=1, descending=True)
        positions = torch.arange(order.shape[1], device=order.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(1, order, positions)  # each anchor's place in its image's order
        num_negative = (positive.sum(dim=1, keepdim=True) * self.neg_pos_ratio).long()
        return rank < num_negative

    # -- inference --------------------------------------------------------------------------------
    def scores_and_boxes(self, outputs: SSDLiteOutputs, image_size: Sequence[int],
                         original_sizes: ImageSizes | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per anchor the class probabilities (B, A, num_classes), background left out, and its decoded box
        (B, A, 4) x1y1x2y2 in pixels: of each original image when ``original_sizes`` (per image ``(height,
        width)``) are given, else of the input of ``image_size`` ``(height, width)``.

        Boxes are clipped here and only here, to the image, while they are still fractions of its sides;
        scaling them to an original size afterwards keeps them inside that image. Non-maximum suppression
        compares IoUs, which a per-axis scaling leaves unchanged, so it selects the same boxes in any pixels."""
        scores = F.softmax(outputs.cls_logits.float(), dim=-1)[..., 1:]
        boxes = self.box_coder.decode(outputs.box_regression, outputs.anchors).clamp(0.0, 1.0)
        if original_sizes is None:
            return scores, boxes * self._pixels_per_unit(image_size, boxes.device)
        sizes = torch.as_tensor(original_sizes, dtype=torch.float32, device=boxes.device).reshape(-1, 2)
        if len(sizes) != len(boxes):
            raise ValueError(f"{len(sizes)} original sizes for a batch of {len(boxes)} images")
        return scores, boxes * sizes[:, [1, 0, 1, 0]].unsqueeze(1)

    def select(self, scores: torch.Tensor, boxes: torch.Tensor) -> Detections:
        """The detections of a batch in fixed shapes, from each anchor's class probabilities ``scores``
        (B, A, C) and box ``boxes`` (B, A, 4) x1y1x2y2 (:meth:`scores_and_boxes`): per image and class
        the ``topk_candidates`` best anchors, of those the ones scoring above ``score_threshold``,
        class-wise NMS at ``nms_threshold``, then per image the best ``detections_per_image``
        (D = min(detections_per_image, topk_candidates * C) rows, padded past ``num_detections``).

        Detections of equal score keep the candidates' order (by rank within the class, then by class):
        a stable sort, as ONNX's TopK in the exported graph orders them too. Every shape is fixed by
        the input's; only inside :func:`nms_keep_mask` do counts vary."""
        batch, num_anchors, num_classes = scores.shape
        k = min(self.topk_candidates, num_anchors)
        top_scores, top_anchor = scores.topk(k, dim=1)  # (B, k, C): each class's k best anchors
        candidates = boxes.gather(1, top_anchor.reshape(batch, -1, 1).expand(-1, -1, 4))  # (B, k * C, 4)
        # NMS within each (image, class) group, the groups first
        by_class = candidates.view(batch, k, num_classes, 4).transpose(1, 2).reshape(-1, k, 4)
        keep = nms_keep_mask(by_class, top_scores.transpose(1, 2).reshape(-1, k), self.nms_threshold,
                             self.score_threshold)
        # the mask already requires the threshold; required again so that the graph does not depend on how
        # a runtime's NonMaxSuppression treats a score equal to it
        keep = keep.view(batch, num_classes, k).transpose(1, 2).reshape(batch, -1) & (
            top_scores.reshape(batch, -1) > self.score_threshold)  # (B, k * C), index = rank * C + class

        count = min(self.detections_per_image, k * num_classes)
        ranked, order = torch.where(keep, top_scores.reshape(batch, -1), -1.0).sort(dim=1, descending=True,
                                                                                     stable=True)
        index = order[:, :count]  # (B, D)
        valid = keep.gather(1, index)
        return Detections(
            boxes=torch.where(valid.unsqueeze(-1), candidates.gather(1, index.unsqueeze(-1).expand(-1, -1, 4)), 0.0),
            scores=torch.where(valid, ranked[:, :count], 0.0),
            labels=torch.where(valid, index % num_classes, -1),
            num_detections=valid.sum(dim=1))

    @torch.no_grad()
    def postprocess(self, outputs: SSDLiteOutputs, image_size: Sequence[int],
                    original_sizes: ImageSizes | None = None) -> list[dict[str, torch.Tensor]]:
        """Decode (:meth:`scores_and_boxes`) and select (:meth:`select`: top ``topk_candidates`` per class,
        threshold, class-wise NMS, the best ``detections_per_image``), for the whole batch at once.

        Returns per image ``{"boxes": (D, 4) x1y1x2y2, "scores": (D,), "labels": (D,) in 0..num_classes-1}``,
        sorted by decreasing score; boxes in the pixels of the original image of ``original_sizes`` (per
        image ``(height, width)``) when given, else of the input of ``image_size`` ``(height, width)``.
        """
        found = self.select(*self.scores_and_boxes(outputs, image_size, original_sizes))
        return [{"boxes": boxes[:n], "scores": scores[:n], "labels": labels[:n]} for boxes, scores, labels, n
                in zip(found.boxes, found.scores, found.labels, found.num_detections.tolist())]
