"""`python -m tasks.detect` end to end on a tiny COCO-layout set: fit, test, predict."""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest


from datamodules.demo_scenes import coco_category_id, write_coco_layout
from tests.conftest import run_task

REPO = Path(__file__).resolve().parents[1]
TINY = ["--data.image_size", "64", "--data.batch_size", "4", "--data.eval_batch_size", "4", "--data.num_workers", "0",
        "--model.head.init_args.proj_channels", "[16, 16, 16, 8]", "--trainer.accelerator", "cpu"]


def run_cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    return run_task("detect", *args, cwd=REPO, env={"SUITE_DATA_CACHE": str(cache)})


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A tiny COCO layout (non-contiguous category ids, a crowd, an empty image) and a 2-step fit on it."""
    base = tmp_path_factory.mktemp("detect-cli")
    data = write_coco_layout(base / "coco", {"train": 8, "val": 6}, size=64, crowd_every=3, empty_every=4)
    run_dir = base / "run"
    run_cli("fit", "--data.root", str(data), "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
            "--trainer.default_root_dir", str(run_dir), *TINY, cache=base / "cache")
    return data, run_dir, base / "cache"


def test_fit_checkpoints_and_logs_map(fitted):
    _, run_dir, _ = fitted
    assert list(run_dir.rglob("last.ckpt"))
    assert list(run_dir.rglob("best-*.ckpt"))  # ModelCheckpoint found val/map to monitor


def test_test_writes_coco_results_and_metrics(fitted):
    from pycocotools.coco import COCO

    data, run_dir, cache = fitted
    ckpt = next(run_dir.rglob("last.ckpt"))
    run_cli("test", "--data.root", str(data), "--ckpt_path", str(ckpt), "--trainer.default_root_dir", str(run_dir),
            *TINY, cache=cache)
    predictions = run_dir / "predictions"
    metrics = json.loads((predictions / "metrics.json").read_text())
    assert {"test/map", "test/map_50", "test/map_75", "test/map_small", "test/mar_100"} <= set(metrics)
    detections = json.loads((predictions / "detections.json").read_text())
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(data / "annotations" / "instances_val2017.json"))
        coco.loadRes(detections)  # valid results: known image ids, [x, y, w, h]
    assert {d["category_id"] for d in detections} <= {coco_category_id(k) for k in range(10)}
    for d in detections:  # original-image pixels (the scenes are 64 px; the model saw 64 px too)
        x, y, w, h = d["bbox"]
        assert 0 <= x and 0 <= y and x + w <= 64.001 and y + h <= 64.001 and 0 < d["score"] <= 1


def test_predict_writes_one_json_per_image_and_drawings(fitted, tmp_path):
    data, run_dir, cache = fitted
    ckpt = next(run_dir.rglob("last.ckpt"))
    folder = tmp_path / "images"
    folder.mkdir()
    for image in sorted((data / "val2017").iterdir())[:3]:
        (folder / image.name).write_bytes(image.read_bytes())
    out_dir = tmp_path / "predict-run"
    run_cli("predict", "--data.root", str(data), "--data.predict_path", str(folder), "--ckpt_path", str(ckpt),
            "--model.draw_predictions", "true", "--model.display_score_threshold", "0.0",
            "--trainer.default_root_dir", str(out_dir), *TINY, cache=cache)
    written = out_dir / "predictions" / "predict"
    rows = [json.loads(p.read_text()) for p in sorted(written.glob("*.json"))]
    assert [Path(r["image"]).name for r in rows] == sorted(p.name for p in folder.iterdir())
    assert all(r["height"] == r["width"] == 64 for r in rows)
    assert all(d["category_name"] in ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
               for r in rows for d in r["detections"])
    assert len(list(written.glob("*.jpg"))) == 3


def test_no_config_means_the_demo_recipe(tmp_path):
    proc = run_cli("fit", "--print_config", cache=tmp_path)
    assert "root: null" in proc.stdout and "backbones.MobileViTv2" in proc.stdout  # the embedded demo set
