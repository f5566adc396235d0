"""End-to-end ``fit`` throughput of one paper recipe per task, data loading included; the headline demo's it/s.

    python benchmarks/gpu_fit.py --output $OUT --budget-s 80          # GPU: 4 paper recipes, ~80 s
    python benchmarks/gpu_fit.py --build-only                         # build the benchmark-sized data, no fit
    python benchmarks/gpu_fit.py --demo 60 --output $OUT              # the README's demo, 60 s of training
    python benchmarks/gpu_fit.py --accelerator cpu --tiny             # CPU smoke run (tests/test_gpu_fit.py)

Unlike ``gpu_suite.py`` (the network's training step on one fixed batch), this is the number a user
sees: ``python -m tasks.<task> fit --config <paper recipe>`` reading images of the benchmark's real
size from disk through the recipe's own augmentation and loaders. The data are
``bench_loaders.py``'s benchmark-sized copies of the demo sets (ImageNet-layout JPEGs of 500x375,
COCO 640x480, ADE20k 683x512, WMT sentences of 24 words), built once into the data cache; class
counts are the demo's, so heads are smaller than the paper's (a negligible share of the work).

Each recipe runs ``--steps`` training steps with no validation, in a child process, with
:class:`StepTimer` added as a callback: it times the steps after ``--warmup`` (device-synchronised)
and writes images (target tokens for translation) per second, peak GPU memory and the first step's
seconds. ``--model.compile`` and ``channels_last`` are the recipe's unless ``--extra`` flags say
otherwise (e.g. ``--extra --model.compile regional``). Writes ``gpu_fit.{md,json}``. With
``--budget-s`` a recipe starts only while the budget lasts and is stopped at its end (status ``cut``).

``--demo SECONDS`` times instead what the README's first command does, ``python -m tasks.detect fit
--trainer.logger false`` (the demo recipe, its own accelerator choice, loaders and validation),
stopped after SECONDS of fitting (:class:`DemoTimer`): training steps per second after the first
five, validation time left out -- the number its progress line prints as it/s. Writes ``demo.json``
and ``demo.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback

REPO = Path(__file__).resolve().parents[1]
#: task -> (paper recipe, bench_loaders pipeline of its benchmark-sized data)
RECIPES = {
    "classify": ("configs/classify/imagenet_mobilevitv2_100.yaml", "imagenet"),
    "detect": ("configs/detect/coco_ssdlite_mobilevitv2_050.yaml", "coco"),
    "segment": ("configs/segment/ade20k_deeplabv3_mobilevitv2_075.yaml", "ade20k"),
    "translate": ("configs/translate/wmt14_en_de_transformer_base.yaml", "wmt14"),
}
#: toy sizes of the CPU smoke run (batch and resolution only: the recipe's networks and pipelines stay)
TINY = {
    "classify": ["--data.batch_size", "4", "--data.image_size", "64", "--data.eval_resize", "64"],
    "detect": ["--data.batch_size", "2", "--data.image_size", "128"],
    "segment": ["--data.batch_size", "2", "--data.crop_size", "128"],
    "translate": ["--data.max_tokens", "256", "--model.encoder_depth", "1", "--model.decoder_depth", "1"],
}


class StepTimer(Callback):
    """Times training steps ``warmup`` .. the last and writes ``{items, seconds, items_per_s, ...}`` to ``output``.

    Items are images (the batch's ``image`` rows) or, for translation, target tokens (``tgt_out``
    entries that are not padding)."""

    def __init__(self, output: str, warmup: int = 10):
        self.output, self.warmup = output, warmup
        self.items, self.steps, self.start, self.first_step_s, self._batch_start = 0, 0, None, None, None

    def _sync(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 0:
            self._sync(pl_module)
            self._batch_start = time.perf_counter()
        if trainer.global_step == self.warmup:
            self._sync(pl_module)
            self.start = time.perf_counter()
            if pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.first_step_s is None and self._batch_start is not None:
            self._sync(pl_module)
            self.first_step_s = time.perf_counter() - self._batch_start
        if self.start is not None:
            if "tgt_out" in batch:
                self.items += int(batch["tgt_out"].ne(0).sum())
            else:
                self.items += int(batch["image"].shape[0])
            self.steps += 1

    def on_train_end(self, trainer, pl_module) -> None:
        self._sync(pl_module)
        seconds = time.perf_counter() - self.start if self.start is not None else float("nan")
        result = {"steps": self.steps, "items": self.items, "seconds": seconds,
                  "items_per_s": self.items / seconds if self.steps else None, "first_step_s": self.first_step_s,
                  "peak_mem_mb": torch.cuda.max_memory_allocated(pl_module.device) / 2**20
                  if pl_module.device.type == "cuda" else None}
        if trainer.is_global_zero:
            Path(self.output).write_text(json.dumps(result))


class DemoTimer(Callback):
    """Stops a fit ``seconds`` after it started (once a few steps are timed) and writes ``{steps, it_per_s, ...}``
    to ``output``: training steps per second from the end of step ``warmup`` to the last one, validation time
    left out."""

    MIN_TIMED_STEPS = 3  # a slow start (a busy CPU) still yields a rate

    def __init__(self, output: str, seconds: float = 60.0, warmup: int = 5):
        self.output, self.seconds, self.warmup = output, seconds, warmup
        self.fit_start = self.timed_start = self.validation_start = None
        self.validation_s, self.steps, self.last_end, self.first_step_end = 0.0, 0, None, None

    def _sync(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.fit_start = time.perf_counter()

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.validation_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.validation_start is not None:
            if self.timed_start is not None:
                self.validation_s += time.perf_counter() - self.validation_start
            self.validation_start = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self.first_step_end is None:
            self._sync(pl_module)
            now = self.first_step_end = time.perf_counter()
        if trainer.global_step == self.warmup:
            self._sync(pl_module)
            now = self.timed_start = time.perf_counter()
        elif self.timed_start is not None:
            self.steps += 1
        self.last_end = now
        if now - self.fit_start >= self.seconds and self.steps >= self.MIN_TIMED_STEPS:
            self._sync(pl_module)
            self.last_end = time.perf_counter()
            self.write(trainer, pl_module)
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        if not Path(self.output).exists():  # the fit ended before the time was up
            self._sync(pl_module)
            self.write(trainer, pl_module)

    def write(self, trainer, pl_module) -> None:
        seconds = (self.last_end - self.timed_start - self.validation_s) if self.timed_start is not None else None
        result = {"steps": self.steps, "seconds": seconds, "it_per_s": self.steps / seconds if seconds else None,
                  "global_step": trainer.global_step, "fit_seconds": time.perf_counter() - self.fit_start,
                  "validation_s": self.validation_s, "first_step_s": self.first_step_end - self.fit_start if self.first_step_end else None,
                  "device": str(pl_module.device),
                  "device_name": torch.cuda.get_device_name(pl_module.device)
                  if pl_module.device.type == "cuda" else "CPU", "torch_threads": torch.get_num_threads()}
        if trainer.is_global_zero:
            Path(self.output).write_text(json.dumps(result))


def build_data(task: str) -> Path:
    """The benchmark-sized copy of the demo set for ``task``'s recipe (built once, in the data cache)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_loaders import PIPELINES, dataset_root, recipe_data

    pipeline = PIPELINES[RECIPES[task][1]]
    return dataset_root(RECIPES[task][1], pipeline, recipe_data(pipeline), native=False)


def child_env() -> dict:
    return dict(os.environ, WANDB_MODE="offline", NO_ALBUMENTATIONS_UPDATE="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(REPO / "benchmarks"),
                                                         os.environ.get("PYTHONPATH")])))


def run_child(command: list[str], args, deadline: float | None) -> tuple[subprocess.CompletedProcess | None, str]:
    """Runs ``command`` until it ends, ``--timeout`` passes or the budget's ``deadline``; (process or None, why
    it was stopped)."""
    timeout = args.timeout if deadline is None else min(args.timeout, deadline - time.monotonic())
    try:
        return subprocess.run(command, cwd=args.work, env=child_env(), capture_output=True, text=True,
                              timeout=timeout), ""
    except subprocess.TimeoutExpired as error:
        output = error.stderr or error.stdout or ""
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        why = "stopped at the time budget" if timeout < args.timeout else f"timed out after {timeout:.0f} s"
        return None, f"{why}: {output[-1500:]}"


def run(task: str, args, deadline: float | None = None) -> dict:
    recipe, _ = RECIPES[task]
    root = build_data(task)
    result_file = args.work / f"{task}.json"
    result_file.unlink(missing_ok=True)
    steps = args.steps
    command = [sys.executable, "-m", f"tasks.{task}", "fit", "--config", str(REPO / recipe),
               "--data.root", str(root), "--data.num_workers", str(args.num_workers),
               "--trainer.accelerator", args.accelerator, "--trainer.devices", "1", "--trainer.max_steps", str(steps),
               "--trainer.strategy", "auto",  # the recipes' ddp at one device would time a one-rank DDP wrapper
               "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
               # the image recipes' LearningRateMonitor needs a logger; CSV needs nothing installed
               "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.default_root_dir", str(args.work / task),
               "--trainer.callbacks+=gpu_fit.StepTimer", "--trainer.callbacks.init_args.output", str(result_file),
               "--trainer.callbacks.init_args.warmup", str(args.warmup),
               *(TINY[task] if args.tiny else []), *args.extra]
    if task in ("detect", "segment"):  # the recipes start from an ImageNet checkpoint; timing needs none
        command += ["--model.backbone.init_args.pretrained", "null"]
    if args.accelerator == "cpu":
        command += ["--trainer.precision", "bf16-mixed", "--trainer.sync_batchnorm", "false"]
    start = time.perf_counter()
    proc, stopped = run_child(command, args, deadline)
    row = {"task": task, "recipe": recipe, "data": str(root), "wall_s": round(time.perf_counter() - start, 1),
           "command": " ".join(command[1:])}
    if proc is None:
        row.update(status="cut" if "budget" in stopped else "failed", error=stopped)
    elif proc.returncode != 0 or not result_file.exists():
        row.update(status="failed", error=(proc.stderr or proc.stdout)[-2000:])
    else:
        row.update(status="ok", **json.loads(result_file.read_text()))
    return row


#: the demo at the contract tests' CPU sizes (the smoke run's demo)
TINY_DEMO = ["--data.image_size", "64", "--data.batch_size", "4", "--data.eval_batch_size", "4",
             "--trainer.limit_val_batches", "2"]


def demo(args) -> int:
    """The README's headline demo, ``python -m tasks.detect fit --trainer.logger false``, for ``args.demo``
    seconds of fitting; writes ``demo.json`` and ``demo.md``."""
    result_file = args.work / "demo_result.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "tasks.detect", "fit", "--trainer.logger", "false",
               "--trainer.default_root_dir", str(args.work / "demo"), "--trainer.callbacks+=gpu_fit.DemoTimer",
               "--trainer.callbacks.init_args.output", str(result_file),
               "--trainer.callbacks.init_args.seconds", str(args.demo), *(TINY_DEMO if args.tiny else []),
               *(["--trainer.accelerator", args.accelerator] if args.accelerator != "auto" else []), *args.extra]
    shutil.rmtree(args.work / "demo", ignore_errors=True)
    start = time.perf_counter()
    args.timeout = min(args.timeout, args.demo + 240)  # data preparation and start-up, then the timed fit
    proc, stopped = run_child(command, args, None)
    row = {"command": "python -m tasks.detect fit --trainer.logger false" + (" (tiny sizes)" if args.tiny else ""),
           "seconds_asked": args.demo, "wall_s": round(time.perf_counter() - start, 1)}
    if result_file.exists():
        row.update(**json.loads(result_file.read_text()))
        row.update(status="ok" if row["it_per_s"] else "failed",
                   error=None if row["it_per_s"] else "the fit ended before a step was timed")
    else:
        row.update(status="failed", error=stopped or (proc.stderr or proc.stdout)[-2000:])
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "demo.json").write_text(json.dumps(row, indent=1))
    rate = f"{row['it_per_s']:.2f} it/s" if row.get("it_per_s") else "-"
    lines = ["| demo | device | status | timed steps | rate | validation s | s to the first step's end | wall s |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
             f"| `{row['command']}` | {row.get('device_name', '-')} | {row['status']} | {row.get('steps', '-')} | {rate} "
             f"| {fmt_s(row.get('validation_s'))} | {fmt_s(row.get('first_step_s'))} | {row['wall_s']} |"]
    if row["status"] != "ok":
        lines.append(f"\n**failed**: {row['error'][-600:]}")
    (args.output / "demo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if row["status"] == "ok" else 1


def fmt_s(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"`{meta['command']}` on {meta['device']}, {meta['started']}", "",
             "| task | recipe | status | timed steps | rate | first step s | peak GPU MB | wall s |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        unit = "tok/s" if r["task"] == "translate" else "img/s"
        rate = f"{r['items_per_s']:,.0f} {unit}" if r.get("items_per_s") else "-"
        first = f"{r['first_step_s']:.1f}" if r.get("first_step_s") else "-"
        peak = f"{r['peak_mem_mb']:,.0f}" if r.get("peak_mem_mb") else "-"
        status = r["status"] if r["status"] == "ok" else f"**{r['status']}**: {r['error'][-300:]}".replace("\n", " / ")
        lines.append(f"| {r['task']} | {Path(r['recipe']).name} | {status.replace('|', '/')} | {r.get('steps', '-')} "
                     f"| {rate} | {first} | {peak} | {r['wall_s']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    p.add_argument("--accelerator", default=None, help="default gpu (--demo: auto, the demo's own choice)")
    p.add_argument("--tiny", action="store_true", help="toy batch and resolution, 4 steps (CPU smoke run)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 40; --tiny 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 10; --tiny 1)")
    p.add_argument("--num-workers", type=int, default=None, help="loader workers (default 12; --tiny 0)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no recipe after this many seconds and stop a running one at it (0: none)")
    p.add_argument("--build-only", action="store_true", help="build the benchmark-sized datasets and exit")
    p.add_argument("--demo", type=float, default=None, metavar="SECONDS",
                   help="time the README's demo (python -m tasks.detect fit) for SECONDS of fitting instead")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu_fit"))
    p.add_argument("--output", type=Path, default=REPO / "benchmarks" / "gpu_results")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more CLI flags for every run")
    args = p.parse_args(argv)
    args.accelerator = args.accelerator or ("auto" if args.demo else "gpu")
    args.steps = args.steps or (4 if args.tiny else 40)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 10)
    args.num_workers = args.num_workers if args.num_workers is not None else (0 if args.tiny else 12)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.build_only:
        for task in args.tasks:
            start = time.perf_counter()
            print(f"{task}: {build_data(task)} ({time.perf_counter() - start:.1f} s)", flush=True)
        return 0
    if args.demo:
        return demo(args)
    args.output.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s if args.budget_s else None
    meta = {"command": "python benchmarks/gpu_fit.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": torch.cuda.get_device_name() if args.accelerator in ("gpu", "cuda") and torch.cuda.is_available()
            else "CPU", "torch": torch.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    rows = []
    for task in args.tasks:
        if deadline is not None and time.monotonic() > deadline - 5:
            rows.append({"task": task, "recipe": RECIPES[task][0], "status": "skipped", "wall_s": 0.0,
                         "error": f"time budget (--budget-s {args.budget_s:g})"})
        else:
            rows.append(run(task, args, deadline))
        r = rows[-1]
        print(f"{task}: {r['status']} {r.get('items_per_s') or ''} ({r['wall_s']} s)", flush=True)
        (args.output / "gpu_fit.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (args.output / "gpu_fit.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0 if all(r["status"] in ("ok", "skipped", "cut") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
