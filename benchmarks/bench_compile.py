"""What ``--model.compile`` costs and gains through the real CLI.

    python benchmarks/bench_compile.py                                   # CPU: the classification demo
    python benchmarks/bench_compile.py --tasks classify detect segment translate \\
        --accelerator gpu --precision bf16-mixed                         # a GPU machine

For each task and each of ``--modes`` (``false``, ``network``, ``regional``), it runs
``python -m tasks.<task> fit`` of the task's demo recipe for one epoch (``--max-epochs``), with its
validation, in a child process, twice: first with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``
a fresh folder: what a user's first run pays), then again with the cache the first run filled (a
later run of the same model). It reads from the run's output what the task reports
(:class:`tasks.engine.compile_report.CompileReport`: the first and second training and validation steps)
and takes the wall time of the whole command, start-up included. Runs go one at a time; run it on an
otherwise quiet machine.

``--steady``: instead, the steady training step of the demo classification network in one process,
eager, regional and network-compiled side by side (forward, loss, backward, AdamW step on one fixed
batch of the recipe's size; after two warm-up steps each, the three are timed in turn, best of
``--reps`` each), on the accelerator's device.

Writes ``benchmarks/results_compile.md`` (``--output``) and prints the table.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP = re.compile(r"compile: the first (train|validation) step took ([\d.]+) s \(compilation included\), "
                  r"the next ([\d.]+) s")


def run_fit(task: str, mode: str, cache: str, args) -> dict:
    root = tempfile.mkdtemp(prefix=f"bench-compile-{task}-{mode}-")
    command = [sys.executable, "-m", f"tasks.{task}", "fit", "--model.compile", mode,
               "--trainer.max_epochs", str(args.max_epochs), "--trainer.default_root_dir", root,
               "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", "--trainer.accelerator", args.accelerator,
               "--trainer.precision", args.precision, *args.extra]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, WANDB_MODE="offline", NO_ALBUMENTATIONS_UPDATE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    row = {"task": task, "mode": mode, "wall_s": wall}
    for stage, first, second in STEP.findall(proc.stdout + proc.stderr):
        row[f"first_{stage}_s"], row[f"next_{stage}_s"] = float(first), float(second)
    return row


def steady_steps(args) -> str:
    """Best-of-``reps`` training step of the classification demo network: eager, regional, network."""
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO))
    from gpu_suite import RECIPES, build_task, compute_loss, make_batch, make_optimizer

    device = torch.device("cuda" if args.accelerator in ("gpu", "cuda") else "cpu")
    recipe = next(r for r in RECIPES if r.task == "classify" and r.name == "demo")
    inputs, target = make_batch(recipe, device)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(model, optimizer) -> float:
        synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        compute_loss(model, recipe, model(*inputs), target).backward()
        optimizer.step()
        synchronize()
        return time.perf_counter() - start

    modes = ("off", "regional", "network")
    models, first, best = {}, {}, {}
    for mode in modes:  # built and compiled one after the other (first step = compilation + one step) ...
        torch.manual_seed(0)
        model = build_task(recipe).to(device)
        model.compile_mode = None if mode == "off" else mode
        model.configure_model()
        models[mode] = (model, make_optimizer(model, recipe))
        first[mode] = step(*models[mode])
        step(*models[mode])
    for _ in range(args.reps):  # ... then timed interleaved, so that drift of a shared machine hits all alike
        for mode in modes:
            best[mode] = min(best.get(mode, float("inf")), step(*models[mode]))
    results = {mode: (first[mode], best[mode]) for mode in modes}
    lines = ["| --model.compile | first step s | steady step ms (best of %d) | vs eager |" % args.reps,
             "| --- | ---: | ---: | ---: |"]
    for mode, (first, best) in results.items():
        lines.append(f"| {mode} | {first:.1f} | {best * 1000:.1f} | {results['off'][1] / best:.2f}x |")
    return "\n".join(lines)


def fmt(value: float | None) -> str:
    return "-" if value is None else (f"{value:.1f}" if value >= 1 else f"{value:.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=["classify"], choices=["classify", "detect", "segment", "translate"])
    p.add_argument("--modes", nargs="+", default=["false", "regional", "network"])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--max-epochs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results_compile.md")
    p.add_argument("--steady", action="store_true", help="the steady step in one process instead (see above)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("extra", nargs="*", help="more CLI flags for every run (after --)")
    args = p.parse_args(argv)
    command = "python benchmarks/bench_compile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.steady:
        text = f"`{command}`\n\n" + steady_steps(args) + "\n"
        print(text)
        args.output.with_name(args.output.stem + "_steady.md").write_text(text)
        return 0

    rows = []
    for task in args.tasks:
        for mode in args.modes:
            cache = tempfile.mkdtemp(prefix="inductor-cache-")
            for state in ("cold", "warm"):
                if mode == "false" and state == "warm":
                    continue
                row = run_fit(task, mode, cache, args) | {"cache": state if mode != "false" else "-"}
                rows.append(row)
                print(f"{task} compile={mode} cache={row['cache']}: {row['wall_s']:.1f} s", flush=True)

    eager = {r["task"]: r["wall_s"] for r in rows if r["mode"] == "false"}
    lines = [
        "| task | --model.compile | inductor cache | fit wall s | vs eager | first train step s | next train step s "
        "| first validation step s | next validation step s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        extra = r["wall_s"] - eager[r["task"]] if r["task"] in eager and r["mode"] != "false" else None
        lines.append(f"| {r['task']} | {r['mode']} | {r['cache']} | {r['wall_s']:.1f} | "
                     f"{'-' if extra is None else f'{extra:+.1f} s'} | {fmt(r.get('first_train_s'))} | "
                     f"{fmt(r.get('next_train_s'))} | {fmt(r.get('first_validation_s'))} | "
                     f"{fmt(r.get('next_validation_s'))} |")
    text = f"`{command}`\n\n" + "\n".join(lines) + "\n"
    args.output.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
