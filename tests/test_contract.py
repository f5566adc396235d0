"""The suite's contract, proven on each real task: one matrix of task x promise.

Every promise the README states for all tasks has a cell per task here, so a task that drops
one fails a named cell (``test_<promise>[<task>]``). Each cell runs the task's real CLI in a
subprocess on its embedded demo data. Cells that take minutes (kill-and-resume of the dense
tasks, 1-vs-2-process equality) and the bf16 cells but classification's carry the ``slow`` marker.
Where a promise is kept by code every task shares (the CLI, tasks/engine), the default run keeps the
cells of the tasks with code of their own in the path and the other cells carry ``slow`` (each test's
docstring names which): the default run stays under 10 minutes on 2 cores, ``-m slow`` runs the rest.
"""
from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from configs.tasks import task_declaration, task_names
from tests.conftest import REPO, run_task

TASKS = tuple(task_names())


def cells(*default: str) -> list:
    """Every task as a parameter; the tasks not in ``default`` carry the ``slow`` marker."""
    return [task if task in default else pytest.param(task, marks=pytest.mark.slow) for task in TASKS]

#: CPU-sized arguments per task (its declaration's smoke flags, loaders in this process); the second list
#: changes the network's shape away from the demo recipe, so a checkpoint rebuilt from the recipe instead of
#: its own arguments cannot load
TINY = {task: [*task_declaration(task).smoke_flags, "--data.num_workers", "0"] for task in TASKS}
SHAPE_OVERRIDE = {
    "classify": ["--model.backbone.init_args.width", "0.25"],
    "detect": ["--model.head.init_args.proj_channels", "[16, 16, 16, 8]"],
    "segment": ["--model.head.init_args.channels", "16"],
    "translate": ["--model.dim", "32", "--model.ffn_dim", "64"],
}
QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
         "--trainer.num_sanity_val_steps", "0"]
SHORT_FIT = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1"]
EVAL_LIMIT = {"classify": ["--trainer.limit_test_batches", "2"], "detect": ["--trainer.limit_test_batches", "2"],
              "segment": ["--trainer.limit_test_batches", "3"], "translate": ["--trainer.limit_test_batches", "2"]}


def demo_dir(cache: Path, prefix: str) -> Path:
    found = sorted(p for p in cache.glob(f"{prefix}-v*") if p.is_dir())
    assert found, f"no demo dataset {prefix}-v* in {cache}"
    return found[-1]


@pytest.fixture
def fitted(demo_fit):
    """``fitted(task)`` -> the run directory of the session's shared short fit (conftest's ``demo_fit``),
    read only."""
    return demo_fit


def all_finite(state: dict) -> bool:
    return all(torch.isfinite(v).all() for v in state.values() if torch.is_tensor(v) and v.is_floating_point())


# -- the checkpoint carries the model ---------------------------------------------------------------
@pytest.mark.parametrize("task", cells("classify", "translate"))
def test_checkpoint_rebuilds_the_model_with_no_overrides(task, fitted, tmp_path):
    """The CLI rebuilds the network from the checkpoint's own arguments (tasks/cli/suite.py, shared by every
    task). Default run: classification and translation (whose tokenizer also comes from the checkpoint);
    detection and segmentation repeat the shared path and run in the slow suite."""
    import importlib

    ckpt = fitted(task) / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["suite_task"] == task_declaration(task).module
    # test on the demo data with nothing but the checkpoint: the recipe's (other) shape must not be used
    run_task(task, "test", "--ckpt_path", str(ckpt), *TINY[task], *QUIET, *EVAL_LIMIT[task], cwd=tmp_path)
    metrics = json.loads((tmp_path / "runs" / task / "predictions" / "metrics.json").read_text())
    assert metrics and all(math.isfinite(v) for v in metrics.values()), metrics
    # and in Python, as a library user would
    module, name = task_declaration(task).module.rsplit(".", 1)
    model = getattr(importlib.import_module(module), name).load_from_checkpoint(ckpt, weights_only=True)
    state = model.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in saved["state_dict"].items()}
    assert all(torch.equal(state[k], v) for k, v in saved["state_dict"].items())


def test_command_line_override_wins_over_the_checkpoint(fitted, tmp_path):
    """A decoding setting given with --ckpt_path is used (Lightning alone lets the checkpoint win); every
    other model argument comes from the checkpoint. Shared CLI code: one task proves it."""
    ckpt = fitted("translate") / "checkpoints" / "last.ckpt"
    proc = run_task("translate", "test", "--ckpt_path", str(ckpt), *TINY["translate"], *QUIET, "--model.beam_size", "3",
                    "--print_config", cwd=tmp_path)
    model = __import__("yaml").safe_load(proc.stdout)["model"]
    assert model["beam_size"] == 3  # the fit used 2
    assert model["dim"] == 32 and model["ffn_dim"] == 64  # the fit's, not the recipe's 256 / 1024


# -- predict on unlabelled input, from the checkpoint alone -------------------------------------------
def _predict_input(task: str, cache: Path, folder: Path) -> Path:
    folder.mkdir()
    if task == "translate":
        path = folder / "input.en"
        path.write_text("Germany\nFrance\nUnited Kingdom\n", encoding="utf-8")
        return path
    pattern = {"classify": ("digits-imagefolder", "test/*/*.png"), "detect": ("coco-digits", "val2017/*.jpg"),
               "segment": ("digits-voc", "JPEGImages/test_*.jpg")}[task]
    for image in sorted(demo_dir(cache, pattern[0]).glob(pattern[1]))[:3]:
        shutil.copy(image, folder / image.name)
    return folder


@pytest.mark.parametrize("task", cells("classify", "translate"))
def test_predict_on_unlabelled_input_needs_only_the_checkpoint(task, fitted, tmp_path, demo_cache):
    """Each task writes its own predictions; reading nothing but the input and the checkpoint is the shared
    CLI's. Detection's and segmentation's cells run in the slow suite: the predict tests of
    tests/test_detect_cli.py and tests/test_segment_cli.py run their writers in the default run."""
    ckpt = fitted(task) / "checkpoints" / "last.ckpt"
    source = _predict_input(task, demo_cache, tmp_path / "inputs")
    empty_cache = tmp_path / "empty-cache"  # no demo data may be built: predict reads only its input
    extra = ["--model.predict_output", "out.txt"] if task == "translate" else []
    proc = run_task(task, "predict", "--ckpt_path", str(ckpt), "--data.predict_path", str(source), *QUIET, *extra,
                    cwd=tmp_path, env={"SUITE_DATA_CACHE": str(empty_cache)})
    assert not empty_cache.exists() or not any(empty_cache.iterdir()), list(empty_cache.iterdir())
    assert "predictions:" in proc.stderr + proc.stdout
    out = tmp_path / "runs" / task / "predictions" / "predict"
    if task == "classify":
        rows = list(csv.DictReader(open(out / "predictions.csv")))
        assert [Path(r["image"]).name for r in rows] == sorted(p.name for p in source.iterdir())
        assert all(len(r["top5"].split()) == 5 for r in rows)
    elif task == "detect":
        assert sorted(p.stem for p in out.glob("*.json")) == sorted(p.stem for p in source.iterdir())
    elif task == "segment":
        assert sorted(p.stem for p in (out / "masks").glob("*.png")) == sorted(p.stem for p in source.iterdir())
    else:
        assert len((tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()) == 3


# -- a non-finite loss stops the run before the optimizer step ------------------------------------------
@pytest.mark.parametrize("task", cells("classify"))
def test_nonfinite_loss_stops_before_the_optimizer_step(task, tmp_path):
    """The guard is tasks/engine/nonfinite.py's, shared by every task: classification's cell runs in the
    default suite, the other tasks' cells repeat the shared guard and run in the slow suite."""
    proc = run_task(task, "fit", *TINY[task], *SHAPE_OVERRIDE[task], *QUIET, *SHORT_FIT,
                    "--trainer.limit_val_batches", "0", "--checkpoint.every_n_train_steps", "1",
                    "--trainer.callbacks+=tests.callbacks.NaNOutputAtStep", "--trainer.callbacks.init_args.step", "2",
                    cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "non-finite loss" in proc.stderr and "global step 2" in proc.stderr, proc.stderr[-3000:]
    last = torch.load(tmp_path / "runs" / task / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 2
    assert all_finite(last["state_dict"]) and all(all_finite(s) for s in last["optimizer_states"][0]["state"].values())


def test_nonfinite_loss_can_be_skipped_and_counted_instead(tmp_path):
    proc = run_task("classify", "fit", *TINY["classify"], *QUIET, *SHORT_FIT, "--trainer.limit_val_batches", "0",
                    "--model.on_nonfinite_loss", "skip", "--trainer.callbacks+=tests.callbacks.NaNOutputAtStep",
                    "--trainer.callbacks.init_args.step", "2", cwd=tmp_path)
    assert "non-finite loss at global step 2" in proc.stderr and "step skipped (1 so far)" in proc.stderr
    last = torch.load(tmp_path / "runs" / "classify" / "checkpoints" / "last.ckpt", weights_only=True)
    assert all_finite(last["state_dict"]) and all(all_finite(s) for s in last["optimizer_states"][0]["state"].values())


# -- a checkpoint is not scored on data with other classes / ids / vocabulary ---------------------------
def _other_data(task: str, cache: Path, root: Path) -> Path:
    """A copy of the demo dataset whose classes (category ids, vocabulary) differ from the demo's."""
    root.mkdir()
    if task == "classify":
        demo = demo_dir(cache, "digits-imagefolder")
        for split in ("train", "val", "test"):
            for folder in (demo / split).iterdir():
                (root / split).mkdir(exist_ok=True)
                (root / split / folder.name.replace("zero", "nought")).symlink_to(folder)
    elif task == "detect":
        demo = demo_dir(cache, "coco-digits")
        (root / "annotations").mkdir()
        for split_dir in demo.iterdir():
            if split_dir.is_dir() and split_dir.name != "annotations":
                (root / split_dir.name).symlink_to(split_dir)
        for file in (demo / "annotations").glob("*.json"):
            data = json.loads(file.read_text())
            for item in data["categories"]:
                item["id"] += 100
            for item in data["annotations"]:
                item["category_id"] += 100
            (root / "annotations" / file.name).write_text(json.dumps(data))
    elif task == "segment":
        demo = demo_dir(cache, "digits-voc")
        for entry in demo.iterdir():
            if entry.name != "class_names.txt":
                (root / entry.name).symlink_to(entry)
        (root / "class_names.txt").write_text((demo / "class_names.txt").read_text().replace("zero", "nought"))
    else:
        demo = demo_dir(cache, "translate-en-de")
        for file in demo.iterdir():
            if file.suffix in (".en", ".de"):
                text = file.read_text(encoding="utf-8")
                (root / file.name).write_text(text.upper() if file.suffix == ".de" else text, encoding="utf-8")
    return root


@pytest.mark.parametrize("task", cells("classify", "translate"))
def test_checkpoint_on_data_with_other_classes_is_refused(task, fitted, tmp_path, demo_cache):
    """The check is tasks/engine/data_checks.py's over each task's DATA_LINKS. Default run: classification
    (class names) and translation (which adds its own vocabulary comparison); detection's category ids and
    segmentation's class names go through the same shared comparison and run in the slow suite."""
    ckpt = fitted(task) / "checkpoints" / "last.ckpt"
    other = _other_data(task, demo_cache, tmp_path / "other")
    proc = run_task(task, "test", "--ckpt_path", str(ckpt), "--data.root", str(other), *TINY[task], *QUIET,
                    *EVAL_LIMIT[task], cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "trained on other data" in proc.stderr, proc.stderr[-3000:]
    what = {"classify": "nought", "detect": "category_ids", "segment": "nought", "translate": "vocabulary"}[task]
    assert what in proc.stderr.split("trained on other data")[-1]


# -- killed mid-epoch before any validation, resumed: equal to the uninterrupted run -----------------------
@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_killed_before_the_first_validation_resumes_exactly(task, tmp_path):
    run = [*TINY[task], *SHAPE_OVERRIDE[task], *QUIET, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3",
           "--trainer.limit_val_batches", "1", "--trainer.check_val_every_n_epoch", "1",
           "--checkpoint.every_n_train_steps", "1"]
    run_task(task, "fit", *run, "--trainer.default_root_dir", "straight", cwd=tmp_path)
    killed = run_task(task, "fit", *run, "--trainer.default_root_dir", "resumed",
                      "--trainer.callbacks+=tests.callbacks.KillAtStep", "--trainer.callbacks.init_args.step", "2",
                      cwd=tmp_path, check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    interrupted = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)
    assert interrupted["global_step"] == 2 and interrupted["epoch"] == 0  # no validation has run yet
    run_task(task, "fit", *run, "--trainer.default_root_dir", "resumed", "--ckpt_path", "last", cwd=tmp_path)
    assert_resumed_equals_straight(tmp_path, steps=6)


@pytest.mark.slow
def test_killed_after_a_validation_resumes_from_the_state_after_it(tmp_path):
    """last.ckpt of the epoch's last step is written after the epoch's validation, not before: resumed from
    a checkpoint written before it, Lightning would skip that validation and train on with other random
    numbers (evaluation draws from the global RNG)."""
    task = "classify"
    run = [*TINY[task], *SHAPE_OVERRIDE[task], *QUIET, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3",
           "--trainer.limit_val_batches", "1", "--checkpoint.every_n_train_steps", "1"]
    run_task(task, "fit", *run, "--trainer.default_root_dir", "straight", cwd=tmp_path)
    killed = run_task(task, "fit", *run, "--trainer.default_root_dir", "resumed",
                      "--trainer.callbacks+=tests.callbacks.KillAtStep", "--trainer.callbacks.init_args.step", "3",
                      cwd=tmp_path, check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    run_task(task, "fit", *run, "--trainer.default_root_dir", "resumed", "--ckpt_path", "last", cwd=tmp_path)
    assert_resumed_equals_straight(tmp_path, steps=6)


def assert_resumed_equals_straight(cwd: Path, steps: int) -> None:
    """``cwd/resumed``'s last.ckpt equals ``cwd/straight``'s: step, weights and optimizer state."""
    straight = torch.load(cwd / "straight/checkpoints/last.ckpt", weights_only=True)
    resumed = torch.load(cwd / "resumed/checkpoints/last.ckpt", weights_only=True)
    assert straight["global_step"] == resumed["global_step"] == steps
    for key, value in straight["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][key]), key
    s_opt, r_opt = straight["optimizer_states"][0]["state"], resumed["optimizer_states"][0]["state"]
    for i in s_opt:
        for name, value in s_opt[i].items():
            assert torch.equal(value, r_opt[i][name]), (i, name)
    assert straight["lr_schedulers"] == resumed["lr_schedulers"]


# -- every number of metrics.json is the same under 1 and 2 processes -------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_metrics_json_is_equal_under_one_and_two_processes(task, fitted, tmp_path):
    ckpt = fitted(task) / "checkpoints" / "last.ckpt"
    # the whole test split (limit_test_batches would count per rank: other data under 2 processes),
    # in batches that do not divide it evenly between the ranks
    limit = {"classify": ["--data.batch_size", "7"], "detect": ["--data.eval_batch_size", "5"],
             "segment": [], "translate": []}[task]
    results = {}
    for devices in ("1", "2"):
        root = f"p{devices}"
        run_task(task, "test", "--ckpt_path", str(ckpt), *TINY[task], *QUIET, *limit, "--trainer.devices", devices,
                 "--trainer.strategy", "ddp" if devices == "2" else "auto", "--trainer.default_root_dir", root,
                 cwd=tmp_path, timeout=900)
        results[devices] = json.loads((tmp_path / root / "predictions" / "metrics.json").read_text())
    one, two = results["1"], results["2"]
    assert one.keys() == two.keys()
    for key in one:  # sums over ranks add in another order: equal to float32 rounding
        assert two[key] == pytest.approx(one[key], rel=1e-6, abs=1e-7), key


# -- mixed precision -----------------------------------------------------------------------------------------
PRECISION_ARGS = {
    "classify": ["--data.image_size", "32", "--data.eval_resize", "32", "--data.batch_size", "16"],
    "detect": ["--data.batch_size", "4", "--data.hflip", "0.0"],
    "segment": ["--data.batch_size", "4"],
    "translate": [],
}


# the dense tasks' and translation's cells (10-20 s each) run in the slow suite, to keep the default run under 10 min
@pytest.mark.parametrize("task", cells("classify"))
def test_bf16_mixed_fit_has_finite_decreasing_loss(task, run_cli, tmp_path):
    """A few bf16-mixed steps on one fixed batch: finite, decreasing losses (float32 islands keep
    softmax, the detection loss and scores stable)."""
    run_cli(task, "fit", *PRECISION_ARGS[task], "--trainer.precision", "bf16-mixed", "--trainer.overfit_batches", "1",
            "--trainer.max_epochs", "10", "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
            "--trainer.log_every_n_steps", "1", "--trainer.enable_checkpointing", "false",
            "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
            "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false", "--data.num_workers", "0",
            "--model.scheduler", "null")
    # the logger wrote under the run root, not into the working directory
    rows = list(csv.DictReader(open(next((tmp_path / "runs" / task).rglob("metrics.csv")))))
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "version_0").exists()
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 10
    assert all(math.isfinite(loss) for loss in losses)
    # the batch is fixed but augmentation still varies per step: compare the ends of the curve
    assert sum(losses[-3:]) < 0.95 * sum(losses[:3]), losses


def test_bf16_clips_the_gradients_of_a_fused_optimizer():
    """The demo recipes' optimizers are fused; Lightning refuses to clip for those under any mixed
    precision. Under bf16 (no grad scaler) the task clips them as in full precision."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.precision import MixedPrecision

    from backbones import MobileViTv2
    from tasks.classify import ClassificationTask

    task = ClassificationTask(MobileViTv2(width=0.25), class_names=["a", "b", "c"])
    optimizer = torch.optim.AdamW(task.parameters(), fused=True)
    for p in task.parameters():
        p.grad = torch.full_like(p, 3.0)
    task.trainer = Trainer(precision="bf16-mixed", accelerator="cpu", logger=False)
    task.configure_gradient_clipping(optimizer, 0.5, "norm")
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in task.parameters()]))
    assert total == pytest.approx(0.5, rel=1e-4)
    task.configure_gradient_clipping(optimizer, 0.01, "value")
    assert all(p.grad.abs().max() <= 0.01 for p in task.parameters())



def test_fp16_unscales_then_clips_the_gradients_of_a_fused_optimizer():
    """Under fp16 a grad scaler multiplies the loss: the task unscales the gradients before clipping them,
    and the scaler's step then leaves the fused optimizer's own unscaling out. The update equals an
    unfused AdamW step on the unscaled, clipped gradients."""
    import copy

    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.precision import MixedPrecision

    from backbones import MobileViTv2
    from tasks.classify import ClassificationTask

    torch.manual_seed(0)
    task = ClassificationTask(MobileViTv2(width=0.25), class_names=["a", "b", "c"])
    reference = copy.deepcopy(task)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # the scale is made on first use
    task.trainer = Trainer(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], accelerator="cpu", logger=False)
    optimizer = torch.optim.AdamW(task.parameters(), lr=0.01, fused=True)
    expected_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for p, q in zip(task.parameters(), reference.parameters()):
        q.grad = torch.randn_like(q)
        p.grad = q.grad * 1024.0  # what backward of the scaled loss gives
    task.configure_gradient_clipping(optimizer, 0.5, "norm")
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in task.parameters()]))
    assert total == pytest.approx(0.5, rel=1e-4)
    scaler.step(optimizer)
    scaler.update()
    torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5)
    expected_optimizer.step()
    for p, q in zip(task.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# -- checkpoint files and resume requests that cannot work (shared CLI: one task is enough) -------------
def test_bad_checkpoint_files_are_named(fitted, tmp_path):
    from tasks.classify import ClassificationTask
    from tasks.cli.suite import read_checkpoint_for

    good = (fitted("classify") / "checkpoints" / "last.ckpt").read_bytes()
    truncated, text = tmp_path / "truncated.ckpt", tmp_path / "notes.ckpt"
    truncated.write_bytes(good[: len(good) // 3])
    text.write_text("not a checkpoint\n")
    for bad in (truncated, text):
        with pytest.raises(ValueError, match=f"cannot read checkpoint {bad}"):
            read_checkpoint_for(["test", "--ckpt_path", str(bad)], ClassificationTask)


def test_checkpoint_of_another_task_is_refused_by_name(fitted, tmp_path):
    ckpt = fitted("classify") / "checkpoints" / "last.ckpt"
    proc = run_task("detect", "test", "--ckpt_path", str(ckpt), *QUIET, cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert f"{ckpt} is a checkpoint of tasks.classify.ClassificationTask, not of tasks.detect.DetectionTask" \
        in proc.stderr, proc.stderr[-2000:]


def test_resume_with_nothing_to_resume_fails_clearly(tmp_path):
    proc = run_task("classify", "fit", "--ckpt_path", "last", "--trainer.default_root_dir", "fresh", *QUIET,
                    cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "there is no" in proc.stderr and "fresh/checkpoints/last.ckpt to resume from" in proc.stderr


def test_sync_batchnorm_recipe_evaluates_on_cpu(fitted, tmp_path):
    """Paper recipes ask for SyncBatchNorm; nothing trains in test, so it runs on CPU."""
    ckpt = fitted("classify") / "checkpoints" / "last.ckpt"
    run_task("classify", "test", "--ckpt_path", str(ckpt), *TINY["classify"], *QUIET, *EVAL_LIMIT["classify"],
             "--trainer.sync_batchnorm", "true", cwd=tmp_path)
    # training it on CPU is refused before anything is built
    from tasks.cli.suite import SuiteCLI

    with pytest.raises(ValueError, match="sync_batchnorm=true .*needs CUDA"):
        SuiteCLI("classify", ["--config", str(REPO / "configs/classify/demo_mobilevitv2.yaml"),
                              "--trainer.sync_batchnorm", "true", *QUIET], run=False)


# -- preemption: SIGTERM mid-epoch stops with last.ckpt and exit code 143; the resume is exact ----------
def _stopped_and_resumed(task: str, cwd: Path, run: list[str], stop: list[str], timeout: float = 600,
                         stopped_after: int = 2) -> None:
    run_task(task, "fit", *run, "--trainer.default_root_dir", "straight", cwd=cwd, timeout=timeout)
    stopped = run_task(task, "fit", *run, *stop, "--trainer.default_root_dir", "resumed", cwd=cwd, check=False,
                       timeout=timeout)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert f"stopped by SIGTERM after global step {stopped_after} (epoch 0); exit code 143" in stopped.stderr
    assert f"last checkpoint:  {cwd / 'resumed/checkpoints/last.ckpt'}" in stopped.stderr
    resume = stopped.stderr.split("resume with:")[1].splitlines()[0].split()
    assert resume[:3] == ["python", "-m", f"tasks.{task}"] and resume[-4:] == [
        "--trainer.default_root_dir", str(cwd / "resumed"), "--ckpt_path", "last"]
    assert not (cwd / "resumed" / "fit.lock").exists()  # released on the way out
    interrupted = torch.load(cwd / "resumed/checkpoints/last.ckpt", weights_only=True)
    assert interrupted["global_step"] == stopped_after and interrupted["epoch"] == 0
    run_task(task, "fit", *run, "--trainer.default_root_dir", "resumed", "--ckpt_path", "last", cwd=cwd,
             timeout=timeout)
    assert_resumed_equals_straight(cwd, steps=6)


PREEMPTED_RUN = ["--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1",
                 "--checkpoint.every_n_train_steps", "100"]  # last.ckpt only from the epoch ends and the signal
SIGTERM_AT_STEP_1 = ["--trainer.callbacks+=tests.callbacks.SignalAtStep", "--trainer.callbacks.init_args.step", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["classify", "translate"])
def test_sigterm_mid_epoch_exits_143_with_last_ckpt_and_resumes_exactly(task, tmp_path):
    _stopped_and_resumed(task, tmp_path, [*TINY[task], *SHAPE_OVERRIDE[task], *QUIET, *PREEMPTED_RUN],
                         SIGTERM_AT_STEP_1)


@pytest.mark.slow
def test_sigterm_in_the_last_step_of_an_epoch_stops_after_its_validation_and_resumes_exactly(tmp_path):
    """A checkpoint written after the epoch's last step but before its validation would resume past that
    validation (Lightning skips it): its metrics would be lost and the RNG that evaluation draws from would
    differ. The stop waits for the validation, so the resumed run equals the uninterrupted one."""
    assert QUIET[:2] == ["--trainer.logger", "false"]
    run = [*TINY["classify"], *SHAPE_OVERRIDE["classify"], "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
           *QUIET[2:], *PREEMPTED_RUN]
    _stopped_and_resumed("classify", tmp_path, run, [*SIGTERM_AT_STEP_1[:1], "--trainer.callbacks.init_args.step", "2"],
                         stopped_after=3)
    stopped_log = next((tmp_path / "resumed").rglob("version_0/metrics.csv")).read_text()
    assert "val/top1" in stopped_log.splitlines()[0]  # epoch 0's validation ran before the stop
    rows = list(csv.DictReader(stopped_log.splitlines()))
    assert [r["step"] for r in rows if r.get("val/top1")] == ["2"]


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_and_resumes_exactly(tmp_path):
    """The signal reaches rank 1 only: both ranks stop after the same step."""
    two = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
    _stopped_and_resumed("classify", tmp_path, [*TINY["classify"], *SHAPE_OVERRIDE["classify"], *QUIET, *PREEMPTED_RUN,
                                                *two], [*SIGTERM_AT_STEP_1, "--trainer.callbacks.init_args.rank", "1"],
                         timeout=900)


# -- a resume refuses to drift; one fit per run root; flags the recipe would override --------------------
@pytest.mark.slow
def test_resume_with_another_batch_size_or_learning_rate_is_refused(fitted, tmp_path):
    ckpt = fitted("classify") / "checkpoints" / "last.ckpt"
    proc = run_task("classify", "fit", *TINY["classify"], *SHAPE_OVERRIDE["classify"], *QUIET, *SHORT_FIT,
                    "--ckpt_path", str(ckpt), "--data.batch_size", "8", "--model.optimizer.init_args.lr", "0.01",
                    cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "data.batch_size: 16 -> 8" in proc.stderr and "model.optimizer.init_args.lr: 0.004 -> 0.01" in proc.stderr
    assert "--allow_changed data.batch_size,model.optimizer.init_args.lr" in proc.stderr


def test_cli_installs_atomic_checkpoints_preemption_and_the_resume_guard_and_locks_the_run_root(tmp_path, monkeypatch):
    import os

    from tasks.cli.checkpoint_io import AtomicCheckpointIO
    from tasks.cli.preemption import Preemption
    from tasks.cli.resume import ResumeGuard, RunInUse, RunLock
    from tasks.cli.suite import SuiteCLI

    monkeypatch.chdir(tmp_path)
    cli = SuiteCLI("classify", ["--config", str(REPO / "configs/classify/demo_mobilevitv2.yaml"), *QUIET,
                                *TINY["classify"], "--trainer.default_root_dir", "run",
                                "--allow_changed", "data.batch_size, model.scheduler"], run=False)
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    preemption = next(c for c in cli.trainer.callbacks if isinstance(c, Preemption))
    assert preemption.resume_command.endswith(f"--trainer.default_root_dir {tmp_path / 'run'} --ckpt_path last")
    guard = next(c for c in cli.trainer.callbacks if isinstance(c, ResumeGuard))
    assert guard.allow_changed == ["data.batch_size", "model.scheduler"]
    assert guard.settings["data.batch_size"] == 16 and guard.settings["trainer.accumulate_grad_batches"] == 1
    assert guard.settings["model.optimizer"]["init_args"]["lr"] == 0.004
    # the run root is held by another live fit on this host: this one refuses before training
    holder = RunLock(tmp_path / "run")
    holder.me["pid"] = os.getppid()
    holder.acquire()
    with pytest.raises(RunInUse, match=rf"run is in use by another fit: pid {os.getppid()} on host"):
        cli.before_fit()


def test_checkpoint_is_scored_without_the_weights_its_training_started_from(tmp_path):
    """A fit that started from a weights file writes checkpoints that rebuild without it (the checkpoint's
    weights replace it): `test --ckpt_path` on a machine without the start file works, and normalises the
    images as the checkpoint was trained (its stored input specification), not with ImageNet's defaults."""
    import yaml

    from backbones.convmixer import ConvMixer

    start = tmp_path / "start.pt"
    torch.save(ConvMixer(dim=8, depth=1, patch_size=4, kernel_size=3).state_dict(), start)
    backbone = ["--model.backbone", "backbones.convmixer.ConvMixer", "--model.backbone.dim", "8",
                "--model.backbone.depth", "1", "--model.backbone.patch_size", "4", "--model.backbone.kernel_size", "3"]
    run_task("classify", "fit", *TINY["classify"], *QUIET, *SHORT_FIT, *backbone,
             "--model.backbone.pretrained", str(start), "--data.mean", "[0.5, 0.5, 0.5]", "--data.std", "[0.25, 0.25, 0.25]",
             cwd=tmp_path)
    last = tmp_path / "runs" / "classify" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["backbone"]["init_args"]["pretrained"] is None
    start.unlink()
    run_task("classify", "test", "--ckpt_path", str(last), *TINY["classify"], *QUIET,
             "--trainer.limit_test_batches", "1", cwd=tmp_path)
    config = yaml.safe_load((tmp_path / "runs" / "classify" / "suite_config.yaml").read_text())
    assert config["data"]["init_args"]["mean"] == [0.5, 0.5, 0.5]
    assert config["data"]["init_args"]["std"] == [0.25, 0.25, 0.25]
    assert json.loads((tmp_path / "runs" / "classify" / "predictions" / "metrics.json").read_text())["test/top1"] >= 0
