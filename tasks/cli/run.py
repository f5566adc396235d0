"""``tasks.run``: one subcommand of a task in this process, as ``python -m tasks.<task>`` runs it.

    import tasks

    fit = tasks.run("classify", **{"trainer.max_epochs": 2})           # the demo recipe, two epochs
    test = tasks.run("classify", subcommand="test", ckpt_path=fit["last_checkpoint"])
    test["metrics"]["test/top1"]

The run goes through the same entry as ``python -m tasks.<task>`` (:func:`tasks.cli.suite.main`) with the
command line the arguments spell (``<subcommand> [--config <config>] --<key>=<value> ...``, a dict config
merged as it is), so the recipes merge, the checkpoint supplies the model and the callbacks are installed
exactly as on the command line (:mod:`configs.recipes`). Under a multi-process strategy Lightning
starts the other ranks by running this process's script again, as for any Lightning script.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from configs.recipes import SUBCOMMANDS, CommandLine, Flag
from configs.tasks import task_declaration


def run(task: str, config: dict | str | Path | None = None, subcommand: str = "fit", **overrides: Any) -> dict:
    """Run ``subcommand`` of ``task`` (a name declared in ``configs/<task>/task.yaml``: ``"classify"``,
    ``"detect"``, ``"segment"``, ``"translate"``).

    Args:
        config: a recipe (a path, or a dict written as a recipe is; ``None``: the task's demo recipe). Without
            ``base:`` it overlays the demo recipe, as ``--config`` does. A dict is merged as it is.
        overrides: dotted keys as the command line's flags name them, ``**{"trainer.max_steps": 2}`` or
            ``trainer__max_steps=2``; ``ckpt_path="last"`` too. Values are Python values (a class as
            ``{"class_path": ..., "init_args": ...}``) or strings read as the command line reads them.

    Returns:
        ``metrics``: the numbers the run logged (``trainer.callback_metrics``) as floats; ``run_dir``; and
        where they exist ``best_checkpoint``, ``last_checkpoint`` and ``predictions`` (the folder of
        ``test``'s files, ``metrics.json`` among them, or where ``predict`` wrote).

    Raises:
        ValueError: an unknown task or subcommand, or an argument the task's CLI refuses (its message names it).
    """
    from tasks.cli.suite import main

    if subcommand not in SUBCOMMANDS:
        raise ValueError(f"tasks.run: subcommand {subcommand!r} is not one of {', '.join(SUBCOMMANDS)}")
    task_declaration(task)  # an unknown task is refused, naming the declared ones
    wandb_before = _wandb_run()
    try:
        cli = main(task, command_line(subcommand, config, overrides), exit_on_error=False)
    except argparse.ArgumentError as err:
        raise ValueError(f"tasks.run({task!r}, subcommand={subcommand!r}): {err}") from None
    finally:
        wandb_after = _wandb_run()
        if wandb_after is not None and wandb_after is not wandb_before:
            wandb_after.finish()  # the next run in this process starts its own wandb run
    return results(cli)


def command_line(subcommand: str, config: dict | str | Path | None, overrides: dict[str, Any]) -> CommandLine:
    """The task's command line for :func:`run`'s arguments; a dict config is a recipe as it is."""
    recipes = () if config is None else (config if isinstance(config, dict) else str(config),)
    flags = []
    for key, value in overrides.items():
        name, text = key.replace("__", "."), flag_value(value)
        flags.append(Flag(name, (text,), (f"--{name}={text}",), len(recipes)))
    return CommandLine(subcommand, recipes, tuple(flags))


def flag_value(value: Any) -> str:
    """A Python value as the command line writes it (values are read as YAML there)."""
    if isinstance(value, (str, Path)):
        return str(value)
    return json.dumps(value)  # JSON is YAML: true, null, numbers, lists, mappings


def results(cli) -> dict:
    """What a finished run logged and wrote (see :func:`run`)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = cli.trainer
    run_dir = Path(trainer.default_root_dir).resolve()
    out: dict[str, Any] = {
        "metrics": {key: float(value) for key, value in trainer.callback_metrics.items() if value.numel() == 1},
        "run_dir": str(run_dir),
    }
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.best_model_path:
            out["best_checkpoint"] = str(Path(callback.best_model_path).resolve())
        if getattr(callback, "last_model_path", ""):
            out["last_checkpoint"] = str(Path(callback.last_model_path).resolve())
    if cli.subcommand == "test" and (run_dir / "predictions").is_dir():
        out["predictions"] = str(run_dir / "predictions")
    elif cli.subcommand == "predict":
        out["predictions"] = str(cli.model.predict_destination)
    return out


def _wandb_run():
    """The wandb run in progress, if wandb is imported."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None) if wandb is not None else None
