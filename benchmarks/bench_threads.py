"""The headline demo's steps and its batch loading, on a quiet machine and beside one CPU-bound process.

    python benchmarks/bench_threads.py                       # quiet 2-core VM: ~6 min
    python benchmarks/bench_threads.py --steps 10 --repeats 1 --variants suite   # smoke run

What a user meets when something else uses a core (a browser, a second run, a compile): the README's first
command, ``python -m tasks.detect fit``, timed for ``--steps`` training steps after ``--warmup`` (the
:class:`gpu_fit.StepTimer` callback, no validation, no logger), and one batch of its training loader
(``--load-batches`` batches in the main process, as the demo loads). Each variant runs in fresh child
processes, since OpenMP reads its settings when torch loads it:

- ``before``: torch's default, one thread per core, held fixed (``SUITE_THREADS`` = the cores): threads that
  do not follow the machine;
- ``suite``: what the suite chooses (:mod:`layers.machine`: the plan, and :class:`tasks.cli.runtime.ThreadsFollowLoad`);
- ``one-thread``: ``OMP_NUM_THREADS=1``, for reference;
- ``passive``: ``OMP_WAIT_POLICY=PASSIVE``, for reference.

Each variant runs quiet and then with ``python -c "while True: pass"`` beside it; best of ``--repeats``.
Writes ``results_threads.md`` beside this file (or ``--output``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning.pytorch import Callback

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

class DemoTimer(Callback):
    """Times training steps ``warmup`` .. the last, and the main process's wait for each of their batches (the
    gap between one step's end and the next one's start: loading, as the demo loads in its main process).
    Writes ``{"steps_s": ..., "batch_ms": median wait}`` to ``output``."""

    def __init__(self, output: str, warmup: int = 5):
        self.output, self.warmup = output, warmup
        self.start = self.batch_end = None
        self.waits = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()
        if self.start is not None and self.batch_end is not None:
            self.waits.append(time.perf_counter() - self.batch_end)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batch_end = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        Path(self.output).write_text(json.dumps({"steps_s": time.perf_counter() - self.start,
                                                 "batch_ms": 1000 * statistics.median(self.waits)}))


def child_env(variant: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(VARIANTS[variant], WANDB_MODE="offline", NO_ALBUMENTATIONS_UPDATE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(REPO / "benchmarks"), env.get("PYTHONPATH")])))
    return env


def time_demo(variant: str, args, work: Path) -> dict:
    """Seconds of ``args.steps`` demo training steps after ``args.warmup``, and the median batch wait."""
    out = work / f"{variant}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "tasks.detect", "fit", "--trainer.logger", "false",
               "--trainer.max_steps", str(args.warmup + args.steps), "--trainer.limit_val_batches", "0",
               "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
               "--trainer.default_root_dir", str(work / variant), "--trainer.callbacks+=bench_threads.DemoTimer",
               "--trainer.callbacks.init_args.output", str(out), "--trainer.callbacks.init_args.warmup", str(args.warmup)]
    proc = subprocess.run(command, cwd=work, env=child_env(variant), capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{variant}: the demo fit failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def measure(variant: str, busy: bool, args, work: Path) -> dict:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        best = min((time_demo(variant, args, work) for _ in range(args.repeats)), key=lambda r: r["steps_s"])
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return {"variant": variant, "busy": busy, **best}


def markdown(rows: list[dict], args) -> str:
    by = {(r["variant"], r["busy"]): r for r in rows}
    lines = [f"`python benchmarks/bench_threads.py {' '.join(args.argv)}` ({os.cpu_count()} cores, "
             f"{time.strftime('%Y-%m-%d')}; best of {args.repeats})", "",
             f"| variant | {args.steps} steps quiet s | beside a busy process s | busy / quiet | busy / suite quiet "
             "| batch wait quiet ms | busy ms |",
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
