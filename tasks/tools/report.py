"""Compare runs: ``python -m tasks.tools.report RUN_DIR... [--output DIR] [--x gflops|params|latency_ms]``.

A run is a ``trainer.default_root_dir`` (``runs/<task>`` by default) on which ``test`` has
written ``predictions/metrics.json``; a folder holding runs anywhere below it works too. The
task comes from the metrics (top-1: classification, mAP: detection, mIoU: segmentation, BLEU:
translation); runs of several tasks get a table each. Each run's resolved config
(``suite_config.yaml``, in the run's wandb folders or, without wandb, in its root; see
:func:`read_config`) is flattened to dotted keys. Keys that are equal in all runs of a task and
keys that say where and how a run was logged or saved (seed, run root, logger, checkpointing)
are dropped; the remaining keys become the columns, and runs with the same values, which differ
only by seed, form one row: mean ± sample standard deviation over its n runs.

Written to ``--output`` (default: the current folder):

- ``report.md``: a table per task (main metric first: top-1, mAP, mIoU or BLEU; then the
  task's other headline metrics, parameters, GFLOPs and latency when ``metrics.json`` has them,
  or ``predictions/latency.json`` next to it, as ``benchmarks/attention_zoo.py`` writes);
- ``report.csv``: one line per row and task, every numeric value of ``metrics.json`` as
  ``<key> mean`` / ``<key> std``, the seeds and the run folders;
- ``report.png``: the main metric against GFLOPs (or ``--x``), error bars of one standard
  deviation, one labelled point per row, one panel per task.

From Python: ``build_report(run_dirs)`` returns the rows (:class:`Row`).
"""
from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tasks.outputs.common import INCOMPLETE

import numpy as np
import yaml

from configs.recipes import CONFIG_FILE_NAME


#: task -> the metrics the table shows (metrics.json key, heading, scale); the first is the main one
TASK_METRICS = {
    "classification": [("test/top1", "top-1 (%)", 100), ("test/top5", "top-5 (%)", 100)],
    "detection": [("test/map", "mAP (%)", 100), ("test/map_50", "AP50 (%)", 100), ("test/map_75", "AP75 (%)", 100)],
    "segmentation": [("test/miou", "mIoU (%)", 100), ("test/pixel_acc", "pixel acc. (%)", 100)],
    "translation": [("test/bleu", "BLEU", 1), ("test/chrf", "chrF", 1)],
}
#: what a model costs, as metrics.json names it: (key, heading, scale)
COSTS = [("params", "params (M)", 1e-6), ("gflops", "GFLOPs", 1), ("latency_ms", "latency (ms)", 1)]
#: the plot's x-axis: the first of these that every run of the task has
PLOT_X = ("gflops", "params", "latency_ms")

#: flattened config keys that say where and how a run was logged or saved, not what it trained
RUN_SPECIFIC = ("seed_everything", "ckpt_path", "verbose", "return_predictions", "trainer.default_root_dir",
                "trainer.logger", "trainer.logger.*", "trainer.log_every_n_steps", "trainer.enable_progress_bar",
                "trainer.enable_model_summary", "checkpoint.*", "*.predict_path", "*.predict_output")


class _Missing:
    """A config key a run does not have (e.g. an argument added to the suite after the run)."""

    def __repr__(self) -> str:
        return "-"


MISSING = _Missing()


@dataclass
class Run:
    path: Path
    task: str
    config: dict[str, Any]  # flattened: dotted key -> value (lists as tuples)
    metrics: dict[str, float]

    @property
    def seed(self):
        return self.config.get("seed_everything")


@dataclass
class Row:
    """Runs of one task whose configs differ at most by seed, and their metrics."""

    task: str
    config: dict[str, Any]  # column name -> value, for the keys that differ between the task's runs
    keys: dict[str, str]    # column name -> the dotted config key it shows
    runs: list[Path]
    seeds: list
    metrics: dict[str, list[float]] = field(default_factory=dict)  # metrics.json key -> one value per run

    @property
    def n(self) -> int:
        return len(self.runs)

    def mean(self, key: str) -> float | None:
        values = self.metrics.get(key)
        return float(np.mean(values)) if values else None

    def std(self, key: str) -> float | None:
        """Sample standard deviation (n - 1); ``None`` with fewer than two values."""
        values = self.metrics.get(key, [])
        return float(np.std(values, ddof=1)) if len(values) > 1 else None

    def label(self, separator: str = ", ") -> str:
        """``attention=linformer, width=0.5``: the row's config values (``all runs`` when none differ)."""
        return separator.join(f"{name}={format_value(self.keys[name], value, short=True)}"
                              for name, value in self.config.items()) or "all runs"


# -- reading runs ---------------------------------------------------------------------------------

class IncompleteRun(ValueError):
    """A run folder the report cannot use; the message names the folder and what is missing."""


def is_run(folder: Path) -> bool:
    return ((folder / "predictions" / "metrics.json").is_file() or (folder / CONFIG_FILE_NAME).is_file()
            or any(folder.glob(f"wandb/*/files/{CONFIG_FILE_NAME}")) or (folder / "checkpoints").is_dir())


def find_runs(paths: Iterable[str | Path]) -> list[Path]:
    """The run folders among ``paths`` and below them (a folder of runs), each once, in order."""
    found: dict[Path, Path] = {}
    for path in map(Path, paths):
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is not a folder (expected a run folder or a folder of runs)")
        if is_run(path):
            found.setdefault(path.resolve(), path)
            continue
        below = []
        for root, dirs, _ in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            if is_run(Path(root)):
                below.append(Path(root))
                dirs[:] = []  # a run's own subfolders hold no other runs
        if not below:
            raise FileNotFoundError(
                f"no runs in {path}: a run folder (a trainer.default_root_dir such as runs/classify) holds "
                f"{CONFIG_FILE_NAME} (itself or in wandb/*/files/) and predictions/metrics.json, which `test` writes")
        for run in below:
            found.setdefault(run.resolve(), run)
    return list(found.values())


def read_run(folder: str | Path) -> Run:
    """A run's task, flattened config (see :func:`read_config`) and ``test`` metrics."""
    folder = Path(folder)
    metrics_file = folder / "predictions" / "metrics.json"
    if (folder / "predictions" / INCOMPLETE).is_file():  # a test that was interrupted or failed part-way
        raise IncompleteRun(f"{folder}: its test did not finish (predictions/{INCOMPLETE}): run `test` again")
    if not metrics_file.is_file():
        raise IncompleteRun(f"{folder}: no predictions/metrics.json (run `test --ckpt_path ...` on it first)")
    try:
        metrics = json.loads(metrics_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise IncompleteRun(f"{metrics_file} is not valid JSON: {err}") from None
    latency_file = folder / "predictions" / "latency.json"  # measured apart from `test` (benchmarks/attention_zoo.py)
    if latency_file.is_file():
        metrics |= {k: v for k, v in json.loads(latency_file.read_text()).items() if k not in metrics}
    metrics = {k: float(v) for k, v in metrics.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and k.count("/") < 2}  # not per class
    task = next((task for task, shown in TASK_METRICS.items() if shown[0][0] in metrics), None)
    if task is None:
        known = ", ".join(shown[0][0] for shown in TASK_METRICS.values())
        raise IncompleteRun(f"{metrics_file} has none of the main metrics {known} (keys: {sorted(metrics)})")
    return Run(folder, task, read_config(folder), metrics)


def read_config(folder: Path) -> dict[str, Any]:
    """The run's config, flattened: its latest ``fit`` config (what was trained) with the ``model``
    section of its latest ``test`` config (what was scored: the checkpoint's arguments, including
    those taken from the data such as class names, and any ``--model.*`` override given to
    ``test``). A run without a ``fit`` config (a checkpoint tested in a fresh folder, or a run
    without wandb, whose single file each command overwrites) uses its latest config as it is."""
    files = {p.resolve(): p for p in [folder / CONFIG_FILE_NAME, *folder.glob(f"wandb/*/files/{CONFIG_FILE_NAME}")]
             if p.is_file()}  # wandb's latest-run link repeats a run folder
    if not files:
        raise IncompleteRun(f"{folder}: no {CONFIG_FILE_NAME} (neither in the folder nor in wandb/*/files/)")
    latest: dict[str, dict] = {}  # subcommand -> its newest config
    for path in sorted(files.values(), key=lambda p: p.stat().st_mtime):
        try:
            config = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise IncompleteRun(f"{path} is not valid YAML: {err}") from None
        if not isinstance(config, dict):
            raise IncompleteRun(f"{path} is not a config (a YAML mapping)")
        latest[subcommand_of(config)] = config
    if "fit" not in latest:
        return flatten(latest.get("test", config))  # else the newest config of all
    flat = flatten(latest["fit"])
    if "test" in latest:  # the model that was scored
        flat = {k: v for k, v in flat.items() if not k.startswith("model.")}
        flat |= {k: v for k, v in flatten(latest["test"]).items() if k.startswith("model.")}
    return flat


def subcommand_of(config: dict) -> str:
    """Which subcommand saved a config: wandb's job type, or (without wandb) the arguments only
    evaluations take."""
    logger = (config.get("trainer") or {}).get("logger")
    for entry in logger if isinstance(logger, list) else [logger]:
        job_type = ((entry or {}).get("init_args") or {}).get("job_type") if isinstance(entry, dict) else None
        if job_type:
            return job_type
    return "predict" if "return_predictions" in config else "test" if "verbose" in config else "fit"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings (and lists of mappings, by index) to ``{"a.b.0.c": value}``; other lists
    become tuples, so every value can be compared and grouped."""
    if isinstance(tree, dict) and tree:
        items = tree.items()
    elif isinstance(tree, list) and any(isinstance(v, dict) for v in tree):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return {prefix: _hashable(tree)}
    out = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    return value


# -- grouping -------------------------------------------------------------------------------------

def build_report(run_dirs: Iterable[str | Path]) -> list[Row]:
    """The report's rows: for each task, one :class:`Row` per distinct config (runs that differ only
    by seed together). ``run_dirs`` are run folders or folders of runs. Runs that cannot be read
    (no ``metrics.json`` yet, no config) are skipped and listed on standard error; if none can be
    read, the error lists them all."""
    runs, skipped = [], []
    for folder in find_runs(run_dirs):
        try:
            runs.append(read_run(folder))
        except IncompleteRun as err:
            skipped.append(str(err))
    if not runs:
        raise ValueError("no run to report:\n  " + "\n  ".join(skipped))
    if skipped:
        print(f"skipped {len(skipped)} of {len(runs) + len(skipped)} runs:\n  " + "\n  ".join(skipped), file=sys.stderr)

    rows = []
    for task in TASK_METRICS:
        task_runs = [run for run in runs if run.task == task]
        if not task_runs:
            continue
        keys = differing_keys([run.config for run in task_runs])
        names = column_names(keys)
        groups: dict[tuple, list[Run]] = {}
        for run in task_runs:
            groups.setdefault(tuple(run.config.get(k, MISSING) for k in keys), []).append(run)
        for values in sorted(groups, key=lambda vs: tuple(_sort_key(v) for v in vs)):
            members = groups[values]
            metric_keys = dict.fromkeys(k for run in members for k in run.metrics)
            rows.append(Row(
                task=task,
                config={names[k]: v for k, v in zip(keys, values)},
                keys={names[k]: k for k in keys},
                runs=[run.path for run in members],
                seeds=[run.seed for run in members],
                metrics={k: [run.metrics[k] for run in members if k in run.metrics] for k in metric_keys},
            ))
    return rows


def differing_keys(configs: list[dict[str, Any]]) -> list[str]:
    """Config keys (in first-seen order) whose values are not all equal, leaving out :data:`RUN_SPECIFIC`."""
    keys = dict.fromkeys(k for config in configs for k in config)
    return [k for k in keys
            if not any(fnmatch.fnmatchcase(k, pattern) for pattern in RUN_SPECIFIC)
            and len({config.get(k, MISSING) for config in configs}) > 1]


def column_names(keys: list[str]) -> dict[str, str]:
    """Short, unique column names: the shortest tail of each key's parts (``init_args`` and
    ``class_path`` left out) that no other key shares, never just a list index:
    ``model.backbone.init_args.attention`` -> ``attention``, ``model.backbone.class_path`` -> ``backbone``."""
    parts = {k: [p for p in k.split(".") if p not in ("init_args", "class_path")] or [k] for k in keys}
    names = {}
    for key, own in parts.items():
        for length in range(1, len(own) + 1):
            tail = own[-length:]
            if tail[0].isdigit():
                continue
            if sum(other[-length:] == tail for other in parts.values()) == 1:
                names[key] = ".".join(tail)
                break
        else:
            names[key] = key
    return names


def _sort_key(value: Any) -> tuple:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value, "")
    return (2, 0, "") if value is MISSING else (1, 0, str(value))


def format_value(key: str, value: Any, short: bool = False) -> str:
    """A config value as a table shows it (YAML spelling; ``short``: class paths by class name)."""
    if value is MISSING:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(format_value(key, v, short) for v in value) + "]"
    if short and key.endswith("class_path") and isinstance(value, str):
        return value.rsplit(".", 1)[-1]
    return str(value)


# -- writing ----------------------------------------------------------------------------------------

def metric_order(rows: list[Row]) -> list[str]:
    """Every metric key of the rows: each task's shown metrics, the costs, then the rest sorted."""
    present = {k for row in rows for k in row.metrics}
    first = [k for shown in TASK_METRICS.values() for k, _, _ in shown] + [k for k, _, _ in COSTS]
    return [k for k in first if k in present] + sorted(present - set(first))


def write_csv(rows: list[Row], path: Path) -> Path:
    columns = list(dict.fromkeys(name for row in rows for name in row.config))
    metrics = metric_order(rows)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", *columns, "n", "seeds", *(f"{k} {s}" for k in metrics for s in ("mean", "std")),
                         "runs"])
        for row in rows:
            config = [format_value(row.keys[c], row.config[c]) if c in row.config else "" for c in columns]
            values = [_number_cell(v) for k in metrics for v in (row.mean(k), row.std(k))]
            writer.writerow([row.task, *config, row.n, " ".join(map(str, row.seeds)), *values,
                             ";".join(str(p) for p in row.runs)])
    return path


def _number_cell(value: float | None) -> str:
    return "" if value is None else repr(value)


def markdown(rows: list[Row]) -> str:
    """One table per task: the differing config values, n, the task's metrics and the model's costs."""
    tasks = list(dict.fromkeys(row.task for row in rows))
    out = []
    for task in tasks:
        task_rows = [row for row in rows if row.task == task]
        present = {k for row in task_rows for k in row.metrics}
        shown = [m for m in TASK_METRICS[task] + COSTS if m[0] in present]
        columns = list(task_rows[0].config)
        if len(tasks) > 1:
            out.append(f"## {task}\n")
        header = [*columns, "n", *(heading for _, heading, _ in shown)]
        out.append("| " + " | ".join(header) + " |")
        out.append("| " + " | ".join(["---"] * len(columns) + ["---:"] * (len(header) - len(columns))) + " |")
        for row in task_rows:
            cells = [_clip(format_value(row.keys[c], row.config[c], short=True)) for c in columns]
            cells += [str(row.n), *(_cell(row, key, scale) for key, _, scale in shown)]
            out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        out.append("\nmean ± sample standard deviation over the n runs (seeds) of each row\n")
    return "\n".join(out)


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _cell(row: Row, key: str, scale: float) -> str:
    values = row.metrics.get(key)
    if not values:
        return ""
    is_cost = key in {k for k, _, _ in COSTS}
    spec = ".3g" if is_cost else ".2f"
    mean, std = row.mean(key) * scale, row.std(key)
    # the same FLOPs summed in another order differ in the last bits: not a spread worth showing
    if std is None or (is_cost and std <= 1e-9 * abs(mean)):
        return f"{mean:{spec}}"
    return f"{mean:{spec}} ± {std * scale:{spec}}"


def plot(rows: list[Row], path: Path, x: str | None = None) -> Path:
    """The main metric against a cost (``x``: gflops, params or latency_ms; by default the first of
    them every row has), one panel per task; without any cost, the rows side by side."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no display backend

    tasks = list(dict.fromkeys(row.task for row in rows))
    figure = Figure(figsize=(7 * len(tasks), 5), layout="constrained")
    for axes, task in zip(np.atleast_1d(figure.subplots(1, len(tasks))), tasks):
        task_rows = [row for row in rows if row.task == task]
        metric, heading, scale = TASK_METRICS[task][0]
        costs = {c[0]: c for c in COSTS if all(c[0] in row.metrics for row in task_rows)}
        cost = costs.get(x) if x else next((costs[k] for k in PLOT_X if k in costs), None)
        if x and cost is None:
            raise ValueError(f"--x {x}: not every {task} run's metrics.json has {x!r}")
        xs = [row.mean(cost[0]) * cost[2] if cost else i for i, row in enumerate(task_rows)]
        ys = [row.mean(metric) * scale for row in task_rows]
        errors = [(row.std(metric) or 0.0) * scale for row in task_rows]
        axes.errorbar(xs, ys, yerr=errors, fmt="o", capsize=4)
        for xv, yv, row in zip(xs, ys, task_rows):
            text = row.label(separator="\n") + f"\nn={row.n}"
            axes.annotate(text, (xv, yv), textcoords="offset points", xytext=(7, 0), va="center", fontsize=7)
        axes.margins(x=0.2, y=0.1)
        if cost:
            axes.set_xlabel(cost[1])
        else:
            axes.set_xticks(xs, [row.label() for row in task_rows], rotation=20, ha="right", fontsize=8)
        axes.set_ylabel(heading)
        axes.set_title(task)
        axes.grid(alpha=0.3)
    figure.savefig(path, dpi=150)
    return path


def write_report(rows: list[Row], output: str | Path, x: str | None = None) -> dict[str, Path]:
    """``report.csv``, ``report.md`` and ``report.png`` under ``output``."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "report.md").write_text(markdown(rows), encoding="utf-8")
    return {"csv": write_csv(rows, output / "report.csv"), "md": output / "report.md",
            "png": plot(rows, output / "report.png", x)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tasks.tools.report",
        description="Compare runs: group runs that differ only by seed (mean ± std) and write report.csv, "
                    "report.md and report.png.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a run folder (trainer.default_root_dir, tested) or a folder of runs")
    parser.add_argument("--output", "-o", default=".", help="where to write the report (default: here)")
    parser.add_argument("--x", choices=PLOT_X,
                        help="the plot's x-axis (default: gflops, else params, else latency_ms)")
    args = parser.parse_args(argv)
    try:
        rows = build_report(args.run_dirs)
        written = write_report(rows, args.output, args.x)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    print(written["md"].read_text(encoding="utf-8"))
    print("\n".join(f"wrote {path}" for path in written.values()))


if __name__ == "__main__":
    main()
