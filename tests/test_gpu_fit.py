"""benchmarks/gpu_fit.py cannot rot: its --tiny mode runs each task's paper recipe through the real CLI
on the benchmark-sized copies of the demo data and writes a rate per task. No rate is asserted."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import REPO, clean_env


@pytest.mark.slow  # builds four benchmark-sized datasets, then four short fits
def test_tiny_fit_throughput_of_every_paper_recipe(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_fit.py"), "--accelerator", "cpu", "--tiny",
                           "--work", str(tmp_path / "work"), "--output", str(tmp_path / "out")],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads((tmp_path / "out" / "gpu_fit.json").read_text())["rows"]
    assert [r["task"] for r in rows] == ["classify", "detect", "segment", "translate"]
    for row in rows:
        assert row["status"] == "ok" and row["steps"] == 3, row  # 4 steps, the first untimed
        assert math.isfinite(row["items_per_s"]) and row["items_per_s"] > 0, row
    assert "| translate | wmt14_en_de_transformer_base.yaml | ok |" in (tmp_path / "out" / "gpu_fit.md").read_text()
