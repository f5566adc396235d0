"""A kill between epochs, resumed from the ``last.ckpt`` written at the epoch's end (a recipe whose epochs do not
end in a validation: translation validates every ``val_check_interval`` steps), goes on exactly as the
uninterrupted run: the next epoch's batches are that epoch's own.

Found by the fault campaign (scripts/fault_campaign.py, translate, a second kill in the first step after a resume):
Lightning creates the training loader's iterator before it calls ``set_epoch`` on such a resume, and the token
batch sampler made its batch list when the iterator was created, so the resumed epoch 1 trained on epoch 0's
batches (other weights, no error).
"""
from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO, run_task
from tests.test_contract import QUIET, SHAPE_OVERRIDE, TINY

sys.path.insert(0, str(REPO / "scripts"))
import fault_campaign  # noqa: E402

#: two epochs of three steps, no validation, last.ckpt only at the epochs' ends
EPOCHS = ["--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3", "--trainer.check_val_every_n_epoch", "5",
          "--checkpoint.every_n_train_steps", "0", "--trainer.callbacks+=tests.fault_injection.FaultInjector"]


@pytest.mark.slow
def test_translation_resumed_from_an_epoch_end_trains_the_next_epoch_on_its_own_batches(tmp_path):
    fit = ["fit", *TINY["translate"], *SHAPE_OVERRIDE["translate"], *QUIET, *EPOCHS]
    run_task("translate", *fit, "--trainer.default_root_dir", "straight", cwd=tmp_path)
    killed = run_task("translate", *fit, "--trainer.default_root_dir", "killed", cwd=tmp_path, check=False,
                      env={"SUITE_FAULT": "step:3"})  # SIGKILL before the first step of epoch 1
    assert killed.returncode == -9, killed.stderr[-2000:]
    run_task("translate", *fit, "--trainer.default_root_dir", "killed", "--ckpt_path", "last", cwd=tmp_path)
    straight, resumed = tmp_path / "straight", tmp_path / "killed"
    assert fault_campaign.compare_checkpoints(straight / "checkpoints" / "last.ckpt", resumed / "checkpoints" / "last.ckpt",
                                              (str(straight), str(resumed))) == []
