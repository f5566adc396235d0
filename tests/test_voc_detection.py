"""Pascal VOC detection: the VOC mAP metric against an independent computation, and the
VOC-layout datamodule (XML parsing, coordinates, difficult objects, faults named by file and line,
the demo in this layout, the recipes)."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import datamodules.voc_detection as voc
from datamodules.voc_detection import (VOC_DETECTION_CLASSES, VocDetection, VocDetectionDataModule,
                                       write_voc_detection_layout)
from tasks.metrics.voc_map import VocMeanAveragePrecision

MEAN, STD = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "detect"


# -- an independent VOC AP, written the devkit's way (VOCevaldet.m / VOCap.m) ----------------------------------
def reference_voc_ap(images: list[dict], num_classes: int, use_11_points: bool = False,
                     iou_threshold: float = 0.5) -> list[float]:
    """Per class: every detection of the class, sorted by descending score, looked at one by one;
    its best-overlapping ground-truth box of the class in its image decides TP / FP / ignored."""
    aps = []
    for c in range(num_classes):
        truth, n_pos = {}, 0
        for i, im in enumerate(images):
            mine = im["gt_labels"] == c
            truth[i] = {"boxes": im["gt_boxes"][mine], "difficult": im["gt_difficult"][mine],
                        "taken": [False] * int(mine.sum())}
            n_pos += int((~im["gt_difficult"][mine]).sum())
        detections = [(float(s), i, [float(v) for v in b]) for i, im in enumerate(images)
                      for b, s, lab in zip(im["boxes"], im["scores"], im["labels"]) if lab == c]
        detections.sort(key=lambda d: -d[0])
        tp, fp = [], []
        for _, i, box in detections:
            best, best_j = -math.inf, -1
            for j, g in enumerate(truth[i]["boxes"]):
                iw = min(box[2], g[2]) - max(box[0], g[0])
                ih = min(box[3], g[3]) - max(box[1], g[1])
                if iw > 0 and ih > 0:
                    union = (box[2] - box[0]) * (box[3] - box[1]) + (g[2] - g[0]) * (g[3] - g[1]) - iw * ih
                    if iw * ih / union > best:
                        best, best_j = iw * ih / union, j
            if best >= iou_threshold:
                if truth[i]["difficult"][best_j]:
                    tp.append(0), fp.append(0)  # neither
                elif not truth[i]["taken"][best_j]:
                    truth[i]["taken"][best_j] = True
                    tp.append(1), fp.append(0)
                else:
                    tp.append(0), fp.append(1)  # a duplicate
            else:
                tp.append(0), fp.append(1)
        if n_pos == 0:
            aps.append(math.nan)
            continue
        tp, fp = np.cumsum(tp, dtype=float), np.cumsum(fp, dtype=float)
        recall = tp / n_pos
        with np.errstate(invalid="ignore", divide="ignore"):
            precision = tp / (tp + fp)  # 0/0 = nan before the first TP/FP, as in the devkit
        if use_11_points:
            ap = 0.0
            for t in [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]:
                above = precision[recall >= t]
                above = above[~np.isnan(above)]
                ap += (above.max() if above.size else 0.0) / 11
        else:
            mrec = np.concatenate([[0.0], recall, [1.0]])
            mpre = np.concatenate([[0.0], precision, [0.0]])
            for k in range(len(mpre) - 2, -1, -1):
                mpre[k] = np.fmax(mpre[k], mpre[k + 1])  # MATLAB's max ignores NaN
            ap = sum((mrec[k + 1] - mrec[k]) * mpre[k + 1] for k in range(len(mrec) - 1) if mrec[k + 1] != mrec[k])
        aps.append(float(ap))
    return aps


def random_images(seed: int, count: int = 40, num_classes: int = 5) -> list[dict]:
    """Ground truth with difficult flags and detections: jittered copies (some of the wrong class,
    some twice), random false positives, images without detections. Class 3 has only difficult
    boxes (left out of the mean); class 4 has boxes but no detection (AP 0)."""
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(count):
        n = int(rng.integers(0, 6))
        xy = rng.uniform(0, 150, (n, 2))
        gt_boxes = np.concatenate([xy, xy + rng.uniform(8, 60, (n, 2))], axis=1)
        gt_labels = rng.integers(0, num_classes, n)
        gt_difficult = (rng.random(n) < 0.2) | (gt_labels == 3)
        boxes, labels = [], []
        for box, label in zip(gt_boxes, gt_labels):
            for _ in range(int(rng.integers(0, 3))):
                w, h = box[2] - box[0], box[3] - box[1]
                boxes.append(box + rng.normal(0, 0.15, 4) * [w, h, w, h])
                wrong = rng.random() < 0.15
                labels.append(int(rng.integers(0, 4)) if wrong else (int(label) if label != 4 else 0))
        for _ in range(int(rng.integers(0, 4))):
            x, y = rng.uniform(0, 150, 2)
            boxes.append([x, y, x + rng.uniform(5, 50), y + rng.uniform(5, 50)])
            labels.append(int(rng.integers(0, 4)))
        if rng.random() < 0.1:
            boxes, labels = [], []
        images.append({
            "boxes": np.array(boxes, np.float32).reshape(-1, 4), "scores": rng.random(len(boxes)).astype(np.float32),
            "labels": np.array(labels, np.int64), "gt_boxes": gt_boxes.astype(np.float32),
            "gt_labels": gt_labels.astype(np.int64), "gt_difficult": gt_difficult,
        })
    return images


def as_update(images: list[dict]) -> tuple[list[dict], list[dict]]:
    preds = [{"boxes": torch.from_numpy(im["boxes"]), "scores": torch.from_numpy(im["scores"]),
              "labels": torch.from_numpy(im["labels"])} for im in images]
    target = [{"boxes": torch.from_numpy(im["gt_boxes"]), "labels": torch.from_numpy(im["gt_labels"]),
               "difficult": torch.from_numpy(im["gt_difficult"])} for im in images]
    return preds, target


# -- the metric ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_11_points", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_map_equals_an_independent_devkit_computation(seed, use_11_points):
    images = random_images(seed)
    metric = VocMeanAveragePrecision(num_classes=5, use_11_points=use_11_points)
    preds, target = as_update(images)
    for start in range(0, len(images), 7):  # several updates, as batches arrive
        ids = list(range(start, min(start + 7, len(images))))
        metric.update([preds[i] for i in ids], [target[i] for i in ids], ids)
    ours = metric.compute()
    reference = reference_voc_ap(images, 5, use_11_points)
    assert math.isnan(reference[3]) and reference[4] == 0.0  # the designed special classes
    assert all(0 < ap < 0.95 for ap in reference[:3])  # a non-trivial case
    np.testing.assert_allclose(ours["ap_per_class"].numpy(), reference, atol=1e-6, equal_nan=True)
    assert float(ours["map"]) == pytest.approx(np.nanmean(reference), abs=1e-6)
    assert float(ours["map_50"]) == float(ours["map"])


def test_hand_checked_toy_case():
    """Class 0 has two boxes, A (image 0) and B (image 1). Detections by score: 0.9 on A (TP),
    0.8 on nothing (FP), 0.7 on B (TP): precision 1, 1/2, 2/3 at recall 1/2, 1/2, 1. The envelope is
    1 up to recall 1/2 and 2/3 up to 1, so AP = 1/2 x 1 + 1/2 x 2/3 = 5/6. VOC2007's 11 points:
    recall 0, 0.1 .. 0.5 see precision 1 (6 points), 0.6 .. 1.0 see 2/3 (5 points): (6 + 10/3) / 11 = 28/33."""
    t = lambda rows: torch.tensor(rows, dtype=torch.float32)  # noqa: E731
    preds = [{"boxes": t([[0, 0, 10, 10], [50, 50, 60, 60]]), "scores": t([0.9, 0.8]), "labels": torch.tensor([0, 0])},
             {"boxes": t([[20, 20, 40, 30]]), "scores": t([0.7]), "labels": torch.tensor([0])}]
    target = [{"boxes": t([[0, 0, 10, 10]]), "labels": torch.tensor([0])},
              {"boxes": t([[21, 20, 40, 30]]), "labels": torch.tensor([0])}]
    area, eleven = VocMeanAveragePrecision(), VocMeanAveragePrecision(use_11_points=True)
    area.update(preds, target, [0, 1])
    eleven.update(preds, target, [0, 1])
    assert float(area.compute()["map"]) == pytest.approx(5 / 6, abs=1e-6)
    assert float(eleven.compute()["map"]) == pytest.approx(28 / 33, abs=1e-6)


def test_difficult_duplicates_and_classes_without_truth():
    """Class 0 as in the toy case plus a difficult box D in image 1, hit at 0.85 (ignored: neither TP
    nor FP, and D is not counted in recall), and a second hit on A at 0.75 (FP: A is taken). In score
    order: TP, -, FP, FP, TP: precision 1, 1/2, 1/3, 2/4 at recall 1/2, 1/2, 1/2, 1, so AP = 1/2 x 1 +
    1/2 x 1/2 = 3/4. Class 1 has a detection but no box, class 2 only a difficult box: both are nan
    and left out of the mean, which is 3/4."""
    t = lambda rows: torch.tensor(rows, dtype=torch.float32)  # noqa: E731
    preds = [{"boxes": t([[0, 0, 10, 10], [50, 50, 60, 60], [1, 0, 10, 10], [5, 5, 9, 9]]),
              "scores": t([0.9, 0.8, 0.75, 0.6]), "labels": torch.tensor([0, 0, 0, 1])},
             {"boxes": t([[20, 20, 40, 30], [60, 60, 80, 80], [60, 60, 80, 80]]), "scores": t([0.7, 0.85, 0.5]),
              "labels": torch.tensor([0, 0, 2])}]
    target = [{"boxes": t([[0, 0, 10, 10]]), "labels": torch.tensor([0]), "difficult": torch.tensor([False])},
              {"boxes": t([[21, 20, 40, 30], [60, 60, 80, 80], [60, 60, 80, 80]]), "labels": torch.tensor([0, 0, 2]),
               "difficult": torch.tensor([False, True, True])}]
    metric = VocMeanAveragePrecision(num_classes=3)
    metric.update(preds, target, [0, 1])
    values = metric.compute()
    ap = values["ap_per_class"].tolist()
    assert ap[0] == pytest.approx(0.75, abs=1e-6) and math.isnan(ap[1]) and math.isnan(ap[2])
    assert float(values["map"]) == pytest.approx(0.75, abs=1e-6)
    # without the difficult flag D is a box to find: 0.85 is then a TP and recall counts 3 boxes
    plain = VocMeanAveragePrecision(num_classes=3)
    plain.update(preds, [{k: v for k, v in g.items() if k != "difficult"} for g in target], [0, 1])
    images = [{"boxes": p["boxes"].numpy(), "scores": p["scores"].numpy(), "labels": p["labels"].numpy(),
               "gt_boxes": g["boxes"].numpy(), "gt_labels": g["labels"].numpy(),
               "gt_difficult": np.zeros(len(g["labels"]), bool)} for p, g in zip(preds, target)]
    assert plain.compute()["ap_per_class"].tolist()[0] == pytest.approx(reference_voc_ap(images, 3)[0], abs=1e-6)


def test_images_scored_twice_count_once_and_order_does_not_matter():
    images = random_images(5)
    preds, target = as_update(images)
    ids = list(range(len(images)))
    once, twice, shuffled = (VocMeanAveragePrecision(num_classes=5) for _ in range(3))
    once.update(preds, target, ids)
    padded = ids + ids[:5]  # what a padding DistributedSampler adds
    twice.update([preds[i] for i in padded], [target[i] for i in padded], padded)
    order = np.random.default_rng(0).permutation(len(ids)).tolist()
    shuffled.update([preds[i] for i in order], [target[i] for i in order], order)
    a, b, c = once.compute(), twice.compute(), shuffled.compute()
    for key in ("map", "ap_per_class"):
        assert torch.equal(a[key].nan_to_num(-7), b[key].nan_to_num(-7))
        assert torch.equal(a[key].nan_to_num(-7), c[key].nan_to_num(-7))


def test_metric_edge_cases():
    metric = VocMeanAveragePrecision()
    empty = {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.long)}
    metric.update([empty], [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)}], [0])
    assert float(metric.compute()["map"]) == -1.0  # no ground truth at all, as torchmetrics' COCO mAP says
    metric = VocMeanAveragePrecision(num_classes=2)
    metric.update([empty], [{"boxes": torch.tensor([[0.0, 0, 5, 5]]), "labels": torch.tensor([1])}], [0])
    assert metric.compute()["ap_per_class"].tolist()[1] == 0.0  # boxes, no detections: AP 0
    with pytest.raises(ValueError, match="labels must lie in 0..1"):
        metric.update([{**empty, "boxes": torch.zeros(1, 4), "scores": torch.ones(1), "labels": torch.tensor([2])}],
                      [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)}], [1])
        metric.compute()
    with pytest.raises(ValueError, match="2 predictions, 2 targets and 1 image ids"):
        metric.update([empty, empty], [empty, empty], [0])


def _ddp_worker(rank: int, world_size: int, port: int, images, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    preds, target = as_update(images)
    ids = list(range(len(images)))
    mine = ids[rank::world_size]
    if rank == 1:
        mine = mine + ids[:1]  # padding repeats an image of rank 0; and ranks hold different counts
    metric = VocMeanAveragePrecision(num_classes=5)
    metric.update([preds[i] for i in mine], [target[i] for i in mine], mine)
    values = metric.compute()
    if rank == 0:
        queue.put(values["ap_per_class"].nan_to_num(-7).tolist())
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_map_equals_single_process():
    import torch.multiprocessing as mp

    images = random_images(3)
    single = VocMeanAveragePrecision(num_classes=5)
    single.update(*as_update(images), list(range(len(images))))
    expected = single.compute()["ap_per_class"].nan_to_num(-7).tolist()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = 29500 + (os.getpid() + 17) % 1000
    mp.start_processes(_ddp_worker, args=(2, port, images, queue), nprocs=2, start_method="spawn")
    assert queue.get() == expected


# -- a VOC layout written by hand --------------------------------------------------------------------------------
def xml_text(width: int, height: int, objects: list[tuple]) -> str:
    """``objects``: ``(name, xmin, ymin, xmax, ymax, difficult)``, written as VOC's own files are."""
    parts = [f"<annotation>\n\t<folder>VOC2007</folder>\n\t<size>\n\t\t<width>{width}</width>\n"
             f"\t\t<height>{height}</height>\n\t\t<depth>3</depth>\n\t</size>\n"]
    for name, xmin, ymin, xmax, ymax, difficult in objects:
        parts.append(f"\t<object>\n\t\t<name>{name}</name>\n\t\t<pose>Left</pose>\n\t\t<truncated>0</truncated>\n"
                     f"\t\t<difficult>{difficult}</difficult>\n\t\t<bndbox>\n\t\t\t<xmin>{xmin}</xmin>\n"
                     f"\t\t\t<ymin>{ymin}</ymin>\n\t\t\t<xmax>{xmax}</xmax>\n\t\t\t<ymax>{ymax}</ymax>\n"
                     "\t\t</bndbox>\n\t</object>\n")
    return "".join(parts) + "</annotation>\n"


#: stem -> (width, height, objects)
SMALL_SET = {
    "000005": (40, 30, [("dog", 1, 1, 10, 8, 0), ("cat", 5, 6, 5, 6, 1)]),
    "000007": (40, 30, [("person", "12.5", 3, "30.0", 20, 0)]),
    "000009": (32, 24, []),
    "000012": (40, 30, [("dog", 20, 10, 40, 30, 0), ("bird", 2, 2, 6, 9, 1)]),
}


def write_voc(root: Path, images: dict = SMALL_SET, lists: dict | None = None) -> Path:
    for folder in ("Annotations", "JPEGImages", "ImageSets/Main"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for k, (stem, (width, height, objects)) in enumerate(images.items()):
        Image.new("RGB", (width, height), (30 * k, 100, 200)).save(root / "JPEGImages" / f"{stem}.jpg")
        (root / "Annotations" / f"{stem}.xml").write_text(xml_text(width, height, objects))
    stems = list(images)
    lists = lists or {"trainval": stems, "test": stems[1:3]}
    for split, names in lists.items():
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(names) + "\n")
    return root


def label(name: str) -> int:
    return VOC_DETECTION_CLASSES.index(name)


def test_xml_is_parsed_and_coordinates_converted(tmp_path):
    root = write_voc(tmp_path / "VOC2007")
    dm = VocDetectionDataModule(root=str(root), image_size=32, mean=MEAN, std=STD)
    assert dm.num_classes == 20 and dm.category_ids == list(range(1, 21)) and dm.category_names[11] == "dog"
    assert dm.evaluation_metric == "voc" and dm.test_split == "test"
    dataset = dm.split("trainval")
    assert dataset.image_ids == [0, 1, 2, 3] and [e.stem for e in dataset.images] == list(SMALL_SET)
    first = dataset.targets[0]
    # 1-based inclusive -> continuous 0-based edges: x1 = xmin - 1, x2 = xmax; a one-pixel box stays one pixel
    assert first["gt_boxes"].tolist() == [[0, 0, 10, 8], [4, 5, 5, 6]]
    assert first["gt_labels"].tolist() == [label("dog"), label("cat")]
    assert first["gt_difficult"].tolist() == [False, True] and first["gt_iscrowd"].tolist() == [0, 0]
    assert first["gt_area"].tolist() == [80.0, 1.0]
    assert first["boxes"].tolist() == [[0, 0, 10, 8]]  # difficult objects stay out of training
    assert dataset.targets[1]["gt_boxes"].tolist() == [[11.5, 2, 30, 20]]  # float coordinates are read as such
    assert dataset.targets[2]["gt_boxes"].shape == (0, 4) and dataset.targets[2]["boxes"].shape == (0, 4)

    image, target = dataset[0]
    assert image.shape == (3, 32, 32) and target["image_id"] == 0 and target["orig_size"] == (30, 40)
    assert target["path"] == str(root / "JPEGImages" / "000005.jpg")
    assert torch.allclose(target["boxes"], torch.tensor([[0, 0, 10 * 32 / 40, 8 * 32 / 30]]))
    assert target["gt_difficult"].dtype == torch.bool
    with_difficult = VocDetection(root, "trainval", dataset.transform, VOC_DETECTION_CLASSES,
                                  use_difficult_in_training=True)
    assert with_difficult.targets[0]["boxes"].tolist() == [[0, 0, 10, 8], [4, 5, 5, 6]]


def test_batches_follow_the_detection_contract(tmp_path):
    root = write_voc(tmp_path / "VOC2007")
    dm = VocDetectionDataModule(root=str(root), image_size=32, batch_size=2, eval_batch_size=3, num_workers=0,
                                mean=MEAN, std=STD)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"image", "targets", "skipped"} and batch["skipped"] == 0
    assert batch["image"].shape == (2, 3, 32, 32)
    keys = {"boxes", "labels", "image_id", "path", "orig_size", "gt_boxes", "gt_labels", "gt_iscrowd", "gt_area",
            "gt_difficult"}
    assert all(set(t) == keys for t in batch["targets"])
    val = list(dm.val_dataloader())  # val_split = test: VOC2007 practice
    assert [t["image_id"] for b in val for t in b["targets"]] == [0, 1]
    assert [t["path"] for b in val for t in b["targets"]] == [str(root / "JPEGImages" / f"{s}.jpg")
                                                              for s in ("000007", "000009")]
    dm.setup("predict")  # no predict_path: the test split's images
    batch = next(iter(dm.predict_dataloader()))
    assert set(batch) == {"image", "path", "orig_size", "skipped"}
    assert batch["orig_size"].tolist() == [[30, 40], [24, 32]]


def test_class_names_from_root_or_argument(tmp_path):
    images = {"a": (20, 20, [("seven", 1, 1, 5, 5, 0)])}
    root = write_voc(tmp_path / "digits", images, {"trainval": ["a"], "test": ["a"]})
    (root / "class_names.txt").write_text("background\nsix\nseven\n")  # the segmentation layout's file works too
    dm = VocDetectionDataModule(root=str(root))
    assert dm.class_names == ["six", "seven"] and dm.category_ids == [1, 2]
    assert dm.split("trainval").targets[0]["gt_labels"].tolist() == [1]
    assert VocDetectionDataModule(root=str(root), class_names=["seven"]).num_classes == 1
    with pytest.raises(ValueError, match="distinct"):
        VocDetectionDataModule(class_names=["a", "a"])


def test_several_split_lists_concatenate(tmp_path):
    """VOC07+12: ``train_split=[trainval, ../VOC2012/trainval]`` with ``root`` the VOC2007 folder."""
    voc07 = write_voc(tmp_path / "VOCdevkit" / "VOC2007")
    write_voc(tmp_path / "VOCdevkit" / "VOC2012", {"2008_000001": (40, 30, [("boat", 3, 3, 20, 20, 0)])},
              {"trainval": ["2008_000001"]})
    dm = VocDetectionDataModule(root=str(voc07), train_split=["trainval", "../VOC2012/trainval"], image_size=32)
    dataset = dm.split(dm.hparams.train_split, train=True)
    assert dataset.image_ids == [0, 1, 2, 3, 4]
    assert dataset.image_path(4).resolve() == (voc07.parent / "VOC2012" / "JPEGImages" / "2008_000001.jpg").resolve()
    assert dataset.targets[4]["gt_labels"].tolist() == [label("boat")]
    with pytest.raises(ValueError, match="already listed"):
        VocDetection(voc07, ["trainval", "test"], dataset.transform, VOC_DETECTION_CLASSES)


BAD_XML = [
    ("<annotation>\n  <size><width>40</width><height>30</height></size>\n  <object>\n    <name>dog</name>\n"
     "</annotation>\n", r"000007\.xml: not well-formed XML at line 5, column 2"),
    ("", r"000007\.xml: not well-formed XML at line 1"),
    (xml_text(40, 30, [("dog", 1, 1, 5, 5, 0)]).replace("<name>dog</name>", ""), r"000007\.xml: object 1 of 1 has no <name>"),
    (xml_text(40, 30, [("dog", 1, 1, 5, 5, 0), ("cat", 1, 1, 5, 5, 0)]).replace(
        "<bndbox>\n\t\t\t<xmin>1</xmin>\n\t\t\t<ymin>1</ymin>\n\t\t\t<xmax>5</xmax>\n\t\t\t<ymax>5</ymax>\n\t\t</bndbox>",
        "", 1), r"000007\.xml: object 1 of 2 \('dog'\) has no <bndbox>"),
    (xml_text(40, 30, [("dog", 1, 1, 5, 5, 0), ("dragon", 1, 1, 5, 5, 0)]),
     r"000007\.xml: object 2 of 2 is named 'dragon', which is not one of the 20 classes"),
    (xml_text(40, 30, [("dog", "abc", 1, 5, 5, 0)]), r"000007\.xml: object 1 of 1 \('dog'\) <xmin> is 'abc', not a number"),
    (xml_text(40, 30, [("dog", 7, 1, 5, 5, 0)]), r"000007\.xml: object 1 of 1 \('dog'\) has xmax 5 < xmin 7"),
    (xml_text(40, 30, [("dog", 1, 1, 5, 5, "yes")]), r"000007\.xml: object 1 of 1 \('dog'\) has <difficult> 'yes'"),
    (xml_text(40, 30, [("dog", 1, 1, 5, 5, 0), ("cat", 2, 9, 6, 3, 0)]),
     r"000007\.xml: object 2 of 2 \('cat'\) has ymax 3 < ymin 9"),
]


@pytest.mark.parametrize("content, message", BAD_XML, ids=["malformed", "empty", "no-name", "no-bndbox",
                                                           "unknown-class", "not-a-number", "inverted", "difficult",
                                                           "inverted-y"])
def test_bad_xml_is_named_by_file_and_line_or_object(tmp_path, content, message):
    root = write_voc(tmp_path / "VOC2007")
    (root / "Annotations" / "000007.xml").write_text(content)
    with pytest.raises(ValueError, match=message):
        VocDetectionDataModule(root=str(root)).split("trainval")


def test_exif_rotated_photo_is_read_upright_and_a_stored_frame_size_is_named(tmp_path):
    """A phone's portrait photo: stored 40 wide and 30 high with EXIF orientation 6 (viewed 30 x 40)."""
    root = write_voc(tmp_path / "VOC2007", {"000005": (30, 40, [("dog", 1, 1, 10, 20, 0)])},
                     {"trainval": ["000005"], "test": ["000005"]})
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (40, 30), (200, 100, 30)).save(root / "JPEGImages" / "000005.jpg", exif=exif)
    dm = VocDetectionDataModule(root=str(root), image_size=32, mean=MEAN, std=STD)
    image, target = dm.split("test")[0]
    assert target["orig_size"] == (40, 30)  # (height, width) upright, as the XML (annotated upright) says
    # an XML written by a tool that ignored the tag has the stored size: the error says it is the orientation
    (root / "Annotations" / "000005.xml").write_text(xml_text(40, 30, [("dog", 1, 1, 10, 20, 0)]))
    with pytest.raises(ValueError, match=r"000005\.jpg is 30x40 .*/000005\.xml says 40x30: the file carries EXIF "
                                         r"orientation 6"):
        dm.split("test")[0]


@pytest.mark.parametrize("missing", ["Annotations/000009.xml", "JPEGImages/000009.jpg"])
def test_missing_files_are_named_by_list_file_and_line(tmp_path, missing):
    root = write_voc(tmp_path / "VOC2007")
    (root / missing).unlink()
    list_file = root / "ImageSets" / "Main" / "trainval.txt"
    with pytest.raises(FileNotFoundError, match=rf"{list_file} line 3 names '000009', but {root / missing} does not"):
        VocDetectionDataModule(root=str(root)).split("trainval")
    with pytest.raises(FileNotFoundError, match=r"split list .*val\.txt not found"):
        VocDetectionDataModule(root=str(root)).split("val")
    (root / "ImageSets" / "Main" / "twice.txt").write_text("000005\n\n000005\n")
    with pytest.raises(ValueError, match=r"twice\.txt line 3 lists '000005' again \(first at line 1\)"):
        VocDetectionDataModule(root=str(root)).split("twice")


def test_image_size_must_match_the_xml(tmp_path):
    root = write_voc(tmp_path / "VOC2007")
    Image.new("RGB", (20, 20)).save(root / "JPEGImages" / "000005.jpg")
    dataset = VocDetectionDataModule(root=str(root), image_size=32).split("trainval")
    with pytest.raises(ValueError, match=r"000005\.jpg is 20x20 .* but .*000005\.xml says 40x30"):
        dataset[0]


def test_predict_path_does_not_touch_root(tmp_path, monkeypatch):
    def no_demo(*args, **kwargs):
        raise AssertionError("predict with predict_path built or read the demo dataset")

    monkeypatch.setattr(voc, "demo_root", no_demo)
    monkeypatch.setattr(voc, "parse_voc_xml", no_demo)
    Image.new("RGB", (24, 18)).save(tmp_path / "x.jpg")
    dm = VocDetectionDataModule(predict_path=str(tmp_path), image_size=32, num_workers=0)
    dm.setup("predict")
    batch = next(iter(dm.predict_dataloader()))
    assert batch["image"].shape == (1, 3, 32, 32) and batch["orig_size"].tolist() == [[18, 24]]


# -- the demo in the VOC layout -------------------------------------------------------------------------------
def test_demo_layout_matches_the_coco_demo_and_marks_difficult_objects(tmp_path):
    from datamodules.coco import CocoDetection, eval_transform
    from datamodules.demo_scenes import write_coco_layout

    counts = {"train": 30, "val": 8}
    root = write_voc_detection_layout(tmp_path / "voc", counts, size=96, crowd_every=6, empty_every=5)
    write_coco_layout(tmp_path / "coco", counts, size=96, crowd_every=6, empty_every=5)
    lists = root / "ImageSets" / "Main"
    assert (lists / "trainval.txt").read_text().split() == (lists / "train.txt").read_text().split() + \
        (lists / "val.txt").read_text().split()
    dm = VocDetectionDataModule(root=str(root), train_split="train", image_size=96, mean=MEAN, std=STD)
    assert dm.category_names[0] == "zero" and dm.num_classes == 10
    ours = dm.split("train")
    coco = CocoDetection(tmp_path / "coco" / "train2017", tmp_path / "coco" / "annotations" / "instances_train2017.json",
                         eval_transform(96, MEAN, STD))
    assert len(ours) == len(coco) == 30
    crowds = 0
    for k in range(len(coco)):  # the same scenes, boxes and classes, read from both formats
        theirs, mine = coco.annotation(k), ours.targets[k]
        assert np.array_equal(mine["gt_boxes"], theirs["gt_boxes"])
        assert np.array_equal(mine["gt_labels"], theirs["gt_labels"])
        assert np.all(mine["gt_difficult"][theirs["gt_iscrowd"] == 1])  # crowd clusters are difficult
        crowds += int(theirs["gt_iscrowd"].sum())
        assert np.array_equal(ours[k][0], coco[k][0])  # same pixels
    difficult = np.concatenate([t["gt_difficult"] for t in ours.targets])
    assert crowds > 0 and crowds < difficult.sum() < 0.3 * len(difficult)  # and some small digits


def test_without_root_the_demo_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SUITE_DATA_CACHE", str(tmp_path / "cache"))  # private: other tests keep the full demo
    monkeypatch.setattr(voc, "DEMO_SPLITS", {"train": 6, "val": 3, "test": 3})
    dm = VocDetectionDataModule(train_split="train", val_split="val", test_split="test", image_size=64,
                                num_workers=0, batch_size=2, mean=MEAN, std=STD)
    assert dm.num_classes == 10 and dm.root.parent == tmp_path / "cache"
    dm.setup("test")
    images = [t["image_id"] for b in dm.test_dataloader() for t in b["targets"]]
    assert images == [0, 1, 2]
    # the demo's ground truth scored against itself: every class with a box has AP 1
    metric = VocMeanAveragePrecision(num_classes=10)
    for batch in dm.test_dataloader():
        preds = [{"boxes": t["gt_boxes"], "scores": torch.ones(len(t["gt_boxes"])), "labels": t["gt_labels"]}
                 for t in batch["targets"]]
        target = [{"boxes": t["gt_boxes"], "labels": t["gt_labels"], "difficult": t["gt_difficult"]}
                  for t in batch["targets"]]
        metric.update(preds, target, [t["image_id"] for t in batch["targets"]])
    assert float(metric.compute()["map"]) == 1.0


# -- recipes --------------------------------------------------------------------------------------------------
def test_recipes_name_the_voc_datamodule_and_the_demo_copies_the_detection_demo():
    demo = yaml.safe_load((CONFIGS / "demo_voc_ssdlite_mobilevitv2.yaml").read_text())
    coco_demo = yaml.safe_load((CONFIGS / "demo_ssdlite_mobilevitv2.yaml").read_text())
    full = yaml.safe_load((CONFIGS / "voc_ssdlite_mobilevitv2_100.yaml").read_text())
    coco_full = yaml.safe_load((CONFIGS / "coco_ssdlite_mobilevitv2_100.yaml").read_text())
    for recipe in (demo, full):
        assert recipe["data"]["class_path"] == "datamodules.voc_detection.VocDetectionDataModule"
        VocDetectionDataModule(**recipe["data"]["init_args"])  # every argument exists (nothing is read here)
    # the VOC demo is the detection demo with another datamodule: it overrides nothing else
    assert demo["base"] == "demo_ssdlite_mobilevitv2.yaml" and set(demo) == {"base", "data"}
    splits = {"train_split": "train", "val_split": "val", "test_split": "test"}
    assert demo["data"]["init_args"] == {**coco_demo["data"], **splits}
    assert full["model"] == coco_full["model"] and full["data"]["init_args"]["image_size"] == 320
    assert full["base"] is None
    assert full["data"]["init_args"]["train_split"] == ["trainval", "../VOC2012/trainval"]


# -- the same CLI, end to end -----------------------------------------------------------------------------------
@pytest.mark.slow  # long CLI run; the default run must stay under 10 minutes on 2 cores
def test_voc_fit_test_predict_with_the_detection_cli(tmp_path):
    """fit, test and predict on a small VOC-layout copy of the demo scenes through `python -m tasks.detect`
    with the VOC demo recipe; test's mAP equals the independent devkit computation on the very
    detections it wrote (detections.json) against the XML ground truth."""
    import json

    from tests.conftest import run_task

    root = write_voc_detection_layout(tmp_path / "VOC", counts={"train": 24, "val": 8, "test": 12}, size=96)
    recipe = str(CONFIGS / "demo_voc_ssdlite_mobilevitv2.yaml")
    common = ["--config", recipe, "--data.root", str(root), "--data.image_size", "64", "--data.batch_size", "4",
              "--data.eval_batch_size", "4", "--data.num_workers", "0", "--trainer.logger", "false",
              "--trainer.enable_progress_bar", "false", "--trainer.num_sanity_val_steps", "0"]
    run_task("detect", "fit", *common, "--model.head.init_args.proj_channels", "[16, 16, 16, 8]",
             "--model.head.init_args.score_threshold", "0.0", "--trainer.max_epochs", "1",
             "--trainer.limit_train_batches", "3", cwd=tmp_path)
    ckpt = tmp_path / "runs" / "detect" / "checkpoints" / "last.ckpt"
    run_task("detect", "test", *common, "--ckpt_path", str(ckpt), cwd=tmp_path)
    out = tmp_path / "runs" / "detect" / "predictions"
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) >= {"test/map", "test/map_50", "test/loss"}

    # rescore detections.json with the devkit-style reference, ground truth from the XML files
    data = VocDetectionDataModule(root=str(root), **{"image_size": 64, "mean": MEAN, "std": STD})
    data.setup("test")
    dataset, detections = data.test_set, json.loads((out / "detections.json").read_text())
    assert {d["image_id"] for d in detections} <= set(range(len(dataset)))
    images = []
    for image_id in range(len(dataset)):
        gt = dataset[image_id][1]
        mine = [d for d in detections if d["image_id"] == image_id]
        boxes = np.array([[x, y, x + w, y + h] for x, y, w, h in (d["bbox"] for d in mine)], np.float64).reshape(-1, 4)
        images.append({"gt_boxes": np.asarray(gt["gt_boxes"], np.float64), "gt_labels": np.asarray(gt["gt_labels"]),
                       "gt_difficult": np.asarray(gt["gt_difficult"], bool), "boxes": boxes,
                       "scores": np.array([d["score"] for d in mine]),
                       "labels": np.array([data.category_ids.index(d["category_id"]) for d in mine], np.int64)})
    reference = float(np.nanmean(reference_voc_ap(images, data.num_classes)))
    assert metrics["test/map"] == pytest.approx(reference, abs=1e-6)

    folder = tmp_path / "unlabelled"
    folder.mkdir()
    for image in sorted((root / "JPEGImages").glob("*.jpg"))[:2]:
        (folder / image.name).write_bytes(image.read_bytes())
    proc = run_task("detect", "predict", "--ckpt_path", str(ckpt), "--data.predict_path", str(folder),
                    "--trainer.logger", "false", cwd=tmp_path)
    assert "predictions:" in proc.stderr
    assert sorted(p.stem for p in (out / "predict").glob("*.json")) == sorted(p.stem for p in folder.iterdir())
