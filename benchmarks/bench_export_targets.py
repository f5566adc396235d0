"""One table per checkpoint: each export target's file size, latency at batch 1 and 8 beside eager PyTorch,
and its score on the test split beside the checkpoint's (``export --format all --int8 true``).

    python benchmarks/bench_export_targets.py classify=runs/classify/checkpoints/last.ckpt \\
        detect=runs/detect/checkpoints/last.ckpt --reps 7 [--out table.md]

Each checkpoint is exported by the ``export`` command's own code (:mod:`tasks.export.command`) into a
temporary folder, with tensor and metric parity checked as the command checks them. Latency is the
median over ``--reps`` calls of the **process CPU time** of one call (every thread's CPU, so another
process's load on a shared machine does not inflate it; a runtime that spreads a call over threads is
charged for all of them), on seeded inputs at the export size: images for the image tasks (the program's
graph: the raw SSDLite head outside ONNX, the head with NMS inside ONNX), greedy translation of
1 / 8 seeded random sources of up to 16 tokens for translation. Eager is the same graph in PyTorch, in the same process.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cpu_ms(call, reps: int) -> float:
    """Median process CPU time of ``call()`` in ms over ``reps`` calls, after one warm-up call."""
    call()
    times = []
    for _ in range(reps):
        start = time.process_time()
        call()
        times.append((time.process_time() - start) * 1000)
    return statistics.median(times)


def size_mb(files) -> float:
    total = 0
    for f in files:
        if f.name.endswith(".json"):
            continue
        total += sum(p.stat().st_size for p in f.rglob("*") if p.is_file()) if f.is_dir() else f.stat().st_size
    return total / 2 ** 20


def batch_call(job, task: str, run, batch: int):
    """A call of ``run`` (an exported program, or ``None`` for eager) on a batch of ``batch`` inputs."""
    model = job.request.model
    if task == "translate":
        from tasks.export.translation import GraphTranslator, metadata_of, random_sources

        src = random_sources(batch, 16, model, torch.Generator().manual_seed(0))
        if run is None:
            return lambda: model.translate(src, beam_size=1)
        translator = GraphTranslator(run["encoder"], run["decoder_step"], metadata_of(model), model.tokenizer)
        return lambda: translator.translate_ids(src, beam_size=1)
    program = job.exporter.program(job.request)
    graph = program.graphs[0]
    size = graph.example_inputs[0].shape[-1]
    images = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))
    if run is None:
        return lambda: graph.module(images)
    return lambda: run["model"](images)


def bench_checkpoint(task: str, ckpt: Path, reps: int, calibration: int) -> list[str]:
    import importlib

    from configs.tasks import task_declaration
    from tasks.export.command import export_targets, prepare_export
    from tasks.export.programs import Refused

    model_module, class_name = task_declaration(task).module.rsplit(".", 1)
    model_class = getattr(importlib.import_module(model_module), class_name)
    work = Path(tempfile.mkdtemp(prefix=f"bench-export-{task}-"))
    copy = shutil.copy(ckpt, work / "model.ckpt")
    job = prepare_export(["--ckpt_path", str(copy), "--format", "all", "--int8", "true",
                          "--calibration", str(calibration)], model_class)
    rows, refused = [], []
    with torch.no_grad():
        eager = [cpu_ms(batch_call(job, task, None, b), reps) for b in (1, 8)]
        checkpoint_score = job.scorer.checkpoint
        ckpt_mb = sum(p.numel() * p.element_size() for p in job.request.model.state_dict().values()) / 2 ** 20
        rows.append(f"| eager PyTorch | {ckpt_mb:.2f} | {eager[0]:.1f} | {eager[1]:.1f} | {checkpoint_score:.2f} | - |")
        for done in export_targets(job):
            if isinstance(done, Refused):
                refused.append(str(done))
                continue
            score = next((c for c in done.report.checks if hasattr(c, "checkpoint")), None)
            name = f"{done.target}{' int8' if done.int8 else ''}"
            if not done.runners:
                rows.append(f"| {name} | {size_mb(done.report.files):.2f} | needs macOS | needs macOS | - | - |")
                continue
            latency = [cpu_ms(batch_call(job, task, done.runners, b), reps) for b in (1, 8)]
            ok = "" if done.report.ok else " FAILED"
            rows.append(f"| {name} | {size_mb(done.report.files):.2f} | {latency[0]:.1f} | {latency[1]:.1f} | "
                        f"{score.exported:.2f} | {score.difference:+.2f}{ok} |")
    metric = job.scorer.metric
    table = [f"### {task}: {ckpt}", "", f"score: {metric} in points on {job.scorer.where}; latency: median process "
             f"CPU ms per call over {reps} calls", "",
             "| format | size MB | batch 1 ms | batch 8 ms | score | difference |", "| --- | ---: | ---: | ---: | ---: | ---: |",
             *rows, ""]
    table += [f"refused: {line}" for line in refused] + ([""] if refused else [])
    shutil.rmtree(work, ignore_errors=True)
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="task=path/to/last.ckpt")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calibration", type=int, default=64)
    parser.add_argument("--out", default=None, help="also append the tables to this file")
    args = parser.parse_args(argv)
    for item in args.checkpoints:
        task, _, path = item.partition("=")
        lines = bench_checkpoint(task, Path(path), args.reps, args.calibration)
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(text)


if __name__ == "__main__":
    main()
