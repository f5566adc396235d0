"""Seed-to-seed spread of a task's demo: for each seed, the default ``fit`` with
``--seed_everything SEED`` (plus any overrides), then ``test`` of its ``last.ckpt``; prints the
mean, standard deviation, minimum and maximum of the test score and of the last validation score.

    python benchmarks/demo_seeds.py detect --seeds 0 1 2
    python benchmarks/demo_seeds.py classify --seeds 0 1 2 --trainer.max_epochs 5

The seed sets the weights' initialisation and every other draw from the global RNGs; the order of
the training data and each sample's augmentation follow the datamodule's own seed, which stays fixed.
Each seed runs in ``<root>/seed-<SEED>`` (root defaults to ``runs/seeds-<task>``); the scores of
all seeds are written to ``<root>/seeds.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS.parent))
from configs.tasks import task_names  # noqa: E402  (the repository, run as a script)


def run_seed(task: str, seed: int, root: Path, overrides: list[str]) -> dict:
    """Fit and test one seed in ``root``; returns its seconds, last validation score and test metrics."""
    # a fresh fit each time: an earlier fit's last.ckpt in the same root would make the suite refuse it
    shutil.rmtree(root / "checkpoints", ignore_errors=True)
    curve = root / "curve.json"
    common = [f"--trainer.default_root_dir={root}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCHMARKS), os.environ.get("PYTHONPATH")]))}
    env.setdefault("WANDB_MODE", "offline")
    env.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", f"tasks.{task}", "fit", *common, f"--seed_everything={seed}",
                    "--trainer.callbacks+=demo_curve.CurveRecorder", f"--trainer.callbacks.init_args.path={curve}",
                    *overrides], check=True, env=env)
    seconds = time.perf_counter() - start
    subprocess.run([sys.executable, "-m", f"tasks.{task}", "test", *common,
                    f"--ckpt_path={root / 'checkpoints' / 'last.ckpt'}", *overrides], check=True, env=env)
    last_validation = json.loads(curve.read_text())[-1]
    monitor = next(k for k in last_validation if k not in ("epoch", "step", "seconds"))
    test = json.loads((root / "predictions" / "metrics.json").read_text())
    return {"seed": seed, "fit_seconds": round(seconds, 1), "monitor": monitor,
            "val": last_validation[monitor], "test": test}


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), minimum and maximum."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=task_names())
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--root", default=None, help="run directory (default runs/seeds-<task>)")
    args, overrides = parser.parse_known_args()
    root = Path(args.root or f"runs/seeds-{args.task}")
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(args.task, seed, root / f"seed-{seed}", overrides))
        (root / "seeds.json").write_text(json.dumps(runs, indent=1))
    val_key = runs[0]["monitor"]
    test_key = val_key.replace("val/", "test/", 1)
    scores = {val_key: spread([r["val"] for r in runs]), test_key: spread([r["test"][test_key] for r in runs])}
    print(f"\n{args.task} demo, seeds {' '.join(map(str, args.seeds))}:")
    print(f"\n| seed | fit s | {val_key} (last validation) | {test_key} (last.ckpt) |\n| --- | --- | --- | --- |")
    for r in runs:
        print(f"| {r['seed']} | {r['fit_seconds']:.0f} | {r['val']:.4f} | {r['test'][test_key]:.4f} |")
    print("\n| score | mean | std | min | max |\n| --- | --- | --- | --- | --- |")
    for key, s in scores.items():
        print(f"| {key} | {s['mean']:.4f} | {s['std']:.4f} | {s['min']:.4f} | {s['max']:.4f} |")


if __name__ == "__main__":
    main()
