"""The four tasks and what they stand on.

    tasks/<task>.py   one LightningModule per task (classify, detect, segment, translate): forward, loss,
                      metric updates; ``python -m tasks.<task> fit|validate|test|predict|export``
    tasks/engine/     what a task module is: the base and its non-finite-loss guard, optimizer groups and
                      schedules, the predictor behind ``tasks.load``, the model's cost, checkpoint contents
    tasks/cli/        how a command runs: the LightningCLI, ``tasks.run``, last.ckpt, checkpoint I/O,
                      resume, pre-emption, progress, threads, determinism
    tasks/metrics/    the benchmark metrics, each equal to its reference implementation
    tasks/outputs/    the files `test` and `predict` write, one callback per output
    tasks/export/     the ONNX export command and one graph module per task
    tasks/tools/      commands over finished runs (``python -m tasks.tools.report``, ``average_checkpoints``)

For Python, ``tasks.run(task, config, subcommand, **overrides)`` runs a subcommand in this process as the
command line does and returns its metrics and paths (:mod:`tasks.cli.run`), and ``tasks.load(checkpoint)``
gives the trained model, ready for ``model.predict(inputs)`` (:mod:`tasks.engine.predictor`).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: modules that moved, by their old names: a saved config or checkpoint names classes by module path
#: (a scheduler's ``class_path: tasks.optim.WarmupCosineLR``, a callback or plugin a recipe lists), so the
#: old names of the modules that define such classes still import
MOVED_MODULES = {
    "tasks.optim": "tasks.engine.optim",
    "tasks.engine.checkpoint_io": "tasks.cli.checkpoint_io",
    "tasks.engine.outputs": "tasks.outputs.common",
    "tasks.engine.preemption": "tasks.cli.preemption",
    "tasks.engine.progress": "tasks.cli.progress",
    "tasks.engine.runtime": "tasks.cli.runtime",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name as the module it moved to (the same module object)."""

    def find_spec(self, name, path=None, target=None):
        if name in MOVED_MODULES:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module) -> None:
        pass  # already executed under its new name


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())


def load(path, map_location="cpu"):
    """The model of a checkpoint written by this suite, as the task class it names, in evaluation mode
    (:func:`tasks.engine.predictor.load`)."""
    from tasks.engine.predictor import load as load_model

    return load_model(path, map_location)


def run(task: str, config=None, subcommand: str = "fit", **overrides) -> dict:
    """Run ``subcommand`` of ``task`` in this process as ``python -m tasks.<task>`` does; its metrics and paths
    (:func:`tasks.cli.run.run`)."""
    from tasks.cli.run import run as run_task

    return run_task(task, config, subcommand, **overrides)
