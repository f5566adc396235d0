"""One table per checkpoint: each export target's file size, latency at batch 1 and 8 beside eager PyTorch,
and its score on the test split beside the checkpoint's (``export --format all --int8 true``).

    python benchmarks/bench_export_targets.py classify=runs/classify/checkpoints/last.ckpt \\
        segment=runs/segment/checkpoints/last.ckpt --export_args "segment=--data.crop_size 128" --reps 7 \\
        [--out table.md]

Each checkpoint is exported by the ``export`` command's own code (:mod:`tasks.export.command`) into a
temporary folder, with tensor and metric parity checked as the command checks them; each export's report
is printed as the command prints it. ``--export_args TASK=ARGS`` adds ``export`` options for one task's
checkpoint (segmentation: ``--data.crop_size`` at the test images' size, since ExecuTorch's image programs
are static). Latency is the median over ``--reps`` calls, after one warm-up call, of the wall-clock time
and of the **process CPU time** of one call (every thread's CPU: on a shared machine another process's
load inflates the wall time and not the CPU time, while a runtime whose worker threads spin-wait is
charged for the spinning), on seeded inputs at the export size: images for the image tasks (the
program's graph: the raw SSDLite head outside ONNX, the head with NMS inside ONNX), greedy translation
of 1 / 8 seeded random sources of up to 16 tokens for translation. Eager is the same graph in PyTorch,
in the same process.
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def latency_ms(call, reps: int) -> tuple[float, float]:
    """(median wall-clock ms, median process CPU ms) of ``call()`` over ``reps`` calls, after one warm-up call."""
    call()
    wall, cpu = [], []
    for _ in range(reps):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        call()
        wall.append((time.perf_counter() - start_wall) * 1000)
        cpu.append((time.process_time() - start_cpu) * 1000)
    return statistics.median(wall), statistics.median(cpu)


def latency_cells(job, task: str, runners, reps: int) -> str:
    """``| wall / CPU at batch 1 | wall / CPU at batch 8 |`` of ``runners`` (``None``: eager)."""
    return " | ".join("{:.1f} / {:.1f}".format(*latency_ms(batch_call(job, task, runners, b), reps)) for b in (1, 8))


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


def bench_checkpoint(task: str, ckpt: Path, reps: int, calibration: int, extra: list[str]) -> list[str]:
    import importlib

    from configs.tasks import task_declaration
    from tasks.export.command import export_targets, prepare_export, runnable
    from tasks.export.programs import Refused

    model_module, class_name = task_declaration(task).module.rsplit(".", 1)
    model_class = getattr(importlib.import_module(model_module), class_name)
    work = Path(tempfile.mkdtemp(prefix=f"bench-export-{task}-"))
    copy = shutil.copy(ckpt, work / "model.ckpt")
    command = ["--ckpt_path", str(copy), "--format", "all", "--int8", "true", "--calibration", str(calibration), *extra]
    job = prepare_export(command, model_class)
    rows, refused = [], []
    with torch.no_grad():
        eager = latency_cells(job, task, None, reps)
        checkpoint_score = job.scorer.checkpoint
        ckpt_mb = sum(p.numel() * p.element_size() for p in job.request.model.state_dict().values()) / 2 ** 20
        rows.append(f"| eager PyTorch | {ckpt_mb:.2f} | {eager} | {checkpoint_score:.2f} | - |")
        for done in export_targets(job):
            if isinstance(done, Refused):
                print(f"refused:   {done}", flush=True)
                refused.append(str(done))
                continue
            print(done.report, flush=True)
            score = next((c for c in done.report.checks if hasattr(c, "checkpoint")), None)
            name = f"{done.target}{' int8' if done.int8 else ''}"
            if not runnable(done.runners):
                rows.append(f"| {name} | {size_mb(done.report.files):.2f} | needs macOS | needs macOS | - | - |")
                continue
            ok = "" if done.report.ok else " FAILED"
            rows.append(f"| {name} | {size_mb(done.report.files):.2f} | {latency_cells(job, task, done.runners, reps)} | "
                        f"{score.exported:.2f} | {score.difference:+.2f}{ok} |")
    metric = job.scorer.metric
    table = [f"### {task}: {ckpt}", "", f"`export {' '.join(command[2:])}`; score: {metric} in points on "
             f"{job.scorer.where}; latency: median ms per call over {reps} calls, wall-clock / process CPU", "",
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
    parser.add_argument("--export_args", action="append", default=[], metavar="TASK=ARGS",
                        help="export options for TASK's checkpoint, e.g. 'segment=--data.crop_size 128'")
    parser.add_argument("--out", default=None, help="also append the tables to this file")
    args = parser.parse_args(argv)
    extra = {}
    for item in args.export_args:
        task, sep, options = item.partition("=")
        if not sep:
            parser.error(f"--export_args takes TASK=ARGS, got {item!r}")
        extra[task] = shlex.split(options)
    for item in args.checkpoints:
        task, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            parser.error(f"a checkpoint is given as task=path/to/file.ckpt, got {item!r}")
        lines = bench_checkpoint(task, Path(path), args.reps, args.calibration, extra.get(task, []))
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(text)


if __name__ == "__main__":
    main()
