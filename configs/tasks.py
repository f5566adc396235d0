"""The tasks of the suite, each declared once in ``configs/<task>/task.yaml``.

A declaration names the task's LightningModule, its default datamodule, its demo recipe, the metric its
best checkpoint is kept on and the one its test reports, its ONNX graph module, the ops it runs that have no
deterministic CUDA kernel, and the CPU-sized flags of a smoke run. The CLI, ``tasks.run``,
``datamodules.optimize``, the determinism check, ``benchmarks/gpu_cli.py``, ``scripts/gpu_check.sh`` and the
tests read it here, so a new task is a new folder with a ``task.yaml`` and no list elsewhere.

Like :mod:`configs.recipes`, this reads YAML only (no Lightning, no task module is imported).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import configs

DECLARATION_FILE = "task.yaml"


@dataclass(frozen=True)
class NondeterministicOp:
    """An aten op without a deterministic CUDA kernel that a task runs: where it comes from, and whether only
    training (the backward) runs it."""

    where: str
    training_only: bool


@dataclass(frozen=True)
class TaskDeclaration:
    name: str  # the ``tasks.<name>`` module and ``python -m tasks.<name>``
    module: str  # class path of the LightningModule
    datamodule: str  # class path of the datamodule a recipe gets when it names none
    demo_recipe: str  # file name in ``configs/<name>/``: the recipe when no ``--config`` is given
    monitor: str  # the validation metric the best checkpoint is kept on
    test_metric: str  # the headline metric ``test`` writes to ``metrics.json``
    export: str  # module of the task's ONNX graph (``tasks.export.<graph>``)
    mode: str = "max"  # whether a higher ``monitor`` is better ("max") or a lower ("min")
    cuda_nondeterministic_ops: dict[str, NondeterministicOp] = field(default_factory=dict)
    smoke_flags: tuple[str, ...] = ()  # CPU-sized command-line flags for a smoke run of the demo recipe

    @property
    def folder(self) -> Path:
        return Path(configs.__file__).parent / self.name

    @property
    def demo_recipe_path(self) -> Path:
        return self.folder / self.demo_recipe


def task_names() -> list[str]:
    """Every declared task, sorted: the folders of ``configs/`` with a ``task.yaml``."""
    root = Path(configs.__file__).parent
    return sorted(path.parent.name for path in root.glob(f"*/{DECLARATION_FILE}"))


@functools.cache
def task_declaration(name: str) -> TaskDeclaration:
    """The declaration of task ``name``; an unknown name is refused with the declared ones."""
    path = Path(configs.__file__).parent / name / DECLARATION_FILE
    if not path.is_file():
        raise ValueError(f"no task {name!r}; the tasks are {', '.join(task_names())} (each declared in "
                         f"configs/<task>/{DECLARATION_FILE})")
    raw = yaml.safe_load(path.read_text())
    if raw.get("name") != name:
        raise ValueError(f"{path}: name {raw.get('name')!r} differs from its folder {name!r}")
    ops = {op: NondeterministicOp(**entry) for op, entry in (raw.pop("cuda_nondeterministic_ops", None) or {}).items()}
    try:
        return TaskDeclaration(**{**raw, "cuda_nondeterministic_ops": ops,
                                  "smoke_flags": tuple(str(flag) for flag in raw.get("smoke_flags") or ())})
    except TypeError as err:  # a missing or unknown key
        raise ValueError(f"{path}: {err}") from None


def declaration_of(module_class: str) -> TaskDeclaration | None:
    """The declaration of the task whose LightningModule is ``module_class`` (a class path), if any."""
    return next((task_declaration(name) for name in task_names() if task_declaration(name).module == module_class),
                None)


def is_recipe(path: Path) -> bool:
    """Whether a YAML file under ``configs/`` is a recipe (and not a task's declaration)."""
    return path.suffix == ".yaml" and path.name != DECLARATION_FILE
