"""The `tasks/` layout keeps what was saved under an old one working: a checkpoint written before the
engine, metrics, export and tools moved into their folders (commit 87d5a03) names its scheduler by the
old module path (``tasks.optim.WarmupCosineLR``), and one written before the command's modules moved from
``tasks/engine/`` to ``tasks/cli/`` (commit de76940); both load in Python and are scored by the CLI."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import tasks

OLD_CHECKPOINT = Path(__file__).parent / "data" / "classify_convmixer_87d5a03.ckpt"
#: every checkpoint an earlier layout wrote, by the commit that wrote it
OLD_CHECKPOINTS = [OLD_CHECKPOINT, Path(__file__).parent / "data" / "classify_convmixer_de76940.ckpt"]


def test_old_checkpoint_names_the_old_module_path():
    saved = torch.load(OLD_CHECKPOINT, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["scheduler"]["class_path"] == "tasks.optim.WarmupCosineLR"


def test_old_module_path_imports_the_moved_module():
    import tasks.engine.optim
    import tasks.optim

    assert tasks.optim is tasks.engine.optim
    assert tasks.optim.WarmupCosineLR.__module__ == "tasks.engine.optim"


@pytest.mark.parametrize("old_checkpoint", OLD_CHECKPOINTS, ids=lambda path: path.stem)
def test_old_checkpoint_loads_and_predicts_in_python(old_checkpoint):
    from tasks.classify import ClassificationTask

    model = tasks.load(old_checkpoint)
    assert isinstance(model, ClassificationTask) and model.class_names[0] == "0_zero"
    image = torch.zeros(3, 32, 32, dtype=torch.uint8)
    result = model.predict(image, top_k=3)
    assert len(result) == 3 and {name for name, _ in result} <= set(model.class_names)


@pytest.mark.parametrize("old_checkpoint", OLD_CHECKPOINTS, ids=lambda path: path.stem)
def test_old_checkpoint_is_scored_by_the_cli(run_cli, tmp_path, old_checkpoint):
    checkpoint = tmp_path / "old.ckpt"
    shutil.copy(old_checkpoint, checkpoint)
    run_cli("classify", "test", "--ckpt_path", str(checkpoint), "--trainer.limit_test_batches", "1",
            "--trainer.logger", "false", "--data.batch_size", "8")
    metrics = json.loads((tmp_path / "runs" / "classify" / "predictions" / "metrics.json").read_text())
    assert 0.0 <= metrics["test/top1"] <= metrics["test/top5"] <= 1.0


def test_no_task_module_writes_a_file():
    """Tasks compute, callbacks write: no task module (``tasks/<task>.py``) opens, writes or creates a file;
    its outputs are the callbacks of ``tasks/outputs/<task>.py``."""
    import ast

    writers = {"open", "write_text", "write_bytes", "mkdir", "save", "savefig", "write_jpeg", "write_png", "dump"}
    modules = sorted(Path(tasks.__file__).parent.glob("*.py"))
    assert {m.stem for m in modules} >= {"classify", "detect", "segment", "translate"}
    for module in modules:
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                assert name not in writers, f"{module.name}:{node.lineno} calls {name}(): write it from a callback"
