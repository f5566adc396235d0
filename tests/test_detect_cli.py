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
    check_per_class(predictions, data / "annotations" / "instances_val2017.json", detections, metrics)
    check_worst(predictions, coco, detections)


def check_worst(predictions: Path, coco, detections: list[dict], threshold: float = 0.3) -> None:
    """worst.csv lists every test image (6 < 16), lowest F1 first, each F1 recomputed here with numpy
    from detections.json (score >= 0.3) and the annotation file; each image is drawn."""
    import csv

    import numpy as np

    def f1(image_id: int) -> float:
        dets = sorted((d for d in detections if d["image_id"] == image_id and d["score"] >= threshold),
                      key=lambda d: -d["score"])
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[image_id]))
        used = [False] * len(anns)
        true_pos = false_pos = 0
        for d in dets:
            ious = [iou_xywh(d["bbox"], a["bbox"]) if a["category_id"] == d["category_id"] else 0.0 for a in anns]
            free = [i if not used[k] and not anns[k]["iscrowd"] else 0.0 for k, i in enumerate(ious)]
            if free and max(free) >= 0.5:
                used[int(np.argmax(free))] = True
                true_pos += 1
            elif not any(i >= 0.5 for k, i in enumerate(ious) if anns[k]["iscrowd"]):
                false_pos += 1
        objects = sum(not a["iscrowd"] for a in anns)
        missed = objects - true_pos
        return 2 * true_pos / (2 * true_pos + false_pos + missed) if true_pos + false_pos + missed else 1.0

    def iou_xywh(a, b):
        ax2, ay2, bx2, by2 = a[0] + a[2], a[1] + a[3], b[0] + b[2], b[1] + b[3]
        inter = max(0.0, min(ax2, bx2) - max(a[0], b[0])) * max(0.0, min(ay2, by2) - max(a[1], b[1]))
        return inter / (a[2] * a[3] + b[2] * b[3] - inter)

    with open(predictions / "worst" / "worst.csv") as f:
        worst = list(csv.DictReader(f))
    ids = {Path(img["file_name"]).name: img["id"] for img in coco.loadImgs(coco.getImgIds())}
    assert sorted(Path(r["image"]).name for r in worst) == sorted(ids)
    expected = {name: f1(image_id) for name, image_id in ids.items()}
    assert [float(r["f1"]) for r in worst] == sorted(expected.values())
    for r in worst:
        assert float(r["f1"]) == pytest.approx(expected[Path(r["image"]).name])
        assert (predictions / "worst" / r["file"]).stat().st_size > 0


def check_per_class(predictions: Path, annotations: Path, detections: list[dict], metrics: dict) -> None:
    """per_class.csv holds pycocotools' own COCOeval numbers per category, run here on the annotation
    file and the written detections.json: precision / recall sliced as COCOeval.summarize does."""
    import csv

    import numpy as np
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(annotations))
        evaluation = COCOeval(coco, coco.loadRes(detections), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
    precision, recall = evaluation.eval["precision"], evaluation.eval["recall"]
    iou = evaluation.params.iouThrs

    def mean(array):
        kept = array[array > -1]
        return float(kept.mean()) if kept.size else -1.0

    with open(predictions / "per_class.csv") as f:
        rows = list(csv.DictReader(f))
    cats = coco.loadCats(evaluation.params.catIds)
    assert [(int(r["category_id"]), r["name"]) for r in rows] == [(c["id"], c["name"]) for c in cats]
    for k, r in enumerate(rows):
        p = precision[:, :, k, 0, -1]
        expected = {"ap": mean(p), "ap50": mean(p[np.isclose(iou, 0.5)]), "ap75": mean(p[np.isclose(iou, 0.75)]),
                    "ar100": mean(recall[:, k, 0, -1])}
        for key, value in expected.items():
            assert float(r[key]) == pytest.approx(value, abs=1e-6), (r, key, value)
    scored = [float(r["ap"]) for r in rows if float(r["ap"]) > -1]
    assert np.mean(scored) == pytest.approx(metrics["test/map"], abs=1e-6)  # the headline is their mean


def test_predict_writes_one_json_per_image_and_drawings(fitted, tmp_path):
    from PIL import Image

    data, run_dir, cache = fitted
    ckpt = next(run_dir.rglob("last.ckpt"))
    folder = tmp_path / "images"
    folder.mkdir()
    for image in sorted((data / "val2017").iterdir())[:3]:
        (folder / image.name).write_bytes(image.read_bytes())
    # one stem, two files: two outputs; and a phone photo stored 64 x 48 with EXIF orientation 6 (viewed 48 x 64)
    first = sorted(folder.iterdir())[0]
    Image.open(first).save(folder / "photo.jpg")
    Image.open(first).save(folder / "photo.png")
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.open(first).resize((64, 48)).save(folder / "portrait.jpg", exif=exif)
    out_dir = tmp_path / "predict-run"
    run_cli("predict", "--data.root", str(data), "--data.predict_path", str(folder), "--ckpt_path", str(ckpt),
            "--model.draw_predictions", "true", "--model.display_score_threshold", "0.0",
            "--trainer.default_root_dir", str(out_dir), *TINY, cache=cache)
    written = out_dir / "predictions" / "predict"
    by_name = {p.name: json.loads(p.read_text()) for p in written.glob("*.json")}
    assert sorted(by_name) == sorted([f"{Path(p.name).stem}.json" for p in folder.iterdir() if p.stem != "photo"]
                                     + ["photo.jpg.json", "photo.png.json"])
    rows = list(by_name.values())
    assert sorted(Path(r["image"]).name for r in rows) == sorted(p.name for p in folder.iterdir())
    assert by_name["photo.png.json"]["image"] == str(folder / "photo.png")
    portrait = by_name.pop("portrait.json")
    assert (portrait["width"], portrait["height"]) == (48, 64)  # upright, as viewers show it
    assert all(x + w <= 48.001 and y + h <= 64.001 for x, y, w, h in (d["bbox"] for d in portrait["detections"]))
    assert all(r["height"] == r["width"] == 64 for r in by_name.values())
    assert all(d["category_name"] in ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
               for r in rows for d in r["detections"])
    assert len(list(written.glob("*.jpg"))) == 6
    assert Image.open(written / "portrait.jpg").size == (48, 64)


def test_no_config_means_the_demo_recipe(tmp_path):
    proc = run_cli("fit", "--print_config", cache=tmp_path)
    assert "root: null" in proc.stdout and "backbones.MobileViTv2" in proc.stdout  # the embedded demo set


def test_per_class_coco_numbers_equal_pycocotools_on_a_nontrivial_set(tmp_path):
    """coco_per_class (what per_class.csv holds) against pycocotools' COCOeval on the same boxes, on
    jittered and spurious detections that give APs strictly between 0 and 1."""
    import numpy as np
    import torch
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from tasks.metrics.coco_map import CocoMeanAveragePrecision, coco_per_class

    rng = np.random.default_rng(0)
    category_ids = [3, 7, 11, 20]  # label 3 has neither ground truth nor detections
    metric = CocoMeanAveragePrecision(extended_summary=True)
    images, annotations, results = [], [], []
    for image_id in range(1, 13):
        n = int(rng.integers(0, 5))
        xy = rng.uniform(0, 60, (n, 2))
        gt = torch.tensor(np.concatenate([xy, xy + rng.uniform(8, 40, (n, 2))], 1), dtype=torch.float32)
        gt_labels = torch.tensor(rng.integers(0, 3, n))
        jitter = torch.tensor(rng.normal(0, 3, (n, 4)), dtype=torch.float32)
        spurious_xy = rng.uniform(0, 60, (2, 2))
        spurious = torch.tensor(np.concatenate([spurious_xy, spurious_xy + 20], 1), dtype=torch.float32)
        boxes = torch.cat([gt + jitter, spurious])
        labels = torch.cat([gt_labels, torch.tensor(rng.integers(0, 3, 2))])
        scores = torch.tensor(rng.uniform(0.05, 1, len(boxes)), dtype=torch.float32)
        area = (gt[:, 2] - gt[:, 0]) * (gt[:, 3] - gt[:, 1])
        metric.update([{"boxes": boxes, "scores": scores, "labels": labels}],
                      [{"boxes": gt, "labels": gt_labels, "iscrowd": torch.zeros(n, dtype=torch.long), "area": area}],
                      [image_id])
        images.append({"id": image_id, "width": 100, "height": 100})
        for box, label, a in zip(gt.tolist(), gt_labels.tolist(), area.tolist()):
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": category_ids[label],
                                "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]], "area": a, "iscrowd": 0})
        for box, label, score in zip(boxes.tolist(), labels.tolist(), scores.tolist()):
            results.append({"image_id": image_id, "category_id": category_ids[label], "score": score,
                            "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]]})
    values = metric.compute()
    per_class = coco_per_class(values, metric)
    path = tmp_path / "annotations.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": [{"id": c, "name": str(c)} for c in category_ids]}))
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(path))
        evaluation = COCOeval(coco, coco.loadRes(results), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    precision, recall = evaluation.eval["precision"], evaluation.eval["recall"]

    def mean(array):
        kept = array[array > -1]
        return float(kept.mean()) if kept.size else -1.0

    assert 3 not in per_class
    aps = []
    for k, category_id in enumerate(category_ids):
        p = precision[:, :, k, 0, -1]
        expected = {"ap": mean(p), "ap50": mean(p[0]), "ap75": mean(p[5]), "ar100": mean(recall[:, k, 0, -1])}
        got = per_class.get(k, {"ap": -1.0, "ap50": -1.0, "ap75": -1.0, "ar100": -1.0})
        assert got == pytest.approx(expected, abs=1e-9), (category_id, got, expected)
        aps.append(got["ap"])
    assert all(0 < ap < 1 for ap in aps[:3]) and aps[3] == -1.0  # a test that can fail
    columns = metric.per_class(values, len(category_ids))  # what per_class.csv writes, label by label
    assert list(columns) == ["ap", "ap50", "ap75", "ar100"] and columns["ap"] == aps
    assert evaluation.stats[0] == pytest.approx(float(values["map"]), abs=1e-6)


def test_voc_per_class_csv_is_the_metric_ap_per_class(tmp_path):
    """VOC data: per_class.csv holds category_id, name and the metric's AP@0.5 per class (nan without ground truth)."""
    import csv
    import math
    from types import SimpleNamespace

    import torch

    from tasks.metrics.voc_map import VocMeanAveragePrecision
    from tasks.outputs.detection import PerClassAP

    metric = VocMeanAveragePrecision(num_classes=3)
    gt = torch.tensor([[0.0, 0.0, 10.0, 10.0], [20.0, 20.0, 30.0, 30.0]])
    metric.update([{"boxes": torch.tensor([[0.0, 0.0, 10.0, 10.0], [50.0, 50.0, 60.0, 60.0], [21.0, 20.0, 30.0, 30.0]]),
                    "scores": torch.tensor([0.9, 0.8, 0.7]), "labels": torch.tensor([0, 0, 1])}],
                  [{"boxes": gt, "labels": torch.tensor([0, 1])}], [1])
    values = metric.compute()
    task = SimpleNamespace(category_ids=[1, 2, 3], category_names=["a", "b", "c"], test_per_class=metric.per_class(values, 3))
    PerClassAP().on_test_end(SimpleNamespace(default_root_dir=str(tmp_path), global_rank=0), task)
    with open(tmp_path / "predictions" / "per_class.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["category_id"], r["name"]) for r in rows] == [("1", "a"), ("2", "b"), ("3", "c")]
    expected = values["ap_per_class"].tolist()
    assert [float(r["ap50"]) for r in rows[:2]] == pytest.approx(expected[:2]) and math.isnan(float(rows[2]["ap50"]))
    assert float(rows[0]["ap50"]) == pytest.approx(1.0) and float(rows[1]["ap50"]) == pytest.approx(1.0)


def test_the_datamodule_names_the_metric_and_no_metric_state_reaches_the_checkpoint():
    """``evaluation_metric`` picks COCO or VOC mAP once, in setup; metric states are not in the state dict, so a
    checkpoint loads (strictly) whichever metric the model evaluated with."""
    from types import SimpleNamespace

    import torch

    from backbones import MobileViTv2
    from tasks.detect import DetectionTask, map_metric
    from tasks.metrics.coco_map import CocoMeanAveragePrecision
    from tasks.metrics.voc_map import VocMeanAveragePrecision

    assert isinstance(map_metric("voc", 3), VocMeanAveragePrecision)
    assert map_metric("coco", 3, per_class=True).extended_summary
    with pytest.raises(ValueError, match="evaluation_metric='lvis'; detection scores 'coco' or 'voc'"):
        map_metric("lvis", 3)
    models = []
    for kind in ("coco", "voc"):
        torch.manual_seed(0)
        model = DetectionTask(MobileViTv2(width=0.25), num_classes=2)
        model.trainer = SimpleNamespace(datamodule=SimpleNamespace(evaluation_metric=kind, input_spec=None))
        model.setup("validate")
        models.append(model)
    assert isinstance(models[0].test_map, CocoMeanAveragePrecision) and isinstance(models[1].val_map, VocMeanAveragePrecision)
    models[0].val_map.update([{"boxes": torch.zeros(1, 4), "scores": torch.ones(1), "labels": torch.zeros(1).long()}],
                             [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0).long()}], [1])
    assert not [key for key in models[0].state_dict() if "_map" in key]
    models[1].load_state_dict(models[0].state_dict(), strict=True)


COCO_PAPER_RECIPES = sorted((REPO / "configs" / "detect").glob("coco_ssdlite_*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", COCO_PAPER_RECIPES, ids=lambda p: p.stem)
def test_paper_recipes_run_one_step(recipe, fitted, tmp_path):
    """Every COCO paper recipe instantiates (CVNets augmentation, EMA, its head and backbone) and takes one
    training step on the tiny COCO layout, on CPU, without its ImageNet checkpoint."""
    data, _, cache = fitted
    run_cli("fit", "--config", str(recipe), "--data.root", str(data), "--model.backbone.init_args.pretrained", "null",
            "--data.image_size", "64", "--data.batch_size", "2", "--data.eval_batch_size", "2",
            "--data.num_workers", "0", "--data.persistent_workers", "false", "--data.pin_memory", "false",
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
            "--trainer.sync_batchnorm", "false", "--trainer.precision", "32-true", "--trainer.fast_dev_run", "1",
            "--trainer.default_root_dir", str(tmp_path / "run"), cache=cache)


def test_test_writes_its_numbers_before_drawing_and_draws_inverted_boxes(tmp_path, caplog, monkeypatch):
    """The task's `test` outputs in their order: metrics.json, detections.json and per_class.csv first, the worst
    images last, drawn on the network's input with boxes brought from original pixels to its size. A ground-truth
    box read inverted (x2 < x1, as a COCO box with a negative width would be) is drawn over the area it names; and
    whatever goes wrong while drawing, the numbers are written."""
    import csv
    from types import SimpleNamespace

    import torch
    from torchvision.io import decode_jpeg, read_file

    from tasks.detect import DetectionTask
    from tasks.outputs.common import MetricsJson
    from tasks.outputs.detection import WorstDetections

    task = SimpleNamespace(draw_predictions=False, num_sample_images=8, num_worst_examples=16, category_ids=[4],
                           category_names=["zero"], test_metrics={"test/map": 0.25, "test/loss": 1.5},
                           test_per_class={"ap50": [0.5]}, model_cost=lambda: {})
    callbacks = [MetricsJson(), *DetectionTask.output_callbacks(task)]
    assert isinstance(callbacks[-1], WorstDetections)  # pictures last
    trainer = SimpleNamespace(default_root_dir=str(tmp_path), global_rank=0, world_size=1, sanity_checking=False)
    image = torch.zeros(3, 32, 32, dtype=torch.uint8)  # the input the network saw, of a 64 x 128 (h x w) image
    detection = {"boxes": torch.tensor([[8.0, 4.0, 40.0, 20.0]]), "scores": torch.tensor([0.5]), "labels": torch.tensor([0])}
    no_detections = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long), "scores": torch.zeros(0)}
    inverted = torch.tensor([[80.0, 8.0, 24.0, 60.0]])  # on the 32 px picture: x 6 .. 20, y 4 .. 30
    step = {"detections": [(7, detection)],
            "worst": [(0.0, 7, lambda: ("/data/img.jpg", image, no_detections, inverted, torch.tensor([0]), (64, 128)))]}

    def test_run():
        for callback in callbacks:
            callback.on_test_epoch_start(trainer, task)
            callback.on_test_batch_end(trainer, task, step, None, 0)
        for callback in callbacks:
            callback.on_test_end(trainer, task)

    test_run()
    predictions = tmp_path / "predictions"
    assert json.loads((predictions / "metrics.json").read_text()) == {"test/map": 0.25, "test/loss": 1.5}
    assert json.loads((predictions / "detections.json").read_text()) == [
        {"image_id": 7, "category_id": 4, "bbox": [8.0, 4.0, 32.0, 16.0], "score": 0.5}]
    with open(predictions / "per_class.csv") as f:
        assert list(csv.reader(f)) == [["category_id", "name", "ap50"], ["4", "zero", "0.5"]]
    with open(predictions / "worst" / "worst.csv") as f:
        assert list(csv.reader(f))[1] == ["1", "/data/img.jpg", "0.0", "0", "1", "01_img.jpg"]
    drawn = decode_jpeg(read_file(str(predictions / "worst" / "01_img.jpg")))
    green = drawn[1].float()
    assert green[16, 6] > 100 and green[16, 20] > 100 and green[4, 13] > 100 and green[16, 13] < 50

    def broken(self, folder, worst, pl_module):
        raise ValueError("a drawing library refusing a sample")

    for name in ("metrics.json", "detections.json", "per_class.csv"):
        (predictions / name).unlink()
    monkeypatch.setattr(WorstDetections, "draw", broken)
    with caplog.at_level("WARNING"):
        test_run()
    assert all((predictions / name).is_file() for name in ("metrics.json", "detections.json", "per_class.csv"))
    assert "could not draw predictions/worst/" in caplog.text and "refusing a sample" in caplog.text


def test_wandb_validation_boxes_are_drawn_on_the_input_the_network_saw(monkeypatch):
    """``val/samples``: the first ``num_sample_images`` of the first batch, predicted boxes (at least
    display_score_threshold) brought from original pixels to the input's, true boxes as the input has them."""
    from types import SimpleNamespace

    import torch

    import tasks.outputs.detection as outputs
    from tasks.outputs.media import WandbSink

    logged = {}

    class Logger:
        def log_image(self, key, images, step=None, **kwargs):
            logged.update(key=key, images=images, **kwargs)

    monkeypatch.setattr(outputs, "media_sink", lambda trainer: WandbSink(Logger()))
    images = torch.randn(3, 3, 32, 32)
    detections = [{"boxes": torch.tensor([[0.0, 0.0, 64.0, 32.0], [8.0, 8.0, 16.0, 16.0]]),
                   "scores": torch.tensor([0.9, 0.1]), "labels": torch.tensor([1, 0])}] * 3
    targets = [{"boxes": torch.tensor([[1.0, 2.0, 5.0, 6.0]]), "labels": torch.tensor([0]), "orig_size": (64, 128)}] * 3
    task = SimpleNamespace(category_names=["a", "b"], display_score_threshold=0.3)
    callback = outputs.ValidationBoxes(2)
    for batch_idx in (1, 0):  # only the first batch is logged
        callback.on_validation_batch_end(SimpleNamespace(sanity_checking=False), task,
                                         {"samples": (images, detections, targets)}, None, batch_idx)
    assert logged["key"] == "val/samples" and len(logged["images"]) == 2 and logged["images"][0].shape == (32, 32, 3)
    predicted, true = logged["boxes"][0]["predictions"]["box_data"], logged["boxes"][0]["ground_truth"]["box_data"]
    assert [(b["position"], b["box_caption"]) for b in predicted] == [
        ({"minX": 0.0, "minY": 0.0, "maxX": 16.0, "maxY": 16.0}, "b 0.90")]
    assert [(b["position"], b["box_caption"]) for b in true] == [({"minX": 1.0, "minY": 2.0, "maxX": 5.0, "maxY": 6.0}, "a")]
