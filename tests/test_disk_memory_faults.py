"""Disk and memory faults on the real commands (issue 50, item 4): a disk that fills during a checkpoint write,
during `test`'s outputs and during ``datamodules.optimize``, and a loader worker killed as the OOM killer kills.

A full disk is a real one: a small tmpfs mounted over the folder the command writes, inside a private mount
namespace (``unshare --user --map-root-user --mount``, no root needed where user namespaces are enabled; the
test is skipped, saying why, where they are not). The command and the check of what it left run in that
namespace, where the mount is visible. (Alternatives that were not taken: ``RLIMIT_FSIZE`` gives ``EFBIG``
or ``SIGXFSZ``, not the ``ENOSPC`` of a full disk; patching ``os.write`` in the process tests the patch.)
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, clean_env
from tests.test_contract import EVAL_LIMIT, QUIET, SHAPE_OVERRIDE, TINY


def namespaces_work() -> str | None:
    """``None`` when a private tmpfs can be mounted here, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"no private mount namespace here: {probe.stderr.strip()}"


needs_tmpfs = pytest.mark.skipif(namespaces_work() is not None, reason=str(namespaces_work()))

#: inside the namespace, after the command: what it left in the small disk, as JSON on the last line
INSPECT = """
import json, sys, torch
from pathlib import Path
folder = Path(sys.argv[1])
files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
last = folder / "last.ckpt"
step = torch.load(last, weights_only=True)["global_step"] if last.is_file() else None
print(json.dumps({"files": files, "last_step": step}))
"""


def on_small_disk(folder, size: str, command: list[str], cwd, timeout: float = 1200):
    """Run ``command`` with a ``size`` tmpfs mounted over ``folder``; returns (exit code, output, what it left)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = (f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(folder))} || exit 99; "
              f"{shlex.join(command)}; code=$?; "
              f"{shlex.join([sys.executable, '-c', INSPECT, str(folder)])}; exit $code")
    proc = subprocess.Popen(["unshare", "-rm", "sh", "-c", script], cwd=cwd, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{shlex.join(command[:4])} ... still running {timeout:.0f} s after the disk filled (a hang):\n"
                    f"{output[-3000:]}")
    left = json.loads(output.strip().splitlines()[-1])
    return proc.returncode, output, left


def parameter_bytes(tmp_path) -> int:
    """The classification network's float32 weights at the test's size."""
    from tasks.cli.suite import SuiteCLI

    cli = SuiteCLI("classify", ["--config", str(REPO / "configs/classify/demo_mobilevitv2.yaml"), *TINY["classify"],
                                *SHAPE_OVERRIDE["classify"], *QUIET,
                                "--trainer.default_root_dir", str(tmp_path / "probe")], run=False)
    return sum(p.numel() * p.element_size() for p in cli.model.parameters())


@pytest.mark.slow
@needs_tmpfs
def test_disk_full_during_a_checkpoint_write_names_it_and_keeps_the_last_checkpoint(tmp_path):
    """Room for one checkpoint (weights and Adam's two moments: about 3x the weights) and a half: the first
    last.ckpt is written, the second (written beside it before it replaces it) does not fit."""
    room = int(4.5 * parameter_bytes(tmp_path))
    checkpoints = tmp_path / "run" / "checkpoints"
    command = [sys.executable, "-m", "tasks.classify", "fit", *TINY["classify"], *SHAPE_OVERRIDE["classify"], *QUIET,
               "--trainer.max_steps", "3", "--checkpoint.every_n_train_steps", "1", "--trainer.default_root_dir",
               str(tmp_path / "run")]
    code, output, left = on_small_disk(checkpoints, str(room), command, tmp_path)
    assert code not in (0, 99), output[-3000:]
    assert f"no space left on device writing checkpoint {checkpoints / 'last.ckpt'}: it needs about" in output
    assert "the last good checkpoint at" in output and "is intact" in output
    assert left == {"files": ["last.ckpt"], "last_step": 1}, left  # the step before, whole; no partial file


@pytest.mark.slow
@needs_tmpfs
def test_disk_full_during_test_outputs_fails_and_leaves_the_folder_marked_unfinished(tmp_path, demo_fit):
    ckpt = demo_fit("classify") / "checkpoints" / "last.ckpt"
    predictions = tmp_path / "run" / "predictions"
    command = [sys.executable, "-m", "tasks.classify", "test", "--ckpt_path", str(ckpt), *TINY["classify"], *QUIET,
               *EVAL_LIMIT["classify"], "--trainer.default_root_dir", "run"]
    code, output, left = on_small_disk(predictions, "8k", command, tmp_path)
    assert code not in (0, 99), output[-3000:]
    assert "No space left on device" in output or "no space left on device" in output
    # what `test` left is marked unfinished (tasks.outputs.common.INCOMPLETE), whatever it had written
    assert "INCOMPLETE.txt" in left["files"], left


@pytest.mark.slow
@needs_tmpfs
def test_disk_full_during_optimize_fails_and_writes_no_manifest(tmp_path):
    """``streaming.json`` is what marks an optimized folder usable: a conversion that ran out of space must not
    leave one, and must end, every process of it."""
    output_dir = tmp_path / "optimized"
    command = [sys.executable, "-m", "datamodules.optimize", "--task", "classify", "--output", str(output_dir),
               "--num-workers", "1", "--chunk-bytes", "16kB"]
    code, output, left = on_small_disk(output_dir, "96k", command, tmp_path, timeout=300)
    assert code not in (0, 99), output[-3000:]
    assert "No space left on device" in output or "no space left on device" in output
    assert "streaming.json" not in left["files"], left
    assert f"converting split train into {output_dir / 'train'} failed" in output, output[-3000:]


@pytest.mark.slow
def test_a_loader_worker_killed_stops_the_fit_naming_it(tmp_path):
    """The OOM killer's SIGKILL to a loader worker: the fit stops (no hang), the error names the worker's pid and
    its signal."""
    proc = subprocess.run([sys.executable, "-m", "tasks.classify", "fit", *TINY["classify"][:-2], "--data.num_workers",
                           "2", *SHAPE_OVERRIDE["classify"], *QUIET, "--trainer.max_steps", "4",
                           "--trainer.default_root_dir", "run", "--trainer.callbacks+=tests.fault_injection.FaultInjector"],
                          cwd=tmp_path, env=clean_env(SUITE_FAULT="worker:2"), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode != 0
    assert "DataLoader worker (pid" in proc.stderr and "is killed by signal: Killed" in proc.stderr, proc.stderr[-3000:]
