"""A read-only run root (issue 50, item 6): ``fit``, ``test`` and ``predict`` with ``--trainer.default_root_dir``
on a read-only file system stop with one line naming the folder, not an ``OSError`` traceback from the first
writer.

The tests run as root here, and ``chmod -w`` does not stop root; a read-only bind mount does (``EROFS`` for
everyone). It is made in a private mount namespace (``unshare --user --map-root-user --mount``, no privilege
needed where user namespaces are enabled; skipped, saying why, where they are not), as
tests/test_disk_memory_faults.py mounts its small disks.
"""
from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
from PIL import Image

from tests.conftest import clean_env
from tests.test_contract import QUIET, SHAPE_OVERRIDE, TINY
from tests.test_disk_memory_faults import needs_tmpfs

COMMANDS = ("fit", "test", "predict")


def run_on_a_read_only_folder(tmp_path, commands: dict[str, list[str]]) -> dict[str, tuple[int, str]]:
    """Each command (``python -m tasks.classify <args>``, in ``tmp_path``) with ``tmp_path/shut`` mounted
    read-only over itself: its exit code and stderr, by name."""
    (tmp_path / "shut").mkdir()
    (tmp_path / "out").mkdir()
    script = ["mount --bind shut shut && mount -o remount,bind,ro shut || exit 99",
              "touch shut/probe 2>/dev/null && exit 98"]  # the mount must really refuse writes, even to root
    for name, args in commands.items():
        command = shlex.join([sys.executable, "-m", "tasks.classify", *args])
        script.append(f"{command} >out/{name}.out 2>out/{name}.err; echo $? >out/{name}.code")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", "\n".join(script)], cwd=tmp_path,
                          env=clean_env(SUITE_DEBUG=""), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"the read-only mount failed ({proc.returncode}): {proc.stderr[-2000:]}"
    return {name: (int((tmp_path / "out" / f"{name}.code").read_text()),
                   (tmp_path / "out" / f"{name}.err").read_text()) for name in commands}


@pytest.mark.slow
@needs_tmpfs
def test_fit_test_and_predict_into_a_read_only_run_root_name_the_folder(demo_fit, tmp_path):
    ckpt = str(demo_fit("classify") / "checkpoints" / "last.ckpt")
    (tmp_path / "images").mkdir()
    Image.new("RGB", (40, 30), (200, 40, 10)).save(tmp_path / "images" / "red.png")
    root = ["--trainer.default_root_dir", "shut"]
    results = run_on_a_read_only_folder(tmp_path, {
        "fit": ["fit", *TINY["classify"], *SHAPE_OVERRIDE["classify"], *QUIET, "--trainer.max_epochs", "1",
                "--trainer.limit_train_batches", "1", *root],
        "test": ["test", "--ckpt_path", ckpt, *QUIET, *root],
        "predict": ["predict", "--ckpt_path", ckpt, "--data.predict_path", "images", *QUIET[:6], *root],
    })
    for name in COMMANDS:
        code, stderr = results[name]
        assert code == 1 and "Traceback" not in stderr, f"{name}: exit {code}\n{stderr[-3000:]}"
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("error: trainer.default_root_dir=shut: this user cannot write in shut (read-only)."), \
            f"{name}: {last}"
