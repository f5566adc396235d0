"""End-to-end ``fit`` throughput of one paper recipe per task, data loading included (issue 31, part 2).

    python benchmarks/gpu_fit.py --output $OUT                        # GPU: 4 paper recipes, ~6 min
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
otherwise (e.g. ``--extra --model.compile regional``). Writes ``gpu_fit.{md,json}``.
"""
from __future__ import annotations

import argparse
import json
import os
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


def build_data(task: str) -> Path:
    """The benchmark-sized copy of the demo set for ``task``'s recipe (built once, in the data cache)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_loaders import PIPELINES, dataset_root, recipe_data

    pipeline = PIPELINES[RECIPES[task][1]]
    return dataset_root(RECIPES[task][1], pipeline, recipe_data(pipeline), native=False)


def run(task: str, args) -> dict:
    recipe, _ = RECIPES[task]
    root = build_data(task)
    result_file = args.work / f"{task}.json"
    result_file.unlink(missing_ok=True)
    steps = args.steps
    command = [sys.executable, "-m", f"tasks.{task}", "fit", "--config", str(REPO / recipe),
               "--data.root", str(root), "--data.num_workers", str(args.num_workers),
               "--trainer.accelerator", args.accelerator, "--trainer.devices", "1", "--trainer.max_steps", str(steps),
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
    env = dict(os.environ, WANDB_MODE="offline", NO_ALBUMENTATIONS_UPDATE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(REPO / "benchmarks"),
                                                        os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=args.work, env=env, capture_output=True, text=True, timeout=args.timeout)
    row = {"task": task, "recipe": recipe, "data": str(root), "wall_s": round(time.perf_counter() - start, 1),
           "command": " ".join(command[1:])}
    if proc.returncode != 0 or not result_file.exists():
        row.update(status="failed", error=(proc.stderr or proc.stdout)[-2000:])
    else:
        row.update(status="ok", **json.loads(result_file.read_text()))
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"`{meta['command']}` on {meta['device']}, {meta['started']}", "",
             "| task | recipe | status | timed steps | rate | first step s | peak GPU MB | wall s |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        unit = "tok/s" if r["task"] == "translate" else "img/s"
        rate = f"{r['items_per_s']:,.0f} {unit}" if r.get("items_per_s") else "-"
        first = f"{r['first_step_s']:.1f}" if r.get("first_step_s") else "-"
        peak = f"{r['peak_mem_mb']:,.0f}" if r.get("peak_mem_mb") else "-"
        status = r["status"] if r["status"] == "ok" else f"**failed**: {r['error'][-300:]}".replace("\n", " / ")
        lines.append(f"| {r['task']} | {Path(r['recipe']).name} | {status.replace('|', '/')} | {r.get('steps', '-')} "
                     f"| {rate} | {first} | {peak} | {r['wall_s']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--tiny", action="store_true", help="toy batch and resolution, 4 steps (CPU smoke run)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 60; --tiny 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 15; --tiny 1)")
    p.add_argument("--num-workers", type=int, default=None, help="loader workers (default 12; --tiny 0)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu_fit"))
    p.add_argument("--output", type=Path, default=REPO / "benchmarks" / "gpu_results")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more CLI flags for every run")
    args = p.parse_args(argv)
    args.steps = args.steps or (4 if args.tiny else 60)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 15)
    args.num_workers = args.num_workers if args.num_workers is not None else (0 if args.tiny else 12)
    args.work.mkdir(parents=True, exist_ok=True)
    args.output.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python benchmarks/gpu_fit.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": torch.cuda.get_device_name() if args.accelerator in ("gpu", "cuda") and torch.cuda.is_available()
            else "CPU", "torch": torch.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    rows = []
    for task in args.tasks:
        rows.append(run(task, args))
        r = rows[-1]
        print(f"{task}: {r['status']} {r.get('items_per_s') or ''} ({r['wall_s']} s)", flush=True)
        (args.output / "gpu_fit.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (args.output / "gpu_fit.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
