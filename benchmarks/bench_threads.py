"""The headline demo's steps and its batch loading, on a quiet machine and beside one CPU-bound process.

    python benchmarks/bench_threads.py                       # quiet 2-core VM: ~6 min
    python benchmarks/bench_threads.py --steps 10 --repeats 1 --variants suite   # smoke run

What a user meets when something else uses a core (a browser, a second run, a compile): the README's first
command, ``python -m tasks.detect fit``, timed for ``--steps`` training steps after ``--warmup`` (the
:class:`gpu_fit.StepTimer` callback, no validation, no logger), and one batch of its training loader
(``--load-batches`` batches in the main process, as the demo loads). Each variant runs in fresh child
processes, since OpenMP reads its settings when torch loads it:

- ``before``: torch's default, one thread per core, held fixed (``SUITE_THREADS`` = the cores), as the suite
  ran before its threads followed the machine;
- ``suite``: what the suite chooses (:mod:`layers.machine`: the plan, and :class:`tasks.runtime.ThreadsFollowLoad`);
- ``one-thread``: ``OMP_NUM_THREADS=1``, for reference;
- ``passive``: ``OMP_WAIT_POLICY=PASSIVE``, for reference.

Each variant runs quiet and then with ``python -c "while True: pass"`` beside it; best of ``--repeats``.
Writes ``results_threads.md`` beside this file (or ``--output``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "before": {"SUITE_THREADS": str(len(os.sched_getaffinity(0)))},
    "suite": {},
    "one-thread": {"OMP_NUM_THREADS": "1"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}
#: what a variant must not inherit from this process
CLEARED = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "SUITE_THREADS",
           "SUITE_PLANNED_THREADS")

LOAD_CHILD = """
import sys, time
from datamodules.coco import CocoDataModule
data = CocoDataModule(**{k: v for k, v in __import__('yaml').safe_load(open(sys.argv[1]))['data'].items()})
data.setup('fit')
loader = iter(data.train_dataloader())
next(loader)
best = float('inf')
for _ in range(int(sys.argv[2])):
    start = time.perf_counter(); next(loader); best = min(best, time.perf_counter() - start)
print(best)
"""


def child_env(variant: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(VARIANTS[variant], WANDB_MODE="offline", NO_ALBUMENTATIONS_UPDATE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(REPO / "benchmarks"), env.get("PYTHONPATH")])))
    return env


def time_steps(variant: str, args, work: Path) -> float:
    """Seconds of ``args.steps`` demo training steps after ``args.warmup``."""
    out = work / f"{variant}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "tasks.detect", "fit", "--trainer.logger", "false",
               "--trainer.max_steps", str(args.warmup + args.steps), "--trainer.limit_val_batches", "0",
               "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
               "--trainer.default_root_dir", str(work / variant), "--trainer.callbacks+=gpu_fit.StepTimer",
               "--trainer.callbacks.init_args.output", str(out), "--trainer.callbacks.init_args.warmup", str(args.warmup)]
    proc = subprocess.run(command, cwd=work, env=child_env(variant), capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{variant}: the demo fit failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())["seconds"]


def time_batch(variant: str, args, work: Path) -> float:
    """Seconds of the fastest of ``args.load_batches`` training batches loaded in the main process."""
    recipe = REPO / "configs/detect/demo_ssdlite_mobilevitv2.yaml"
    proc = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(recipe), str(args.load_batches)], cwd=work,
                          env=child_env(variant), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant}: loading failed:\n{proc.stderr[-3000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def measure(variant: str, busy: bool, args, work: Path) -> dict:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        steps = min(time_steps(variant, args, work) for _ in range(args.repeats))
        batch = min(time_batch(variant, args, work) for _ in range(args.repeats))
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return {"variant": variant, "busy": busy, "steps_s": steps, "batch_ms": batch * 1000}


def markdown(rows: list[dict], args) -> str:
    by = {(r["variant"], r["busy"]): r for r in rows}
    lines = [f"`python benchmarks/bench_threads.py {' '.join(args.argv)}` ({os.cpu_count()} cores, "
             f"{time.strftime('%Y-%m-%d')}; best of {args.repeats})", "",
             f"| variant | {args.steps} steps quiet s | beside a busy process s | busy / quiet | busy / suite quiet "
             "| one batch quiet ms | busy ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    reference = by.get(("suite", False), {}).get("steps_s")
    for variant in args.variants:
        quiet, busy = by[(variant, False)], by[(variant, True)]
        versus_suite = f"{busy['steps_s'] / reference:.2f}x" if reference else "-"
        lines.append(f"| {variant} | {quiet['steps_s']:.1f} | {busy['steps_s']:.1f} | "
                     f"{busy['steps_s'] / quiet['steps_s']:.2f}x | {versus_suite} | {quiet['batch_ms']:.0f} | "
                     f"{busy['batch_ms']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--load-batches", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output", type=Path, default=Path(__file__).with_name("results_threads.md"))
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for busy in (False, True):
            for variant in args.variants:
                rows.append(measure(variant, busy, args, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    text = markdown(rows, args)
    args.output.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
