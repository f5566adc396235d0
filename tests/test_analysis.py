"""The pieces behind `test`'s analysis outputs: FLOPs against the paper's table, the k-worst
selection, and the per-sample scores that rank images (detection F1, segmentation mIoU)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from backbones import MobileViTv2
from tasks.outputs.common import WorstExamples, lowest, most_confused, write_confusion_matrix_png
from tasks.engine.cost import count_flops
from tasks.classify import ClassificationTask
from tasks.detect import image_f1
from tasks.segment import image_miou

#: MobileViTv2 paper, ImageNet-1k table at 256 x 256: width -> (params M, "FLOPs" G, which are multiply-adds)
PAPER = {0.5: (1.4, 0.5), 0.75: (2.9, 1.0), 1.0: (4.9, 1.8), 1.25: (7.5, 2.8), 1.5: (10.6, 4.0),
         1.75: (14.3, 5.5), 2.0: (18.5, 7.5)}


@pytest.mark.parametrize("width", sorted(PAPER))
def test_gmacs_of_mobilevitv2_match_the_paper(width):
    # counted on the meta device: shapes only, so the 7.5-GMAC model costs no arithmetic
    model = ClassificationTask(MobileViTv2(width=width), class_names=[str(i) for i in range(1000)]).to("meta")
    gmacs = count_flops(model, torch.zeros(1, 3, 256, 256, device="meta")) / 2e9
    params, paper_gmacs = PAPER[width]
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(params, abs=0.1)
    # the paper rounds to 0.1 G; its counter also counts a few element-wise ops PyTorch's does not (2.0: 7.16 vs 7.5)
    assert gmacs == pytest.approx(paper_gmacs, rel=0.05, abs=0.05)


@pytest.mark.parametrize("size, paper_gmacs", [("tiny", 1.3), ("small", 4.6)])
def test_gmacs_of_vit_count_attention_on_cpu(size, paper_gmacs):
    # on CPU, SDPA runs a kernel PyTorch's counter does not know; without its formula the two
    # attention products went uncounted (ViT-S: 4.25 GMACs); DeiT paper: Ti 1.3, S 4.6
    from backbones import create_backbone

    model = create_backbone("vit", size=size)
    gmacs = count_flops(model, torch.zeros(1, 3, 224, 224)) / 2e9
    assert gmacs == pytest.approx(paper_gmacs, abs=0.05)


def test_training_flops_count_cpu_attention_backward():
    # benchmarks/bench_backbones.py reports training's share of the GEMM rate from this count; the
    # CPU flash kernel's backward recomputes the scores, so it runs 5 products of the forward's 2
    from torch.utils.flop_counter import FlopCounterMode

    from layers.attention import register_cpu_sdpa_flops

    register_cpu_sdpa_flops()
    q, k, v = (torch.randn(2, 3, 50, 16, requires_grad=True) for _ in range(3))
    counter = FlopCounterMode(display=False)
    with counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
    one_product = 2 * 2 * 3 * 50 * 50 * 16
    assert counter.get_total_flops() == (2 + 5) * one_product


def test_flop_count_restores_training_mode():
    model = ClassificationTask(MobileViTv2(width=0.5), class_names=["a", "b"])
    model.train()
    model.head.eval()
    count_flops(model, torch.zeros(1, 3, 64, 64))
    assert model.training and model.backbone.training and not model.head.training


def test_worst_examples_are_the_k_lowest_however_the_split_is_sharded():
    rng = random.Random(0)
    scores = [round(rng.random(), 2) for _ in range(200)]  # rounded: many ties
    expected = sorted((s, i) for i, s in enumerate(scores))[:10]
    for ranks in (1, 2, 3):
        shards = [WorstExamples(10) for _ in range(ranks)]
        payloads = 0
        for i, s in enumerate(scores):
            def payload(i=i):
                nonlocal payloads
                payloads += 1
                return f"image {i}"
            shards[i % ranks].offer(s, i, payload)
        merged = lowest([e for shard in shards for e in shard.entries()], 10)
        assert [(s, key) for s, key, _ in merged] == expected
        assert [p for _, _, p in merged] == [f"image {i}" for _, i in expected]
        assert payloads < 200  # a payload is built only for a sample entering the current k worst
    empty = WorstExamples(0)
    empty.offer(0.0, 1, lambda: pytest.fail("k=0 keeps nothing"))
    assert empty.entries() == []


def boxes(*rows):
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, 4)


def test_image_f1_matches_counts_by_hand():
    gt = boxes([0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 50, 50])
    gt_labels = torch.tensor([1, 1, 2])
    # two right, one on the right box with the wrong class, one duplicate of a matched box: TP 2, FP 2, FN 1
    det = boxes([0, 0, 10, 10], [20, 20, 30, 31], [40, 40, 50, 50], [0, 0, 10, 11])
    det_labels = torch.tensor([1, 1, 1, 1])
    assert image_f1(det, det_labels, gt, gt_labels) == pytest.approx(2 * 2 / (2 * 2 + 2 + 1))
    # a detection on a crowd region counts neither way; the crowd is no object to find
    crowd = torch.tensor([False, False, True])
    det_labels = torch.tensor([1, 1, 2, 1])
    assert image_f1(det, det_labels, gt, gt_labels, crowd) == pytest.approx(2 * 2 / (2 * 2 + 1 + 0))
    assert image_f1(boxes(), torch.zeros(0, dtype=torch.long), boxes(), torch.zeros(0, dtype=torch.long)) == 1.0
    assert image_f1(boxes(), torch.zeros(0, dtype=torch.long), gt, gt_labels) == 0.0
    assert image_f1(det, det_labels, boxes(), torch.zeros(0, dtype=torch.long)) == 0.0
    # below IoU 0.5 (0.25 here) is a miss
    assert image_f1(boxes([0, 0, 5, 10]), torch.tensor([1]), boxes([0, 0, 10, 20]), torch.tensor([1])) == 0.0


def test_image_miou_equals_a_numpy_confusion_matrix():
    rng = np.random.default_rng(0)
    for _ in range(5):
        truth = rng.integers(0, 6, size=(17, 23))
        truth[rng.random(truth.shape) < 0.1] = 255
        pred = np.where(rng.random(truth.shape) < 0.6, truth % 255, rng.integers(0, 6, size=truth.shape))
        keep = truth != 255
        confusion = np.zeros((6, 6), np.int64)
        np.add.at(confusion, (truth[keep], pred[keep]), 1)
        tp, union = np.diag(confusion), confusion.sum(0) + confusion.sum(1) - np.diag(confusion)
        expected = (tp[union > 0] / union[union > 0]).mean()
        assert image_miou(torch.from_numpy(pred), torch.from_numpy(truth), 6, 255) == pytest.approx(expected)


def test_confusion_matrix_picture_shows_the_most_confused_classes_of_many(tmp_path):
    from PIL import Image

    confusion = torch.diag(torch.full((60,), 10))
    confusion[5, 7] = 9
    confusion[40, 2] = 1
    confusion[59, 2] = 2
    assert most_confused(confusion, 3).tolist() == [2, 5, 7]  # errors: 2 -> 3, 5 -> 9, 7 -> 9, 59 -> 2, 40 -> 1
    assert most_confused(confusion, 60).tolist() == list(range(60))
    names = [f"class_{i}" for i in range(60)]
    write_confusion_matrix_png(confusion, names, tmp_path / "cm.png", max_classes=8)
    with Image.open(tmp_path / "cm.png") as image:
        assert image.format == "PNG" and image.width >= 300
