"""``python -m tasks.tools.report``: runs laid out as the suite writes them (the resolved demo config,
``suite_config.yaml`` in wandb run folders or in the run root, ``predictions/metrics.json``),
grouped by the config values that differ, mean and sample std checked against numpy."""
import copy
import csv
import io
import json
import os
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from tasks.tools.report import build_report, main, read_run
from tests.conftest import run_task


def resolved_config(task: str) -> dict:
    """The resolved demo recipe, as ``python -m tasks.<task> fit --print_config`` shows it."""
    import importlib

    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        importlib.import_module(f"tasks.{task}").main(["fit", "--print_config"])
    return yaml.safe_load(out.getvalue())


@pytest.fixture(scope="module")
def classify_config() -> dict:
    return resolved_config("classify")


def write_run(folder: Path, recipe: dict, *, seed: int, metrics: dict, fit_overrides: dict, wandb: bool = True,
              test_model: dict | None = None) -> None:
    """A run as `fit` then `test --ckpt_path` leave it: with wandb, a fit and a test config in two wandb
    run folders; without wandb, the root's single config, which `test` overwrote last. ``fit_overrides``
    are the fit's flags (dotted keys); `test` was given only the checkpoint, so its trainer values
    are the recipe's and its model section is the checkpoint's (plus the class names from the data)."""
    def apply(config, overrides):
        for key, value in overrides.items():
            *parents, last = key.split(".")
            node = config
            for part in parents:
                node = node[part]
            node[last] = value
        return config

    fit = apply(copy.deepcopy(recipe), {"seed_everything": seed, "trainer.default_root_dir": str(folder),
                                        "checkpoint.dirpath": str(folder / "checkpoints"), **fit_overrides})
    test = apply(copy.deepcopy(recipe), {"seed_everything": seed, "trainer.default_root_dir": str(folder),
                                         "checkpoint.dirpath": str(folder / "checkpoints"),
                                         "ckpt_path": str(folder / "checkpoints" / "last.ckpt"), "verbose": True})
    test["model"] = {**copy.deepcopy(fit["model"]),
                     **(test_model or {"class_names": [f"{i}_digit" for i in range(10)]})}
    if wandb:
        for config, job, stamp in ((fit, "fit", "20260101_120000"), (test, "test", "20260101_130000")):
            config["trainer"]["logger"]["init_args"].update(save_dir=str(folder), group=f"{folder.name}-1a2b3c4d",
                                                            job_type=job)
            files = folder / "wandb" / f"offline-run-{stamp}-{job}{seed}" / "files"
            files.mkdir(parents=True)
            (files / "suite_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        (folder / "wandb" / "latest-run").symlink_to(files.parent.name)  # wandb's link to the newest run
        fit_file = next((folder / "wandb").glob("*fit*/files/suite_config.yaml"))
        os.utime(fit_file, (1e9, 1e9))  # written before the test config
    else:
        test["trainer"]["logger"] = False
        folder.mkdir(parents=True)
        (folder / "suite_config.yaml").write_text(yaml.safe_dump(test, sort_keys=False))
    (folder / "predictions").mkdir()
    (folder / "predictions" / "metrics.json").write_text(json.dumps(metrics, indent=2))


#: (max_epochs given to fit, the backbone's attention, seeds, params, gflops)
VARIANTS = [(15, "separable", (0, 1, 2), 1_370_000, 0.466), (15, "linformer", (0, 1, 2), 1_512_000, 0.431),
            (30, "separable", (0,), 1_370_000, 0.466)]


@pytest.fixture
def runs(tmp_path, classify_config) -> tuple[Path, dict]:
    """Seven runs under ``tmp_path/runs`` plus one not tested yet; returns the metrics written per variant."""
    rng = np.random.default_rng(0)
    written = {}
    for max_epochs, attention, seeds, params, gflops in VARIANTS:
        written[max_epochs, attention] = []
        for seed in seeds:
            metrics = {"test/top1": rng.uniform(0.6, 0.8), "test/top5": rng.uniform(0.9, 1.0),
                       "test/loss": rng.uniform(0.5, 1.0), "params": params, "gflops": gflops, "gmacs": gflops / 2}
            written[max_epochs, attention].append(metrics)
            folder = tmp_path / "runs" / f"{attention}-e{max_epochs}" / f"seed{seed}"
            # one run logged without wandb: its config lies in the run root
            write_run(folder, classify_config, seed=seed, metrics=metrics, wandb=(attention, seed) != ("separable", 2),
                      fit_overrides={"trainer.max_epochs": max_epochs,
                                     "model.backbone.init_args.attention": attention})
    untested = tmp_path / "runs" / "untested"
    (untested / "checkpoints").mkdir(parents=True)
    return tmp_path / "runs", written


def test_runs_differing_by_seed_are_one_row_with_numpy_mean_and_std(runs, tmp_path, capsys):
    parent, written = runs
    rows = build_report([parent])
    skipped = capsys.readouterr().err
    assert "skipped 1 of 8 runs" in skipped and "untested: no predictions/metrics.json" in skipped
    # the columns are the config values that differ (max_epochs from the fit config, not the test's),
    # named shortly; seeds, run roots, wandb groups and checkpoint paths are no columns
    assert [row.config for row in rows] == [{"max_epochs": 15, "attention": "linformer"},
                                            {"max_epochs": 15, "attention": "separable"},
                                            {"max_epochs": 30, "attention": "separable"}]
    assert rows[0].keys == {"max_epochs": "trainer.max_epochs", "attention": "model.backbone.init_args.attention"}
    for row in rows:
        metrics = written[row.config["max_epochs"], row.config["attention"]]
        assert row.task == "classification" and row.n == len(metrics) and sorted(row.seeds) == list(range(row.n))
        for key in ("test/top1", "test/top5", "test/loss", "params", "gflops"):
            values = np.array([m[key] for m in metrics])
            assert row.mean(key) == pytest.approx(values.mean(), rel=1e-12)
            if row.n > 1:
                assert row.std(key) == pytest.approx(values.std(ddof=1), rel=1e-12, abs=1e-15)
            else:
                assert row.std(key) is None

    main([str(parent), "--output", str(tmp_path / "report")])
    table = (tmp_path / "report" / "report.md").read_text().splitlines()
    assert table[0] == "| max_epochs | attention | n | top-1 (%) | top-5 (%) | params (M) | GFLOPs |"
    for line, ((max_epochs, attention), metrics) in zip(table[2:5], sorted(written.items(), key=lambda kv: kv[0])):
        top1, top5 = (100 * np.array([m[k] for m in metrics]) for k in ("test/top1", "test/top5"))
        shown = [f"{top1.mean():.2f}", f"{top5.mean():.2f}"] if len(metrics) == 1 else \
            [f"{top1.mean():.2f} ± {top1.std(ddof=1):.2f}", f"{top5.mean():.2f} ± {top5.std(ddof=1):.2f}"]
        params, gflops = metrics[0]["params"] / 1e6, metrics[0]["gflops"]
        assert line == (f"| {max_epochs} | {attention} | {len(metrics)} | {' | '.join(shown)} "
                        f"| {params:.3g} | {gflops:.3g} |")

    with open(tmp_path / "report" / "report.csv", newline="") as f:
        lines = list(csv.DictReader(f))
    assert [(int(r["max_epochs"]), r["attention"], int(r["n"])) for r in lines] == [
        (15, "linformer", 3), (15, "separable", 3), (30, "separable", 1)]
    top1 = [m["test/top1"] for m in written[15, "linformer"]]
    assert float(lines[0]["test/top1 mean"]) == pytest.approx(np.mean(top1), rel=1e-12)
    assert float(lines[0]["test/top1 std"]) == pytest.approx(np.std(top1, ddof=1), rel=1e-12)
    assert lines[2]["test/top1 std"] == ""  # one run: no spread to report
    assert lines[0]["seeds"] == "0 1 2" and len(lines[0]["runs"].split(";")) == 3

    with Image.open(tmp_path / "report" / "report.png") as image:
        assert image.format == "PNG" and image.width > 300 and image.height > 200
        image.verify()


def test_a_run_whose_test_did_not_finish_is_left_out_and_named(runs, capsys):
    """``INCOMPLETE.txt`` beside a ``metrics.json`` (a test killed while drawing pictures) is a partial run: the
    report skips it, saying why, and its numbers join no row."""
    parent, written = runs
    interrupted = parent / "linformer-e15" / "seed0"
    (interrupted / "predictions" / "INCOMPLETE.txt").write_text("test started\n")
    rows = build_report([parent])
    skipped = capsys.readouterr().err
    assert "skipped 2 of 8 runs" in skipped and "seed0: its test did not finish" in skipped, skipped
    row = next(r for r in rows if r.config == {"max_epochs": 15, "attention": "linformer"})
    assert row.n == 2 and sorted(row.seeds) == [1, 2]


def test_runs_of_two_tasks_get_a_table_each(tmp_path, classify_config):
    translate_config = resolved_config("translate")
    write_run(tmp_path / "classify", classify_config, seed=0, fit_overrides={},
              metrics={"test/top1": 0.7, "test/top5": 0.95, "params": 1e6, "gflops": 0.5})
    for beam, bleu in ((4, 21.5), (8, 22.25)):
        # the test's own --model.beam_size is what scored the run, whatever fit used
        write_run(tmp_path / f"translate-beam{beam}", translate_config, seed=0, fit_overrides={},
                  test_model={"beam_size": beam, "vocab_size": 2000},
                  metrics={"test/bleu": bleu, "test/chrf": 50.0, "test/chrf++": 48.0, "params": 2e6, "gflops": 0.1})
    rows = build_report([tmp_path])
    assert [(row.task, row.config) for row in rows] == [("classification", {}), ("translation", {"beam_size": 4}),
                                                          ("translation", {"beam_size": 8})]
    main([str(tmp_path), "--output", str(tmp_path / "report"), "--x", "params"])
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## classification\n\n| n | top-1 (%) | top-5 (%) | params (M) | GFLOPs |\n" in text
    assert "## translation\n\n| beam_size | n | BLEU | chrF | params (M) | GFLOPs |\n" in text
    assert "| 8 | 1 | 22.25 | 50.00 | 2 | 0.1 |" in text


def test_a_folder_without_runs_is_named(tmp_path):
    (tmp_path / "notes").mkdir()
    with pytest.raises(SystemExit, match=f"no runs in {tmp_path}"):
        main([str(tmp_path), "--output", str(tmp_path / "report")])
    (tmp_path / "fitted" / "checkpoints").mkdir(parents=True)  # fit ran, test did not
    with pytest.raises(ValueError, match=r"no run to report:\n  .*fitted: no predictions/metrics.json"):
        build_report([tmp_path])
    assert not (tmp_path / "report").exists()


@pytest.mark.slow
def test_report_of_real_runs_differing_by_seed(tmp_path):
    """Two real fit + test runs (default wandb logging) with seeds 0 and 1 are one row of n=2."""
    tiny = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.limit_test_batches", "2",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
            "--data.image_size", "32", "--data.eval_resize", "32", "--data.batch_size", "16", "--data.num_workers", "0",
            "--model.scheduler.init_args.warmup_steps", "2"]
    for seed in (0, 1):
        root = f"runs/seed{seed}"
        run_task("classify", "fit", *tiny, "--seed_everything", str(seed), "--trainer.default_root_dir", root,
                 "--trainer.val_check_interval", "2", cwd=tmp_path)
        run_task("classify", "test", *tiny, "--trainer.default_root_dir", root, "--seed_everything", str(seed),
                 "--ckpt_path", f"{root}/checkpoints/last.ckpt", cwd=tmp_path)
    run = read_run(tmp_path / "runs" / "seed0")
    assert run.config["trainer.max_steps"] == 2 and run.config["trainer.val_check_interval"] == 2  # the fit's config
    assert len(run.config["model.class_names"]) == 10  # the test's model, as the checkpoint rebuilt it
    rows = build_report([tmp_path / "runs"])
    assert len(rows) == 1 and rows[0].config == {} and rows[0].n == 2 and sorted(rows[0].seeds) == [0, 1]
    top1 = [json.loads((tmp_path / "runs" / f"seed{s}" / "predictions" / "metrics.json").read_text())["test/top1"]
            for s in (0, 1)]
    assert rows[0].mean("test/top1") == pytest.approx(np.mean(top1))
    assert rows[0].std("test/top1") == pytest.approx(np.std(top1, ddof=1))
    main([str(tmp_path / "runs"), "--output", str(tmp_path / "report")])
    with Image.open(tmp_path / "report" / "report.png") as image:
        image.verify()
