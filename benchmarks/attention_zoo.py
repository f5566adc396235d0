"""The attention zoo on vision and language: every attention variant of ``layers.attention``
trained on the classification demo (MobileViTv2-0.5's token mixer) and the translation demo (the
Transformer encoder's self-attention), for several seeds, then one table through ``tasks.tools.report``.

Each run is the task's own CLI on a shipped recipe (``configs/classify/demo_mobilevitv2*.yaml``,
``configs/translate/demo_transformer*.yaml``): ``fit`` with ``--seed_everything S`` into
``OUT/<task>/<variant>/seed<S>``, then ``test`` on the best checkpoint, which writes
``predictions/metrics.json`` (metric, params, GFLOPs). The latency phase adds batch-1 CPU latency
of the tested model's forward at its FLOPs input (median of ``--repeats`` after warm-up, one
thread, every model in this one process, alternating) as ``predictions/latency.json``. Finally
``python -m tasks.tools.report`` groups the seeds into mean +- std.

    nice python benchmarks/attention_zoo.py --out runs/zoo                   # all: 2 tasks x 5 variants x 3 seeds
    python benchmarks/attention_zoo.py --out runs/zoo --tasks classify --seeds 0 --epochs classify=2
    python benchmarks/attention_zoo.py --out runs/zoo --phases latency report   # re-measure, re-tabulate

A run that already has its ``metrics.json`` is not trained again, so an interrupted sweep resumes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

VARIANTS = ["separable", "mha", "linformer", "synthesizer_dense", "synthesizer_random"]
RECIPES = {
    "classify": {"separable": "demo_mobilevitv2.yaml", **{v: f"demo_mobilevitv2_{v}.yaml" for v in VARIANTS[1:]}},
    "translate": {"mha": "demo_transformer.yaml", **{v: f"demo_transformer_{v}.yaml" for v in VARIANTS if v != "mha"}},
}
#: a fifth / a quarter of the demo recipes' schedules (15 and 12 epochs; the classification
#: cosine schedule follows the shorter run), so that 30 runs fit in well under an hour on 2 cores: a comparison of
#: the variants at equal, short training, not their converged quality
EPOCHS = {"classify": 3, "translate": 3}


def run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def train_and_test(task: str, variant: str, seed: int, run_dir: Path, epochs: int) -> float:
    """Fit then test one run; returns the wall time in seconds (0 when it was already done)."""
    if (run_dir / "predictions" / "metrics.json").is_file():
        return 0.0
    if run_dir.exists():  # an interrupted run starts afresh: its checkpoints would be mistaken for this one's
        shutil.rmtree(run_dir)
    recipe = str(REPO / "configs" / task / RECIPES[task][variant])
    common = ["--config", recipe, "--seed_everything", str(seed), "--trainer.default_root_dir", str(run_dir),
              "--trainer.logger", "false"]
    start = time.perf_counter()
    run([sys.executable, "-m", f"tasks.{task}", "fit", *common, "--trainer.max_epochs", str(epochs)])
    best = sorted((run_dir / "checkpoints").glob("best-*.ckpt"))
    run([sys.executable, "-m", f"tasks.{task}", "test", *common, "--ckpt_path", str(best[-1] if best else "last")])
    return time.perf_counter() - start


def measure_latency(run_dirs: list[Path], repeats: int) -> None:
    """Median batch-1 forward latency of each run's tested model, measured round-robin in this
    process (one thread) so that every model sees the same machine state."""
    import torch

    from tasks.engine.checkpoints import read_checkpoint
    from tasks.classify import ClassificationTask
    from tasks.translate import TranslationTask

    torch.set_num_threads(1)
    models = {}
    for run_dir in run_dirs:
        best = sorted((run_dir / "checkpoints").glob("best-*.ckpt")) or [run_dir / "checkpoints" / "last.ckpt"]
        checkpoint = read_checkpoint(best[-1])
        task_class = TranslationTask if "translate" in checkpoint.get("suite_task", "") else ClassificationTask
        model = task_class.load_from_checkpoint(best[-1], map_location="cpu").eval()
        if task_class is ClassificationTask:  # at the size the run evaluated
            size = checkpoint["datamodule_hyper_parameters"]["image_size"]
            example = (torch.zeros(1, 3, size, size),)
        else:
            example = model.example_input(None)
        models[run_dir] = (model, example)
    times: dict[Path, list[float]] = {d: [] for d in run_dirs}
    with torch.inference_mode():
        for model, example in models.values():
            for _ in range(3):
                model(*example)
        for _ in range(repeats):
            for run_dir, (model, example) in models.items():
                start = time.perf_counter()
                model(*example)
                times[run_dir].append((time.perf_counter() - start) * 1e3)
    for run_dir, samples in times.items():
        path = run_dir / "predictions" / "latency.json"
        path.write_text(json.dumps({"latency_ms": statistics.median(samples)}, indent=2) + "\n")
        print(f"{run_dir}: {statistics.median(samples):.2f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "zoo")
    parser.add_argument("--tasks", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", nargs="*", default=[], help="task=N overrides, e.g. classify=3")
    parser.add_argument("--repeats", type=int, default=50, help="latency samples per model")
    parser.add_argument("--phases", nargs="+", default=["train", "latency", "report"],
                        choices=["train", "latency", "report"])
    args = parser.parse_args()
    epochs = EPOCHS | {k: int(v) for k, v in (item.split("=") for item in args.epochs)}
    runs = [(task, variant, seed, args.out / task / variant / f"seed{seed}")
            for task in args.tasks for variant in args.variants for seed in args.seeds]
    if "train" in args.phases:
        start = time.perf_counter()
        for task, variant, seed, run_dir in runs:
            seconds = train_and_test(task, variant, seed, run_dir, epochs[task])
            print(f"{task} {variant} seed {seed}: {seconds:.0f} s", flush=True)
        print(f"training and testing took {time.perf_counter() - start:.0f} s", flush=True)
    if "latency" in args.phases:
        measure_latency([run_dir for *_, run_dir in runs], args.repeats)
    if "report" in args.phases:
        for task in args.tasks:
            run([sys.executable, "-m", "tasks.tools.report", str(args.out / task), "--output", str(args.out / task / "report")])
            print((args.out / task / "report" / "report.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
