"""Every task's real CLI on a device, end to end (issue 31, part 1): the commands a user runs.

    python benchmarks/gpu_cli.py --output $OUT                  # CUDA machine: 4 tasks x 10 cells, ~5 min
    python benchmarks/gpu_cli.py --accelerator cpu --tiny       # CPU smoke run (tests/test_gpu_cli.py)

For each task (classify, detect, segment, translate) it runs ``python -m tasks.<task>`` on the demo
recipe, a short fit (``--steps`` training steps, one validation), in child processes, and checks
what each command promises:

==================  ===========================================================================
``fit_bf16``        ``fit --trainer.precision bf16-mixed``: exit 0, finite losses, ``last.ckpt``
``fit_fp16``        ``fit --trainer.precision 16-mixed`` (gradient scaling): the same
``test``            ``test`` of the bf16 checkpoint: ``metrics.json`` with the task's metric
``predict``         ``predict`` of the bf16 checkpoint on demo inputs: one output per input
``export``          ``export`` of the bf16 checkpoint: ONNX Runtime parity lines, none failed
``resume``          ``fit`` stopped by SIGTERM after step 2 (exit 143), resumed with ``--ckpt_path
                    last``: weights and optimizer state equal to an uninterrupted run's (both
                    with ``--trainer.deterministic warn``); the largest difference is reported
``channels_last``   ``fit --model.channels_last true`` (image tasks)
``compile_*``       ``fit --model.compile regional`` and ``network``: the first and next training
                    step's seconds as the task reports them (compilation included in the first)
==================  ===========================================================================

Tasks run side by side (``--jobs``, default 4: one GPU holds the four demo models many times
over), cells of a task in order. Each cell's command, exit code, seconds and the end of its output
go to ``gpu_cli.json``; ``gpu_cli.md`` is the table. A failed cell does not stop the others, and
the files are rewritten after every cell, so a run cut short still leaves its table.

``--tiny``: CPU-sized inputs (the contract tests' sizes), no fp16 or compiled cells (fp16 autocast
is a GPU setting; inductor's C++ builds take minutes on a CPU); it exists so that this script
cannot rot. ``--cells`` picks cells (``fit_bf16`` is always run: the others read its checkpoint).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASKS = ("classify", "detect", "segment", "translate")
CELLS = ("fit_bf16", "fit_fp16", "test", "predict", "export", "resume", "channels_last", "compile_regional",
         "compile_network")
METRIC = {"classify": "test/top1", "detect": "test/map", "segment": "test/miou", "translate": "test/bleu"}
#: the contract tests' CPU sizes (tests/test_contract.py TINY)
TINY = {
    "classify": ["--data.image_size", "32", "--data.eval_resize", "32", "--data.batch_size", "16",
                 "--model.scheduler.init_args.warmup_steps", "2"],
    "detect": ["--data.image_size", "64", "--data.batch_size", "4", "--data.eval_batch_size", "4"],
    "segment": ["--data.crop_size", "64", "--data.scale_range", "[0.75, 1.25]", "--data.batch_size", "4",
                "--data.eval_short_side", "null"],
    "translate": ["--model.encoder_depth", "1", "--model.decoder_depth", "1", "--model.num_heads", "2",
                  "--model.max_len_b", "4", "--model.beam_size", "2", "--data.vocab_size", "500",
                  "--data.max_tokens", "512", "--data.eval_max_tokens", "4096"],
}
STEP = re.compile(r"compile: the first train step took ([\d.]+) s \(compilation included\), the next ([\d.]+) s")


class TaskRun:
    """The cells of one task, in order, in their own folder."""

    def __init__(self, task: str, args, report: "Report"):
        self.task, self.args, self.report = task, args, report
        self.root = args.work / task
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        self.base = ["--trainer.accelerator", args.accelerator, "--trainer.devices", "1",
                     "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
                     "--data.num_workers", str(args.num_workers), *(TINY[task] if args.tiny else [])]
        self.short = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", str(args.steps),
                      "--trainer.limit_val_batches", "2", "--trainer.num_sanity_val_steps", "0"]

    def cli(self, name: str, *args: str, expect: int = 0) -> tuple[subprocess.CompletedProcess, float]:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   WANDB_MODE="offline", NO_ALBUMENTATIONS_UPDATE="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
        command = [sys.executable, "-m", f"tasks.{self.task}", *args]
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=self.root, env=env, capture_output=True, text=True,
                              timeout=self.args.cell_timeout)
        seconds = time.perf_counter() - start
        (self.root / f"{name}.log").write_text(" ".join(command) + "\n\n" + proc.stdout + "\n" + proc.stderr)
        if proc.returncode != expect:
            raise CellError(f"exit {proc.returncode} (expected {expect}): {tail(proc)}")
        return proc, seconds

    def fit(self, name: str, *args: str) -> tuple[Path, subprocess.CompletedProcess, float]:
        run_dir = self.root / name
        proc, seconds = self.cli(name, "fit", *self.base, *self.short, "--trainer.default_root_dir", str(run_dir),
                                 *args)
        last = run_dir / "checkpoints" / "last.ckpt"
        if not last.exists():
            raise CellError(f"no {last}")
        return last, proc, seconds

    def run(self) -> None:
        for cell in self.args.cells:
            if cell == "channels_last" and self.task == "translate":
                continue
            if self.args.tiny and (cell == "fit_fp16" or cell.startswith("compile")):
                self.report.add(self.task, cell, "skipped", 0.0, "CPU smoke run: a GPU setting")
                continue
            start = time.perf_counter()
            try:
                detail = getattr(self, cell)()
                status = "ok"
            except CellError as error:
                status, detail = "failed", str(error)
            except subprocess.TimeoutExpired as error:
                status, detail = "failed", f"timed out after {error.timeout:.0f} s"
            self.report.add(self.task, cell, status, time.perf_counter() - start, detail)
            if cell == "fit_bf16" and status != "ok":
                for rest in self.args.cells[1:]:
                    self.report.add(self.task, rest, "skipped", 0.0, "fit_bf16 failed")
                return

    # -- the cells ---------------------------------------------------------------------------------
    def fit_bf16(self) -> str:
        last, proc, seconds = self.fit("fit_bf16", "--trainer.precision", "bf16-mixed")
        return f"{seconds:.1f} s; {losses(last)}"

    def fit_fp16(self) -> str:
        last, proc, seconds = self.fit("fit_fp16", "--trainer.precision", "16-mixed")
        return f"{seconds:.1f} s; {losses(last)}"

    @property
    def checkpoint(self) -> Path:
        return self.root / "fit_bf16" / "checkpoints" / "last.ckpt"

    def test(self) -> str:
        out = self.root / "test"
        self.cli("test", "test", "--ckpt_path", str(self.checkpoint), *self.base, "--trainer.limit_test_batches", "4",
                 "--trainer.default_root_dir", str(out))
        metrics = json.loads(next(out.rglob("metrics.json")).read_text())
        value = metrics.get(METRIC[self.task])
        if value is None or not math.isfinite(value):
            raise CellError(f"metrics.json has no finite {METRIC[self.task]}: {sorted(metrics)}")
        return f"{METRIC[self.task]} = {value:.4g} (4 batches of a {self.args.steps}-step model)"

    def predict(self) -> str:
        source = predict_input(self.task, self.root / "predict_input")
        out = self.root / "predict"
        extra = ["--model.predict_output", str(out / "out.txt")] if self.task == "translate" else []
        self.cli("predict", "predict", "--ckpt_path", str(self.checkpoint), "--trainer.accelerator", self.args.accelerator,
                 "--trainer.devices", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                 "--data.predict_path", str(source), "--trainer.default_root_dir", str(out), *extra)
        if self.task == "translate":
            lines = (out / "out.txt").read_text(encoding="utf-8").splitlines()
            if len(lines) != 3:
                raise CellError(f"3 sentences in, {len(lines)} translations out")
            return "3 sentences, 3 translations"
        written = {"classify": "predictions.csv", "detect": "*.json", "segment": "masks/*.png"}[self.task]
        found = list((out / "predictions" / "predict").glob(written))
        expected = 1 if self.task == "classify" else 3
        if len(found) != expected:
            raise CellError(f"{len(found)} files {written} under {out / 'predictions' / 'predict'}, expected {expected}")
        return f"3 images: {expected} x {written}"

    def export(self) -> str:
        proc, _ = self.cli("export", "export", "--ckpt_path", str(self.checkpoint),
                           "--output", str(self.root / "export" / "model.onnx"))
        parity = [line.strip() for line in proc.stdout.splitlines() if "parity:" in line]
        if not parity or any("FAILED" in line for line in parity):
            raise CellError("parity: " + (" / ".join(parity) or f"no parity lines: {tail(proc)}"))
        return " / ".join(parity)[:300]

    def resume(self) -> str:
        import torch

        run = ["--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1",
               "--trainer.num_sanity_val_steps", "0", "--trainer.deterministic", "warn", "--seed_everything", "0",
               "--checkpoint.every_n_train_steps", "100"]
        base = self.base
        self.cli("resume_straight", "fit", *base, *run, "--trainer.default_root_dir", str(self.root / "straight"))
        self.cli("resume_stopped", "fit", *base, *run, "--trainer.default_root_dir", str(self.root / "resumed"),
                 "--trainer.callbacks+=tests.callbacks.SignalAtStep", "--trainer.callbacks.init_args.step", "2",
                 expect=143)
        self.cli("resume_resumed", "fit", *base, *run, "--trainer.default_root_dir", str(self.root / "resumed"),
                 "--ckpt_path", "last")
        straight = torch.load(self.root / "straight/checkpoints/last.ckpt", weights_only=True, map_location="cpu")
        resumed = torch.load(self.root / "resumed/checkpoints/last.ckpt", weights_only=True, map_location="cpu")
        if straight["global_step"] != resumed["global_step"]:
            raise CellError(f"global step {resumed['global_step']} after the resume, {straight['global_step']} straight")
        worst = max((float((a.double() - resumed["state_dict"][k].double()).abs().max())
                     for k, a in straight["state_dict"].items() if a.is_floating_point() and a.numel()), default=0.0)
        optimizer = max((float((v.double() - resumed["optimizer_states"][0]["state"][i][n].double()).abs().max())
                         for i, state in straight["optimizer_states"][0]["state"].items() for n, v in state.items()
                         if torch.is_tensor(v) and v.is_floating_point() and v.numel()), default=0.0)
        if worst or optimizer:
            raise CellError(f"resumed run differs: weights by up to {worst:.3g}, optimizer state by {optimizer:.3g}")
        return f"step {straight['global_step']}: weights and optimizer state equal"

    def channels_last(self) -> str:
        last, _, seconds = self.fit("channels_last", "--trainer.precision", "bf16-mixed",
                                    "--model.channels_last", "true")
        return f"{seconds:.1f} s; {losses(last)}"

    def _compiled(self, mode: str) -> str:
        last, proc, seconds = self.fit(f"compile_{mode}", "--trainer.precision", "bf16-mixed", "--model.compile", mode)
        found = STEP.search(proc.stdout + proc.stderr)
        steps = f"first step {found[1]} s, next {found[2]} s" if found else "no compile report"
        return f"{seconds:.1f} s; {steps}; {losses(last)}"

    def compile_regional(self) -> str:
        return self._compiled("regional")

    def compile_network(self) -> str:
        return self._compiled("network")


class CellError(Exception):
    pass


def tail(proc: subprocess.CompletedProcess, chars: int = 1500) -> str:
    return (proc.stderr or proc.stdout)[-chars:].replace("\n", " / ")


def losses(checkpoint: Path) -> str:
    """The checkpoint's weights are finite (a non-finite loss would have stopped the fit)."""
    import torch

    state = torch.load(checkpoint, weights_only=True, map_location="cpu")
    bad = [k for k, v in state["state_dict"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise CellError(f"non-finite weights in {checkpoint}: {bad[:5]}")
    return f"step {state['global_step']}, weights finite"


def predict_input(task: str, folder: Path) -> Path:
    """Three demo inputs (the demo datasets are in the data cache once a fit has run)."""
    folder.mkdir(parents=True, exist_ok=True)
    if task == "translate":
        path = folder / "input.en"
        path.write_text("Germany\nFrance\nUnited Kingdom\n", encoding="utf-8")
        return path
    from datamodules.demo import cache_home

    prefix, pattern = {"classify": ("digits-imagefolder", "test/*/*.png"), "detect": ("coco-digits", "val2017/*.jpg"),
                       "segment": ("digits-voc", "JPEGImages/test_*.jpg")}[task]
    found = sorted(p for p in cache_home().glob(f"{prefix}-v*") if p.is_dir())
    if not found:
        raise CellError(f"no demo dataset {prefix}-v* in {cache_home()}")
    for image in sorted(found[-1].glob(pattern))[:3]:
        shutil.copy(image, folder / image.name)
    return folder


class Report:
    def __init__(self, args):
        self.args, self.rows, self.lock = args, [], threading.Lock()
        self.meta = {"command": "python benchmarks/gpu_cli.py " + " ".join(sys.argv[1:]), "device": device_name(args),
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def add(self, task: str, cell: str, status: str, seconds: float, detail: str) -> None:
        with self.lock:
            self.rows.append({"task": task, "cell": cell, "status": status, "seconds": round(seconds, 1),
                              "detail": detail})
            print(f"{task:<9} {cell:<17} {status:<7} {seconds:6.1f} s  {detail[:200]}", flush=True)
            self.write()

    def write(self) -> None:
        self.args.output.mkdir(parents=True, exist_ok=True)
        rows = sorted(self.rows, key=lambda r: (TASKS.index(r["task"]), CELLS.index(r["cell"])))
        (self.args.output / "gpu_cli.json").write_text(json.dumps({"meta": self.meta, "rows": rows}, indent=1))
        lines = [f"`{self.meta['command']}` on {self.meta['device']}, {self.meta['started']}", "",
                 "| task | cell | status | s | detail |", "| --- | --- | --- | ---: | --- |"]
        lines += [f"| {r['task']} | {r['cell']} | {r['status']} | {r['seconds']} | {r['detail'].replace('|', '/')[:400]} |"
                  for r in rows]
        (self.args.output / "gpu_cli.md").write_text("\n".join(lines) + "\n")


def device_name(args) -> str:
    import torch

    if args.accelerator in ("gpu", "cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU, torch {torch.__version__}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--cells", nargs="+", choices=CELLS, default=list(CELLS))
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--tiny", action="store_true", help="CPU-sized inputs; no fp16 or compiled cells")
    p.add_argument("--steps", type=int, default=None, help="training steps of each fit (default 20; --tiny 3)")
    p.add_argument("--num-workers", type=int, default=None, help="loader workers (default 3; --tiny 0)")
    p.add_argument("--jobs", type=int, default=4, help="tasks run side by side")
    p.add_argument("--cell-timeout", type=float, default=480)
    p.add_argument("--work", type=Path, default=None, help="run folders (default: <output>/work)")
    p.add_argument("--output", type=Path, default=REPO / "benchmarks" / "gpu_results")
    args = p.parse_args(argv)
    args.steps = args.steps or (3 if args.tiny else 20)
    args.num_workers = args.num_workers if args.num_workers is not None else (0 if args.tiny else 3)
    args.work = args.work or args.output / "work"
    args.cells = ["fit_bf16"] + [c for c in args.cells if c != "fit_bf16"]
    sys.path.insert(0, str(REPO))
    report = Report(args)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(lambda task: TaskRun(task, args, report).run(), args.tasks))
    failed = [r for r in report.rows if r["status"] == "failed"]
    print(f"{len(report.rows)} cells, {len(failed)} failed; {args.output / 'gpu_cli.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
