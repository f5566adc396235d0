"""The fault campaign (scripts/fault_campaign.py, points in tests/fault_injection.py): its pieces, then subsets of
the campaign itself on the real tasks. A fault is a fit of the demo recipe killed with SIGKILL and a resume; on
2 slow cores one costs 30-60 s, so the campaign subsets carry the ``slow`` marker."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, clean_env
from tests.fault_injection import parse_fault

sys.path.insert(0, str(REPO / "scripts"))
import fault_campaign  # noqa: E402


def test_fault_names_are_parsed_and_bad_ones_named():
    assert parse_fault("checkpoint:3") == ("checkpoint", 3, 0)
    assert parse_fault("allreduce:2:1") == ("allreduce", 2, 1)
    with pytest.raises(ValueError, match=r"SUITE_FAULT='checkpint:3': give <point>:<n>\[:<rank>\] with a point of "
                                         r"step, backward"):
        parse_fault("checkpint:3")


def test_checkpoints_compare_bit_for_bit_with_the_run_roots_made_equal(tmp_path):
    weights = torch.randn(4, 3)
    straight = {"state_dict": {"w": weights}, "optimizer_states": [{"state": {0: {"exp_avg": weights * 2}}}],
                "callbacks": {"ModelCheckpoint": {"best_model_path": f"{tmp_path}/straight/checkpoints/best.ckpt"}},
                "suite_run": {"id": "a"}}
    resumed = {"state_dict": {"w": weights.clone()}, "optimizer_states": [{"state": {0: {"exp_avg": weights * 2}}}],
               "callbacks": {"ModelCheckpoint": {"best_model_path": f"{tmp_path}/resumed/checkpoints/best.ckpt"}},
               "suite_run": {"id": "b"}}  # another run id: the same run's state
    torch.save(straight, tmp_path / "a.ckpt")
    torch.save(resumed, tmp_path / "b.ckpt")
    roots = (f"{tmp_path}/straight", f"{tmp_path}/resumed")
    assert fault_campaign.compare_checkpoints(tmp_path / "a.ckpt", tmp_path / "b.ckpt", roots) == []

    off = resumed["optimizer_states"][0]["state"][0]["exp_avg"]
    off[0, 0] = torch.nextafter(off[0, 0], torch.tensor(float("inf")))  # one bit of one moment
    torch.save(resumed, tmp_path / "b.ckpt")
    assert fault_campaign.compare_checkpoints(tmp_path / "a.ckpt", tmp_path / "b.ckpt", roots) == [
        "/optimizer_states[0]/state/0/exp_avg"]


def test_report_counts_every_outcome_by_task_and_kind():
    def result(task, procs, kind, outcome, peer=None):
        return {"fault": {"task": task, "procs": procs, "kind": kind, "n": 1, "rank": 0, "streamed": False},
                "outcome": outcome, "detail": "what differed" if outcome == "failure" else "", "peer_exit_s": peer}

    results = [result("classify", 1, "checkpoint", "identical"), result("classify", 1, "checkpoint", "refused"),
               result("detect", 2, "allreduce", "identical", peer=1.5), result("detect", 2, "time", "failure", peer=3.0)]
    text = fault_campaign.report(results, "python scripts/fault_campaign.py --work w")
    assert "| classify, 1 process | 2 | 1 | 1 | 0 | 0 | 0 |" in text
    assert "| detect, 2 processes | 2 | 1 | 0 | 0 | 1 | 0 |" in text
    assert "| checkpoint | 2 | 1 | 1 | 0 | 0 | 0 |" in text
    assert "| **all** | **4** | **2** | **1** | **0** | **1** | **0** |" in text
    assert "at most 3.0 s after the first rank died" in text
    assert "detect p2 time:1 rank 0: **failure** what differed" in text


def campaign(tmp_path, *args: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "fault_campaign.py"), "--work", str(tmp_path),
                           "--seed", "1", "--live", *args], env=clean_env(), capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return fault_campaign.load_results(tmp_path)


@pytest.mark.slow
def test_faults_inside_a_checkpoint_write_a_validation_and_ema_resume_bit_identical(tmp_path):
    """Classification, 1 process: one kill in each dangerous place of a fit and in `test`'s writers. Every resume
    equals the uninterrupted run bit for bit, or is refused by name (a kill before the first last.ckpt)."""
    results = campaign(tmp_path, "--tasks", "classify", "--procs", "1", "--streamed", "--kinds", "checkpoint",
                       "rename", "validation", "ema", "resume", "--per-kind", "1", "--random", "0",
                       "--test-every", "1")
    assert len(results) == 5
    outcomes = {r["fault"]["kind"]: r["outcome"] for r in results}
    assert set(outcomes.values()) <= {"identical", "refused"}, json.dumps(results, indent=1)[-4000:]
    assert outcomes["validation"] == outcomes["ema"] == "identical"
    for r in results:
        if r["outcome"] == "refused":
            assert "there is no" in r["detail"] and "last.ckpt to resume from" in r["detail"]


@pytest.mark.slow
def test_two_process_and_streamed_faults_resume_bit_identical(tmp_path):
    """The larger subset: classification on 2 processes and streamed from LitData chunks, kills inside an
    all-reduce, a backward (the peer waits in the gradient all-reduce), a checkpoint write and at random moments;
    a surviving rank is gone within the bound every time."""
    results = campaign(tmp_path, "--tasks", "classify", "--procs", "2", "--streamed", "classify", "--kinds",
                       "allreduce", "backward", "checkpoint", "time", "--per-kind", "1", "--random", "1",
                       "--test-every", "0")
    assert len(results) >= 6
    assert {r["outcome"] for r in results} <= {"identical", "refused"}, json.dumps(results, indent=1)[-4000:]
    assert all(r["peer_exit_s"] is None or r["peer_exit_s"] <= fault_campaign.PEER_BOUND_S for r in results)


@pytest.mark.slow
def test_a_kill_between_a_best_checkpoint_and_its_last_ckpt_resumes_to_the_same_best_file(tmp_path):
    """Classification, 1 process, killed inside the 5th checkpoint write: step 4's last.ckpt, after step 4's
    best-001-4.ckpt was complete. The resume trains step 4 again and must keep that one best file, as the
    uninterrupted run does (the campaign found best-001-4-v1.ckpt beside it, named as the best)."""
    results = campaign(tmp_path, "--tasks", "classify", "--procs", "1", "--streamed", "--points", "checkpoint:4",
                       "--test-every", "0")
    assert [r["outcome"] for r in results] == ["identical"], json.dumps(results, indent=1)[-4000:]
    checkpoints = tmp_path / "classify-p1" / "faults" / "classify-p1-checkpoint-4-r0-0" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("best-*")) == ["best-001-4.ckpt"]
