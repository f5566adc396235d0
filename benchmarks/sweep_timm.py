"""Every timm family in every vision task: one training step, a test forward and ONNX parity per architecture.

For each architecture (default: the smallest of every family, ``timm.list_models()`` grouped by the module of
``timm.models`` that defines it, sized by parameters counted on the meta device) and each task, on CPU at
``--size`` px with random weights (``pretrained=None``: nothing is downloaded):

- classify: :class:`tasks.classify.ClassificationTask`; detect: :class:`tasks.detect.DetectionTask` (SSDLite at
  the backbone's strides from 8 up, extra levels to 64); segment: :class:`tasks.segment.SegmentationTask`
  (DeepLabv3 on the deepest map), each over :class:`backbones.Timm`;
- one training step: the task's ``training_loss`` on a synthetic batch, backward, an SGD step;
- a ``test``-equivalent forward in eval mode (``task(images)``, ``task.detect(images)``);
- ONNX export and parity through the suite's exporters (:mod:`tasks.export`), as ``export`` runs them.

Each cell is ``pass``, ``refused`` (the suite refuses by name: :class:`backbones.timm_backbone.TimmRefusal` or a
``ValueError`` naming the architecture) or ``failed`` (anything else, with its first line). A markdown table
goes to ``--out``, one row per architecture, the counts first.

    python benchmarks/sweep_timm.py --out benchmarks/results_timm.md             # every family (long)
    python benchmarks/sweep_timm.py --models convnext_atto resnet10t --out -      # chosen ones, to stdout
"""
from __future__ import annotations

import argparse
import re
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TASKS = ("classify", "detect", "segment")
#: the architectures the README and the tests name, swept beside each family's smallest
NAMED = ("convnext_atto", "efficientnet_b0", "mobilenetv4_conv_small", "mobilenetv3_small_050", "resnet10t",
         "vit_tiny_patch16_224")
NUM_CLASSES = 3


class CellTimeout(Exception):
    pass


#: name parts of large variants, skipped when sizing a family that has others (building each on the meta device
#: costs seconds on 2 cores; 1,300 of them take longer than the sweep)
LARGE = re.compile(r"(large|huge|giant|gigantic|xlarge|enormous|big|base|medium|_l\d|_h\d|_g\d|_b\d|_l_|_h_|_g_|_b_"
                   r"|_m_|_l$|_b$|_h$|_g$|_m$|384|448|512|518|336|\d{3}m|_xl)")


SMALL_WORDS = ("test", "atto", "zepto", "femto", "pico", "nano", "xxs", "micro", "tiny", "mini", "xs", "small", "_s")


def _smallness(name: str) -> tuple[int, int]:
    """A first guess at how small ``name`` is, by the size words timm's names use, then the name's length."""
    rank = next((i for i, word in enumerate(SMALL_WORDS) if word in name), len(SMALL_WORDS))
    return rank, len(name)


def smallest_per_family(per_family: int = 1, seconds: int = 3, candidates_per_family: int = 4) -> list[str]:
    """The ``per_family`` smallest architectures (parameters counted on the meta device) of every module of
    ``timm.models``, among the ``candidates_per_family`` of its variants that :func:`_smallness` ranks first (not
    named large); an architecture that cannot be built on the meta device within ``seconds`` counts as the
    largest."""
    import timm
    from timm.models._registry import _model_to_module

    names: dict[str, list[str]] = defaultdict(list)
    for name in timm.list_models():
        names[_model_to_module[name]].append(name)
    chosen = []
    signal.signal(signal.SIGALRM, _alarm)
    for family in sorted(names):
        candidates = [n for n in names[family] if not LARGE.search(n)] or names[family]
        candidates = sorted(candidates, key=_smallness)[:candidates_per_family]
        sized = []
        for name in candidates:
            signal.alarm(seconds)
            try:
                with torch.device("meta"), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    count = sum(p.numel() for p in timm.create_model(name, num_classes=0).parameters())
            except (Exception, CellTimeout):  # noqa: BLE001 - sized as the largest; its cells say why
                count = float("inf")
            finally:
                signal.alarm(0)
            sized.append((count, name))
        chosen += [name for _, name in sorted(sized)[:per_family]]
        print(f"{family}: {', '.join(chosen[-per_family:])} (of {len(names[family])})", file=sys.stderr, flush=True)
    return chosen


def build_task(task: str, name: str, size: int):
    from functools import partial

    from backbones import Timm

    backbone = Timm(name, img_size=size)
    if task == "classify":
        from tasks.classify import ClassificationTask

        return ClassificationTask(backbone, class_names=[f"c{i}" for i in range(NUM_CLASSES)])
    if task == "detect":
        from heads.ssdlite import SSDLiteHead
        from tasks.detect import DetectionTask

        strides = [s for s in backbone.feature_channels if s >= 8]
        if not strides:
            raise ValueError(f"timm's {name} gives no map at stride 8 or deeper: SSDLite has no level to read")
        levels = list(strides)
        while levels[-1] < 64:  # extra levels to stride 64, a 1x1 map at 64 px
            levels.append(levels[-1] * 2)
        head = partial(SSDLiteHead, output_strides=levels, proj_channels=[16] * len(levels),
                       aspect_ratios=[[2]] * len(levels), min_scale=0.2, max_scale=0.9)
        return DetectionTask(backbone, num_classes=NUM_CLASSES, head=head)
    from heads.deeplabv3 import DeepLabV3
    from tasks.segment import SegmentationTask

    head = partial(DeepLabV3, channels=16, atrous_rates=(1, 2, 3))
    return SegmentationTask(backbone, class_names=[f"c{i}" for i in range(NUM_CLASSES)], head=head)


def synthetic_batch(task: str, size: int, batch: int = 2) -> dict:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size, size, generator=generator)
    if task == "classify":
        return {"image": images, "target": torch.arange(batch) % NUM_CLASSES}
    if task == "detect":
        box = torch.tensor([[size * 0.2, size * 0.2, size * 0.7, size * 0.8]])
        return {"image": images, "targets": [{"boxes": box, "labels": torch.tensor([i % NUM_CLASSES])}
                                              for i in range(batch)]}
    mask = torch.randint(0, NUM_CLASSES, (batch, size, size), generator=generator)
    return {"image": images, "mask": mask}


def export_parity(task: str, model, size: int, folder: Path) -> list[str]:
    """The exporter's failed checks (empty: parity holds)."""
    import importlib

    from backbones.pretrained import IMAGENET_MEAN, IMAGENET_STD
    from datamodules.input_spec import InputSpec
    from tasks.export.onnx import ExportRequest

    spec = {"classify": lambda: InputSpec.center_crop(size, size, IMAGENET_MEAN, IMAGENET_STD),
            "detect": lambda: InputSpec.square(size, IMAGENET_MEAN, IMAGENET_STD),
            "segment": lambda: InputSpec.short_side(None, size, IMAGENET_MEAN, IMAGENET_STD)}[task]()
    module = {"classify": "classification", "detect": "detection", "segment": "segmentation"}[task]
    exporter = importlib.import_module(f"tasks.export.{module}")
    report = exporter.export(ExportRequest(model, spec, spec, folder / f"{task}.onnx", 18, {}))
    return [str(check) for check in report.checks if not check.ok]


def run_cell(task: str, name: str, size: int, onnx: bool = True) -> tuple[str, str]:
    """("pass" | "refused" | "failed", why); without ``onnx`` the export is skipped (said in why). An architecture
    that refuses ``size`` px as an input size is run again at the size it was made for (said in why)."""
    from backbones.timm_backbone import InputSizeRefusal, TimmRefusal

    torch.manual_seed(0)
    try:
        model = build_task(task, name, size)
        model.train()
        torch.set_grad_enabled(True)  # a cell cut short by its alarm inside a no_grad block leaves grad off
        loss = model.training_loss(synthetic_batch(task, size), 0)
        if not torch.isfinite(loss):
            return "failed", f"training loss {loss.item()}"
        loss.backward()
        torch.optim.SGD(model.parameters(), lr=1e-3).step()
        model.eval()
        images = synthetic_batch(task, size)["image"]
        with torch.no_grad():
            model.detect(images) if task == "detect" else model(images)
        if not onnx:
            return "pass", "ONNX not run"
        with tempfile.TemporaryDirectory() as folder:
            failed = export_parity(task, model, size, Path(folder))
        return ("failed", "ONNX parity: " + "; ".join(failed)) if failed else ("pass", "")
    except InputSizeRefusal as err:
        if err.size == size:
            return "refused", str(err)
        verdict, why = run_cell(task, name, err.size, onnx)  # the size the architecture was made for
        return verdict, f"at {err.size} px, refuses {size} px" + (f"; {why}" if why else "")
    except TimmRefusal as err:
        return "refused", str(err)
    except CellTimeout:
        return "failed", "timed out"
    except Exception as err:  # noqa: BLE001 - the table records it
        line = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if isinstance(err, ValueError) and name in str(err):
            return "refused", line
        frames = traceback.extract_tb(err.__traceback__)
        # where it broke: the deepest frame outside torch (timm's or the suite's code), not torch._assert's
        where = next((f for f in reversed(frames) if "/torch/" not in f.filename), frames[-1])
        return "failed", f"{line} ({Path(where.filename).name}:{where.lineno})"


def _alarm(signum, frame):
    raise CellTimeout()


def sweep(models: list[str], size: int, timeout: int, out, onnx: str = "all", progress=sys.stderr,
          merge: bool = False, tasks: tuple[str, ...] = TASKS) -> dict:
    """Run every cell; ``onnx``: export and compare in ``"all"`` tasks, only ``"classify"``, or ``"none"``;
    ``merge``: replace these architectures' rows in the table already at ``out`` (its counts recomputed)."""
    from backbones.timm_backbone import timm_family

    rows, counts = [], {task: defaultdict(int) for task in tasks}
    signal.signal(signal.SIGALRM, _alarm)
    warnings.filterwarnings("ignore")  # self.log outside a Trainer, timm's deprecation notes: not results
    for i, name in enumerate(models):
        cells = []
        for task in tasks:
            start = time.time()
            signal.alarm(timeout)
            try:
                verdict, why = run_cell(task, name, size, onnx == "all" or onnx == task)
            except CellTimeout:
                verdict, why = "failed", "timed out"
            finally:
                signal.alarm(0)
            counts[task][verdict] += 1
            cells.append(f"{verdict}" + (f": {why}" if why else ""))
            print(f"[{i + 1}/{len(models)}] {name} {task}: {verdict} {why[:160]} ({time.time() - start:.1f} s)",
                  file=progress, flush=True)
        rows.append(f"| {name} | {timm_family(name)} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        if merge:
            table, merged_counts = merged_rows(out, rows[-1:], tasks)
            write_table(table, merged_counts, size, out)
        else:
            write_table(rows, counts, size, out)
    return counts


def merged_rows(out: str, rows: list[str], tasks: tuple[str, ...] = TASKS) -> tuple[list[str], dict]:
    """The rows of the table in ``out`` with each architecture of ``rows`` replaced (or added), and the counts
    of the verdicts in them: ``--merge`` re-runs some architectures of a sweep without the others."""
    new = {row.split(" | ")[0]: row for row in rows}
    old = [line for line in Path(out).read_text().splitlines() if line.startswith("| ")
           and line.count(" | ") == len(tasks) + 1 and not line.startswith(("| architecture", "| ---"))]
    kept = [new.pop(line.split(" | ")[0], line) for line in old]
    table = kept + list(new.values())
    counts = {task: defaultdict(int) for task in tasks}
    for line in table:
        for task, cell in zip(tasks, line.rstrip(" |").split(" | ")[2:]):
            counts[task][cell.split(":")[0].strip()] += 1
    return table, counts


def write_table(rows: list[str], counts: dict, size: int, out) -> None:
    """The counts per task (the tasks of ``counts``) and a row per architecture; a note written by hand between
    the title and the counts of a table already at ``out`` is kept."""
    notes = []
    if out != "-" and Path(out).is_file():
        old = Path(out).read_text().splitlines()
        notes = old[1:next((i for i, line in enumerate(old) if line.startswith("| task |")), 1)]
    lines = [f"# timm architectures in every task ({len(rows)} architectures, {size} px, CPU, random weights)",
             *(notes or [""]), "| task | pass | refused | failed |", "| --- | --- | --- | --- |"]
    lines += [f"| {task} | {c['pass']} | {c['refused']} | {c['failed']} |" for task, c in counts.items()]
    lines += ["", "| architecture | family | " + " | ".join(counts) + " |", "| --- " * (len(counts) + 2) + "|", *rows]
    text = "\n".join(lines) + "\n"
    if out == "-":
        print(text)
    else:
        Path(out).write_text(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="architectures (default: the smallest of each family)")
    parser.add_argument("--per-family", type=int, default=1, help="how many of each family, smallest first")
    parser.add_argument("--size", type=int, default=64, help="input side in pixels")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell before it counts as failed")
    parser.add_argument("--onnx", default="all", choices=["all", "none", *TASKS],
                        help="the tasks whose ONNX export and parity run (the export takes ~30 s a cell on 2 cores)")
    parser.add_argument("--out", default="benchmarks/results_timm.md", help="markdown table, or - for stdout")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS, help="the tasks to run")
    parser.add_argument("--merge", action="store_true",
                        help="replace the rows of --models in the table already at --out, keeping the others")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if not args.models:
        smallest = smallest_per_family(args.per_family)
        args.models = smallest + [name for name in NAMED if name not in smallest]
    models = args.models
    print(f"{len(models)} architectures", file=sys.stderr, flush=True)
    counts = sweep(models, args.size, args.timeout, args.out, args.onnx, merge=args.merge, tasks=tuple(args.tasks))
    print({task: dict(c) for task, c in counts.items()}, file=sys.stderr)


if __name__ == "__main__":
    main()
