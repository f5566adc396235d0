"""benchmarks/gpu_cli.py cannot rot: its --tiny mode runs every task's real CLI on the CPU through the
cells a GPU run checks (fit, test, predict, export, SIGTERM-and-resume, channels_last) and writes its
table. The GPU run itself is issue 31's device check."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, clean_env


@pytest.mark.slow  # four tasks' CLIs, about ten commands each
def test_tiny_cli_check_passes_every_cell_on_the_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_cli.py"), "--accelerator", "cpu", "--tiny",
                           "--jobs", "2", "--output", str(tmp_path / "out")], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "gpu_cli.json").read_text())["rows"]
    cells = {(r["task"], r["cell"]): r for r in rows}
    for task in ("classify", "detect", "segment", "translate"):
        for cell in ("fit_bf16", "test", "predict", "export", "resume"):
            assert cells[(task, cell)]["status"] == "ok", cells[(task, cell)]
        assert cells[(task, "fit_fp16")]["status"] == "skipped"
        assert "weights and optimizer state equal" in cells[(task, "resume")]["detail"]
    table = (tmp_path / "out" / "gpu_cli.md").read_text()
    assert table.count("| ok |") == sum(r["status"] == "ok" for r in rows)
