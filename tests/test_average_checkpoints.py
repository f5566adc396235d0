"""Checkpoint averaging (``python -m tasks.tools.average_checkpoints``) on the checkpoints of a real,
tiny translation fit: the average is the element-wise mean, `test` scores it like any checkpoint,
and checkpoints that are not snapshots of one network are refused."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from tasks.tools.average_checkpoints import TRAINING_STATE, average_checkpoints, last_checkpoints, main
from tests.conftest import run_task

TINY = ["--model.dim", "32", "--model.encoder_depth", "1", "--model.decoder_depth", "1", "--model.num_heads", "2",
        "--model.ffn_dim", "64", "--model.max_len_b", "4", "--model.beam_size", "2", "--data.vocab_size", "500",
        "--data.max_tokens", "512", "--data.eval_max_tokens", "4096"]
QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
         "--trainer.num_sanity_val_steps", "0"]
#: a checkpoint at every step, the newest 3 kept (what the WMT recipes do every 1,250 / 600 steps)
KEEP_LAST_3 = ["--checkpoint.monitor", "step", "--checkpoint.mode", "max", "--checkpoint.save_top_k", "3",
               "--checkpoint.every_n_train_steps", "1", "--checkpoint.filename", "step-{step}"]


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    """One 4-step fit keeping the checkpoints of steps 2, 3 and 4 (and last.ckpt, also step 4)."""
    cwd = tmp_path_factory.mktemp("average-fit")
    run_task("translate", "fit", *TINY, *QUIET, *KEEP_LAST_3, "--trainer.max_steps", "4",
             "--trainer.limit_val_batches", "0", cwd=cwd)
    return cwd / "runs" / "translate"


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_last_n_by_step_and_the_average_is_the_elementwise_mean(run_root):
    paths = last_checkpoints(run_root, 3)
    sources = [load(p) for p in paths]
    assert [c["global_step"] for c in sources] == [2, 3, 4]  # read from the files; last.ckpt (step 4) counted once
    averaged = average_checkpoints(paths)

    for name, tensor in averaged["state_dict"].items():
        stacked = torch.stack([c["state_dict"][name] for c in sources])
        assert tensor.dtype == stacked.dtype == torch.float32
        torch.testing.assert_close(tensor, stacked.double().mean(dim=0).float(), rtol=1e-6, atol=1e-9)
    # the steps moved the weights: the mean is none of its sources
    name = "encoder.layers.0.ffn.fc1.weight"
    assert all(not torch.equal(averaged["state_dict"][name], c["state_dict"][name]) for c in sources)
    # the tied embedding stays one tensor
    weights = averaged["state_dict"]
    assert weights["encoder.embed.tokens.weight"] is weights["decoder.embed.tokens.weight"]

    newest = sources[-1]
    assert averaged["global_step"] == 4 and averaged["suite_task"] == "tasks.translate.TranslationTask"
    assert averaged["hyper_parameters"] == newest["hyper_parameters"]
    assert torch.equal(averaged["tokenizer"], newest["tokenizer"])
    assert not set(TRAINING_STATE) & set(averaged) and {"optimizer_states", "suite_resume"} <= set(newest)  # cannot be resumed by mistake
    assert averaged["averaged_from"] == [[p.name, s] for p, s in zip(paths, (2, 3, 4))]


def test_integer_buffers_come_from_the_newest_checkpoint(run_root, tmp_path):
    paths = []
    for path in last_checkpoints(run_root, 3):
        checkpoint = load(path)
        checkpoint["state_dict"]["norm.num_batches_tracked"] = torch.tensor(checkpoint["global_step"] * 10)
        paths.append(tmp_path / path.name)
        torch.save(checkpoint, paths[-1])
    averaged = average_checkpoints(paths[::-1])  # the newest by step, not by position
    assert averaged["state_dict"]["norm.num_batches_tracked"].item() == 40


@pytest.mark.slow  # long CLI run; the default run must stay under 10 minutes on 2 cores
def test_averaged_checkpoint_is_tested_through_the_cli(run_root):
    output = run_root / "averaged.ckpt"
    main([str(run_root), "--last", "3", "--output", str(output)])
    assert last_checkpoints(run_root, 3)[-1].name != "averaged.ckpt"  # an average is never a candidate itself
    run_task("translate", "test", "--ckpt_path", str(output), *QUIET, "--data.vocab_size", "500",
             "--data.eval_max_tokens", "4096", "--trainer.limit_test_batches", "1", cwd=run_root.parents[1])
    metrics = json.loads((run_root / "predictions" / "metrics.json").read_text())
    assert {"test/bleu", "test/chrf", "test/loss"} <= set(metrics)
    assert (run_root / "predictions" / "hypotheses.txt").is_file()


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(suite_task="tasks.classify.ClassificationTask"), "different tasks"),
    (lambda c: c["state_dict"].update({"encoder.layers.0.ffn.fc1.bias": torch.zeros(3)}),
     r"encoder\.layers\.0\.ffn\.fc1\.bias is \(64,\) torch\.float32 in the first and \(3,\)"),
    (lambda c: c["hyper_parameters"].update(dropout=0.3), r"hyper-parameters differ \(dropout: 0\.1 vs 0\.3\)"),
    (lambda c: c.update(tokenizer=c["tokenizer"][:-1]), "different sentencepiece vocabularies"),
])
def test_checkpoints_of_different_networks_are_refused_naming_the_files(run_root, tmp_path, capsys, change, message):
    first, second = last_checkpoints(run_root, 2)
    altered = load(second)
    change(altered)
    other = tmp_path / "other.ckpt"
    torch.save(altered, other)
    with pytest.raises(ValueError, match=message) as refused:
        average_checkpoints([first, other])
    assert str(first) in str(refused.value) and str(other) in str(refused.value)
    with pytest.raises(SystemExit, match=message):
        main([str(first), str(other), "--output", str(tmp_path / "never.ckpt")])
    assert not (tmp_path / "never.ckpt").exists()


def test_too_few_checkpoints_and_mixed_runs_are_refused(run_root, tmp_path):
    with pytest.raises(ValueError, match=r"--last 4: .* holds checkpoints of 3 training step\(s\)"):
        last_checkpoints(run_root, 4)
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for path, group in zip(last_checkpoints(run_root, 2), ("run-a", "run-b")):
        checkpoint = load(path)
        checkpoint["suite_run"]["id"] = group
        torch.save(checkpoint, folder / path.name)
    shutil.copy(folder / "step-4.ckpt", folder / "last.ckpt")
    with pytest.raises(ValueError, match=r"come from different training runs \(\['run run-a in .*', 'run run-b in .*'\]"):
        last_checkpoints(tmp_path, 2)


def test_checkpoints_of_two_runs_are_refused_unless_forced(run_root, tmp_path):
    """Two runs of the same network and hyper-parameters (here: the same run, relabelled) are not one
    run's snapshots; averaging them is a choice made with --force."""
    first, second = last_checkpoints(run_root, 2)
    assert load(first)["suite_run"] == load(second)["suite_run"]  # one fit: one run id in every checkpoint
    other = load(second)
    other["suite_run"] = {"id": "0123456789abcdef", "root": "/elsewhere/runs/translate"}
    other_path = tmp_path / "other-run.ckpt"
    torch.save(other, other_path)
    with pytest.raises(SystemExit, match=rf"different training runs \({first.name}: run [0-9a-f]{{8}} in {run_root}; "
                                         r"other-run.ckpt: run 01234567 in /elsewhere/runs/translate\).*--force"):
        main([str(first), str(other_path), "--output", str(tmp_path / "never.ckpt")])
    assert not (tmp_path / "never.ckpt").exists()
    main([str(first), str(other_path), "--output", str(tmp_path / "forced.ckpt"), "--force"])
    assert load(tmp_path / "forced.ckpt")["averaged_from"] == [[first.name, 3], ["other-run.ckpt", 4]]
