"""Translation resumes exactly mid-epoch: the token-batch sampler rebuilds the interrupted
epoch's batches and skips those already trained on, so killing `fit` and resuming with
`--ckpt_path last` ends where an uninterrupted run ends (weights, Adam state, schedule,
RNG states, best validation loss)."""
from types import SimpleNamespace

import numpy as np
import torch

from datamodules.wmt import TokenBatchSampler
from tests.conftest import REPO


def restarting_trainer(epoch: int, trained: int, restarting: bool = True):
    """The parts of a Trainer a sampler reads after ``fit`` restored a mid-epoch checkpoint
    written in ``on_train_batch_end`` (its own batch processed, not yet marked completed)."""
    progress = SimpleNamespace(current=SimpleNamespace(ready=trained, started=trained, processed=trained,
                                                       completed=trained - 1))
    loop = SimpleNamespace(restarting=restarting, epoch_loop=SimpleNamespace(batch_progress=progress))
    return SimpleNamespace(fit_loop=loop, current_epoch=epoch)


def test_restarting_sampler_rebuilds_the_epoch_and_skips_completed_batches_on_each_rank():
    num_tokens = np.random.default_rng(0).integers(1, 30, size=400)
    for rank in range(2):
        def sampler(trainer=None):
            return TokenBatchSampler(num_tokens, 100, shuffle=True, seed=3, num_replicas=2, rank=rank, trainer=trainer)

        straight = sampler()
        straight.set_epoch(2)
        epoch = [tuple(b) for b in straight]
        # a fresh sampler (epoch 0) built after the restore: Lightning has not called set_epoch yet
        resumed = sampler(restarting_trainer(epoch=2, trained=5))
        assert [tuple(b) for b in resumed] == epoch[5:]
        assert len(resumed) == len(epoch)  # Lightning counts the completed batches into the epoch itself
        # the next epoch (no longer restarting) is whole again
        resumed.trainer.fit_loop.restarting = False
        resumed.set_epoch(3)
        straight.set_epoch(3)
        assert [tuple(b) for b in resumed] == [tuple(b) for b in straight]


def test_evaluation_batches_ignore_the_restart():
    num_tokens = np.random.default_rng(1).integers(1, 30, size=50)
    plain = TokenBatchSampler(num_tokens, 100, shuffle=False)
    restarting = TokenBatchSampler(num_tokens, 100, shuffle=False, trainer=restarting_trainer(epoch=1, trained=2))
    assert [tuple(b) for b in restarting] == [tuple(b) for b in plain]


RUN = ["--config", str(REPO / "configs/translate/demo_transformer.yaml"), "--trainer.max_epochs", "2",
       "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
       "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--model.dim", "32",
       "--model.encoder_depth", "1", "--model.decoder_depth", "1", "--model.num_heads", "2", "--model.ffn_dim", "64",
       "--model.dropout", "0.3", "--model.max_len_b", "4", "--model.beam_size", "2", "--data.vocab_size", "500",
       "--data.max_tokens", "256", "--data.eval_max_tokens", "256", "--data.num_workers", "0",
       "--model.scheduler.init_args.warmup_steps", "3", "--checkpoint.every_n_train_steps", "1",
       # six steps leave BLEU at 0 for both runs; the validation loss tells two trajectories apart
       "--checkpoint.monitor", "val/loss", "--checkpoint.mode", "min"]


def test_kill_mid_epoch_then_resume_matches_uninterrupted_run(run_cli, tmp_path):
    run_cli("translate", "fit", *RUN, "--trainer.default_root_dir", "straight")

    killed = run_cli("translate", "fit", *RUN, "--trainer.default_root_dir", "resumed",
                     "--trainer.callbacks+=tests.callbacks.KillAtStep", "--trainer.callbacks.init_args.step", "5",
                     check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    interrupted = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)
    assert interrupted["global_step"] == 5 and interrupted["epoch"] == 1  # killed inside the second epoch

    run_cli("translate", "fit", *RUN, "--trainer.default_root_dir", "resumed", "--ckpt_path", "last")

    straight = torch.load(tmp_path / "straight/checkpoints/last.ckpt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)
    assert straight["global_step"] == resumed["global_step"] == 6
    # weights, Adam moments and step counts, the schedule and the RNG states it ends with
    for part in ("state_dict", "optimizer_states", "lr_schedulers", "rng_states"):
        assert_identical(straight[part], resumed[part], part)
    score = [next(v for k, v in c["callbacks"].items() if "'monitor'" in k)["best_model_score"]
             for c in (straight, resumed)]
    assert torch.equal(score[0], score[1])  # the same best validation loss


def assert_identical(a, b, where: str) -> None:
    """``a`` and ``b`` (nested dicts / lists of tensors and plain values) are bit-for-bit equal."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where
