"""COCO mAP: our torchmetrics/faster_coco_eval metric equals pycocotools' COCOeval, and counts
every image once however the images were spread over ranks."""
from __future__ import annotations

import contextlib
import io
import os

import numpy as np
import pytest
import torch

from datamodules.coco import CocoDetection, eval_transform
from datamodules.demo_scenes import write_coco_layout
from tasks.detect import MAP_KEYS, CocoMeanAveragePrecision


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
    for image_id in dataset.image_ids:
        gt = dataset.targets[image_id]
        boxes, labels = [], []
        for box, label in zip(gt["boxes"], gt["labels"]):
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
    gt = dataset.targets[image_id]
    return {"boxes": torch.from_numpy(gt["gt_boxes"]), "labels": torch.from_numpy(gt["gt_labels"]),
            "iscrowd": torch.from_numpy(gt["gt_iscrowd"]), "area": torch.from_numpy(gt["gt_area"])}


def pycocotools_stats(dataset: CocoDetection, detections: dict[int, dict]) -> np.ndarray:
    from pycocotools.cocoeval import COCOeval

    results = []
    for image_id, det in detections.items():
        for box, score, label in zip(det["boxes"].tolist(), det["scores"].tolist(), det["labels"].tolist()):
            results.append({"image_id": image_id, "category_id": dataset.category_ids[label],
                            "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]], "score": score})
    with contextlib.redirect_stdout(io.StringIO()):
        evaluator = COCOeval(dataset.coco, dataset.coco.loadRes(results), "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return evaluator.stats


def test_map_equals_pycocotools_cocoeval(val_set):
    detections = synthetic_detections(val_set)
    metric = CocoMeanAveragePrecision()
    ids = val_set.image_ids
    for start in range(0, len(ids), 7):  # several updates, as batches arrive
        chunk = ids[start:start + 7]
        metric.update([detections[i] for i in chunk], [ground_truth(val_set, i) for i in chunk], chunk)
    ours = metric.compute()
    reference = pycocotools_stats(val_set, detections)
    # COCOeval.stats order: AP, AP50, AP75, AP S/M/L, AR@1, AR@10, AR@100, AR S/M/L == MAP_KEYS
    assert 0.1 < reference[0] < 0.9  # a non-trivial case
    for key, value in zip(MAP_KEYS, reference):
        assert float(ours[key]) == pytest.approx(value, abs=1e-6), key


def test_images_scored_twice_count_once(val_set):
    detections = synthetic_detections(val_set, seed=1)
    ids = val_set.image_ids
    once, twice = CocoMeanAveragePrecision(), CocoMeanAveragePrecision()
    once.update([detections[i] for i in ids], [ground_truth(val_set, i) for i in ids], ids)
    padded = ids + ids[:5]  # what a padding DistributedSampler adds
    twice.update([detections[i] for i in padded], [ground_truth(val_set, i) for i in padded], padded)
    a, b = once.compute(), twice.compute()
    assert all(float(a[k]) == float(b[k]) for k in MAP_KEYS)


def _ddp_worker(rank: int, world_size: int, port: int, dataset, detections, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    ids = dataset.image_ids
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
