"""tasks.metrics.miou against a plain numpy confusion matrix, and the DDP guarantee that every evaluation
image is counted exactly once.

The oracle is mmsegmentation's definition: one confusion matrix summed over the whole dataset (and over
ranks), ignore-label pixels left out; IoU_c = TP / (TP + FP + FN) per class, and mIoU the mean over the
classes present in the truth or the predictions (a class absent from both has NaN IoU and is left out),
not a mean of per-image scores."""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tasks.metrics.miou import MeanIoU, confusion_counts, confusion_scores, image_miou
from tests.test_host_sync import SyncLog

IGNORE = 255


def numpy_confusion(pairs: list[tuple[np.ndarray, np.ndarray]], num_classes: int) -> np.ndarray:
    confmat = np.zeros((num_classes, num_classes), np.int64)
    for pred, true in pairs:
        keep = true != IGNORE
        np.add.at(confmat, (true[keep], pred[keep]), 1)
    return confmat


def numpy_scores(pairs: list[tuple[np.ndarray, np.ndarray]], num_classes: int) -> dict:
    """Reference: one confusion matrix over all images, ignore pixels dropped, IoU = TP / (TP + FP + FN),
    mIoU over classes present in truth or prediction, pixel accuracy = TP / labelled pixels."""
    confmat = numpy_confusion(pairs, num_classes)
    tp = np.diag(confmat)
    union = confmat.sum(0) + confmat.sum(1) - tp
    present = union > 0
    iou = np.full(num_classes, np.nan)
    iou[present] = tp[present] / union[present]
    truth = confmat.sum(1)
    class_acc = np.full(num_classes, np.nan)
    class_acc[truth > 0] = tp[truth > 0] / truth[truth > 0]
    return {"confmat": confmat, "iou": iou, "miou": iou[present].mean(), "pixel_acc": tp.sum() / confmat.sum(),
            "class_acc": class_acc, "macc": class_acc[truth > 0].mean(), "present": present}


def area_miou(pairs: list[tuple[np.ndarray, np.ndarray]], num_classes: int) -> float:
    """mmsegmentation's form of the same number: per-class areas of intersection, prediction and truth
    summed over the images, IoU = intersection / union, nanmean over classes."""
    inter, pred_area, true_area = (np.zeros(num_classes) for _ in range(3))
    for pred, true in pairs:
        keep = true != IGNORE
        pred, true = pred[keep], true[keep]
        inter += np.bincount(pred[pred == true], minlength=num_classes)
        pred_area += np.bincount(pred, minlength=num_classes)
        true_area += np.bincount(true, minlength=num_classes)
    with np.errstate(invalid="ignore"):
        return float(np.nanmean(inter / (pred_area + true_area - inter)))


def area_macc(pairs: list[tuple[np.ndarray, np.ndarray]], num_classes: int) -> float:
    """mmsegmentation's mAcc: per-class correct pixels over truth pixels summed over the images, nanmean over
    classes (a class without truth pixels is 0 / 0 and left out)."""
    inter, true_area = np.zeros(num_classes), np.zeros(num_classes)
    for pred, true in pairs:
        keep = true != IGNORE
        pred, true = pred[keep], true[keep]
        inter += np.bincount(pred[pred == true], minlength=num_classes)
        true_area += np.bincount(true, minlength=num_classes)
    with np.errstate(invalid="ignore"):
        return float(np.nanmean(inter / true_area))


def random_pairs(rng: np.random.Generator, num_classes: int, count: int, size: tuple[int, int] | None = None
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Images of different sizes (or all ``size``); classes 3 and 7 never appear in truth or prediction,
    class 5 only in predictions (a false-positive-only class: IoU 0, counted), ~20 % of the truth ignored."""
    used = [c for c in range(num_classes) if c not in (3, 5, 7)]
    pairs = []
    for _ in range(count):
        h, w = size or rng.integers(5, 40, size=2)
        true = rng.choice(used, size=(h, w))
        pred = np.where(rng.random((h, w)) < 0.6, true, rng.choice(used + [5], size=(h, w)))
        true[rng.random((h, w)) < 0.2] = IGNORE
        pairs.append((pred, true))
    return pairs


def test_metric_equals_numpy_confusion_matrix():
    rng = np.random.default_rng(0)
    num_classes = 9
    pairs = random_pairs(rng, num_classes, count=12)
    metric = MeanIoU(num_classes, ignore_index=IGNORE)
    for pred, true in pairs:
        metric.update(torch.from_numpy(pred)[None], torch.from_numpy(true)[None])
    ours = metric.compute()
    ref = numpy_scores(pairs, num_classes)

    np.testing.assert_array_equal(ours["confmat"].numpy(), ref["confmat"])
    assert ours["present"].tolist() == ref["present"].tolist()
    assert not ref["present"][3] and not ref["present"][7] and ref["present"][5]
    np.testing.assert_allclose(ours["iou"].numpy(), ref["iou"], rtol=0, atol=1e-12, equal_nan=True)
    assert ours["iou"][5] == 0
    assert float(ours["miou"]) == pytest.approx(ref["miou"], abs=1e-12)
    assert float(ours["miou"]) == pytest.approx(area_miou(pairs, num_classes), abs=1e-12)
    assert float(ours["pixel_acc"]) == pytest.approx(ref["pixel_acc"], abs=1e-12)
    np.testing.assert_allclose(ours["class_acc"].numpy(), ref["class_acc"], rtol=0, atol=1e-12, equal_nan=True)
    assert torch.isnan(ours["class_acc"][5]) and ref["present"][5]  # predicted only: an IoU of 0, no accuracy
    assert float(ours["macc"]) == pytest.approx(ref["macc"], abs=1e-12)
    assert float(ours["macc"]) == pytest.approx(area_macc(pairs, num_classes), abs=1e-12)
    # dataset-wide, not a mean of per-image scores
    per_image = np.mean([image_miou(torch.from_numpy(p), torch.from_numpy(t), num_classes, IGNORE) for p, t in pairs])
    assert per_image == pytest.approx(np.mean([numpy_scores([p], num_classes)["miou"] for p in pairs]), abs=1e-12)
    assert abs(per_image - float(ours["miou"])) > 1e-4


def test_batches_and_label_dtypes_do_not_change_the_counts():
    """A batch of N images equals N single updates; uint8 masks (as read from PNGs) count like int64."""
    rng = np.random.default_rng(2)
    pairs = random_pairs(rng, 9, count=6, size=(11, 13))
    single = MeanIoU(9)
    for pred, true in pairs:
        single.update(torch.from_numpy(pred)[None], torch.from_numpy(true)[None])
    batched = MeanIoU(9)
    preds, truths = (torch.from_numpy(np.stack(arrays)) for arrays in zip(*pairs))
    batched.update(preds, truths.to(torch.uint8))
    assert torch.equal(single.compute()["confmat"], batched.compute()["confmat"])


def test_counting_has_no_host_sync():
    """Evaluation on a GPU stays queued: no op whose output size or value the host must read."""
    pred, true = random_pairs(np.random.default_rng(3), 9, count=1)[0]
    metric = MeanIoU(9, validate_args=False)
    pred, true = torch.from_numpy(pred)[None], torch.from_numpy(true)[None]
    with SyncLog() as log:
        metric.update(pred, true)
    assert log.found == []
    assert torch.equal(metric.confmat, torch.from_numpy(numpy_confusion([(pred[0].numpy(), true[0].numpy())], 9)))


def test_confusion_scores_edge_cases():
    # nothing evaluated: NaN, not a silent 0 or 1
    empty = confusion_scores(torch.zeros(3, 3, dtype=torch.long))
    assert torch.isnan(empty["miou"]) and torch.isnan(empty["pixel_acc"]) and torch.isnan(empty["macc"])
    # perfect on the classes present
    perfect = confusion_scores(torch.diag(torch.tensor([4, 0, 6])))
    assert float(perfect["miou"]) == 1.0 and perfect["present"].tolist() == [True, False, True]


def test_ignore_only_images_do_not_count():
    metric = MeanIoU(4)
    metric.update(torch.zeros(1, 3, 3, dtype=torch.long), torch.full((1, 3, 3), IGNORE))
    assert int(metric.compute()["confmat"].sum()) == 0
    assert int(confusion_counts(torch.zeros(3, 3), torch.full((3, 3), IGNORE), 4).sum()) == 0
    assert np.isnan(image_miou(torch.zeros(3, 3), torch.full((3, 3), IGNORE), 4))


def test_labels_outside_the_classes_are_named():
    metric = MeanIoU(4)
    true = torch.tensor([[0, 1], [6, IGNORE]])
    with pytest.raises(ValueError, match=r"4 classes 0\.\.3 .*truth \[6\]"):
        metric.update(torch.zeros(1, 2, 2, dtype=torch.long), true[None])
    with pytest.raises(ValueError, match=r"prediction \[4\]"):
        metric.update(torch.full((1, 2, 2), 4), torch.zeros(1, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(1, 2, 2\) and target \(1, 3, 3\)"):
        metric.update(torch.zeros(1, 2, 2), torch.zeros(1, 3, 3))
    assert int(metric.confmat.sum()) == 0  # a refused update counts nothing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_scores(rank: int, world: int, port: int, pairs, num_classes: int, out) -> None:
    from datamodules.loaders import eval_sampler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sampler = eval_sampler(pairs)  # what the segmentation datamodule uses for val/test
        metric = MeanIoU(num_classes)
        seen = []
        for index in sampler:
            pred, true = pairs[index]
            metric.update(torch.from_numpy(pred)[None], torch.from_numpy(true)[None])
            seen.append(index)
        scores = metric.compute()  # sums the confusion matrix over ranks
        out[rank] = {"seen": seen, "confmat": scores["confmat"].tolist(), "miou": float(scores["miou"]),
                     "pixel_acc": float(scores["pixel_acc"])}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_count_every_image_once():
    """7 images on 2 ranks: DistributedSampler would repeat one; the eval sampler must not."""
    rng = np.random.default_rng(1)
    num_classes = 9
    pairs = random_pairs(rng, num_classes, count=7)
    ref = numpy_scores(pairs, num_classes)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_scores, args=(2, _free_port(), pairs, num_classes, out), nprocs=2, join=True)
        results = dict(out)
    assert sorted(results[0]["seen"] + results[1]["seen"]) == list(range(7))
    for rank in (0, 1):
        assert results[rank]["confmat"] == ref["confmat"].tolist()
        assert results[rank]["miou"] == pytest.approx(ref["miou"], abs=1e-12)
        assert results[rank]["pixel_acc"] == pytest.approx(ref["pixel_acc"], abs=1e-12)


def test_the_classification_confusion_matrix_is_numpys_and_holds_only_the_matrix_in_deterministic_mode():
    """ImageNet's 1,000 classes, a batch of 128, under torch.use_deterministic_algorithms: the counts equal
    numpy's, and the update allocates about the matrix (8 MB), where torchmetrics' deterministic path
    builds a 128 x 1,000,000 comparison mesh."""
    from torch.profiler import ProfilerActivity, profile

    from tasks.metrics.miou import ConfusionMatrix

    generator = torch.Generator().manual_seed(0)
    preds = torch.randint(0, 1000, (128,), generator=generator)
    target = torch.randint(0, 1000, (128,), generator=generator)
    expected = np.zeros((1000, 1000), dtype=np.int64)
    np.add.at(expected, (target.numpy(), preds.numpy()), 1)
    metric = ConfusionMatrix(1000)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            metric.update(preds, target)
    finally:
        torch.use_deterministic_algorithms(previous)
    allocated = sum(event.self_cpu_memory_usage for event in prof.key_averages() if event.self_cpu_memory_usage > 0)
    assert allocated < 3 * 1000 * 1000 * 8, allocated  # the (K * K + 1) counter and its view, not a mesh
    np.testing.assert_array_equal(metric.compute().numpy(), expected)
