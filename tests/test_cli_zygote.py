"""tests/cli_zygote.py: a CLI call forked from the server answers as a fresh ``python -m tasks.<task>`` does,
and a call whose environment the imports read gets a fresh process."""
import subprocess
import sys

import pytest

from tests.cli_zygote import can_fork_for
from tests.conftest import clean_env, cli_zygote, run_task


def test_a_forked_call_prints_and_exits_as_a_fresh_process_does(tmp_path, monkeypatch):
    args = ["fit", "--data.batch_size", "0", "--trainer.max_steps", "1"]
    forked = run_task("classify", *args, cwd=tmp_path, check=False)
    monkeypatch.setenv("SUITE_TEST_FRESH_PROCESSES", "1")
    fresh = run_task("classify", *args, cwd=tmp_path, check=False)
    assert forked.returncode == fresh.returncode == 1
    assert "batch_size" in forked.stderr
    # the same lines, warnings included (a module the server had imported would warn under runpy)
    assert forked.stdout == fresh.stdout and forked.stderr == fresh.stderr


def test_the_environment_decides_fork_or_fresh_process():
    base = clean_env()
    assert can_fork_for(clean_env(SUITE_DATA_CACHE="/elsewhere", SUITE_DEBUG="1", WANDB_MODE="disabled"), base)
    for read_at_import in ("OMP_NUM_THREADS", "SUITE_CPU_SPEEDUPS", "TORCH_LOGS", "CUDA_VISIBLE_DEVICES"):
        assert not can_fork_for(clean_env(**{read_at_import: "7"}), base), read_at_import
    assert cli_zygote(clean_env(OMP_NUM_THREADS="7")) is None


def test_a_call_past_its_timeout_is_killed_and_the_next_call_runs(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_task("classify", "fit", "--trainer.max_epochs", "1000", cwd=tmp_path, timeout=1)
    proc = run_task("classify", "--help", cwd=tmp_path)
    assert "fit" in proc.stdout and proc.args[:3] == [sys.executable, "-m", "tasks.classify"]
