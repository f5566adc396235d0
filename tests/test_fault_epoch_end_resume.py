"""A kill between epochs, resumed from the ``last.ckpt`` written at the epoch's end (a recipe whose epochs do not
end in a validation: translation validates every ``val_check_interval`` steps), goes on exactly as the
uninterrupted run: the next epoch's batches are that epoch's own, and the loop's state (the loader's own state
included) is the uninterrupted run's.

Found by the fault campaign (scripts/fault_campaign.py, a second kill in the first step after a resume): on such a
resume Lightning creates the training loader's iterator before it counts the finished epoch and calls
``set_epoch``. The token batch sampler (translation) made its batch list, and the streamed training loader
(classification with ``--data.streaming_root``) read the trainer's epoch, when the iterator was created: the
resumed epoch 1 trained on epoch 0's batches (other weights, no error).
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


def assert_killed_and_resumed_as_uninterrupted(task: str, tmp_path, fault: str, *fit: str) -> None:
    """``fit`` straight, and killed at ``fault`` (``SUITE_FAULT``) then resumed with ``--ckpt_path last``: both
    last.ckpt files must be equal, tensor for tensor (weights, optimizer, loops, the loader's state)."""
    run_task(task, "fit", *fit, "--trainer.default_root_dir", "straight", cwd=tmp_path)
    killed = run_task(task, "fit", *fit, "--trainer.default_root_dir", "killed", cwd=tmp_path, check=False,
                      env={"SUITE_FAULT": fault})
    assert killed.returncode == -9, killed.stderr[-2000:]
    run_task(task, "fit", *fit, "--trainer.default_root_dir", "killed", "--ckpt_path", "last", cwd=tmp_path)
    straight, resumed = tmp_path / "straight", tmp_path / "killed"
    assert fault_campaign.compare_checkpoints(straight / "checkpoints" / "last.ckpt", resumed / "checkpoints" / "last.ckpt",
                                              (str(straight), str(resumed))) == []


def between_epochs(task: str) -> list[str]:
    return [*TINY[task], *SHAPE_OVERRIDE[task], *QUIET, *EPOCHS]


@pytest.mark.slow
def test_translation_resumed_from_an_epoch_end_trains_the_next_epoch_on_its_own_batches(tmp_path):
    # step:3: SIGKILL before the first step of epoch 1
    assert_killed_and_resumed_as_uninterrupted("translate", tmp_path, "step:3", *between_epochs("translate"))


@pytest.mark.slow
def test_streamed_classification_resumed_from_an_epoch_end_shuffles_the_next_epoch_as_its_own(tmp_path):
    """LitData shuffles each epoch by the trainer's epoch; the loader's own epoch count (LitData restores it on a
    later mid-epoch resume) must be the uninterrupted run's too."""
    root = fault_campaign.optimized("classify", tmp_path)  # the demo data in LitData chunks of 16 kB
    assert_killed_and_resumed_as_uninterrupted("classify", tmp_path, "step:3", *between_epochs("classify"),
                                               "--data.streaming_root", str(root))


@pytest.mark.slow
def test_streamed_classification_resumed_after_the_last_step_before_the_epoch_end_keeps_the_loader_state(tmp_path):
    """The campaign's fit (last.ckpt every step, a validation each epoch) killed inside its last checkpoint write
    (the 8th: last.ckpt after the final validation) resumes from the last step's last.ckpt and fetches no batch;
    the loader's state it saves must be the one it was handed (LitData's own answer before a fetch holds other
    counters: the dataset's epoch, the next worker). Found by the campaign (classify streamed, ``checkpoint:7``)."""
    root = fault_campaign.optimized("classify", tmp_path)
    assert_killed_and_resumed_as_uninterrupted("classify", tmp_path, "checkpoint:7", *fault_campaign.task_arguments("classify"),
                                               *fault_campaign.FIT, "--data.streaming_root", str(root))
