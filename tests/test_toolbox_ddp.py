"""The training toolbox on two processes (gloo on CPU, ``--trainer.strategy ddp``), on the real classification task.

Each piece has its single-process checks in its own test file; here the same CLI options run under DDP:
repeated augmentation spreads the copies over the ranks (the epoch length is DeiT's, per rank), activation
checkpointing and layer-wise decay train the same weights as a run without checkpointing (the recomputation
is exact on CPU), and the throughput line counts both devices. Variable-resolution batches:
tests/test_variable_resolution.py; distillation and FSDP: their own files.
"""
import math
import re

import pytest
import torch

from tests.conftest import run_task
from tests.test_contract import QUIET, SHAPE_OVERRIDE, TINY

TWO = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
#: the demo's training digits
DEMO_TRAIN = 1257


def fit(tmp_path, root: str, *args: str):
    proc = run_task("classify", "fit", *TINY["classify"], *SHAPE_OVERRIDE["classify"], *QUIET, *TWO,
                    "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", root, *args, cwd=tmp_path)
    return proc, torch.load(tmp_path / root / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.mark.slow
def test_repeated_augmentation_spreads_the_copies_over_two_ranks(tmp_path):
    """1,257 digits, 3 copies: each rank trains floor(1257 // 256 * 256 / 2) = 512 samples an epoch (DeiT's cut),
    16 steps of 32; the throughput line counts both devices."""
    proc, last = fit(tmp_path, "ra", "--data.batch_size", "32", "--data.repeated_augmentation", "3",
                     "--trainer.max_epochs", "1")
    per_rank = DEMO_TRAIN // 256 * 256 // 2
    assert last["global_step"] == per_rank // 32
    line = next(line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("throughput:"))
    total, per_device = map(float, re.match(r"throughput: ([\d.]+) images/s \(([\d.]+) per device\)", line).groups())
    assert math.isclose(total, 2 * per_device, rel_tol=0.02)


@pytest.mark.slow
def test_checkpointing_and_layer_decay_train_the_same_weights_on_two_ranks(tmp_path):
    """Three steps on two ranks with layer-wise decay, with and without activation checkpointing: the same
    weights (gradients are all-reduced over the recomputed forward as over the stored one)."""
    common = ["--trainer.max_steps", "3", "--model.layer_decay", "0.75", "--trainer.precision", "32-true"]
    _, plain = fit(tmp_path, "plain", *common)
    _, checkpointed = fit(tmp_path, "checkpointed", *common, "--model.activation_checkpointing", "true")
    assert plain["global_step"] == checkpointed["global_step"] == 3
    for key, value in plain["state_dict"].items():
        torch.testing.assert_close(checkpointed["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    # the groups' learning rates are the layer-decayed ones on both runs
    rates = [group["lr"] for group in plain["optimizer_states"][0]["param_groups"]]
    assert len(set(rates)) > 2 and rates == [group["lr"] for group in
                                            checkpointed["optimizer_states"][0]["param_groups"]]


@pytest.mark.slow
def test_two_rank_translation_killed_mid_epoch_resumes_exactly(tmp_path):
    """Translation's ranks train token batches of different shapes, so they draw different numbers of dropout
    values: each rank's RNG states are saved and restored (rank 0's alone left rank 1 off by ~1e-4 after the
    resume). Killed at step 2 of 6 on two gloo ranks, resumed: the uninterrupted run's weights and optimizer."""
    from tests.test_contract import assert_resumed_equals_straight

    run = [*TINY["translate"], *SHAPE_OVERRIDE["translate"], *QUIET, *TWO, "--trainer.max_epochs", "2",
           "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1",
           "--checkpoint.every_n_train_steps", "1"]
    run_task("translate", "fit", *run, "--trainer.default_root_dir", "straight", cwd=tmp_path)
    killed = run_task("translate", "fit", *run, "--trainer.default_root_dir", "resumed",
                      "--trainer.callbacks+=tests.callbacks.KillAtStep", "--trainer.callbacks.init_args.step", "2",
                      cwd=tmp_path, check=False)
    assert killed.returncode != 0
    interrupted = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)
    assert interrupted["global_step"] == 2 and len(interrupted["rng_states_per_rank"]) == 2
    run_task("translate", "fit", *run, "--trainer.default_root_dir", "resumed", "--ckpt_path", "last", cwd=tmp_path)
    assert_resumed_equals_straight(tmp_path, steps=6)
