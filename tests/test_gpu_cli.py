"""benchmarks/gpu_cli.py cannot rot: its --tiny mode runs every task's real CLI on the CPU through the
cells a GPU run checks (fit, test, predict, export, SIGTERM-and-resume, channels_last) and writes its
table (slow). The resume verdict and the order cells start in are checked directly."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

from tests.conftest import REPO, clean_env

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_cli  # noqa: E402


def test_a_resumed_run_is_judged_against_two_uninterrupted_ones():
    assert gpu_cli.resume_verdict(0.0, 0.0) == "exact"
    assert gpu_cli.resume_verdict(0.0, 0.02) == "exact"
    assert gpu_cli.resume_verdict(0.05, 0.02) == "within noise"
    assert gpu_cli.resume_verdict(0.3, 0.02) == "beyond"  # a real resume difference above CUDA's noise
    assert gpu_cli.resume_verdict(1e-7, 0.0) == "beyond"  # deterministic straight runs: any difference is real


def test_difference_covers_weights_buffers_and_optimizer_state():
    def checkpoint(weight: float, running: float, moment: float) -> dict:
        return {"state_dict": {"w": torch.full((2,), weight), "bn.running_var": torch.full((2,), running),
                               "bn.num_batches_tracked": torch.tensor(3)},
                "optimizer_states": [{"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.full((2,), moment)}}}]}

    a, b = checkpoint(1.0, 2.0, 0.5), checkpoint(1.0, 2.25, 0.75)
    assert gpu_cli.difference(a, b, "weights") == 0.25
    assert gpu_cli.difference(a, b, "optimizer state") == 0.25


def test_cells_start_in_order_of_value_and_checkpoint_readers_wait_for_their_fit():
    schedule = gpu_cli.Schedule(["classify", "detect"], list(gpu_cli.CELLS))
    taken = [schedule.take()[:2] for _ in range(4)]
    assert taken == [("classify", "fit_bf16"), ("detect", "fit_bf16"), ("classify", "resume"), ("detect", "resume")]
    assert schedule.take()[:2] == ("classify", "fit_fp16")  # test/predict/export wait for a fit
    schedule.done("classify", "fit_bf16", "failed")
    assert schedule.take() == ("classify", "test", "fit_bf16 did not pass")
    waiter = threading.Thread(target=lambda: taken.append(schedule.take()))
    schedule.pending = [("detect", "test")]
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # detect's fit still runs
    schedule.done("detect", "fit_bf16", "ok")
    waiter.join(5)
    assert taken[-1] == ("detect", "test", None)


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
        detail = cells[(task, "resume")]["detail"]
        assert detail.startswith("deterministic true") and "weights exact" in detail and "optimizer state exact" in detail
    table = (tmp_path / "out" / "gpu_cli.md").read_text()
    assert table.count("| ok |") == sum(r["status"] == "ok" for r in rows)
