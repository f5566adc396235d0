"""SSDLite head pieces: anchors, box coding, matching, multibox loss, post-processing, sizes."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.detection._utils import BoxCoder as TorchvisionBoxCoder
from torchvision.ops import box_convert, box_iou, nms

from backbones.base import Backbone
from heads.anchors import SSDAnchorGenerator
from heads.box_coder import SSDBoxCoder
from heads.matcher import SSDMatcher
from heads.ssdlite import SSDLiteHead, SSDLiteOutputs

PAPER_RATIOS = ((2, 3),) * 5 + ((2,),)


class TinyBackbone(Backbone):
    """Stand-in with the feature contract: maps at strides 16 and 32."""

    def __init__(self, strides=(16, 32)):
        super().__init__()
        self.feature_channels = {s: 8 * (i + 1) for i, s in enumerate(strides)}
        self.num_features = self.feature_channels[max(strides)]
        self.convs = nn.ModuleDict({str(s): nn.Conv2d(3, c, s, stride=s) for s, c in self.feature_channels.items()})

    def forward(self, x):
        return {s: F.relu(self.convs[str(s)](x)) for s in self.feature_channels}


# -- anchors ---------------------------------------------------------------------------------------
def test_anchor_layout_matches_ssd_definition():
    gen = SSDAnchorGenerator(PAPER_RATIOS, 0.1, 1.05)
    assert gen.num_anchors_per_location == [6, 6, 6, 6, 6, 4]
    sizes = [(20, 20), (10, 10), (5, 5), (3, 3), (2, 2), (1, 1)]
    anchors = gen(sizes)
    assert anchors.shape == (sum(6 * h * w for h, w in sizes[:5]) + 4, 4)
    scales = torch.linspace(0.1, 1.05, 7)
    first = anchors[:6]  # location (0, 0) of the stride-16 level
    assert torch.allclose(first[:, :2], torch.full((6, 2), 0.5 / 20))
    s0, s1 = scales[0].item(), scales[1].item()
    expected_wh = torch.tensor([[s0, s0], [math.sqrt(s0 * s1)] * 2,
                                [s0 * math.sqrt(2), s0 / math.sqrt(2)], [s0 / math.sqrt(2), s0 * math.sqrt(2)],
                                [s0 * math.sqrt(3), s0 / math.sqrt(3)], [s0 / math.sqrt(3), s0 * math.sqrt(3)]])
    assert torch.allclose(first[:, 2:], expected_wh, atol=1e-6)
    # row-major locations: the next 6 anchors sit one column to the right
    assert torch.allclose(anchors[6:12, 0], torch.full((6,), 1.5 / 20))
    assert anchors.min() >= 0 and anchors.max() <= 1  # clipped


def test_anchors_are_cached_per_feature_size():
    gen = SSDAnchorGenerator(PAPER_RATIOS)
    sizes = [(4, 4), (2, 2), (1, 1), (1, 1), (1, 1), (1, 1)]
    assert gen(sizes) is gen(sizes)
    assert gen([(5, 5)] + sizes[1:]) is not gen(sizes)


# -- box coding and matching -----------------------------------------------------------------------
def test_box_coder_matches_torchvision_and_round_trips():
    torch.manual_seed(0)
    anchors = torch.cat([torch.rand(50, 2), 0.05 + 0.5 * torch.rand(50, 2)], dim=1)
    boxes = box_convert(torch.cat([torch.rand(50, 2), 0.05 + 0.5 * torch.rand(50, 2)], dim=1), "cxcywh", "xyxy")
    coder = SSDBoxCoder(0.1, 0.2)
    codes = coder.encode(boxes, anchors)
    reference = TorchvisionBoxCoder(weights=(10.0, 10.0, 5.0, 5.0)).encode_single(
        boxes, box_convert(anchors, "cxcywh", "xyxy"))
    assert torch.allclose(codes, reference, atol=1e-5)
    assert torch.allclose(coder.decode(codes, anchors), boxes, atol=1e-5)


def test_matcher_threshold_and_forced_match():
    anchors = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.5, 0.5, 1.0, 1.0], [0.0, 0.5, 0.5, 1.0], [0.05, 0.0, 0.55, 0.5]])
    gt = torch.tensor([[0.0, 0.0, 0.5, 0.5],      # IoU 1 with anchor 0, 0.82 with anchor 3
                       [0.5, 0.5, 0.6, 0.6]])     # IoU 0.04 with anchor 1: below threshold, forced anyway
    matches = SSDMatcher(0.5)(gt, anchors)
    assert matches.tolist() == [0, 1, -1, 0]
    assert SSDMatcher(0.5)(torch.zeros(0, 4), anchors).tolist() == [-1] * 4


# -- loss --------------------------------------------------------------------------------------------
def reference_multibox_loss(cls_logits, box_regression, labels, codes, ratio=3):
    """Per-image loop version of the SSD loss, for comparison."""
    total_cls = total_box = 0.0
    num_pos = 0
    for logits, reg, lab, code in zip(cls_logits, box_regression, labels, codes):
        pos = lab > 0
        n = int(pos.sum())
        num_pos += n
        total_box += F.smooth_l1_loss(reg[pos], code[pos], reduction="sum")
        bg = -F.log_softmax(logits, -1)[:, 0]
        bg[pos] = -float("inf")
        neg_idx = bg.argsort(descending=True)[: n * ratio]
        keep = pos.clone()
        keep[neg_idx] = True
        total_cls += F.cross_entropy(logits[keep], lab[keep], reduction="sum")
    return (total_cls + total_box) / max(num_pos, 1)


def test_multibox_loss_matches_reference_and_stays_float32_under_autocast():
    torch.manual_seed(0)
    head = SSDLiteHead(TinyBackbone().feature_channels, num_classes=4)
    cls_logits, box_regression = torch.randn(3, 200, 5), torch.randn(3, 200, 4)
    labels = torch.zeros(3, 200, dtype=torch.long)
    labels[0, :7] = torch.randint(1, 5, (7,))
    labels[1, 50:52] = 2  # image 2 has no positives: it contributes no negatives either
    codes = torch.randn(3, 200, 4)
    loss = head.multibox_loss(cls_logits, box_regression, labels, codes)
    assert torch.allclose(loss["loss"], reference_multibox_loss(cls_logits, box_regression, labels, codes), rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = head.multibox_loss(cls_logits.bfloat16(), box_regression.bfloat16(), labels, codes)
    assert low["loss"].dtype == torch.float32


def reference_assign_targets(head, targets, anchors, size):
    """Per-image, per-box loop version of SSD matching (threshold, then each box forced onto its best
    anchor in order, a later box taking a shared anchor), for comparison."""
    anchor_boxes = box_convert(anchors, "cxcywh", "xyxy")
    all_labels, all_codes = [], []
    for target in targets:
        boxes = target["boxes"].float() / size
        labels = torch.zeros(len(anchors), dtype=torch.long)
        codes = torch.zeros(len(anchors), 4)
        if len(boxes):
            iou = box_iou(boxes, anchor_boxes)
            best_iou, best_gt = iou.max(dim=0)
            match = [int(g) if v >= head.matcher.iou_threshold else -1 for v, g in zip(best_iou, best_gt)]
            for g in range(len(boxes)):
                match[int(iou[g].argmax())] = g
            matched = torch.tensor([max(m, 0) for m in match])
            labels = torch.tensor([int(target["labels"][m]) + 1 if m >= 0 else 0 for m in match])
            codes = head.box_coder.encode(boxes[matched], anchors)
        all_labels.append(labels)
        all_codes.append(codes)
    return torch.stack(all_labels), torch.stack(all_codes)


def test_loss_of_the_demo_recipe_on_a_demo_batch_equals_the_per_image_loops():
    """The demo recipe's network and head on a real training batch of the demo detection data (one
    image without any box added): batched matching and the masked loss give what the loops give, and the
    head's ``loss(outputs, targets, image_size)`` is the two in a row."""
    from backbones import MobileViTv2
    from datamodules.coco import CocoDataModule

    data = CocoDataModule(image_size=64, batch_size=4, num_workers=0)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    targets = batch["targets"] + [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)}]
    images = torch.cat([batch["image"], batch["image"][:1]])
    torch.manual_seed(0)
    backbone = MobileViTv2(width=0.5)
    head = SSDLiteHead(backbone.feature_channels, data.num_classes, output_strides=(8, 16, 32, 64),
                       proj_channels=(128, 128, 128, 64), aspect_ratios=((2, 3), (2, 3), (2, 3), (2,)),
                       min_scale=0.12, max_scale=0.7)
    outputs = head(backbone(images))
    labels, codes = head.assign_targets(targets, outputs.anchors, (64, 64))
    expected_labels, expected_codes = reference_assign_targets(head, targets, outputs.anchors, 64)
    assert torch.equal(labels, expected_labels) and (labels > 0).sum() > len(targets)
    torch.testing.assert_close(codes, expected_codes)
    loss = head.loss(outputs, targets, (64, 64))
    expected = reference_multibox_loss(outputs.cls_logits, outputs.box_regression, expected_labels, expected_codes)
    torch.testing.assert_close(loss["loss"], expected, rtol=1e-6, atol=0)
    loss["loss"].backward()
    assert all(p.grad is not None for p in head.parameters())


# -- post-processing --------------------------------------------------------------------------------
def reference_postprocess(head, cls_logits, box_regression, anchors, size):
    """Per-image, per-class loop, as SSD implementations commonly write it."""
    out = []
    for logits, reg in zip(cls_logits, box_regression):
        scores = logits.softmax(-1)[:, 1:]
        boxes = head.box_coder.decode(reg, anchors).clamp(0, 1) * size
        rows = []
        for c in range(scores.shape[1]):
            s, idx = scores[:, c].topk(min(head.topk_candidates, len(anchors)))
            keep = s > head.score_threshold
            s, idx = s[keep], idx[keep]
            kept = nms(boxes[idx], s, head.nms_threshold)
            rows += [(float(s[k]), c, tuple(boxes[idx[k]].tolist())) for k in kept]
        rows.sort(key=lambda r: -r[0])
        out.append(rows[: head.detections_per_image])
    return out


def test_postprocess_matches_per_class_loop():
    torch.manual_seed(0)
    head = SSDLiteHead(TinyBackbone().feature_channels, num_classes=3, topk_candidates=50, detections_per_image=40)
    sizes = [(4, 4), (2, 2), (1, 1), (1, 1), (1, 1), (1, 1)]
    anchors = head.anchor_generator(sizes)
    cls_logits, box_regression = 3 * torch.randn(2, len(anchors), 4), torch.randn(2, len(anchors), 4)
    got = head.postprocess(SSDLiteOutputs(cls_logits, box_regression, anchors), (64, 64))
    expected = reference_postprocess(head, cls_logits, box_regression, anchors, 64)
    for det, ref in zip(got, expected):
        assert len(det["scores"]) == len(ref) > 0
        assert torch.allclose(det["scores"], torch.tensor([r[0] for r in ref]))
        assert sorted(zip(det["labels"].tolist(), det["scores"].tolist())) == sorted((r[1], r[0]) for r in ref)


def test_select_pads_to_a_fixed_shape_and_ranks_equal_scores_by_candidate_then_class():
    """What the ONNX graph returns: D = detections_per_image rows, padding past num_detections; equal scores
    in the candidates' order (each class's best anchor first, the classes in order), as a stable sort."""
    head = SSDLiteHead(TinyBackbone().feature_channels, num_classes=3, topk_candidates=2, detections_per_image=5,
                       score_threshold=0.1)
    # four far-apart boxes (no suppression); classes 0 and 2 score 0.5 on every anchor, class 1 nowhere
    boxes = torch.tensor([[0.0, 0, 1, 1], [10, 10, 11, 11], [20, 20, 21, 21], [30, 30, 31, 31]]).expand(2, -1, -1)
    scores = torch.tensor([0.5, 0.0, 0.5]).expand(2, 4, -1)
    found = head.select(scores, boxes)
    assert found.boxes.shape == (2, 5, 4) and found.scores.shape == found.labels.shape == (2, 5)
    assert found.num_detections.tolist() == [4, 4]  # 2 candidates x 2 classes
    assert found.labels[0].tolist() == [0, 2, 0, 2, -1]
    assert found.scores[0, :4].eq(0.5).all() and found.scores[0, 4:].eq(0).all() and found.boxes[0, 4:].eq(0).all()
    assert torch.equal(found.boxes[0, 0], found.boxes[0, 1]) and not torch.equal(found.boxes[0, 0], found.boxes[0, 2])
    outputs = SSDLiteOutputs(torch.randn(2, 4, 4), torch.randn(2, 4, 4), torch.rand(4, 4))
    detections = head.postprocess(outputs, (64, 64))
    found = head.select(*head.scores_and_boxes(outputs, (64, 64)))
    for i, det in enumerate(detections):  # postprocess is select, the padding cut off
        n = int(found.num_detections[i])
        assert all(torch.equal(det[k], getattr(found, k)[i, :n]) for k in ("boxes", "scores", "labels"))


def test_postprocess_gives_boxes_in_each_original_image_clipped_to_it():
    """With the original sizes, the same detections as in input pixels, each box scaled by its own image's
    width and height ratios (not swapped, not the input's) and inside that image."""
    torch.manual_seed(0)
    head = SSDLiteHead(TinyBackbone().feature_channels, num_classes=3, topk_candidates=50, detections_per_image=40)
    anchors = head.anchor_generator([(4, 4), (2, 2), (1, 1), (1, 1), (1, 1), (1, 1)])
    # wide codes push many boxes past the image: clipping matters
    outputs = SSDLiteOutputs(3 * torch.randn(2, len(anchors), 4), 4 * torch.randn(2, len(anchors), 4), anchors)
    originals = [(48, 100), (120, 30)]  # (height, width)
    in_input = head.postprocess(outputs, (64, 64))
    in_original = head.postprocess(outputs, (64, 64), originals)
    assert head.postprocess(outputs, (64, 64), torch.tensor(originals))[1]["boxes"].equal(in_original[1]["boxes"])
    for det, ref, (height, width) in zip(in_original, in_input, originals):
        assert len(det["boxes"]) > 0 and det["labels"].equal(ref["labels"]) and det["scores"].equal(ref["scores"])
        scale = torch.tensor([width / 64, height / 64, width / 64, height / 64])
        torch.testing.assert_close(det["boxes"], ref["boxes"] * scale)
        assert det["boxes"].min() >= 0 and (det["boxes"][:, 0::2] <= width).all() and (det["boxes"][:, 1::2] <= height).all()
        assert (det["boxes"][:, 0::2] == width).any() or (det["boxes"][:, 1::2] == height).any()  # some were clipped
    with pytest.raises(ValueError, match="1 original sizes for a batch of 2"):
        head.postprocess(outputs, (64, 64), originals[:1])


# -- the head as a whole ----------------------------------------------------------------------------
@pytest.mark.parametrize("width, paper_millions", [(0.5, 2.0), (0.75, 3.6), (1.75, 14.9)])
def test_parameter_count_matches_mobilevitv2_paper_table(width, paper_millions):
    """SSDLite-MobileViTv2 on COCO (80 classes), MobileViTv2 paper Table 4."""
    from backbones.mobilevitv2 import MobileViTv2

    backbone = MobileViTv2(width=width)
    head = SSDLiteHead(backbone.feature_channels, num_classes=80)
    total = sum(p.numel() for p in backbone.parameters()) + sum(p.numel() for p in head.parameters())
    assert round(total / 1e6, 1) == paper_millions


@pytest.mark.parametrize("size, paper_millions", [("xxs", 1.7), ("xs", 2.7), ("s", 5.7)])
def test_parameter_count_matches_mobilevit_paper_table(size, paper_millions):
    """SSDLite-MobileViT v1 on COCO, MobileViT paper Table 2; the classifier's 1x1 expansion conv
    (``final_conv``) is not part of the detector (CVNets deletes it)."""
    from backbones.mobilevit import MobileViT

    backbone = MobileViT(size=size)
    head = SSDLiteHead(backbone.feature_channels, num_classes=80)
    total = sum(p.numel() for name, p in backbone.named_parameters() if not name.startswith("final_conv"))
    total += sum(p.numel() for p in head.parameters())
    assert abs(total / 1e6 - paper_millions) < 0.06


def test_head_shapes_with_any_backbone_and_clear_error_for_missing_strides():
    backbone = TinyBackbone()
    head = SSDLiteHead(backbone.feature_channels, num_classes=5, proj_channels=(16, 16, 16, 8, 8, 8))
    outputs = head(backbone(torch.randn(2, 3, 128, 128)))
    assert isinstance(outputs, SSDLiteOutputs)
    cls_logits, box_regression, anchors = outputs
    # 128 px: levels 8x8, 4x4, 2x2, 1x1, 1x1 (6 anchors) and global (4 anchors)
    num = 6 * (64 + 16 + 4 + 1 + 1) + 4
    assert cls_logits.shape == (2, num, 6) and box_regression.shape == (2, num, 4) and anchors.shape == (num, 4)
    with pytest.raises(ValueError, match="no stride"):
        SSDLiteHead(TinyBackbone(strides=(32,)).feature_channels, num_classes=5)
    with pytest.raises(ValueError, match="pyramid"):
        SSDLiteHead({8: 16}, num_classes=5, output_strides=(16, 32, 64, 128, 256, -1))


def test_assign_targets_labels_shift_past_background_and_empty_images_are_negative():
    head = SSDLiteHead(TinyBackbone().feature_channels, num_classes=5)
    anchors = head.anchor_generator([(4, 4), (2, 2), (1, 1), (1, 1), (1, 1), (1, 1)])
    targets = [{"boxes": torch.tensor([[0.0, 0.0, 40.0, 40.0]]), "labels": torch.tensor([0])},
               {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)}]
    labels, codes = head.assign_targets(targets, anchors, (64, 64))
    assert set(labels[0].unique().tolist()) == {0, 1}  # class 0 is label 1; 0 is background
    matched = labels[0] > 0
    decoded = head.box_coder.decode(codes[0][matched], anchors[matched]) * 64
    assert torch.allclose(decoded, targets[0]["boxes"].expand_as(decoded), atol=1e-3)
    assert (labels[1] == 0).all()


def test_training_reduces_loss_on_a_tiny_batch():
    torch.manual_seed(0)
    backbone = TinyBackbone()
    head = SSDLiteHead(backbone.feature_channels, num_classes=2, proj_channels=(16, 16, 16, 8, 8, 8))
    images = torch.randn(2, 3, 64, 64)
    targets = [{"boxes": torch.tensor([[4.0, 8.0, 40.0, 50.0]]), "labels": torch.tensor([1])},
               {"boxes": torch.tensor([[20.0, 20.0, 60.0, 60.0], [0.0, 0.0, 20.0, 30.0]]), "labels": torch.tensor([0, 1])}]
    opt = torch.optim.Adam(list(backbone.parameters()) + list(head.parameters()), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = head.loss(head(backbone(images)), targets, (64, 64))["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_a_head_with_the_global_level_exports_and_loads_the_global_name():
    """The global 1x1 level every COCO paper recipe uses goes through torch.export (whose generated code cannot
    name a submodule ``global``), and a state dict naming it ``extra_layers.global`` still loads."""
    head = SSDLiteHead({8: 16, 16: 32, 32: 64}, 3, output_strides=(16, 32, 64, 128, 256, -1)).eval()
    features = (torch.randn(1, 16, 64, 64), torch.randn(1, 32, 32, 32), torch.randn(1, 64, 16, 16))

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = head

        def forward(self, a, b, c):
            outputs = self.head({8: a, 16: b, 32: c})
            return outputs.cls_logits, outputs.box_regression

    exported = torch.export.export(Wrapped(), features).module()
    for got, expected in zip(exported(*features), Wrapped()(*features)):
        torch.testing.assert_close(got, expected)
    named_global = {k.replace("extra_layers.pooled.", "extra_layers.global."): v.clone() + 1
                    for k, v in head.state_dict().items()}
    assert any(".global." in k for k in named_global)
    fresh = SSDLiteHead({8: 16, 16: 32, 32: 64}, 3, output_strides=(16, 32, 64, 128, 256, -1))
    fresh.load_state_dict(named_global)  # strict
    torch.testing.assert_close(fresh.extra_layers["pooled"][1].weight,
                               named_global["extra_layers.global.1.weight"])
