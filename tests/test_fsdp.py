"""Sharded training, ``--trainer.strategy fsdp`` (tasks/cli/sharding.py: FSDP2 through Lightning's
ModelParallelStrategy), on the real tasks.

Quick: the flag and a recipe value build the strategy; what cannot run is refused before anything is built
(through the command: one line, no traceback; slow); the sharding plan on a real task (one rank); the optimizer-state numbering against
``torch.optim.Optimizer.state_dict``'s own. Slow (two gloo processes on CPU, about a minute a run here):
classification and translation fitted sharded equal DDP, a run killed mid-epoch resumes to the uninterrupted
run's weights and optimizer state exactly, and ``test --ckpt_path`` of the resumed checkpoint scores as DDP
does.
"""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import yaml

from configs.tasks import task_declaration
from tests.conftest import REPO, run_task

QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
         "--trainer.num_sanity_val_steps", "0", "--data.num_workers", "0"]
TWO_RANKS = ["--trainer.devices", "2"]
TINY = {task: [*task_declaration(task).smoke_flags, *QUIET] for task in ("classify", "translate")}


def _cli(*args: str, exit_on_error: bool = False):
    from tasks.cli.suite import main

    return main("classify", ["--config", str(REPO / "configs/classify/demo_mobilevitv2.yaml"), *TINY["classify"],
                             *args], run=False, exit_on_error=exit_on_error)


# -- built from a flag or a recipe value ----------------------------------------------------------------------
def test_the_flag_and_a_recipe_value_build_the_sharded_strategy(tmp_path, monkeypatch):
    from tasks.cli.sharding import FullyShardedStrategy

    monkeypatch.chdir(tmp_path)
    flag = _cli(*TWO_RANKS, "--trainer.strategy", "fsdp")
    recipe = tmp_path / "fsdp.yaml"
    recipe.write_text(yaml.safe_dump({"trainer": {"strategy": "fsdp", "devices": 2}}))
    from_recipe = _cli("--config", str(recipe))
    for cli in (flag, from_recipe):
        strategy = cli.trainer.strategy
        assert isinstance(strategy, FullyShardedStrategy) and strategy.reshard_after_forward
        assert cli.trainer.num_devices == 2 and not strategy._save_distributed_checkpoint  # one-file checkpoints
    # the class path takes the strategy's own arguments
    keep = _cli(*TWO_RANKS, "--trainer.strategy", "tasks.cli.sharding.FullyShardedStrategy",
                "--trainer.strategy.reshard_after_forward", "false")
    assert isinstance(keep.trainer.strategy, FullyShardedStrategy) and not keep.trainer.strategy.reshard_after_forward


# -- what cannot run is refused before anything is built ---------------------------------------------------------
REFUSED = {
    "16-mixed": (["--trainer.precision", "16-mixed"], r"--trainer.precision 16-mixed.*bf16-mixed.*ddp"),
    "ema": (["--trainer.callbacks+=lightning.pytorch.callbacks.EMAWeightAveraging"],
            r"EMAWeightAveraging.*--trainer.strategy ddp"),
    "compile": (["--model.compile", "regional"], r"--model.compile regional.*--trainer.strategy ddp"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_fsdp_cannot_run_is_refused_naming_the_flag_and_the_way_out(case, tmp_path, monkeypatch):
    from jsonargparse import ArgumentError

    monkeypatch.chdir(tmp_path)
    flags, message = REFUSED[case]
    with pytest.raises(ArgumentError, match=message):
        _cli(*TWO_RANKS, "--trainer.strategy", "fsdp", *flags)
    assert not (tmp_path / "runs").exists()  # refused before anything was built


@pytest.mark.parametrize("name", ["fsdp_cpu_offload", "lightning.pytorch.strategies.FSDPStrategy"])
def test_lightnings_fsdp1_is_refused_for_fsdp2(name, tmp_path, monkeypatch):
    from jsonargparse import ArgumentError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArgumentError, match=rf"--trainer.strategy {name}: .*FSDP1.*Use --trainer.strategy fsdp"):
        _cli(*TWO_RANKS, "--trainer.strategy", name)


@pytest.mark.slow  # a fresh interpreter importing torch and Lightning: about 25 s here
def test_the_command_refuses_in_one_line_without_a_traceback(run_cli):
    proc = run_cli("classify", "fit", *TINY["classify"], *TWO_RANKS, "--trainer.strategy", "fsdp",
                   "--trainer.precision", "16-mixed", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error: --trainer.strategy fsdp with --trainer.precision 16-mixed" in proc.stderr.splitlines()[-1]


# -- the sharding plan on a real task, one rank -------------------------------------------------------------------
@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone (FSDP2 needs one)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _classifier(layer_decay=None):
    from backbones import MobileViTv2
    from tasks.classify import ClassificationTask

    torch.manual_seed(0)
    return ClassificationTask(backbone=MobileViTv2(width=0.5), class_names=[str(i) for i in range(10)],
                              layer_decay=layer_decay)


def test_each_repeated_block_is_a_unit_and_the_task_the_root(one_rank_group):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from layers.compile import repeated_blocks
    from tasks.classify import ClassificationTask
    from tasks.cli.sharding import shard_task, sharded_like
    from tasks.engine.checkpoints import qualified_name

    model = _classifier()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    blocks = [f"backbone.{name}" for name, _ in repeated_blocks(model.backbone)]
    assert len(blocks) == 9  # MobileViTv2's transformer blocks (2 + 4 + 3)
    assert shard_task(model, one_rank_group) == [*blocks, ""]
    assert shard_task(model, one_rank_group) == []  # sharded once
    assert isinstance(model, FSDPModule) and all(isinstance(p, DTensor) for p in model.parameters())
    # the checkpoint still names the task's class, and its keys and values are unchanged
    assert qualified_name(type(model)) == qualified_name(ClassificationTask) == "tasks.classify.ClassificationTask"
    sharded = model.state_dict()
    assert list(sharded) == list(before)
    assert all(torch.equal(sharded[k].full_tensor() if isinstance(sharded[k], DTensor) else sharded[k], v)
               for k, v in before.items())
    # a full state dict is cut as the model's: loaded, it gives back the same weights
    model.load_state_dict(sharded_like({k: torch.zeros_like(v) if v.is_floating_point() else v
                                        for k, v in before.items()}, sharded))
    assert all(float(p.detach().full_tensor().abs().sum()) == 0 for p in model.parameters())


def test_the_optimizer_state_is_numbered_as_torch_numbers_it():
    """``numbered_by_place`` of the name-keyed state equals ``Optimizer.state_dict()`` of the same optimizer
    (layer-wise decay: parameter groups in another order than named_parameters); ``named_by_place`` inverts it."""
    from tasks.cli.sharding import named_by_place, numbered_by_place

    model = _classifier(layer_decay=0.7)
    optimizer = model.configure_optimizers()["optimizer"]
    group_order = [p for g in optimizer.param_groups for p in g["params"]]
    assert [id(p) for p in group_order] != [id(p) for p in model.parameters()]  # not named_parameters' order
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    reference = optimizer.state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    by_name = {"state": {names[id(p)]: optimizer.state[p] for p in group_order},
               "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                 "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]}
    numbered = numbered_by_place(by_name)
    assert numbered["param_groups"] == reference["param_groups"]
    assert numbered["state"].keys() == reference["state"].keys()
    assert all(numbered["state"][i] is reference["state"][i] or
               all(torch.equal(numbered["state"][i][k], reference["state"][i][k]) for k in reference["state"][i])
               for i in reference["state"])
    assert named_by_place(reference, optimizer, model) == by_name


# -- two gloo processes on the real tasks ----------------------------------------------------------------------
def _fit(task: str, cwd: Path, root: str, strategy: str, *args: str, check: bool = True):
    return run_task(task, "fit", *TINY[task], *TWO_RANKS, "--trainer.strategy", strategy,
                    "--trainer.default_root_dir", root, *args, cwd=cwd, check=check, env={"OMP_NUM_THREADS": "1"},
                    timeout=900)


def _last(cwd: Path, root: str) -> dict:
    return torch.load(cwd / root / "checkpoints" / "last.ckpt", weights_only=True)


def _assert_same_state(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a["global_step"] == b["global_step"]
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key, value in a["state_dict"].items():
        torch.testing.assert_close(value, b["state_dict"][key], atol=atol, rtol=0, msg=key)
    a_opt, b_opt = a["optimizer_states"][0], b["optimizer_states"][0]
    assert [g["params"] for g in a_opt["param_groups"]] == [g["params"] for g in b_opt["param_groups"]]
    for i, state in a_opt["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(value, b_opt["state"][i][name], atol=atol, rtol=0, msg=f"{i} {name}")


def _killed_and_resumed(task: str, cwd: Path, run: list[str], step: int = 2) -> None:
    killed = _fit(task, cwd, "resumed", "fsdp", *run, "--trainer.callbacks+=tests.callbacks.KillAtStep",
                  "--trainer.callbacks.init_args.step", str(step), check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    interrupted = _last(cwd, "resumed")
    assert interrupted["global_step"] == step and interrupted["epoch"] == 0  # mid-epoch, before any validation
    _fit(task, cwd, "resumed", "fsdp", *run, "--ckpt_path", "last")


#: two epochs of three steps, last.ckpt after every step
SIX_STEPS = ["--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1",
             "--checkpoint.every_n_train_steps", "1"]


@pytest.mark.slow
def test_classification_fsdp_equals_ddp_resumes_exactly_and_tests_as_ddp(tmp_path):
    """Six steps (fused AdamW, gradient clipping, warm-up): sharded equals DDP; killed at step 2 and resumed
    with ``--ckpt_path last``, the run ends where the uninterrupted one does; ``test --ckpt_path`` of that
    checkpoint under fsdp writes the metrics DDP's test writes."""
    _fit("classify", tmp_path, "straight", "fsdp", *SIX_STEPS)
    _fit("classify", tmp_path, "ddp", "ddp", *SIX_STEPS)
    straight = _last(tmp_path, "straight")
    assert straight["suite_task"] == "tasks.classify.ClassificationTask" and straight["global_step"] == 6
    ddp = _last(tmp_path, "ddp")
    _assert_same_state(straight, ddp, atol=1e-6)
    # the same file as DDP's, so every reader of checkpoints (test, predict, export, tasks.load, averaging) takes it
    assert straight.keys() == ddp.keys() and straight["callbacks"].keys() == ddp["callbacks"].keys()
    _killed_and_resumed("classify", tmp_path, SIX_STEPS)
    _assert_same_state(straight, _last(tmp_path, "resumed"))
    assert straight["lr_schedulers"] == _last(tmp_path, "resumed")["lr_schedulers"]
    checkpoint = str(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    for strategy in ("fsdp", "ddp"):
        run_task("classify", "test", "--ckpt_path", checkpoint, *TINY["classify"], *TWO_RANKS, "--trainer.strategy",
                 strategy, "--trainer.limit_test_batches", "3", "--trainer.default_root_dir", f"test-{strategy}",
                 cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    sharded, ddp = (json.loads((tmp_path / f"test-{s}" / "predictions" / "metrics.json").read_text())
                    for s in ("fsdp", "ddp"))
    assert sharded == ddp and "test/top1" in sharded


@pytest.mark.slow
def test_translation_fsdp_equals_ddp_and_resumes_exactly(tmp_path):
    """Translation's encoder and decoder share their token table (one root unit) and its validation decodes by
    beam search (a different number of decoder calls per rank). Without dropout: with it, a resumed run of
    2 processes differs from the uninterrupted one under DDP too (each rank draws its masks from the RNG state
    rank 0 saved; /work/notes/fsdp_requests.md)."""
    no_dropout = [*SIX_STEPS, "--model.dropout", "0"]
    _fit("translate", tmp_path, "straight", "fsdp", *no_dropout)
    _fit("translate", tmp_path, "ddp", "ddp", *no_dropout)
    straight = _last(tmp_path, "straight")
    assert straight["global_step"] == 6
    best = next(state for key, state in straight["callbacks"].items() if key.startswith("ModelCheckpoint"))
    assert torch.is_tensor(best["best_model_score"])  # validation decoded and scored val/bleu
    _assert_same_state(straight, _last(tmp_path, "ddp"), atol=1e-5)
    _killed_and_resumed("translate", tmp_path, no_dropout)
    _assert_same_state(straight, _last(tmp_path, "resumed"))


def test_a_sharded_checkpoint_folder_is_refused_naming_it(tmp_path):
    from tasks.engine.checkpoints import read_checkpoint

    folder = tmp_path / "last.ckpt"  # what a sharded save leaves: a folder of parts and meta.pt
    folder.mkdir()
    torch.save({"epoch": 0}, folder / "meta.pt")
    with pytest.raises(ValueError, match=rf"checkpoint {folder} is a folder: a sharded checkpoint.*consolidate"):
        read_checkpoint(folder)


@pytest.mark.slow
def test_a_nonfinite_loss_is_skipped_under_fsdp_as_under_ddp(tmp_path):
    """The loss guard's device-side skip (the fused AdamW's found_inf) on sharded parameters: from step 1 on the
    network's output is NaN; both skipped steps leave weights and Adam's step count as DDP leaves them."""
    nan = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1",
           "--model.on_nonfinite_loss", "skip", "--trainer.callbacks+=tests.callbacks.NaNOutputAtStep",
           "--trainer.callbacks.init_args.step", "1"]
    sharded = _fit("classify", tmp_path, "fsdp", "fsdp", *nan)
    _fit("classify", tmp_path, "ddp", "ddp", *nan)
    assert "step skipped (2 so far)" in sharded.stderr
    fsdp, ddp = _last(tmp_path, "fsdp"), _last(tmp_path, "ddp")
    _assert_same_state(fsdp, ddp, atol=1e-6)
    assert all(torch.isfinite(v).all() for v in fsdp["state_dict"].values() if v.is_floating_point())
    assert float(fsdp["optimizer_states"][0]["state"][0]["step"]) == 1  # only step 0 updated
