"""COCO mAP: our metric (faster_coco_eval fed from flat arrays) equals pycocotools' COCOeval, its
12 stats and its per-category precision / recall arrays, and counts every image once however the
images were spread over ranks."""
from __future__ import annotations

import contextlib
import io
import os

import numpy as np
import pytest
import torch

from datamodules.coco import CocoDetection, eval_transform, load_coco
from datamodules.demo_scenes import write_coco_layout
from tasks.metrics.coco_map import MAP_KEYS, CocoMeanAveragePrecision, coco_per_class


@pytest.fixture(scope="module")
def val_set(tmp_path_factory) -> CocoDetection:
    root = tmp_path_factory.mktemp("coco-metric")
    write_coco_layout(root, {"val": 40}, size=96, crowd_every=6, empty_every=8)
    return CocoDetection(root / "val2017", root / "annotations" / "instances_val2017.json",
                         eval_transform(96, (0, 0, 0), (1, 1, 1)))


def synthetic_detections(dataset: CocoDetection, seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    """Per image: jittered copies of the ground truth (crowds included), some with the wrong class,
    plus random false positives; a few images get nothing."""
    rng = np.random.default_rng(seed)
    out = {}
    for index, image_id in enumerate(dataset.image_ids.tolist()):
        gt = dataset.annotation(index)
        boxes, labels = [], []
        for box, label in zip(gt["gt_boxes"], gt["gt_labels"]):
            for _ in range(rng.integers(0, 3)):
                w, h = box[2] - box[0], box[3] - box[1]
                boxes.append(box + rng.normal(0, 0.12, 4) * [w, h, w, h])
                labels.append(label if rng.random() < 0.8 else rng.integers(10))
        for _ in range(rng.integers(0, 4)):
            x, y = rng.uniform(0, 80, 2)
            boxes.append([x, y, x + rng.uniform(4, 40), y + rng.uniform(4, 40)])
            labels.append(rng.integers(10))
        if rng.random() < 0.1:
            boxes, labels = [], []
        out[image_id] = {"boxes": torch.tensor(np.array(boxes, np.float32).reshape(-1, 4)),
                         "scores": torch.tensor(rng.uniform(0.01, 1, len(boxes)), dtype=torch.float32),
                         "labels": torch.tensor(np.array(labels, np.int64))}
    return out


def ground_truth(dataset: CocoDetection, image_id: int) -> dict[str, torch.Tensor]:
    gt = dataset.annotation(dataset.image_ids.tolist().index(image_id))
    return {"boxes": torch.from_numpy(gt["gt_boxes"]), "labels": torch.from_numpy(gt["gt_labels"]),
            "iscrowd": torch.from_numpy(gt["gt_iscrowd"]), "area": torch.from_numpy(gt["gt_area"])}


def pycocotools_stats(dataset: CocoDetection, detections: dict[int, dict]) -> np.ndarray:
    from pycocotools.cocoeval import COCOeval

    results = []
    for image_id, det in detections.items():
        for box, score, label in zip(det["boxes"].tolist(), det["scores"].tolist(), det["labels"].tolist()):
            results.append({"image_id": image_id, "category_id": dataset.category_ids[label],
                            "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]], "score": score})
    coco = load_coco(dataset.annotation_file)  # the reference reads the file itself
    with contextlib.redirect_stdout(io.StringIO()):
        evaluator = COCOeval(coco, coco.loadRes(results), "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return evaluator.stats


def test_map_equals_pycocotools_cocoeval(val_set):
    detections = synthetic_detections(val_set)
    metric = CocoMeanAveragePrecision()
    ids = val_set.image_ids.tolist()
    for start in range(0, len(ids), 7):  # several updates, as batches arrive
        chunk = ids[start:start + 7]
        metric.update([detections[i] for i in chunk], [ground_truth(val_set, i) for i in chunk], chunk)
    ours = metric.compute()
    reference = pycocotools_stats(val_set, detections)
    # COCOeval.stats order: AP, AP50, AP75, AP S/M/L, AR@1, AR@10, AR@100, AR S/M/L == MAP_KEYS
    assert 0.1 < reference[0] < 0.9  # a non-trivial case
    for key, value in zip(MAP_KEYS, reference):
        assert float(ours[key]) == pytest.approx(value, abs=1e-6), key


CATEGORY_IDS = [3, 7, 11, 20, 31, 40]  # label 4 is only ever detected, label 5 never appears


def random_case(seed: int, num_images: int = 30):
    """Images of 200x200 with 0-5 objects of labels 0-3 (some crowds, every 7th image empty), detected
    as jittered copies (some with the wrong label, some images with no detection at all) plus
    spurious boxes of labels 0-4, all in float32 -> ``(coco, results, preds, targets, image_ids)``:
    pycocotools' ground truth and results list, and the metric's per-image tensors."""
    from pycocotools.coco import COCO

    rng = np.random.default_rng(seed)
    images, annotations, results, preds, targets = [], [], [], [], []
    image_ids = [1000 + 7 * k for k in range(num_images)]  # not 0..N-1, not contiguous
    for index, image_id in enumerate(image_ids):
        n = int(rng.integers(0, 6)) if index % 7 else 0
        xy = rng.uniform(0, 150, (n, 2))
        gt = torch.tensor(np.concatenate([xy, xy + rng.uniform(4, 150, (n, 2))], 1), dtype=torch.float32)
        labels = torch.tensor(rng.integers(0, 4, n))
        crowd = torch.tensor(rng.random(n) < 0.15, dtype=torch.long)
        area = ((gt[:, 2] - gt[:, 0]) * (gt[:, 3] - gt[:, 1]) * torch.tensor(rng.uniform(0.5, 1, n))).float()
        boxes, det_labels = [], []
        for box, label in zip(gt.numpy(), labels.tolist()):
            for _ in range(rng.integers(0, 3)):
                w, h = box[2] - box[0], box[3] - box[1]
                boxes.append(box + rng.normal(0, 0.1, 4) * [w, h, w, h])
                det_labels.append(label if rng.random() < 0.8 else int(rng.integers(0, 5)))
        for _ in range(rng.integers(0, 4)):
            x, y = rng.uniform(0, 150, 2)
            boxes.append([x, y, x + rng.uniform(4, 50), y + rng.uniform(4, 50)])
            det_labels.append(int(rng.integers(0, 5)))
        if rng.random() < 0.1:
            boxes, det_labels = [], []
        det = torch.tensor(np.array(boxes).reshape(-1, 4), dtype=torch.float32)
        scores = torch.tensor(rng.uniform(0.01, 1, len(det)), dtype=torch.float32)
        preds.append({"boxes": det, "scores": scores, "labels": torch.tensor(det_labels, dtype=torch.long)})
        targets.append({"boxes": gt, "labels": labels, "iscrowd": crowd, "area": area})
        images.append({"id": image_id, "width": 200, "height": 200})
        for box, label, c, a in zip(gt.tolist(), labels.tolist(), crowd.tolist(), area.tolist()):
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": CATEGORY_IDS[label],
                                "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]], "area": a, "iscrowd": c})
        for box, label, score in zip(det.tolist(), det_labels, scores.tolist()):
            results.append({"image_id": image_id, "category_id": CATEGORY_IDS[label], "score": score,
                            "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]]})
    coco = COCO()
    coco.dataset = {"images": images, "annotations": annotations,
                    "categories": [{"id": c, "name": str(c)} for c in CATEGORY_IDS]}
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco, results, preds, targets, image_ids


def pycocotools_eval(coco, results):
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        evaluator = COCOeval(coco, coco.loadRes(results) if results else coco.loadRes([]), "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return evaluator


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stats_and_per_class_arrays_equal_pycocotools(seed):
    coco, results, preds, targets, image_ids = random_case(seed)
    metric = CocoMeanAveragePrecision(extended_summary=True)
    order = np.random.default_rng(seed).permutation(len(image_ids))  # batches in any order
    for chunk in np.array_split(order, 4):
        metric.update([preds[k] for k in chunk], [targets[k] for k in chunk], [image_ids[k] for k in chunk])
    ours = metric.compute()
    reference = pycocotools_eval(coco, results)

    assert 0.1 < reference.stats[0] < 0.9  # a non-trivial case
    for key, value in zip(MAP_KEYS, reference.stats):
        assert float(ours[key]) == pytest.approx(value, abs=1e-6), key
    # per category: ours holds the labels seen (0-4), pycocotools every category of the file
    assert ours["classes"].tolist() == [0, 1, 2, 3, 4]
    for k, label in enumerate(ours["classes"].tolist()):
        j = reference.params.catIds.index(CATEGORY_IDS[label])
        np.testing.assert_allclose(ours["precision"][:, :, k].numpy(), reference.eval["precision"][:, :, j],
                                   rtol=0, atol=1e-12)
        np.testing.assert_allclose(ours["recall"][:, k].numpy(), reference.eval["recall"][:, j], rtol=0, atol=1e-12)
    assert (reference.eval["precision"][:, :, 5] == -1).all() and (ours["precision"][:, :, 4] == -1).all()
    # per_class.csv's numbers: COCOeval's summarize restricted to one category
    per_class = coco_per_class(ours, metric)
    for label in range(4):
        reference.params.catIds = [CATEGORY_IDS[label]]
        with contextlib.redirect_stdout(io.StringIO()):
            reference.evaluate()
            reference.accumulate()
            reference.summarize()
        assert per_class[label]["ap"] == pytest.approx(reference.stats[0], abs=1e-12)
        assert per_class[label]["ar100"] == pytest.approx(reference.stats[8], abs=1e-12)


def test_without_objects_or_images_every_stat_is_minus_one():
    coco, results, preds, targets, image_ids = random_case(3, num_images=8)
    no_objects = [{**t, **{k: t[k][:0] for k in ("boxes", "labels", "iscrowd", "area")}} for t in targets]
    coco.dataset["annotations"] = []
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    reference = pycocotools_eval(coco, results)
    assert list(reference.stats) == [-1.0] * 12

    detections_only = CocoMeanAveragePrecision()
    detections_only.update(preds, no_objects, image_ids)
    nothing = CocoMeanAveragePrecision()
    nothing.update([{k: v[:0] for k, v in p.items()} for p in preds], no_objects, image_ids)
    for metric in (detections_only, nothing):
        values = metric.compute()
        assert [float(values[k]) for k in MAP_KEYS] == [-1.0] * 12
    never_updated = CocoMeanAveragePrecision(extended_summary=True)
    with pytest.warns(UserWarning, match="called before the ``update`` method"):  # torchmetrics' warning
        values = never_updated.compute()
    assert [float(values[k]) for k in MAP_KEYS] == [-1.0] * 12
    assert coco_per_class(values, never_updated) == {}  # per_class.csv: -1 everywhere


def test_bad_input_names_the_image():
    metric = CocoMeanAveragePrecision()
    good = {"boxes": torch.zeros(2, 4), "scores": torch.ones(2), "labels": torch.zeros(2, dtype=torch.long)}
    truth = {"boxes": torch.zeros(1, 4), "labels": torch.zeros(1, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"image 42: preds boxes has shape \(2, 5\), expected \(N, 4\)"):
        metric.update([good, {**good, "boxes": torch.zeros(2, 5)}], [truth, truth], [41, 42])
    with pytest.raises(ValueError, match=r"image 41: target labels has shape \(2,\), expected \(1,\)"):
        metric.update([good], [{**truth, "labels": torch.zeros(2, dtype=torch.long)}], [41])
    with pytest.raises(ValueError, match="2 predictions, 2 targets and 1 image ids"):
        metric.update([good, good], [truth, truth], [41])


def test_images_scored_twice_count_once(val_set):
    detections = synthetic_detections(val_set, seed=1)
    ids = val_set.image_ids.tolist()
    once, twice = CocoMeanAveragePrecision(), CocoMeanAveragePrecision()
    once.update([detections[i] for i in ids], [ground_truth(val_set, i) for i in ids], ids)
    padded = ids + ids[:5]  # what a padding DistributedSampler adds
    twice.update([detections[i] for i in padded], [ground_truth(val_set, i) for i in padded], padded)
    a, b = once.compute(), twice.compute()
    assert all(float(a[k]) == float(b[k]) for k in MAP_KEYS)


def _ddp_worker(rank: int, world_size: int, port: int, dataset, detections, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    ids = [int(i) for i in dataset.image_ids]  # a list: `+` below appends
    mine = ids[rank::world_size]
    if rank == 1:
        mine = mine + ids[:1]  # padding repeats an image of rank 0; and ranks hold different counts
    metric = CocoMeanAveragePrecision()
    metric.update([detections[i] for i in mine], [ground_truth(dataset, i) for i in mine], mine)
    values = metric.compute()
    if rank == 0:
        queue.put({k: float(values[k]) for k in MAP_KEYS})
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_map_equals_single_process(val_set):
    import torch.multiprocessing as mp

    detections = synthetic_detections(val_set, seed=2)
    single = CocoMeanAveragePrecision()
    single.update([detections[i] for i in val_set.image_ids],
                  [ground_truth(val_set, i) for i in val_set.image_ids], val_set.image_ids)
    expected = {k: float(v) for k, v in single.compute().items() if k in MAP_KEYS}
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = 29500 + os.getpid() % 1000
    mp.start_processes(_ddp_worker, args=(2, port, val_set, detections, queue), nprocs=2, start_method="spawn")
    assert queue.get() == expected
