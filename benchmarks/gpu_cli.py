"""Every task's real CLI on a device, end to end: the commands a user runs.

    python benchmarks/gpu_cli.py --output $OUT --budget-s 215   # CUDA machine: 4 tasks, ~3.5 min
    python benchmarks/gpu_cli.py --accelerator cpu --tiny       # CPU smoke run (tests/test_gpu_cli.py)

For each task (classify, detect, segment, translate) it runs ``python -m tasks.<task>`` on the demo
recipe, a short fit (``--steps`` training steps, one validation), in child processes, and checks
what each command promises:

==================  ===========================================================================
``fit_bf16``        ``fit --trainer.precision bf16-mixed``: exit 0, finite weights, ``last.ckpt``
``fit_fp16``        ``fit --trainer.precision 16-mixed`` (gradient scaling): the same
``test``            ``test`` of the bf16 checkpoint: ``metrics.json`` with the task's metric
``predict``         ``predict`` of the bf16 checkpoint on demo inputs: one output per input
``export``          ``export`` of the bf16 checkpoint: ONNX Runtime parity lines, none failed
``resume``          two epochs of two steps: a fit stopped by SIGTERM after step 1 (exit 143) and
                    resumed with ``--ckpt_path last``, beside two uninterrupted fits. The resumed
                    run's weights and optimizer state against the uninterrupted ones, judged by the
                    difference between the two uninterrupted ones (the noise floor: CUDA kernels
                    that add with atomics): ``exact``, ``within noise`` (at most
                    ``NOISE_FACTOR`` times the floor) or ``beyond`` (a failure). Runs with
                    ``--trainer.deterministic true`` where the task allows it on the device
                    (:mod:`tasks.cli.determinism`), else ``warn``
``channels_last``   ``fit --model.channels_last true`` (image tasks)
``compile_*``       ``fit --model.compile regional`` and ``network``: the first and next training
                    step's seconds as the task reports them (compilation included in the first)
==================  ===========================================================================

Cells of all tasks share ``--jobs`` slots (one GPU holds the demo models many times over), most
valuable first: every task's ``fit_bf16``, then ``resume`` (the longest: its first three fits run
side by side), ``test``, ``predict``, ``export``, ``fit_fp16``, ``channels_last``, the compiled
cells; ``test``/``predict``/``export`` wait for their task's ``fit_bf16``. With ``--budget-s`` no
cell starts after the budget and a running one is stopped at it (status ``cut``), so a run cut
short still reports every finished cell. Each cell's command, exit code, seconds and the end of its
output go to ``gpu_cli.json``; ``gpu_cli.md`` is the table; both are rewritten after every cell.

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
sys.path.insert(0, str(REPO))
from configs.tasks import task_declaration, task_names  # noqa: E402  (the repository, run as a script)

TASKS = tuple(task_names())
#: in order of value: the order cells start in
CELLS = ("fit_bf16", "resume", "test", "predict", "export", "fit_fp16", "channels_last", "compile_regional",
         "compile_network")
NEEDS_CHECKPOINT = {"test", "predict", "export"}
#: a resumed run whose difference from the uninterrupted runs is at most this many times theirs from each
#: other is "within noise": three runs that differ only by atomics' order are three draws of one noise
NOISE_FACTOR = 4.0
STEP = re.compile(r"compile: the first train step took ([\d.]+) s \(compilation included\), the next ([\d.]+) s")


class CellError(Exception):
    pass


class CellCut(Exception):
    """The time budget ran out while the cell's command ran."""


class TaskRun:
    """The cells of one task, each in its own folder under ``<work>/<task>``."""

    def __init__(self, task: str, args, deadline: float | None):
        self.task, self.args, self.deadline = task, args, deadline
        self.root = args.work / task
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        self.common = ["--trainer.accelerator", args.accelerator, "--trainer.devices", "1",
                       "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
                       *(task_declaration(task).smoke_flags if args.tiny else [])]
        self.short = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", str(args.steps),
                      "--trainer.limit_val_batches", "2", "--trainer.num_sanity_val_steps", "0"]

    def base(self, workers: int | None = None) -> list[str]:
        """The common flags with ``workers`` loader workers (the cell's default: none, read in the main
        process; the fits whose loaders matter, fit_bf16 and resume, take ``args.fit_workers``)."""
        chosen = self.args.num_workers if self.args.num_workers is not None else (workers or 0)
        return [*self.common, "--data.num_workers", str(chosen)]

    def cli(self, name: str, *args: str, expect: int = 0) -> tuple[subprocess.CompletedProcess, float]:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   WANDB_MODE="offline", NO_ALBUMENTATIONS_UPDATE="1")
        # several CLIs share the machine's cores: each gets a few torch threads, not all of them
        env.setdefault("OMP_NUM_THREADS", str(self.args.threads))
        command = [sys.executable, "-m", f"tasks.{self.task}", *args]
        timeout = self.args.cell_timeout
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 1:
                raise CellCut("the time budget ran out before this command started")
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, cwd=self.root, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            out = (error.stdout or b"").decode(errors="replace") if isinstance(error.stdout, bytes) else error.stdout
            (self.root / f"{name}.log").write_text(" ".join(command) + "\n\n" + (out or ""))
            if timeout < self.args.cell_timeout:
                raise CellCut(f"{name} stopped at the time budget after {timeout:.0f} s") from None
            raise CellError(f"{name} timed out after {timeout:.0f} s") from None
        seconds = time.perf_counter() - start
        (self.root / f"{name}.log").write_text(" ".join(command) + "\n\n" + proc.stdout + "\n" + proc.stderr)
        if proc.returncode != expect:
            raise CellError(f"{name}: exit {proc.returncode} (expected {expect}): {tail(proc)}")
        return proc, seconds

    def fit(self, name: str, *args: str, workers: int | None = None) -> tuple[Path, subprocess.CompletedProcess, float]:
        run_dir = self.root / name
        proc, seconds = self.cli(name, "fit", *self.base(workers), *self.short, "--trainer.default_root_dir",
                                 str(run_dir), *args)
        last = run_dir / "checkpoints" / "last.ckpt"
        if not last.exists():
            raise CellError(f"no {last}")
        return last, proc, seconds

    def skip_reason(self, cell: str) -> str | None:
        if cell == "channels_last" and self.task == "translate":
            return "translation has no image layout"
        if self.args.tiny and (cell == "fit_fp16" or cell.startswith("compile")):
            return "CPU smoke run: a GPU setting"
        return None

    # -- the cells ---------------------------------------------------------------------------------
    def fit_bf16(self) -> str:
        last, proc, seconds = self.fit("fit_bf16", "--trainer.precision", "bf16-mixed", workers=self.args.fit_workers)
        return f"{seconds:.1f} s; {losses(last)}"

    def fit_fp16(self) -> str:
        last, proc, seconds = self.fit("fit_fp16", "--trainer.precision", "16-mixed")
        return f"{seconds:.1f} s; {losses(last)}"

    @property
    def checkpoint(self) -> Path:
        return self.root / "fit_bf16" / "checkpoints" / "last.ckpt"

    def test(self) -> str:
        out = self.root / "test"
        self.cli("test", "test", "--ckpt_path", str(self.checkpoint), *self.base(), "--trainer.limit_test_batches", "2",
                 "--trainer.default_root_dir", str(out))
        metrics = json.loads(next(out.rglob("metrics.json")).read_text())
        metric = task_declaration(self.task).test_metric
        value = metrics.get(metric)
        if value is None or not math.isfinite(value):
            raise CellError(f"metrics.json has no finite {metric}: {sorted(metrics)}")
        return f"{metric} = {value:.4g} (2 batches of a {self.args.steps}-step model)"

    def predict(self) -> str:
        source = predict_input(self.task, self.root / "predict_input")
        out = self.root / "predict"
        extra = ["--model.predict_output", str(out / "out.txt")] if self.task == "translate" else []
        self.cli("predict", "predict", "--ckpt_path", str(self.checkpoint), "--trainer.accelerator", self.args.accelerator,
                 "--trainer.devices", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                 "--data.num_workers", "0", "--data.predict_path", str(source), "--trainer.default_root_dir", str(out),
                 *extra)
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

    def deterministic(self) -> tuple[str, str]:
        """(``--trainer.deterministic`` value, why): ``true`` unless the task refuses it on this device."""
        from tasks.cli.determinism import deterministic_refusal, run_ops

        if deterministic_refusal(self.task, True, self.args.accelerator) is None:
            return "true", "deterministic true"
        return "warn", f"deterministic warn (true is refused on CUDA: {', '.join(run_ops(self.task))})"

    def resume(self) -> str:
        mode, why = self.deterministic()
        run = [*self.base(self.args.fit_workers), "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "2",
               "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0", "--trainer.deterministic",
               mode, "--seed_everything", "0", "--checkpoint.every_n_train_steps", "100"]
        first = {
            "straight_a": lambda: self.cli("resume_straight_a", "fit", *run, "--trainer.default_root_dir",
                                           str(self.root / "straight_a")),
            "straight_b": lambda: self.cli("resume_straight_b", "fit", *run, "--trainer.default_root_dir",
                                           str(self.root / "straight_b")),
            "stopped": lambda: self.cli("resume_stopped", "fit", *run, "--trainer.default_root_dir",
                                        str(self.root / "resumed"), "--trainer.callbacks+=tests.callbacks.SignalAtStep",
                                        "--trainer.callbacks.init_args.step", "1", expect=143),
        }
        with ThreadPoolExecutor(max_workers=3) as pool:  # independent fits: side by side
            futures = [pool.submit(fn) for fn in first.values()]
            for future in futures:
                future.result()
        self.cli("resume_resumed", "fit", *run, "--trainer.default_root_dir", str(self.root / "resumed"),
                 "--ckpt_path", "last")
        a, b, resumed = (load_state(self.root / name / "checkpoints" / "last.ckpt")
                         for name in ("straight_a", "straight_b", "resumed"))
        if len({a["global_step"], b["global_step"], resumed["global_step"]}) != 1:
            raise CellError(f"global steps differ: straight {a['global_step']} and {b['global_step']}, "
                            f"resumed {resumed['global_step']}")
        judged = []
        for part in ("weights", "optimizer state"):
            floor = difference(a, b, part)
            off = max(difference(a, resumed, part), difference(b, resumed, part))
            judged.append((part, resume_verdict(off, floor), off, floor))
        detail = f"{why}; step {a['global_step']}: " + "; ".join(
            f"{part} {verdict} (resumed differs by {off:.3g}, two uninterrupted runs by {floor:.3g})"
            for part, verdict, off, floor in judged)
        if any(verdict == "beyond" for _, verdict, _, _ in judged):
            raise CellError("resumed run beyond the noise floor: " + detail)
        return detail

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


def resume_verdict(resumed: float, floor: float) -> str:
    """``exact`` (no difference), ``within noise`` (at most :data:`NOISE_FACTOR` times the difference
    between two uninterrupted runs) or ``beyond``."""
    if resumed == 0:
        return "exact"
    return "within noise" if resumed <= NOISE_FACTOR * floor else "beyond"


def load_state(checkpoint: Path) -> dict:
    import torch

    return torch.load(checkpoint, weights_only=True, map_location="cpu")


def difference(a: dict, b: dict, part: str) -> float:
    """Largest absolute difference between two checkpoints' floating-point weights (``part="weights"``:
    parameters and buffers) or optimizer state."""
    import torch

    def tensors(state: dict) -> dict:
        if part == "weights":
            return state["state_dict"]
        return {(i, n): v for i, s in state["optimizer_states"][0]["state"].items() for n, v in s.items()}

    left, right = tensors(a), tensors(b)
    return max((float((v.double() - right[k].double()).abs().max()) for k, v in left.items()
                if torch.is_tensor(v) and v.is_floating_point() and v.numel()), default=0.0)


def tail(proc: subprocess.CompletedProcess, chars: int = 1500) -> str:
    return (proc.stderr or proc.stdout)[-chars:].replace("\n", " / ")


def losses(checkpoint: Path) -> str:
    """The checkpoint's weights are finite (a non-finite loss would have stopped the fit)."""
    import torch

    state = load_state(checkpoint)
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
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "budget_s": args.budget_s}

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
        budget = f"; time budget {self.meta['budget_s']:g} s" if self.meta["budget_s"] else ""
        lines = [f"`{self.meta['command']}` on {self.meta['device']}, {self.meta['started']}{budget}", "",
                 "| task | cell | status | s | detail |", "| --- | --- | --- | ---: | --- |"]
        lines += [f"| {r['task']} | {r['cell']} | {r['status']} | {r['seconds']} | {r['detail'].replace('|', '/')[:500]} |"
                  for r in rows]
        (self.args.output / "gpu_cli.md").write_text("\n".join(lines) + "\n")


class Schedule:
    """Hands out (task, cell) jobs to the slots in :data:`CELLS` order, a checkpoint reader only once its
    task's ``fit_bf16`` is done; tells when no job is left."""

    def __init__(self, tasks: list[str], cells: list[str]):
        self.pending = [(task, cell) for cell in cells for task in tasks]
        self.fit_status: dict[str, str] = {}
        self.condition = threading.Condition()

    def take(self) -> tuple[str, str, str | None] | None:
        """The next job and, if its checkpoint's fit failed, why it is skipped; None when none is left."""
        with self.condition:
            while self.pending:
                for job in self.pending:
                    task, cell = job
                    if cell in NEEDS_CHECKPOINT and task not in self.fit_status:
                        continue  # its fit is still running
                    self.pending.remove(job)
                    failed = cell in NEEDS_CHECKPOINT and self.fit_status[task] != "ok"
                    return task, cell, "fit_bf16 did not pass" if failed else None
                self.condition.wait()
            return None

    def done(self, task: str, cell: str, status: str) -> None:
        with self.condition:
            if cell == "fit_bf16":
                self.fit_status[task] = status
            self.condition.notify_all()


def device_name(args) -> str:
    import torch

    if args.accelerator in ("gpu", "cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU, torch {torch.__version__}"


def run_cells(args, report: Report) -> None:
    deadline = time.monotonic() + args.budget_s if args.budget_s else None
    runs = {task: TaskRun(task, args, deadline) for task in args.tasks}
    schedule = Schedule(args.tasks, args.cells)

    def slot() -> None:
        while (job := schedule.take()) is not None:
            task, cell, skipped = job
            run = runs[task]
            skipped = skipped or run.skip_reason(cell)
            if skipped is None and deadline is not None and time.monotonic() > deadline - 1:
                skipped = f"time budget (--budget-s {args.budget_s:g})"
            if skipped is not None:
                report.add(task, cell, "skipped", 0.0, skipped)
                schedule.done(task, cell, "skipped")
                continue
            start = time.perf_counter()
            try:
                status, detail = "ok", getattr(run, cell)()
            except CellError as error:
                status, detail = "failed", str(error)
            except CellCut as error:
                status, detail = "cut", str(error)
            except Exception as error:  # a bug in this script must not stop the other cells
                status, detail = "failed", f"{type(error).__name__}: {error}"
            report.add(task, cell, status, time.perf_counter() - start, detail)
            schedule.done(task, cell, status)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for future in [pool.submit(slot) for _ in range(args.jobs)]:
            future.result()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--cells", nargs="+", choices=CELLS, default=list(CELLS))
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--tiny", action="store_true", help="CPU-sized inputs; no fp16 or compiled cells")
    p.add_argument("--steps", type=int, default=None, help="training steps of each fit (default 10; --tiny 3)")
    p.add_argument("--num-workers", type=int, default=None,
                   help="loader workers of every command (default: --fit-workers for fit_bf16 and resume, none else)")
    p.add_argument("--fit-workers", type=int, default=None, help="loader workers of fit_bf16 and resume (default 2; "
                                                                 "--tiny 0)")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each command (unless set)")
    p.add_argument("--jobs", type=int, default=None, help="cells run side by side (default 6; --tiny 2)")
    p.add_argument("--budget-s", type=float, default=0.0, help="start no cell after this many seconds and stop "
                                                                "running ones at it (0: no budget)")
    p.add_argument("--cell-timeout", type=float, default=480)
    p.add_argument("--work", type=Path, default=None, help="run folders (default: <output>/work)")
    p.add_argument("--output", type=Path, default=REPO / "benchmarks" / "gpu_results")
    args = p.parse_args(argv)
    args.steps = args.steps or (3 if args.tiny else 10)
    args.fit_workers = args.fit_workers if args.fit_workers is not None else (0 if args.tiny else 2)
    args.jobs = args.jobs or (2 if args.tiny else 6)
    args.work = args.work or args.output / "work"
    args.cells = ["fit_bf16"] + [c for c in CELLS if c in args.cells and c != "fit_bf16"]
    sys.path.insert(0, str(REPO))
    report = Report(args)
    run_cells(args, report)
    failed = [r for r in report.rows if r["status"] == "failed"]
    cut = [r for r in report.rows if r["status"] == "cut" or "time budget" in r["detail"]]
    print(f"{len(report.rows)} cells, {len(failed)} failed, {len(cut)} cut or not started at the time budget; "
          f"{args.output / 'gpu_cli.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
