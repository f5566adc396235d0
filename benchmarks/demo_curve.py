"""Time-to-quality of a task's demo recipe: runs the default ``fit`` (plus any overrides, or another
``--config``) with ``tasks.run``, records the monitored validation metric against wall-clock time after
every validation, then ``test`` on the final model (``last.ckpt``), and prints a markdown table.

    python benchmarks/demo_curve.py classify
    python benchmarks/demo_curve.py detect --trainer.max_epochs 30

Writes ``<root>/curve.json`` (root defaults to ``runs/bench-<task>``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from lightning.pytorch import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

import tasks  # noqa: E402
from configs.recipes import split_command_line  # noqa: E402
from configs.tasks import task_names  # noqa: E402


class CurveRecorder(Callback):
    """Records (epoch, step, seconds since fit start, monitored metric) after each validation."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.points: list[dict] = []
        self.start = time.perf_counter()

    def on_fit_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        monitor = trainer.checkpoint_callback.monitor
        value = trainer.callback_metrics.get(monitor)
        self.points.append({"epoch": trainer.current_epoch, "step": trainer.global_step,
                            "seconds": round(time.perf_counter() - self.start, 1), monitor: float(value)})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.points, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=task_names())
    parser.add_argument("--root", default=None, help="run directory (default runs/bench-<task>)")
    args, rest = parser.parse_known_args()
    config, overrides = recipe_and_overrides(rest)
    root = Path(args.root or f"runs/bench-{args.task}")
    curve = root / "curve.json"
    # each measurement is a fresh fit: an earlier one's last.ckpt would make the suite refuse it (one fit per root)
    shutil.rmtree(root / "checkpoints", ignore_errors=True)
    common = {"trainer.default_root_dir": str(root)}
    recorder = {"trainer.callbacks+": f"{__name__}.CurveRecorder", "trainer.callbacks.init_args.path": str(curve)}
    start = time.perf_counter()
    fit = tasks.run(args.task, config, "fit", **common, **recorder, **overrides)
    fit_seconds = time.perf_counter() - start
    test = tasks.run(args.task, config, "test", **common, ckpt_path=fit["last_checkpoint"], **overrides)
    metrics = json.loads((Path(test["predictions"]) / "metrics.json").read_text())
    points = json.loads(curve.read_text())
    monitor = [k for k in points[0] if k not in ("epoch", "step", "seconds")][0]
    print(f"\n{args.task} demo: fit {fit_seconds:.0f} s; test on the final model: "
          + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
    print(f"\n| epoch | step | seconds | {monitor} |\n| --- | --- | --- | --- |")
    for p in points:
        print(f"| {p['epoch']} | {p['step']} | {p['seconds']} | {p[monitor]:.4f} |")


def recipe_and_overrides(argv: list[str]) -> tuple[str | None, dict[str, str]]:
    """``(recipe or None, {key: value})`` of the task flags after the script's own: ``--config R --trainer.max_epochs 30``."""
    command = split_command_line(argv)
    if len(command.recipes) > 1 or any(len(flag.values) != 1 for flag in command.flags):
        raise SystemExit("give at most one --config and a value for every flag (--name value)")
    return (command.recipes[0] if command.recipes else None), {flag.name: flag.value for flag in command.flags}


if __name__ == "__main__":
    main()
