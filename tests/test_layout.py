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


# -- imports run one way ------------------------------------------------------------------------------------------
#: the floors of the tree, lowest first; a module imports only from its own floor or one below it. Inside
#: `tasks/` each folder is a floor of its own: the metrics, what `test` and `predict` write, what a task module
#: is, the export graphs, how a command runs, the task modules (whose `main()` runs the command), the tools
#: over finished runs, and the package's own `tasks.load` / `tasks.run`
FLOORS = [("layers",), ("backbones", "heads"), ("configs", "datamodules"), ("tasks.metrics",), ("tasks.outputs",),
          ("tasks.engine",), ("tasks.export",), ("tasks.cli",), ("tasks.<task>",), ("tasks.tools",), ("tasks",)]
REPO_ROOT = Path(__file__).resolve().parents[1]


def source_modules() -> dict[str, Path]:
    """Every module of the installed packages (not tests, benchmarks or scripts), by its dotted name."""
    modules = {}
    for package in ("layers", "backbones", "heads", "configs", "datamodules", "tasks"):
        for path in (REPO_ROOT / package).rglob("*.py"):
            modules[".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The repository's modules that ``path`` imports, at its top or inside a function."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def floor(module: str) -> int:
    parts = module.split(".")
    unit = parts[0]
    if parts[0] == "tasks" and len(parts) > 1:
        unit = f"tasks.{parts[1]}" if (REPO_ROOT / "tasks" / parts[1]).is_dir() else "tasks.<task>"
    return next(i for i, units in enumerate(FLOORS) if unit in units)


def test_imports_run_one_way():
    modules = source_modules()
    upward = [f"{module} -> {target}" for module, path in modules.items() for target in imports_of(path, modules)
              if floor(target) > floor(module)]
    assert not upward, "imports that reach a floor above their own: " + "; ".join(sorted(upward))


def test_no_import_circle():
    modules = source_modules()
    graph = {module: imports_of(path, modules) - {module} for module, path in modules.items()}
    state: dict[str, str] = {}  # "open" while its imports are walked, then "done"

    def walk(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                circle = trail[trail.index(target):] + [module, target] if target in trail else [module, target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                walk(target, [*trail, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module, [])
