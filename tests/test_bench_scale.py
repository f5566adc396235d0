"""benchmarks/bench_scale.py at a tiny fraction: the synthetic datasets have the real layouts and are
readable by the tools that read the real ones, and one measured start reports its numbers."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_scale  # noqa: E402

FRACTION = 0.0002


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bench_scale")
    for fmt in ("imagenet", "coco", "wmt"):
        bench_scale.ensure_dataset(root, fmt, FRACTION)
    return root


def test_imagenet_layout(data_root):
    from torchvision.datasets import ImageFolder

    root = bench_scale.dataset_root(data_root, "imagenet", FRACTION)
    train, val = ImageFolder(str(root / "train")), ImageFolder(str(root / "val"))
    assert len(train.classes) == len(val.classes) == 1000 and train.classes == val.classes
    assert len(train) == 1000 and len(val) == 1000  # at least one image per class folder
    assert train.samples[0][0].endswith(".JPEG") and Image.open(train.samples[0][0]).size == (64, 64)


def test_coco_layout(data_root):
    from pycocotools import mask
    from pycocotools.coco import COCO

    root = bench_scale.dataset_root(data_root, "coco", FRACTION)
    coco = COCO(str(root / "annotations" / "instances_train2017.json"))
    assert sorted(coco.cats) == [c[0] for c in bench_scale.COCO_CATEGORIES] and len(coco.cats) == 80
    assert max(coco.cats) == 90 and coco.cats[90]["name"] == "toothbrush"
    assert len(coco.imgs) == round(bench_scale.COCO_TRAIN_IMAGES * FRACTION)
    for ann in coco.anns.values():
        info = coco.imgs[ann["image_id"]]
        x, y, w, h = ann["bbox"]
        assert 0 <= x and x + w <= info["width"] and 0 <= y and y + h <= info["height"]
        if ann["iscrowd"]:  # uncompressed RLE covering the box
            assert ann["segmentation"]["size"] == [info["height"], info["width"]]
            assert mask.area(mask.frPyObjects(ann["segmentation"], info["height"], info["width"])) == ann["area"]
        else:
            assert len(ann["segmentation"][0]) == 48
    image = next(iter(coco.imgs.values()))
    assert Image.open(root / "train2017" / image["file_name"]).size == (image["width"], image["height"])
    assert (root / "annotations" / "instances_val2017.json").is_file()


def test_wmt_layout(data_root):
    root = bench_scale.dataset_root(data_root, "wmt", FRACTION)
    for split, lines in (("train", round(bench_scale.WMT_TRAIN_PAIRS * FRACTION)), ("valid", 3000), ("test", 3000)):
        en = (root / f"{split}.en").read_text().splitlines()
        de = (root / f"{split}.de").read_text().splitlines()
        assert len(en) == len(de) == lines
    words = [len(line.split()) for line in en]
    assert 20 < np.mean(words) < 32 and all(n >= 1 for n in words)
    assert en[:10] != de[:10] and any(c in "".join(de) for c in "äöüß")


@pytest.mark.slow  # a fresh process importing torch and Lightning: 10-30 s on the 2-core machine
def test_one_measured_start(data_root, tmp_path):
    root = bench_scale.dataset_root(data_root, "coco", FRACTION)
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    [row] = bench_scale.run_starts(ROOT, "coco", root, prepared, ranks=1, env_extra={}, timeout=300)
    assert row["malloc_setting_applied"] is True and row["first_batch_cpu_s"] > 0
    assert row["peak_rss_mb"] >= row["base_rss_mb"] and row["setup_wall_s"] <= row["first_batch_wall_s"]
    assert row["linked"].startswith("[80, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13,")  # linked before setup
    row.update(start="first", ranks=1, code=str(ROOT), fraction=FRACTION, system_malloc=False)
    assert "| coco | suite | 1 | first |" in bench_scale.markdown_table([row])
