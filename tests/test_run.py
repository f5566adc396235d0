"""``tasks.run`` runs a subcommand in this process as the command line does and returns its numbers and paths."""
import json
from pathlib import Path

import pytest

import tasks

#: the classification demo at CPU test sizes (tests/test_contract.py's TINY and SHAPE_OVERRIDE), as overrides
TINY = {"data.image_size": 32, "data.eval_resize": 32, "data.batch_size": 16, "data.num_workers": 0,
        "model.scheduler.init_args.warmup_steps": 2, "model.backbone.init_args.width": 0.25,
        "trainer.enable_progress_bar": False, "trainer.accelerator": "cpu"}


def test_fit_then_test_return_what_the_runs_logged_and_wrote(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a dict config overlays the demo recipe, as a recipe without base: does
    config = {"trainer": {"default_root_dir": str(tmp_path / "run"), "logger": False, "max_epochs": 1,
                          "limit_train_batches": 2, "limit_val_batches": 1, "num_sanity_val_steps": 0}}
    fit = tasks.run("classify", config, **TINY)
    assert fit["run_dir"] == str(tmp_path / "run")
    assert fit["last_checkpoint"] == str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert Path(fit["best_checkpoint"]).is_file() and {"val/top1", "val/loss"} <= fit["metrics"].keys()
    test = tasks.run("classify", subcommand="test", ckpt_path=fit["last_checkpoint"], trainer__logger=False,
                     trainer__default_root_dir=str(tmp_path / "run"), trainer__limit_test_batches=2,
                     **{key: value for key, value in TINY.items() if not key.startswith("model.")})
    written = json.loads((Path(test["predictions"]) / "metrics.json").read_text())
    scores = {key: value for key, value in written.items() if key.startswith("test/")}
    assert {"test/top1", "test/top5", "test/loss"} <= scores.keys()
    assert {key: test["metrics"][key] for key in scores} == pytest.approx(scores, rel=1e-6)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="trainer.max_stepz"):
        tasks.run("classify", trainer__max_stepz=2)
    with pytest.raises(ValueError, match="no task 'clasify'; the tasks are classify, detect, segment, translate"):
        tasks.run("clasify")
    with pytest.raises(ValueError, match="subcommand 'train' is not one of fit, validate, test, predict"):
        tasks.run("classify", subcommand="train")
