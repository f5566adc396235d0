"""A fit that has finished, given ``fit --ckpt_path last`` again (a job script re-run, a scheduler's retry of a
job that had ended, or a SIGKILL in the run's teardown after its last checkpoint), has nothing left to train: its
``last.ckpt`` stays as the finished run wrote it.

The fault campaign (scripts/fault_campaign.py) found it was not so: the final ``last.ckpt`` was the one its last
validation wrote, whose loops put the run before its last epoch's end, so the second fit ran that epoch's end
again and rewrote the file with ``epoch_progress.processed`` and ``_batches_that_stepped`` one higher.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import run_task
from tests.test_contract import QUIET, SHAPE_OVERRIDE, TINY

#: two epochs of two steps, a validation ending each; last.ckpt every step (the campaign's schedule)
TWO_EPOCHS = ["--trainer.max_epochs", "2", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
              "--checkpoint.every_n_train_steps", "1"]


@pytest.mark.slow
def test_fit_with_ckpt_path_last_of_a_finished_run_leaves_its_last_checkpoint(tmp_path):
    fit = ["fit", *TINY["classify"], *SHAPE_OVERRIDE["classify"], *QUIET, *TWO_EPOCHS]
    run_task("classify", *fit, cwd=tmp_path)
    last = tmp_path / "runs" / "classify" / "checkpoints" / "last.ckpt"
    finished = last.read_bytes()
    progress = torch.load(last, weights_only=True)["loops"]["fit_loop"]["epoch_progress"]["current"]
    assert progress["processed"] == 2  # Lightning's fit loop stops a resume at processed == max_epochs

    again = run_task("classify", *fit, "--ckpt_path", "last", cwd=tmp_path)
    assert "`max_epochs=2` reached" in again.stdout + again.stderr
    assert last.read_bytes() == finished
