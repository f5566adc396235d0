"""benchmarks/gpu_suite.py cannot rot: its --tiny mode (CPU, toy sizes, 3 steps) runs end to end
for every task, network and variant and writes its Markdown table and JSON (slow). No timing is
asserted. The translation peer's dimensions and the time budget's rules are checked directly."""
from __future__ import annotations

import importlib.util
import itertools
import json
import math
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, clean_env

SUITE = REPO / "benchmarks" / "gpu_suite.py"
TASKS = ("classify", "detect", "segment", "translate")
PEERS = {"classify", "detect", "segment", "translate"}
POSTPROCESSED = {"detect", "segment"}  # decoding + NMS; upsampling + argmax
PAPER_ROWS = {"classify": 2351, "detect": 2782, "segment": 241}  # MobileViTv2 paper, V100 img/s


def run_suite(*args: str, cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SUITE), *args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"gpu_suite.py {' '.join(args)} exited {proc.returncode}\n--- stdout\n" \
                                 f"{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return proc


@pytest.mark.slow  # long CLI run; the default run must stay under 10 minutes on 2 cores
def test_tiny_suite_writes_a_row_per_task_and_variant(tmp_path):
    run_suite("--tiny", "--output", str(tmp_path / "out"), cwd=tmp_path)
    data = json.loads((tmp_path / "out" / "gpu_suite.json").read_text())
    rows = data["rows"]
    assert data["meta"]["tiny"] and data["meta"]["device"] == "cpu"

    # --tiny plans: both precisions x the recipe's own layout (channels_last on for the paper recipes), no compile;
    # ours for every task x recipe, the peer at the paper recipe's size
    expected = set()
    for task in TASKS:
        for recipe, channels_last in (("demo", False), ("paper", task != "translate")):
            for precision in ("bf16-mixed", "16-mixed"):
                for kind in ("ours", "peer") if (task in PEERS and recipe == "paper") else ("ours",):
                    expected.add((task, recipe, kind, precision, channels_last, "off"))
    keys = [(r["task"], r["recipe"], r["kind"], r["precision"], r["channels_last"], r["compile"]) for r in rows]
    assert len(keys) == len(set(keys)), "duplicate rows"
    assert set(keys) == expected

    for row in rows:
        where = f"{row['task']} {row['recipe']} {row['network']} {row['precision']}"
        if row["precision"] == "16-mixed":  # fp16 autocast is a GPU setting: skipped on CPU, with a note
            assert row["status"] == "skipped" and "CPU" in row["note"], where
            continue
        if row["kind"] == "peer" and row["task"] == "translate" and importlib.util.find_spec("transformers") is None:
            assert row["status"] == "skipped" and "transformers not installed" in row["note"], where
            continue
        assert row["status"] == "ok", f"{where}: {row['status']} {row['note']}"
        assert row["steps"] == 2 and row["warmup_steps"] == 1, where
        for key in ("train_per_s", "loss_first", "loss_last", "params_m"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), f"{where}: {key}={row[key]}"
        assert row["train_per_s"] > 0 and row["params_m"] > 0, where
        assert row["unit"] == ("tok/s" if row["task"] == "translate" else "img/s"), where
        assert len(row["loss_curve"]) == 3 and all(math.isfinite(v) for v in row["loss_curve"]), where
        assert row["peak_mem_mb"] is None, where  # only measured on CUDA
        if row["recipe"] == "paper":  # inference at the paper's protocol (toy batch here)
            assert isinstance(row["infer_per_s"], float) and math.isfinite(row["infer_per_s"]) \
                and row["infer_per_s"] > 0 and row["infer_batch"] == 2, where
            assert (row["postprocess_per_s"] is not None) == (row["task"] in POSTPROCESSED), where
            if row["kind"] == "ours" and row["task"] in PAPER_ROWS:
                assert row["paper_v100_infer"] == PAPER_ROWS[row["task"]], where
        else:
            assert row["infer_per_s"] is None, where

    table = (tmp_path / "out" / "gpu_suite.md").read_text()
    assert "training step throughput of the network" in table
    single = table.split("## Single-window runs")[1]
    lines = [line for line in single.splitlines() if line.startswith("| ") and not line.startswith(("| task", "| ---"))]
    assert len(lines) == len(rows)
    for task in TASKS:
        assert f"| {task} | demo |" in table and f"| {task} | paper |" in table
    assert "| 2,351 |" in table and "| 2,782 |" in table and "| 241 |" in table

    # interleaved rounds (3 of 1 step): each paper recipe's network against its peer, then against its other layout
    groups = {(g["kind"], g["task"]): g for g in data["interleaved"]}
    image_tasks = ("classify", "detect", "segment")
    assert set(groups) == {("pair", task) for task in TASKS} | {("decision", task) for task in image_tasks}
    for (kind, task), group in groups.items():
        assert group["recipe"] == "paper" and group["current"] == {"channels_last": task != "translate",
                                                                   "compile": "off"}
        if task == "translate" and importlib.util.find_spec("transformers") is None:
            assert [r["status"] for r in group["rows"]] == ["skipped", "skipped"]
            continue
        reference, other = group["rows"]
        assert [reference["kind"], other["kind"]] == (["peer", "ours"] if kind == "pair" else ["ours", "ours"])
        for row in group["rows"]:
            assert row["status"] == "ok" and row["rounds"] == 3 and row["round_steps"] == 1, (kind, task, row["note"])
            assert len(row["ratios"]) == 3 and row["train_per_s"] > 0
        assert (other["channels_last"] != reference["channels_last"]) == (kind == "decision")
    decided = {d["task"]: d for d in data["decisions"]}
    assert set(decided) == set(image_tasks)
    for decision in decided.values():  # the layout was measured both ways; no compiled variant ran
        assert isinstance(decision["channels_last"], bool) and decision["compile"] is None
    assert "## Ours against the peer, interleaved rounds" in table and "How to read" in table
    assert "| configs/classify/imagenet_mobilevitv2_100.yaml | " in table


def test_check_env_reports_optional_packages(tmp_path):
    out = run_suite("--check-env", cwd=tmp_path).stdout
    assert "missing optional:" in out
    for name in ("torch", "torchvision", "timm", "triton"):
        assert name in out


@pytest.mark.slow  # inductor builds C++ on the CPU: about a minute per compiled network
def test_tiny_suite_times_regional_and_network_compilation(tmp_path):
    """The compiled variants run through the task's own --model.compile: both modes train, and the
    warm-up seconds (compilation included) are recorded."""
    run_suite("--tiny", "--tasks", "classify", "--recipes", "demo", "--precisions", "bf16-mixed",
              "--compile", "regional", "network", "--output", str(tmp_path / "out"), cwd=tmp_path)
    rows = json.loads((tmp_path / "out" / "gpu_suite.json").read_text())["rows"]
    assert sorted(r["compile"] for r in rows) == ["network", "regional"]
    for row in rows:
        assert row["status"] == "ok", row["note"]
        assert row["warmup_steps"] == 2 and row["warmup_s"] > 0 and math.isfinite(row["loss_last"])
    table = (tmp_path / "out" / "gpu_suite.md").read_text()
    assert "| regional |" in table and "| network |" in table


def test_the_marian_peer_has_our_translation_models_trainable_parameters():
    """Same dimensions, same architecture: a translation recipe and its MarianMTModel peer train the same
    number of parameters (Marian keeps its sinusoidal tables as frozen parameters). The demo recipe keeps
    it quick; the paper recipe's peer is built by the same code from its own dimensions."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite

    from tasks.translate import TranslationTask

    recipe = gpu_suite.tiny(next(r for r in gpu_suite.RECIPES if r.task == "translate" and r.name == "demo"))
    architecture = {k: v for k, v in recipe.config["model"].items() if not isinstance(v, dict)}
    ours, peer = TranslationTask(**architecture, **recipe.data_links), gpu_suite.MarianPeer(recipe)
    trainable = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in (ours, peer)]
    assert trainable[0] == trainable[1] > 1_000_000
    src = torch.randint(4, 2000, (2, 8))
    assert peer(src, src).shape == ours(src, src).shape == (2, 8, 2000)


def test_compiled_runs_keep_their_share_of_the_budget_and_estimates_follow_measured_runs():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite

    recipe = next(r for r in gpu_suite.RECIPES if r.task == "classify" and r.name == "paper")
    eager, compiled = (gpu_suite.Run(recipe, "ours", "bf16-mixed", True, mode) for mode in ("off", "network"))
    budget = gpu_suite.Budget(100.0, 0.4, any_compiled=True)
    assert budget.refuses(eager, 30.0) is None  # 30 + 23 <= 60, the eager share
    assert "eager runs' share" in budget.refuses(eager, 40.0)
    assert budget.refuses(compiled, 40.0) is None  # 40 + 48 <= 100
    budget.record(eager, 10.0)
    assert budget.refuses(eager, 45.0) is None  # the measured 10 s replaces the first guess
    assert gpu_suite.Budget(100.0, 0.4, any_compiled=False).refuses(eager, 70.0) is None  # nothing to keep it for
    assert gpu_suite.Budget(0.0, 0.4, any_compiled=True).refuses(eager, 1e6) is None  # no budget


def suite_module():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite

    return gpu_suite


def test_interleaved_rounds_alternate_which_variant_goes_first():
    """Each round times every variant for the same number of calls, the order rotating by one per round."""
    import numpy as np

    suite_module()
    from interleaved import round_orders, spread, timed_rounds

    calls = []
    variants = {name: (lambda name=name: calls.append(name)) for name in "AB"}
    seconds, orders = timed_rounds(variants, rounds=4, calls=2, device=torch.device("cpu"))
    assert orders == [["A", "B"], ["B", "A"], ["A", "B"], ["B", "A"]]
    assert "".join(calls) == "AABB" "BBAA" "AABB" "BBAA"
    assert {name: len(values) for name, values in seconds.items()} == {"A": 4, "B": 4}
    assert round_orders(["x", "y", "z"], 3) == [["x", "y", "z"], ["y", "z", "x"], ["z", "x", "y"]]
    values = [1.3, 0.9, 1.05, 1.1, 0.97, 1.0]  # quartiles as numpy's default (linear) percentiles
    summary = spread(values)
    assert [summary[k] for k in ("min", "q1", "median", "q3", "max")] == pytest.approx(
        np.percentile(values, [0, 25, 50, 75, 100]))
    with pytest.raises(ValueError, match="rounds=0"):
        timed_rounds(variants, rounds=0, calls=1, device=torch.device("cpu"))


def test_one_network_timed_against_itself_gives_a_ratio_near_one():
    """The demo classification recipe's network (built as `fit --config` builds it, toy size) as both sides of
    an interleaved pair: every round is timed, the sides alternate, and the median ratio is near 1 with its spread
    reported (a loose bound: the CPU is shared; the check is that the two sides are timed alike)."""
    gpu_suite = suite_module()
    recipe = gpu_suite.tiny(next(r for r in gpu_suite.RECIPES if r.task == "classify" and r.name == "demo"))
    run = gpu_suite.Run(recipe, "ours", "bf16-mixed", recipe.channels_last, "off")
    args = gpu_suite.parse_args(["--tiny", "--rounds", "6"])
    torch.set_num_threads(1)
    reference, same = gpu_suite.measure_group(gpu_suite.Group("pair", [run, run]), args, torch.device("cpu"))
    for row in (reference, same):
        assert row["status"] == "ok", row["note"]
        assert row["rounds"] == 6 and row["round_steps"] == 1 and len(row["round_per_s"]) == 6
        assert math.isfinite(row["loss_first"]) and row["train_per_s"] > 0
    assert reference["ratios"] == [1.0] * 6
    assert same["first_in_round"] == [r % 2 == 1 for r in range(6)]
    assert reference["first_in_round"] == [r % 2 == 0 for r in range(6)]
    ratio = same["ratio"]
    assert 0.5 < ratio["median"] < 2.0, same["ratios"]
    assert ratio["min"] <= ratio["q1"] <= ratio["median"] <= ratio["q3"] <= ratio["max"]
    text = gpu_suite.markdown_interleaved([{"kind": "pair", "task": "classify", "rows": [reference, same]}],
                                          {"rounds": 6, "round_steps": 1, "device": "cpu"})
    assert f"| 6 x 1 | " in text and f"{ratio['median']:.3f}" in text and "How to read" in text


def variant(channels_last, compile, status="ok", ratios=None, note=""):
    from interleaved import spread

    row = {"channels_last": channels_last, "compile": compile, "status": status, "note": note, "rounds": 5,
           "round_steps": 5}
    if ratios:
        row.update(ratios=ratios, ratio=spread(ratios))
    return row


def test_the_decision_takes_the_variant_faster_in_every_round_and_refuses_on_missing_rows():
    gpu_suite = suite_module()
    current = (True, "off")
    rows = [variant(True, "off", ratios=[1.0] * 5),
            variant(False, "off", ratios=[0.90, 0.92, 0.91, 0.93, 0.90]),
            variant(True, "regional", ratios=[1.20, 1.25, 1.22, 1.30, 1.21]),
            variant(True, "network", ratios=[1.60, 0.95, 1.50, 1.70, 1.55]),  # faster median, one slower round
            variant(False, "network", "skipped", note="time budget")]
    decision = gpu_suite.decide(rows, current)
    assert (decision["channels_last"], decision["compile"], decision["change"]) == (True, "regional", True)
    assert decision["margin"] == pytest.approx(0.22)
    assert decision["not_measured"] == ["channels_last off, compile network (skipped: time budget)"]
    assert "chosen alternative channels_last on, compile regional: x1.220 (rounds 1.200-1.300)" in decision["evidence"]

    # no alternative beats the setting in every round: it stays, the fastest alternative's margin shown
    kept = gpu_suite.decide(rows[:2] + rows[3:4], current)
    assert (kept["channels_last"], kept["compile"], kept["change"]) == (True, "off", False)
    assert kept["margin"] == pytest.approx(0.55)
    # only the layout was measured: the compile value is not guessed
    layout = gpu_suite.decide([rows[0], variant(False, "off", ratios=[1.1, 1.2, 1.15])], current)
    assert (layout["channels_last"], layout["compile"]) == (False, None)

    for missing in ([], rows[1:], [variant(True, "off", "error", note="OOM")] + rows[1:],
                    [rows[0], variant(False, "off", "skipped", note="time budget")]):
        refused = gpu_suite.decide(missing, current)
        assert (refused["channels_last"], refused["compile"], refused["margin"]) == (None, None, None)
        assert refused["evidence"].startswith("not measured")
    record = {"kind": "decision", "task": "classify", "recipe_source": "configs/x.yaml",
              "current": {"channels_last": True, "compile": "off"},
              "rows": [dict(r, network="n", unit="img/s", train_per_s=1.0) for r in rows[1:]]}
    table = gpu_suite.markdown_interleaved([record], {"rounds": 5, "round_steps": 5})
    assert "| configs/x.yaml | not measured | not measured | - | not measured: the recipe's own setting" in table
    record["rows"].insert(0, dict(rows[0], network="n", unit="img/s", train_per_s=1.0))
    table = gpu_suite.markdown_interleaved([record], {"rounds": 5, "round_steps": 5})
    assert "| configs/x.yaml | true (keep) | **regional** (was false) | +22.0 % |" in table


def test_on_cuda_each_timing_is_two_events_and_the_host_waits_on_the_end_event_only(monkeypatch):
    """The CUDA branch driven on the CPU with a fake event: per round and variant, start recorded, the calls, end
    recorded, a wait on the end event, its elapsed time (milliseconds) read; one device-wide synchronisation before
    the rounds (the warm-up's work) and none inside them."""
    suite_module()
    import interleaved

    log, names = [], itertools.cycle(["start", "end"])  # a timing makes its start event, then its end event

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.name = next(names)
            log.append(f"new {self.name}")

        def record(self):
            log.append(f"record {self.name}")

        def synchronize(self):
            log.append(f"wait {self.name}")

        def elapsed_time(self, end):
            log.append("elapsed")
            return 250.0

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("device sync"))
    seconds, _ = interleaved.timed_rounds({"A": lambda: log.append("A"), "B": lambda: log.append("B")}, rounds=2,
                                          calls=2, device=torch.device("cuda"))
    assert seconds == {"A": [0.25, 0.25], "B": [0.25, 0.25]}
    one = lambda name: ["new start", "new end", "record start", name, name, "record end", "wait end", "elapsed"]  # noqa: E731
    assert log == ["device sync", *one("A"), *one("B"), *one("B"), *one("A")]
