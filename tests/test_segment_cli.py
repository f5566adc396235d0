"""`python -m tasks.segment` end to end on a tiny VOC-layout set: fit, test (masks in the dataset's
encoding, metrics.json equal to a numpy recomputation from the written masks), predict on a folder;
and every shipped recipe parses."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from PIL import Image

from datamodules.segmentation import IGNORE_INDEX, read_mask, write_voc_demo
from configs.recipes import recipe_path
from configs.tasks import is_recipe
from tests.conftest import run_task

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (REPO / "configs" / "segment").glob("*.yaml") if is_recipe(p))

TINY = [
    "--data.crop_size", "64", "--data.scale_range", "[0.75, 1.25]", "--data.batch_size", "4",
    "--data.num_workers", "0", "--data.eval_short_side", "null",
    "--model.head.init_args.channels", "16",
    "--trainer.accelerator", "cpu",
]


def run_cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    return run_task("segment", *args, cwd=REPO, env={"SUITE_DATA_CACHE": str(cache)})


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A 2-step fit on a 64x64 VOC-layout demo (8 train, 3 val, 4 test images)."""
    tmp = tmp_path_factory.mktemp("segment-cli")
    root = write_voc_demo(tmp / "VOC2012", {"train": 8, "val": 3, "test": 4}, size=64)
    run_dir = tmp / "run"
    # one epoch, validated (the demo recipe validates every third epoch)
    run_cli("fit", "--data.root", str(root), *TINY, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
            "--trainer.check_val_every_n_epoch", "1", "--trainer.default_root_dir", str(run_dir), cache=tmp / "cache")
    return root, run_dir, tmp / "cache"


def test_fit_checkpoints_on_miou(fitted):
    root, run_dir, _ = fitted
    best = list(run_dir.rglob("best-*.ckpt"))
    assert best and list(run_dir.rglob("last.ckpt"))
    import torch

    ckpt = torch.load(best[0], map_location="cpu", weights_only=False)
    callback = next(v for k, v in ckpt["callbacks"].items() if "monitor" in v)
    assert callback["monitor"] == "val/miou"
    # image / prediction / ground-truth overlays and the per-class IoU table went to the (offline) wandb run
    assert len(list(run_dir.glob("wandb/*/files/media/images/mask/val/overlays_*.mask.png"))) >= 2
    tables = list(run_dir.glob("wandb/*/files/media/table/val/per_class_*.table.json"))  # latest-run links the run
    assert len({p.name for p in tables}) == 1, tables  # one validation, one table
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["class", "iou"] and [row[0] for row in table["data"]] == (
        root / "class_names.txt").read_text().split()


def test_test_writes_masks_and_metrics(fitted):
    root, run_dir, cache = fitted
    ckpt = next(run_dir.rglob("last.ckpt"))
    run_cli("test", "--data.root", str(root), *TINY, "--ckpt_path", str(ckpt), "--trainer.default_root_dir",
            str(run_dir), "--trainer.logger", "false", cache=cache)
    predictions = run_dir / "predictions"
    stems = (root / "ImageSets" / "Segmentation" / "test.txt").read_text().split()
    confmat = np.zeros((11, 11), np.int64)
    image_miou = {}
    for stem in stems:
        with Image.open(predictions / "masks" / f"{stem}.png") as written:
            assert written.mode == "P" and written.size == (64, 64)  # VOC encoding, original size
            pred = np.asarray(written)
        assert pred.max() <= 10
        true = read_mask(root / "SegmentationClass" / f"{stem}.png")
        keep = true != IGNORE_INDEX
        np.add.at(confmat, (true[keep], pred[keep]), 1)
        single = np.zeros((11, 11), np.int64)
        np.add.at(single, (true[keep], pred[keep]), 1)
        tp, union = np.diag(single), single.sum(0) + single.sum(1) - np.diag(single)
        image_miou[stem] = (tp[union > 0] / union[union > 0]).mean()
    # worst/: every test image (4 < 16), lowest per-image mIoU first, each drawn as image | prediction | truth
    import csv

    with open(predictions / "worst" / "worst.csv") as f:
        worst = list(csv.DictReader(f))
    assert sorted(Path(r["image"]).stem for r in worst) == sorted(stems)
    assert [float(r["miou"]) for r in worst] == pytest.approx(sorted(image_miou[Path(r["image"]).stem] for r in worst))
    for r in worst:
        assert float(r["miou"]) == pytest.approx(image_miou[Path(r["image"]).stem])
        with Image.open(predictions / "worst" / r["file"]) as drawn:
            assert drawn.size == (3 * 64, 64)
    metrics = json.loads((predictions / "metrics.json").read_text())
    tp = np.diag(confmat)
    union = confmat.sum(0) + confmat.sum(1) - tp
    assert metrics["test/miou"] == pytest.approx((tp[union > 0] / union[union > 0]).mean(), abs=1e-6)
    assert metrics["test/pixel_acc"] == pytest.approx(tp.sum() / confmat.sum(), abs=1e-6)
    truth = confmat.sum(1)
    assert metrics["test/macc"] == pytest.approx((tp[truth > 0] / truth[truth > 0]).mean(), abs=1e-6)
    assert "test/loss" in metrics and metrics["params"] > 0 and metrics["gflops"] > 0
    check_per_class(predictions / "per_class.csv", confmat, (root / "class_names.txt").read_text().split())


def check_per_class(path: Path, confmat: np.ndarray, class_names: list[str]) -> None:
    """per_class.csv holds IoU, recall and support of the numpy confusion matrix of the written masks."""
    import csv

    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [r["class"] for r in rows] == class_names
    tp = np.diag(confmat)
    support = confmat.sum(1)
    union = confmat.sum(0) + support - tp
    for k, r in enumerate(rows):
        assert int(r["support_pixels"]) == support[k]
        if union[k]:
            assert float(r["iou"]) == pytest.approx(tp[k] / union[k], abs=1e-12)
        else:
            assert r["iou"] == "nan"
        if support[k]:
            assert float(r["pixel_accuracy"]) == pytest.approx(tp[k] / support[k], abs=1e-12)
        else:
            assert r["pixel_accuracy"] == "nan"


def test_predict_on_a_folder(fitted, tmp_path):
    """The segmentation writer in the default run (tests/test_contract.py's segmentation predict cell, which
    needs a fit of its own, is in the slow suite)."""
    root, run_dir, cache = fitted
    folder = tmp_path / "photos"
    folder.mkdir()
    for i, size in enumerate([(50, 70), (64, 64)]):
        Image.open(root / "JPEGImages" / f"val_0000{i}.jpg").resize(size).save(folder / f"photo{i}.png")
    ckpt = next(run_dir.rglob("last.ckpt"))
    out_dir = tmp_path / "out"
    run_cli("predict", "--data.root", str(root), *TINY, "--data.predict_path", str(folder), "--ckpt_path", str(ckpt),
            "--trainer.default_root_dir", str(out_dir), "--trainer.logger", "false", cache=cache)
    for i, size in enumerate([(50, 70), (64, 64)]):
        with Image.open(out_dir / "predictions" / "predict" / "masks" / f"photo{i}.png") as mask:
            assert mask.size == size
        with Image.open(out_dir / "predictions" / "predict" / "overlays" / f"photo{i}.jpg") as overlay:
            assert overlay.size == size and overlay.mode == "RGB"


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_recipes_parse(recipe, capsys):
    from tasks.segment import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(recipe), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: heads." in printed and "class_path: backbones." in printed


@pytest.mark.parametrize("recipe", ["demo_deeplabv3_convmixer.yaml", "demo_deeplabv3_mobilevitv2.yaml"])
def test_demo_recipe_atrous_rates_fit_its_feature_map(recipe, capsys):
    """At the demo's small crops a dilated 3x3 whose rate reaches the map side samples only
    padding (it degenerates to a 1x1 conv); the recipe's rates must stay inside the map the
    head reads, at the training crop and at the demo's 128 px evaluation size."""
    import importlib

    import torch
    import yaml

    from datamodules.segmentation import DEMO_SIZE
    from heads.deeplabv3 import DeepLabV3
    from tasks.segment import main

    with pytest.raises(SystemExit):
        main(["fit", "--config", str(recipe_path("segment", recipe)), "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)  # the recipe with its base chain resolved
    module, name = config["model"]["backbone"]["class_path"].rsplit(".", 1)
    backbone = getattr(importlib.import_module(module), name)(**config["model"]["backbone"]["init_args"]).eval()
    head_args = {k: config["model"]["head"]["init_args"][k] for k in ("channels", "atrous_rates")}
    head = DeepLabV3(dict(backbone.feature_channels), 11, **head_args)
    for side in (config["data"]["init_args"]["crop_size"], DEMO_SIZE):
        with torch.no_grad():
            features = backbone(torch.zeros(1, 3, side, side))
        map_side = features[head.in_stride].shape[-1]
        assert max(head_args["atrous_rates"]) < map_side, (side, map_side, head_args["atrous_rates"])


def voc_to_ade20k(voc: Path, root: Path) -> Path:
    """An ADEChallengeData2016-layout copy of a VOC-layout folder (stored labels + 1, ignore -> 0)."""
    for voc_split, ade_split in (("train", "training"), ("val", "validation")):
        (root / "images" / ade_split).mkdir(parents=True, exist_ok=True)
        (root / "annotations" / ade_split).mkdir(parents=True, exist_ok=True)
        for stem in (voc / "ImageSets" / "Segmentation" / f"{voc_split}.txt").read_text().split():
            (root / "images" / ade_split / f"{stem}.jpg").write_bytes((voc / "JPEGImages" / f"{stem}.jpg").read_bytes())
            stored = read_mask(voc / "SegmentationClass" / f"{stem}.png").astype(np.int64)
            ade = np.where(stored == IGNORE_INDEX, 0, stored + 1).astype(np.uint8)
            Image.fromarray(ade).save(root / "annotations" / ade_split / f"{stem}.png")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [p for p in RECIPES if not p.name.startswith("demo")], ids=lambda p: p.name)
def test_paper_recipes_run_one_step(recipe, fitted, tmp_path):
    """The paper recipes instantiate and take a step (CPU, tiny crops, no checkpoint) on a VOC / ADE20k layout."""
    voc, _, cache = fitted
    root = voc_to_ade20k(voc, tmp_path / "ADEChallengeData2016") if recipe.name.startswith("ade20k") else voc
    # the COCO part of the VOC training set has its own tests (test_coco_voc.py); the demo has no COCO folder
    aug = [] if recipe.name.startswith("ade20k") else ["--data.aug_masks", "false", "--data.coco_root", "null"]
    run_cli("fit", "--config", str(recipe), "--data.root", str(root), *aug, "--model.backbone.init_args.width", "0.5",
            "--model.backbone.init_args.pretrained", "null", "--data.crop_size", "64", "--data.batch_size", "2",
            "--data.num_workers", "0", "--data.eval_short_side", "null", "--trainer.accelerator", "cpu",
            "--trainer.devices", "1", "--trainer.strategy", "auto", "--trainer.sync_batchnorm", "false",
            "--trainer.precision", "32-true", "--trainer.fast_dev_run", "1",
            "--trainer.default_root_dir", str(tmp_path / "run"), cache=cache)


@pytest.mark.slow
def test_two_process_test_equals_one_process(fitted, tmp_path):
    """Under DDP every evaluation image is counted once (an unrepeated sampler, no padding repeats;
    ARCHITECTURE.md). 5 test images on 2 ranks: a padding sampler would score one twice; the
    scores must equal the 1-process run exactly."""
    root, run_dir, cache = fitted
    odd = tmp_path / "VOC2012"
    odd.mkdir()
    for name in ("JPEGImages", "SegmentationClass", "class_names.txt"):
        (odd / name).symlink_to(root / name)
    (odd / "ImageSets" / "Segmentation").mkdir(parents=True)
    stems = (root / "ImageSets" / "Segmentation" / "val.txt").read_text().split()
    stems += (root / "ImageSets" / "Segmentation" / "test.txt").read_text().split()[:2]
    for split in ("train", "val", "test"):
        (odd / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(stems) + "\n")
    ckpt = next(run_dir.rglob("last.ckpt"))
    metrics, per_class = {}, {}
    for devices in (1, 2):
        out = tmp_path / f"devices{devices}"
        run_cli("test", "--data.root", str(odd), *TINY, "--ckpt_path", str(ckpt), "--trainer.devices", str(devices),
                "--trainer.strategy", "ddp" if devices > 1 else "auto", "--trainer.logger", "false",
                "--trainer.default_root_dir", str(out), cache=cache)
        metrics[devices] = json.loads((out / "predictions" / "metrics.json").read_text())
        per_class[devices] = (out / "predictions" / "per_class.csv").read_text()
        assert sorted(p.stem for p in (out / "predictions" / "masks").iterdir()) == sorted(stems)
    loss1, loss2 = metrics[1].pop("test/loss"), metrics[2].pop("test/loss")
    assert metrics[1] == metrics[2]
    assert loss1 == pytest.approx(loss2, rel=1e-6)
    assert per_class[1] == per_class[2]  # rank 0 wrote the matrix summed over both ranks
