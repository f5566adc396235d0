"""Killing `fit` mid-epoch and resuming with `--ckpt_path last` ends exactly where an
uninterrupted run ends: weights, optimizer, schedule, EMA average, RNG and data order. A run root
holds one run: a second fit there without `--ckpt_path` is refused, and a file cannot be one."""
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


# -- one run per run root --------------------------------------------------------------------------------------
TINY_CLASSIFY = ["--config", str(REPO / "configs/classify/demo_mobilevitv2.yaml"), "--trainer.logger", "false",
                 "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
                 "--trainer.num_sanity_val_steps", "0", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
                 "--data.image_size", "32", "--data.eval_resize", "32", "--data.batch_size", "8",
                 "--data.num_workers", "0", "--model.backbone.init_args.width", "0.25",
                 "--model.scheduler.init_args.warmup_steps", "2"]


def classify_cli(root, *args: str):
    """The classification task's real CLI, built in this process without running a subcommand."""
    from tasks.cli.suite import SuiteCLI

    return SuiteCLI("classify", [*TINY_CLASSIFY, "--trainer.default_root_dir", str(root), *args], run=False)


def test_second_fit_in_a_run_root_is_refused_unless_it_resumes(tmp_path):
    """The first run finished; a second fit there without --ckpt_path would overwrite its last.ckpt (its
    only way to resume) with Lightning's "directory exists" warning alone. It stops before training,
    saying how to continue the run or start another; with --ckpt_path last it continues the run."""
    root = tmp_path / "run"
    first = classify_cli(root)
    first.trainer.fit(first.model, datamodule=first.datamodule)
    last = root / "checkpoints" / "last.ckpt"
    written = last.read_bytes()

    second = classify_cli(root)
    message = (rf"{last} holds the last checkpoint of an earlier fit in this run root \(epoch 0, global step 2, "
               r"written .*\); this fit would overwrite it. To continue that run, add --ckpt_path last; to start a "
               rf"new one, give it its own --trainer.default_root_dir \(or delete {root / 'checkpoints'} to start over")
    with pytest.raises(FileExistsError, match=message):
        second.trainer.fit(second.model, datamodule=second.datamodule)
    assert second.trainer.global_step == 0 and last.read_bytes() == written

    # what --ckpt_path last (the SLURM requeue script's and the pre-emption message's command) resumes
    resumed = classify_cli(root, "--trainer.max_steps", "3")
    resumed.trainer.fit(resumed.model, datamodule=resumed.datamodule, ckpt_path=str(last))
    assert torch.load(last, weights_only=True)["global_step"] == 3
    # the same trainer fitting again in one process continues its own file
    resumed.trainer.fit_loop.epoch_loop.max_steps = 4
    resumed.trainer.fit(resumed.model, datamodule=resumed.datamodule)
    assert torch.load(last, weights_only=True)["global_step"] == 4


def test_run_root_that_is_a_file_is_named(tmp_path):
    """``--trainer.default_root_dir`` naming a file (or a path under one) gave a bare FileExistsError."""
    from tasks.cli.resume import make_run_root

    taken = tmp_path / "results"
    taken.write_text("not a folder")
    cli = classify_cli(taken)
    with pytest.raises(NotADirectoryError, match=rf"trainer.default_root_dir={taken} cannot be a run folder: {taken} "
                                                 "is a file. The run root holds the checkpoints"):
        cli.before_fit()
    with pytest.raises(NotADirectoryError, match=rf"default_root_dir={taken / 'run'} cannot be a run folder: {taken} "
                                                 "is a file"):
        make_run_root(taken / "run")
    assert make_run_root(tmp_path / "new" / "run").is_dir()
