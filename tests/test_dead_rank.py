"""A dead peer rank: one of two processes of the real classification fit is SIGKILLed (rank 0, or the rank
Lightning's launcher started); the other stops within the bound (60 s; on CPU with gloo about 1 s through
tasks.cli.preemption.PeerWatch), exits non-zero, prints the command that resumes, and writes nothing half-done:
``last.ckpt`` is whole and the resume ends where an uninterrupted run ends."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, clean_env
from tests.test_contract import QUIET, SHAPE_OVERRIDE, TINY, assert_resumed_equals_straight

sys.path.insert(0, str(REPO / "scripts"))
from fault_campaign import PEER_BOUND_S, Run, folder_digest  # noqa: E402
from fault_campaign import test_arguments as evaluation_arguments  # noqa: E402  (not a test)

RUN = [*TINY["classify"], *SHAPE_OVERRIDE["classify"], *QUIET, "--trainer.devices", "2", "--trainer.strategy", "ddp",
       "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1",
       "--checkpoint.every_n_train_steps", "1", "--trainer.callbacks+=tests.fault_injection.FaultInjector"]


def fit(tmp_path, root: str, *extra: str, fault: str | None = None):
    env = clean_env(**({"SUITE_FAULT": fault} if fault else {}))
    run = Run("classify", ["fit", *RUN, "--trainer.default_root_dir", root, *extra], tmp_path, env,
              tmp_path / f"{root}-{fault}.log", fork=False)
    code, info = run.wait(timeout=900)
    return code, info, run.text()


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_killed_rank_stops_the_other_within_the_bound_with_the_resume_command(tmp_path, rank):
    code, info, log = fit(tmp_path, "resumed", fault=f"step:4:{rank}")
    assert "hang" not in info, log[-3000:]
    assert code != 0
    assert info["all_gone"] - info["first_death"] <= PEER_BOUND_S, info
    survivor = 1 - rank
    assert f"rank {survivor}: stopping, another process of this run is gone" in log, log[-3000:]
    last = tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    resume = log.split("resume with:")[1].splitlines()[0].split()
    assert resume[:3] == ["python", "-m", "tasks.classify"] and resume[-4:] == [
        "--trainer.default_root_dir", str(tmp_path / "resumed"), "--ckpt_path", "last"]
    # nothing half-done: the last checkpoint is the whole one of the last finished step, no partial file beside it
    assert torch.load(last, weights_only=True)["global_step"] == 4
    assert not [p.name for p in last.parent.iterdir() if ".tmp-" in p.name]
    if rank == 0:  # the resume the message gives ends where the uninterrupted run ends
        code, info, log = fit(tmp_path, "resumed", "--ckpt_path", "last")
        assert code == 0, log[-3000:]
        code, info, log = fit(tmp_path, "straight")
        assert code == 0, log[-3000:]
        assert_resumed_equals_straight(tmp_path, steps=6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, rank", [("ddp", 0), ("ddp", 1), ("fsdp", 0)])
def test_a_rank_killed_inside_the_rendezvous_stops_the_other_within_the_bound(tmp_path, strategy, rank):
    """The fault campaign's round-three hang: a rank killed inside ``init_process_group`` (rank 0 hosts its TCPStore,
    rank 1 waits there for it) left the other waiting for the process group's 10-minute timeout, since the peer
    watch started only at the callbacks' ``setup``, after the rendezvous. The suite's ``ddp`` and ``fsdp`` strategies
    now start it before; the survivor stops within the bound, saying that there is nothing to resume yet."""
    code, info, log = fit(tmp_path, "run", "--trainer.strategy", strategy, fault=f"rendezvous:0:{rank}")
    assert "hang" not in info, log[-3000:]
    assert info["all_gone"] - info["first_death"] <= PEER_BOUND_S, info
    if rank == 1:  # the launcher's own exit code is the survivor's (0's PeerWatch before Lightning's observer's kill)
        assert code == 1, log[-3000:]
    assert f"rank {1 - rank}: stopping, another process of this run is gone" in log, log[-3000:]
    assert "no last.ckpt yet: the run starts again from its beginning" in log
    assert not list((tmp_path / "run").glob("checkpoints/*"))


@pytest.mark.slow
def test_a_resume_killed_inside_the_rendezvous_prints_the_resume_command(tmp_path):
    """A resumed fit whose rank 0 dies inside the rendezvous: rank 1 stops within the bound, prints the command
    that resumes, and the ``last.ckpt`` it names is the one the killed run left, untouched."""
    code, info, log = fit(tmp_path, "run", fault="step:2:1")
    assert code != 0 and "hang" not in info, log[-3000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    code, info, log = fit(tmp_path, "run", "--ckpt_path", "last", fault="rendezvous:0:0")
    assert "hang" not in info, log[-3000:]
    assert info["all_gone"] - info["first_death"] <= PEER_BOUND_S, info
    assert "rank 1: stopping, another process of this run is gone" in log, log[-3000:]
    resume = log.split("resume with:")[1].splitlines()[0].split()
    assert resume[:3] == ["python", "-m", "tasks.classify"] and resume[-4:] == [
        "--trainer.default_root_dir", str(tmp_path / "run"), "--ckpt_path", "last"]
    assert last.read_bytes() == before
    assert not [p.name for p in last.parent.iterdir() if ".tmp-" in p.name]


@pytest.mark.slow
def test_a_rank_killed_at_the_end_of_test_fails_the_command_and_names_what_is_complete(tmp_path):
    """Fault campaign round four: rank 1 of a 2-process `test` SIGKILLed after its last output writer, where no
    peer waited on it any more, and the command exited 0 (Lightning's launcher does not wait for the ranks it
    started). Now, killed there, rank 0 fails in the barrier before the folder is marked finished, so
    ``INCOMPLETE.txt`` stays; killed later, as its interpreter exits, rank 0 waits for it and the command exits 1
    naming the rank and its signal, with the outputs, all written before, equal to an undisturbed run's."""
    code, _, log = fit(tmp_path, "fit")
    assert code == 0, log[-3000:]
    ckpt = str(tmp_path / "fit" / "checkpoints" / "last.ckpt")

    def test(root: str, **env: str):
        args = ["test", *evaluation_arguments("classify"), "--trainer.devices", "2", "--trainer.strategy", "ddp",
                "--ckpt_path", ckpt, "--trainer.default_root_dir", root]
        run = Run("classify", args, tmp_path, clean_env(**env), tmp_path / f"{root}.log", fork=False)
        code, info = run.wait(timeout=900)
        return code, run.text()

    counts = tmp_path / "counts"
    code, log = test("straight", SUITE_FAULT_COUNTS=str(counts))
    assert code == 0, log[-3000:]
    last_writer = json.loads(Path(f"{counts}.rank1").read_text())["test_output"] - 1
    code, log = test("after-writing", SUITE_FAULT=f"test_output:{last_writer}:1")
    assert code == 1, log[-3000:]
    assert "rank 0: stopping, another process of this run is gone" in log
    assert "this test did not finish: its outputs stay marked unfinished; run the command again" in log
    assert (tmp_path / "after-writing" / "predictions" / "INCOMPLETE.txt").is_file()
    code, log = test("at-exit", SUITE_FAULT="exit:0:1")
    assert code == 1, log[-3000:]
    assert "error: local rank 1 (process" in log and "was killed by SIGKILL, after the run's last collective" in log
    assert folder_digest(tmp_path / "at-exit" / "predictions") == folder_digest(tmp_path / "straight" / "predictions")


def test_a_launched_rank_that_ended_badly_is_named():
    """What the launching rank reports once its command is done: each rank it started that was killed, exited
    non-zero or still runs after the wait; a rank that ended with 0 is not named."""
    import subprocess
    from types import SimpleNamespace

    from tasks.cli.preemption import launched_ranks_failed

    def started(code: str):
        return subprocess.Popen([sys.executable, "-c", code])

    procs = [started("pass"), started("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
             started("raise SystemExit(3)"), started("import time; time.sleep(30)")]
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=SimpleNamespace(procs=procs)))
    try:
        failed = launched_ranks_failed(trainer, wait_s=5)
    finally:
        procs[-1].kill()
    assert failed == [f"local rank 2 (process {procs[1].pid}) was killed by SIGKILL",
                      f"local rank 3 (process {procs[2].pid}) exited with code 3",
                      f"local rank 4 (process {procs[3].pid}) still runs 5 s after rank 0 ended"]
    assert launched_ranks_failed(SimpleNamespace(strategy=SimpleNamespace(launcher=None))) == []


def test_ddp_and_fsdp_get_torchs_nccl_timeout_for_their_collectives():
    """``--trainer.strategy ddp`` / ``fsdp``: a collective waits for a dead peer on another node as long as torch's
    own NCCL default (not Lightning's 30 minutes for every backend); other strategy values are left alone."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.constants import default_pg_nccl_timeout

    from tasks.cli.sharding import COLLECTIVE_TIMEOUT, FullyShardedStrategy, sharded_strategy

    assert COLLECTIVE_TIMEOUT == timedelta(minutes=10)
    if default_pg_nccl_timeout is not None:  # a torch built with NCCL
        assert COLLECTIVE_TIMEOUT == default_pg_nccl_timeout
    ddp, fsdp = sharded_strategy("ddp"), sharded_strategy("fsdp")
    assert isinstance(ddp, DDPStrategy) and ddp._timeout == COLLECTIVE_TIMEOUT
    assert isinstance(fsdp, FullyShardedStrategy) and fsdp._timeout == COLLECTIVE_TIMEOUT
    assert sharded_strategy("ddp_spawn") == "ddp_spawn" and sharded_strategy("auto") == "auto"


def test_peer_watch_ends_a_process_blocked_as_in_a_collective_once_its_peer_is_gone(tmp_path):
    """What NCCL needs (gloo's collective fails by itself, so the CLI runs above end through the error): the main
    thread sits in a call that never returns, the peer process dies, and the watch thread prints the summary and
    ends the process with code 1 within seconds."""
    import subprocess
    import time

    script = """
import subprocess, sys, time
from tasks.cli.preemption import PeerWatch
peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
def summary(why):
    return "resume with: python -m tasks.classify fit --ckpt_path last (" + why + ")"
watch = PeerWatch([peer], None, summary, period=0.2)
watch.start()
peer.wait()  # the peer ends with 0: not gone
watch.children = [subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])]
time.sleep(120)  # a collective that never returns
"""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert time.monotonic() - started < 100  # not the 120 s sleep
    assert "resume with: python -m tasks.classify fit --ckpt_path last (process" in proc.stderr
    assert "exited with code -9)" in proc.stderr
