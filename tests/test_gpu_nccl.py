"""benchmarks/gpu_nccl.py, the GPU check's ``nccl`` stage, where this machine can run it: its verdicts on stuck
children that end as torch's NCCL watchdog ends a process, or hang (fast), and its check of the suite's process
group on a real one-rank ``fit --trainer.strategy ddp`` with gloo, which fails when the timeout differs (slow)."""
from __future__ import annotations

import re
import sys
from datetime import timedelta

import pytest

from tests.conftest import REPO, clean_env

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_nccl  # noqa: E402

#: what ProcessGroupNCCL's watchdog prints, then does (SIGABRT), under TORCH_NCCL_ASYNC_ERROR_HANDLING=3
ABORTS = ("import os, sys; print('stuck collective queued', flush=True); sys.stderr.write('[rank0]:[E] [PG ID 0 "
          "Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, "
          "Timeout(ms)=3000) ran for 3004 milliseconds before timing out.\\n'); sys.stderr.flush(); os.abort()")
HANGS = "import time; print('stuck collective queued', flush=True); time.sleep(60)"
ENDS_QUIETLY = "print('stuck collective queued', flush=True)"


def watch(tmp_path, code: str, window_s: float = 30.0, deadline: float | None = None) -> dict:
    return gpu_nccl.watch_stuck_child(tmp_path, "child", clean_env(), window_s, deadline, [sys.executable, "-c", code])


def test_a_child_the_watchdog_ends_holds_and_one_left_running_fails_the_default_check(tmp_path):
    aborted = watch(tmp_path, ABORTS)
    assert aborted["queued"] and aborted["exit_code"] == -6 and not aborted["cut"]  # SIGABRT, not killed by us
    assert "ran for 3004 milliseconds" in aborted["watchdog_line"]
    assert gpu_nccl.watchdog_row(aborted)["status"] == "ok"
    no_handling = gpu_nccl.no_handling_row(aborted)
    assert no_handling["status"] == "failed" and "exited -6" in no_handling["note"]

    hung = watch(tmp_path, HANGS, window_s=gpu_nccl.STUCK_TIMEOUT_S + gpu_nccl.MIN_OBSERVED_S + 0.5)
    assert hung["exit_code"] is None and not hung["cut"]  # killed at the end of its window
    assert gpu_nccl.no_handling_row(hung)["status"] == "ok"
    still = gpu_nccl.watchdog_row(hung)
    assert still["status"] == "failed" and still["note"].startswith("still running")

    quiet = gpu_nccl.watchdog_row(watch(tmp_path, ENDS_QUIETLY))
    assert quiet["status"] == "failed" and quiet["note"] == "exit 0; no watchdog timeout line on stderr"

    early = gpu_nccl.watchdog_row(watch(tmp_path, "raise SystemExit('NCCL error: unhandled system error')"))
    assert early["status"] == "failed" and early["note"].startswith("exit 1 before its collective queued")
    assert "unhandled system error" in early["note"]
    table = gpu_nccl.markdown({"machine": "m", "torch_defaults": gpu_nccl.torch_defaults(),
                               "rows": [gpu_nccl.watchdog_row(aborted), no_handling, still, early]})
    assert re.search(r"\| exit -6 [\d.]+ s after it queued; \[rank0\].*ran for 3004 milliseconds before timing out\. \| ok \|",
                     table), table
    assert "| ok |" in table and table.count("| failed: ") == 3


def test_a_child_stopped_by_the_budget_is_cut_not_passed(tmp_path):
    import time

    hung = watch(tmp_path, HANGS, deadline=time.monotonic() + 1.5)
    assert hung["exit_code"] is None and hung["cut"]
    assert gpu_nccl.watchdog_row(hung)["status"] == "cut"
    assert gpu_nccl.no_handling_row(hung)["status"] == "cut"  # not watched long enough past the timeout


@pytest.mark.slow  # two one-step CLI fits (~25 s each on 2 cores)
def test_the_strategy_check_reads_the_suites_timeout_from_the_process_group(tmp_path, monkeypatch):
    from tasks.cli import sharding

    row = gpu_nccl.strategy_row(tmp_path, tiny=True, deadline=None)
    assert row["status"] == "ok", row
    assert row["observed"]["backend"] == "gloo" and row["observed"]["strategy"] == "WatchedDDPStrategy"
    assert row["observed"]["process_group_timeout_s"] == sharding.COLLECTIVE_TIMEOUT.total_seconds() == 600
    # expecting another timeout than the fit's process group has fails the check, naming both
    monkeypatch.setattr(sharding, "COLLECTIVE_TIMEOUT", timedelta(minutes=5))
    row = gpu_nccl.strategy_row(tmp_path, tiny=True, deadline=None)
    assert row["status"] == "failed" and "process_group_timeout_s 600.0, expected 300.0" in row["note"], row
