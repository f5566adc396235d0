"""The classification CLI end to end, in subprocesses, on a slice of the digits demo."""
import csv
import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

TINY = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "3",
        "--trainer.num_sanity_val_steps", "0", "--trainer.log_every_n_steps", "1", "--data.batch_size", "16",
        "--data.num_workers", "0", "--data.image_size", "32", "--data.eval_resize", "32",
        "--model.scheduler.init_args.warmup_steps", "2"]


def test_fit_then_test_writes_checkpoints_wandb_run_predictions_and_metrics(classify_run):
    """The session's shared classification run (conftest's ``classify_run``: this file's TINY, wandb first of
    its loggers); tests/test_media.py reads the same run's TensorBoard and CSV output."""
    fit, root = classify_run.fit, classify_run.root
    assert "best checkpoint:" in fit.stdout + fit.stderr
    # output to a pipe, as in a cluster log: plain progress lines instead of a redrawn bar
    assert "fit epoch 1/1 step 1/4 (batch 1/4) loss" in fit.stdout and "fit epoch 1 done at step 4" in fit.stdout
    assert "validate: 2 batches" in fit.stdout and "val/top1" in fit.stdout
    ckpts = sorted(root.rglob("*.ckpt"))
    names = {p.name for p in ckpts}
    assert "last.ckpt" in names and any(n.startswith("best-") for n in names), names
    # wandb wrote an offline run under the run directory, holding the resolved config
    run_dirs = classify_run.fit_wandb_runs
    assert len(run_dirs) == 1, list(root.rglob("*"))[:20]
    config = yaml.safe_load((run_dirs[0] / "files" / "suite_config.yaml").read_text())
    assert config["model"]["backbone"]["class_path"].endswith("MobileViTv2")

    last = next(p for p in ckpts if p.name == "last.ckpt")
    assert last == classify_run.last  # the checkpoint `test` scored
    predictions = root / "predictions"
    metrics = json.loads((predictions / "metrics.json").read_text())
    assert set(metrics) >= {"test/top1", "test/top5"}
    assert 0.0 <= metrics["test/top1"] <= metrics["test/top5"] <= 1.0
    with open(predictions / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * 16  # limit_test_batches x batch size, each image once
    assert Path(rows[0]["image"]).parts[0] == "test" and rows[0]["label"] == "0_zero"  # names from the data
    top1 = sum(r["label"] == r["prediction"] for r in rows) / len(rows)
    assert abs(top1 - metrics["test/top1"]) < 1e-6  # the file holds what was scored
    check_per_class_files(predictions)  # per-class numbers from the same confusion matrix
    check_worst_and_cost(predictions, rows, metrics, last)


def check_worst_and_cost(predictions: Path, rows: list[dict], metrics: dict, checkpoint: Path) -> None:
    """worst/ holds the 16 images whose label got the lowest probability, lowest first, each drawn;
    the confusion-matrix picture exists; metrics.json's cost is the checkpoint model's at 32 px."""
    import torch
    from PIL import Image

    from tasks.engine.cost import count_flops
    from tasks.classify import ClassificationTask

    with open(predictions / "worst" / "worst.csv") as f:
        worst = list(csv.DictReader(f))
    assert [int(r["rank"]) for r in worst] == list(range(1, 17))
    probabilities = [float(r["label_probability"]) for r in worst]
    assert probabilities == sorted(probabilities)
    scored = {r["image"]: r for r in rows}
    for r in worst:  # the same prediction and score as predictions.csv; the label's probability is at most the top one
        assert (r["label"], r["prediction"]) == (scored[r["image"]]["label"], scored[r["image"]]["prediction"])
        assert float(r["score"]) == pytest.approx(float(scored[r["image"]]["score"]), abs=1e-6)
        assert float(r["label_probability"]) <= float(r["score"]) + 1e-9
        assert (r["label_probability"] == r["score"]) == (r["label"] == r["prediction"])
        with Image.open(predictions / "worst" / r["file"]) as image:
            assert image.width >= 256
    with Image.open(predictions / "confusion_matrix.png") as image:
        assert image.width >= 400 and image.height >= 400
    model = ClassificationTask.load_from_checkpoint(checkpoint, map_location="cpu")
    assert metrics["params"] == sum(p.numel() for p in model.parameters())
    assert metrics["gflops"] == pytest.approx(count_flops(model, torch.zeros(1, 3, 32, 32)) / 1e9)
    assert metrics["gmacs"] == pytest.approx(metrics["gflops"] / 2)


@pytest.mark.slow
def test_a_second_fit_in_the_same_directory_is_refused_unless_it_resumes(run_cli):
    short = [*TINY, "--trainer.limit_train_batches", "1", "--trainer.limit_val_batches", "1"]
    run_cli("classify", "fit", *short)
    again = run_cli("classify", "fit", *short, check=False)  # would train afresh over the first run's last.ckpt
    assert again.returncode != 0 and "--ckpt_path last" in again.stderr
    resumed = run_cli("classify", "fit", *short, "--ckpt_path", "last", "--trainer.max_epochs", "2")
    assert "last checkpoint:" in resumed.stdout + resumed.stderr


def test_missing_root_is_reported_with_the_expected_layout(run_cli, tmp_path):
    proc = run_cli("classify", "validate", "--data.root", str(tmp_path / "imagenet"), check=False)
    assert proc.returncode != 0
    assert "expected" in proc.stderr and "imagenet/train/<class>/<image>" in proc.stderr


@pytest.mark.slow
def test_ema_under_ddp_with_injected_optimizer(run_cli, tmp_path):
    """EMAWeightAveraging deep-copies the module; under DDP that used to reach the process group
    through the CLI-injected optimizer callable. Two gloo processes on CPU."""
    ema = tmp_path / "ema.yaml"
    ema.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.EMAWeightAveraging\n"
                   "      init_args: {decay: 0.9}\n")
    proc = run_cli("classify", "fit", "--config", str(REPO / "configs/classify/demo_mobilevitv2.yaml"),
                   "--config", str(ema), *TINY, "--trainer.limit_train_batches", "2",
                   "--trainer.limit_val_batches", "1", "--data.batch_size", "4", "--trainer.strategy", "ddp",
                   "--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
                   env={"OMP_NUM_THREADS": "1"})
    assert "last checkpoint:" in proc.stdout + proc.stderr
    import torch

    ckpt = torch.load(next((tmp_path / "runs/classify").rglob("last.ckpt")), weights_only=False)
    assert any("EMAWeightAveraging" in key for key in ckpt["callbacks"])  # the average travels with the run


@pytest.mark.slow
def test_two_processes_score_every_test_image_once_and_match_one_process(run_cli, tmp_path, demo_cache):
    """The 269 test digits split unevenly over 2 gloo ranks (no DistributedSampler padding):
    top-1/top-5 and the written predictions equal the single-process run exactly."""
    common = ["--data.num_workers", "0", "--data.image_size", "32", "--data.eval_resize", "32",
              "--data.eval_batch_size", "50", "--trainer.logger", "false", "--trainer.accelerator", "cpu"]
    run_cli("classify", "test", *common, "--trainer.default_root_dir", "one")
    run_cli("classify", "test", *common, "--trainer.default_root_dir", "two", "--trainer.strategy", "ddp",
            "--trainer.devices", "2", env={"OMP_NUM_THREADS": "1"})
    one, two = (json.loads((tmp_path / d / "predictions/metrics.json").read_text()) for d in ("one", "two"))
    assert one["test/top1"] == two["test/top1"] and one["test/top5"] == two["test/top5"]
    rows = [sorted(csv.DictReader(open(tmp_path / d / "predictions/predictions.csv")), key=lambda r: r["image"])
            for d in ("one", "two")]
    n_test = sum(1 for _ in (demo_cache / "digits-imagefolder-v1" / "test").rglob("*.png"))
    assert len(rows[0]) == len(rows[1]) == n_test
    assert [r["prediction"] for r in rows[0]] == [r["prediction"] for r in rows[1]]
    per_class = [(tmp_path / d / "predictions/per_class.csv").read_text() for d in ("one", "two")]
    assert per_class[0] == per_class[1]  # rank 0 wrote the synced confusion matrix
    check_per_class_files(tmp_path / "two" / "predictions")


def test_last_checkpoint_is_the_latest_epoch_even_when_it_is_not_the_best(run_cli, tmp_path):
    """Lightning rewrites last.ckpt only with a new best; ours must follow every epoch (resume)."""
    run_cli("classify", "fit", *TINY, "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "1",
            "--trainer.limit_val_batches", "1", "--trainer.logger", "false", "--trainer.callbacks", "[]",
            "--checkpoint.monitor", "epoch", "--checkpoint.mode", "min")  # only epoch 0 is ever "best"
    import torch

    last = torch.load(tmp_path / "runs/classify/checkpoints/last.ckpt", weights_only=True)
    assert last["epoch"] == 2 and last["global_step"] == 3


def check_per_class_files(predictions: Path) -> None:
    """per_class.csv and confusion_matrix.csv hold exactly the confusion matrix of predictions.csv."""
    import numpy as np

    with open(predictions / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    with open(predictions / "confusion_matrix.csv") as f:
        table = list(csv.reader(f))
    names = table[0][1:]
    assert [r[0] for r in table[1:]] == names
    index = {name: k for k, name in enumerate(names)}
    expected = np.zeros((len(names), len(names)), dtype=np.int64)
    for r in rows:
        expected[index[r["label"]], index[r["prediction"]]] += 1
    written = np.array([[int(v) for v in r[1:]] for r in table[1:]], dtype=np.int64)
    assert (written == expected).all()
    with open(predictions / "per_class.csv") as f:
        per_class = list(csv.DictReader(f))
    assert [r["class"] for r in per_class] == names
    tp = np.diag(expected).astype(float)
    predicted, support = expected.sum(0), expected.sum(1)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, support, out=np.zeros_like(tp), where=support > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(tp), where=precision + recall > 0)
    for k, r in enumerate(per_class):
        assert int(r["support"]) == support[k]
        assert float(r["precision"]) == pytest.approx(precision[k], abs=1e-12)
        assert float(r["recall"]) == pytest.approx(recall[k], abs=1e-12)
        assert float(r["f1"]) == pytest.approx(f1[k], abs=1e-12)
    with open(predictions / "confused_pairs.csv") as f:
        pairs = list(csv.DictReader(f))
    mistakes = sorted(((-expected[t, p], t, p) for t in range(len(names)) for p in range(len(names))
                       if t != p and expected[t, p] > 0))[:20]
    assert [(r["label"], r["prediction"], int(r["count"])) for r in pairs] == [
        (names[t], names[p], -c) for c, t, p in mistakes]
    assert all(float(r["share"]) == pytest.approx(int(r["count"]) / support[index[r["label"]]]) for r in pairs)


# -- ViT's image size is the data's: one value -------------------------------------------------------
VIT = ["--model.backbone", "backbones.ViT", "--model.backbone.size", "tiny", "--model.backbone.patch_size", "8"]
QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu"]


def _classify_cli(*args):
    from tasks.cli.suite import SuiteCLI

    return SuiteCLI("classify", ["--config", str(REPO / "configs/classify/demo_mobilevitv2.yaml"), *QUIET, *args],
                    run=False)


def test_vit_takes_the_data_image_size_without_its_own_flag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = _classify_cli(*VIT, "--data.image_size", "64")
    assert cli.model.backbone.img_size == (64, 64) and cli.model.backbone.grid_size == (8, 8)
    assert cli.config.model.backbone.init_args.img_size == 64  # the saved config (and checkpoint) say so too


def test_vit_image_size_given_twice_must_agree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = _classify_cli(*VIT, "--model.backbone.img_size", "64", "--data.image_size", "64")
    assert cli.model.backbone.img_size == (64, 64)
    with pytest.raises(ValueError, match="--model.backbone.img_size 96 differs from --data.image_size 64"):
        _classify_cli(*VIT, "--model.backbone.img_size", "96", "--data.image_size", "64")
