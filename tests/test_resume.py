"""Killing `fit` mid-epoch and resuming with `--ckpt_path last` ends exactly where an
uninterrupted run ends: weights, optimizer, schedule, EMA average, RNG and data order."""
import pytest
import torch

from tests.conftest import REPO

EMA = ("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.EMAWeightAveraging\n"
       "      init_args: {decay: 0.9}\n")
RUN = ["--config", str(REPO / "configs/classify/demo_mobilevitv2.yaml"), "--trainer.max_epochs", "2",
       "--trainer.limit_train_batches", "5", "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
       "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--data.batch_size", "8",
       "--data.num_workers", "0", "--data.image_size", "32", "--data.eval_resize", "32", "--model.head_dropout", "0.2",
       "--model.scheduler.init_args.warmup_steps", "3", "--checkpoint.every_n_train_steps", "1"]


@pytest.mark.slow  # long CLI run; the default run must stay under 10 minutes on 2 cores
def test_kill_mid_epoch_then_resume_matches_uninterrupted_run(run_cli, tmp_path):
    ema = tmp_path / "ema.yaml"
    ema.write_text(EMA)
    run_cli("classify", "fit", *RUN, "--config", str(ema), "--trainer.default_root_dir", "straight")

    killed = run_cli("classify", "fit", *RUN, "--config", str(ema), "--trainer.default_root_dir", "resumed",
                     "--trainer.callbacks+=tests.callbacks.KillAtStep", "--trainer.callbacks.init_args.step", "7",
                     check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    interrupted = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)
    assert interrupted["global_step"] == 7 and interrupted["epoch"] == 1  # killed inside the second epoch

    run_cli("classify", "fit", *RUN, "--config", str(ema), "--trainer.default_root_dir", "resumed",
            "--ckpt_path", "last")

    straight = torch.load(tmp_path / "straight/checkpoints/last.ckpt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)
    assert straight["global_step"] == resumed["global_step"] == 10
    # the EMA average integrates the raw weights of every step, so equal averages and equal Adam
    # moments mean equal trajectories (the resumed run's final save comes after EMA copied the
    # average into the model, so its current_model_state is not comparable)
    for key, value in straight["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][key]), key
    s_opt, r_opt = straight["optimizer_states"][0]["state"], resumed["optimizer_states"][0]["state"]
    assert s_opt.keys() == r_opt.keys()
    for i in s_opt:
        assert torch.equal(s_opt[i]["exp_avg"], r_opt[i]["exp_avg"]) and torch.equal(s_opt[i]["exp_avg_sq"], r_opt[i]["exp_avg_sq"])
    assert straight["lr_schedulers"] == resumed["lr_schedulers"]
    score = [next(v for k, v in c["callbacks"].items() if "'monitor'" in k)["best_model_score"]
             for c in (straight, resumed)]
    assert torch.equal(score[0], score[1])  # the same validation top-1
