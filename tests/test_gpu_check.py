"""scripts/gpu_check.sh: the one command a lent GPU machine runs. Its stages' boxes fit the 9 minutes a
command may take there (fast), and ``all --tiny`` runs every stage on the CPU, leaving at most 8 files
in OUT and none deeper than OUT/a/b (slow)."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.conftest import REPO, clean_env

SCRIPT = REPO / "scripts" / "gpu_check.sh"
#: one device command may run 10 minutes; the check keeps a minute for the machine's start and transfers
TOTAL_S = 540
SETUP_S = 15  # the wheels' install and the machine's description, before the first stage


def gpu_setting(name: str) -> int:
    """A number the script sets in its GPU branch (``name=N``), e.g. ``cli_box``."""
    text = SCRIPT.read_text()
    gpu = text[text.index("accelerator=gpu"):text.index("\nfi\n", text.index("accelerator=gpu"))]
    return int(re.search(rf"\b{name}=(\d+)", gpu)[1])


def test_the_stage_boxes_add_up_to_at_most_nine_minutes():
    assert f"total=${{GPU_CHECK_TOTAL_S:-{TOTAL_S}}}" in SCRIPT.read_text()
    boxes = {stage: gpu_setting(f"{stage}_box") for stage in ("cli", "suite", "fit", "micro", "nccl", "demo")}
    assert SETUP_S + sum(boxes.values()) <= TOTAL_S, boxes
    for stage in ("cli", "suite", "fit", "nccl"):  # a stage's own budget ends it before its box kills it
        assert gpu_setting(f"{stage}_budget") < boxes[stage], stage
    assert gpu_setting("demo_s") + 10 < boxes["demo"]


@pytest.mark.slow  # every stage on the CPU: four tasks' CLIs, the suite, four paper-recipe fits, nccl, the demo
def test_all_stages_pass_tiny_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), "all", str(out), "--tiny"], cwd=REPO,
                          env=clean_env(GPU_CHECK_WORK=str(tmp_path / "work")), capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    files = [p.relative_to(out) for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.parts) <= 3 for p in files), files  # the device's limits on OUT
    assert {"summary.md", "all.log", "gpu_cli.json", "gpu_suite.json", "gpu_fit.json", "demo.json"} <= {
        str(p) for p in files}
    assert not (out / "failed_cells.log").exists()

    summary = (out / "summary.md").read_text()
    for stage in ("cli", "suite", "fit", "micro", "nccl", "demo"):
        assert re.search(rf"^\| {stage} \| none \| \d+ \| 0 \|$", summary, re.M), summary[:2000]
    assert re.search(r"^\| setup \(the cold start[^|]*\| none \| \d+ \| 0 \|$", summary, re.M), summary[:2000]
    assert summary.startswith("# GPU check")  # no headline row missing
    assert "## cli: gpu_cli.md" in summary and "## demo: demo.md" in summary
    # the nccl stage: the suite's ddp process group verified with gloo, NCCL's rows skipped; its JSON in the log only
    assert re.search(r"^\| `fit --trainer.strategy ddp`, 1 rank[^|]*\| gloo, 600 s [^|]*\| gloo, 600.0 s [^|]*\| ok \|$",
                     summary, re.M), summary[-3000:]
    assert "| watchdog | - | - | skipped: needs CUDA (NCCL): --tiny |" in summary
    assert not (out / "gpu_nccl.json").exists() and '"check": "strategy"' in (out / "all.log").read_text()

    cells = {(r["task"], r["cell"]): r for r in json.loads((out / "gpu_cli.json").read_text())["rows"]}
    for task in ("classify", "detect", "segment", "translate"):
        assert cells[(task, "resume")]["status"] == "ok", cells[(task, "resume")]
        assert "weights exact" in cells[(task, "resume")]["detail"]  # CPU kernels are deterministic
    suite = json.loads((out / "gpu_suite.json").read_text())["rows"]
    assert {(r["task"], r["kind"]) for r in suite if r["status"] == "ok"} >= {
        (task, "ours") for task in ("classify", "detect", "segment", "translate")}
    fits = json.loads((out / "gpu_fit.json").read_text())["rows"]
    assert [r["status"] for r in fits] == ["ok"] * 4
    demo = json.loads((out / "demo.json").read_text())
    assert demo["status"] == "ok" and demo["it_per_s"] > 0 and demo["steps"] > 0


def test_a_headline_row_that_did_not_run_fails_the_check_and_heads_the_summary(tmp_path):
    """A paper recipe's interleaved ours-vs-peer pair with a side skipped by the budget, a paper peer timed in a
    single window with no pair, or a fit that failed, is named and exits 1; a single-window compiled row cut, or a
    peer with no equivalent of the recipe, is not a headline failure."""
    import sys

    def row(kind, status, compile="off", note="", task="classify"):
        return {"task": task, "recipe": "paper", "kind": kind, "network": "n", "status": status, "compile": compile,
                "note": note}

    def pair(peer, ours, task="classify"):
        return {"kind": "pair", "task": task, "rows": [peer, ours]}

    def check(pairs, single_rows, fit_rows, *flags):
        (tmp_path / "gpu_suite.json").write_text(json.dumps({"interleaved": pairs, "rows": single_rows}))
        (tmp_path / "gpu_fit.json").write_text(json.dumps({"rows": fit_rows}))
        (tmp_path / "demo.json").write_text(json.dumps({"status": "ok"}))
        proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_headline.py"), str(tmp_path),
                               str(tmp_path / "headline.md"), "all", *flags], capture_output=True, text=True)
        return proc.returncode, (tmp_path / "headline.md").read_text()

    no_equivalent = row("peer", "skipped", note="MarianMTModel has no equivalent of the recipe's {}", task="translate")
    fine = [pair(row("peer", "ok"), row("ours", "ok")),
            pair(no_equivalent, row("ours", "skipped", note="not compared", task="translate"), task="translate")]
    single = [row("ours", "skipped", "network", "budget"), row("peer", "skipped", note="budget")]
    assert check(fine, single, [{"task": "detect", "status": "ok"}]) == (0, "")
    rc, text = check([pair(row("peer", "skipped", note="over the budget"), row("ours", "ok"))],
                     [row("peer", "ok", task="segment")], [{"task": "detect", "status": "error", "note": "exit 1"}])
    assert rc == 1 and text.startswith("**Headline rows that did not run")
    assert "suite: classify paper peer (n) skipped: over the budget" in text
    assert "suite: segment paper: no interleaved ours-vs-peer pair" in text
    assert "fit: detect error: exit 1" in text
    assert check([], [], [])[0] == 1  # no pair at all
    missing_library = [pair(row("peer", "skipped", note="timm not installed (peer)"), row("ours", "skipped"))]
    assert check(missing_library, [], [])[0] == 1  # on the GPU machine: the comparison is missing
    # --tiny on a CPU machine without the peer's library
    assert check(missing_library, [], [{"task": "detect", "status": "ok"}], "--allow-missing-peers") == (0, "")
