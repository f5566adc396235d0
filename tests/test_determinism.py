"""--trainer.deterministic true on CUDA: refused up front, naming the ops, for the tasks whose runs use an
op without a deterministic CUDA kernel; allowed for the others. The per-task statement of those ops is
checked against what a real fit of each task dispatches (slow cells)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback

from tasks.cli.determinism import (CUBLAS_WORKSPACE, NondeterministicOpLog, check_deterministic, deterministic_refusal,
                               run_ops)
from tests.conftest import run_task


def test_the_log_sees_the_documented_ops_only_when_their_arguments_make_them_nondeterministic():
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    labels = torch.randint(0, 3, (2, 8, 8))
    with NondeterministicOpLog() as log:
        F.interpolate(x, size=(16, 16), mode="bilinear").sum().backward()
        F.cross_entropy(x, labels), F.cross_entropy(x, labels, reduction="none")  # only the mean counts
        F.cross_entropy(x.mean((2, 3)), labels[:, 0, 0])  # a 1-D nll_loss reduces deterministically
        F.adaptive_avg_pool2d(x, 1).sum().backward()  # a mean
        F.adaptive_avg_pool2d(x, 3).sum().backward()
        torch.bincount(labels.flatten()), torch.bincount(labels.flatten(), weights=torch.ones(128))
        index, src = torch.tensor([0, 1]), torch.ones(2)
        torch.zeros(3).scatter_reduce(0, index, src, "prod"), torch.zeros(3).scatter_reduce(0, index, src, "sum")
        torch.randn(5).median(), torch.randn(4, 5).median(dim=1)
        F.interpolate(x, scale_factor=2.0, mode="nearest").sum().backward()  # nearest: deterministic
    assert log.found == {"upsample_bilinear2d_backward": 1, "nll_loss2d_forward": 1, "_adaptive_avg_pool2d_backward": 1,
                         "bincount": 1, "scatter_reduce": 1, "median": 1}


def test_segmentation_is_refused_on_cuda_naming_the_ops_and_what_to_set_instead():
    reason = deterministic_refusal("segment", True, "gpu")
    assert "upsample_bilinear2d_backward" in reason and "nll_loss2d_forward" in reason
    assert "--trainer.deterministic warn" in reason
    pspnet = deterministic_refusal("segment", True, "cuda", head="heads.pspnet.PSPNet")
    assert "_adaptive_avg_pool2d_backward" in pspnet
    # evaluation runs no backward: only the loss's op is left
    evaluation = deterministic_refusal("segment", True, "gpu", subcommand="test")
    assert "nll_loss2d_forward" in evaluation and "upsample_bilinear2d_backward" not in evaluation
    assert deterministic_refusal("segment", True, "gpu", subcommand="predict") is None


@pytest.mark.parametrize("task", ["classify", "detect", "translate"])
def test_the_other_tasks_are_allowed_on_cuda(task):
    assert deterministic_refusal(task, True, "gpu") is None


def test_warn_the_cpu_and_no_gpu_are_never_refused(monkeypatch):
    assert deterministic_refusal("segment", "warn", "gpu") is None
    assert deterministic_refusal("segment", False, "gpu") is None
    assert deterministic_refusal("segment", True, "cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert deterministic_refusal("segment", True, "auto") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "nll_loss2d_forward" in deterministic_refusal("segment", True, "auto")


def test_the_cli_check_raises_for_a_refused_run_and_fixes_cublas_for_an_allowed_one(monkeypatch):
    from tasks.classify import ClassificationTask
    from tasks.segment import SegmentationTask

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    trainer = SimpleNamespace(deterministic=True, accelerator="gpu")
    head = SimpleNamespace(class_path="heads.deeplabv3.DeepLabV3")
    with pytest.raises(ValueError, match="segment on CUDA .*upsample_bilinear2d_backward"):
        check_deterministic("fit", trainer, SimpleNamespace(head=head), SegmentationTask)
    check_deterministic("fit", trainer, SimpleNamespace(), ClassificationTask)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a user's own setting stays
    check_deterministic("fit", trainer, SimpleNamespace(), ClassificationTask)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


class RecordNondeterministic(Callback):
    """Records the ops without a deterministic CUDA kernel that a whole fit dispatches (training steps,
    backward, optimizer, validation) and writes ``{op: count}`` to ``report``."""

    def __init__(self, report: str):
        self.report, self.ops = Path(report), NondeterministicOpLog()

    def on_fit_start(self, trainer, pl_module) -> None:
        self.ops.__enter__()

    def on_fit_end(self, trainer, pl_module) -> None:
        self.ops.__exit__(None, None, None)
        self.report.write_text(json.dumps(self.ops.found))


TINY = {  # the demo recipes at small sizes that are multiples of the backbones' size_multiple (64)
    "classify": ["--data.image_size", "64", "--data.eval_resize", "64", "--data.batch_size", "8"],
    "detect": ["--data.image_size", "64", "--data.batch_size", "4", "--data.eval_batch_size", "4"],
    "segment": ["--data.crop_size", "64", "--data.scale_range", "[0.75, 1.25]", "--data.batch_size", "4",
                "--data.eval_short_side", "null"],
    "translate": ["--model.encoder_depth", "1", "--model.decoder_depth", "1", "--model.num_heads", "2",
                  "--data.vocab_size", "500", "--data.max_tokens", "512", "--model.max_len_b", "4",
                  "--model.beam_size", "2"],
}
PSPNET = '{"class_path": "heads.pspnet.PSPNet", "init_args": {"channels": 32, "pool_sizes": [1, 2, 3, 6]}}'


@pytest.mark.slow  # one short CPU fit per cell
@pytest.mark.parametrize("task, head", [("classify", None), ("detect", None), ("segment", None),
                                        ("segment", "heads.pspnet.PSPNet"), ("translate", None)])
def test_what_each_task_states_is_what_its_fit_dispatches(task, head, tmp_path):
    report = tmp_path / "ops.json"
    run_task(task, "fit", *TINY[task], *(["--model.head", PSPNET] if head else []),
             "--trainer.accelerator", "cpu", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
             "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
             "--data.num_workers", "0", "--trainer.callbacks+=tests.test_determinism.RecordNondeterministic",
             "--trainer.callbacks.init_args.report", str(report), cwd=tmp_path)
    assert set(json.loads(report.read_text())) == set(run_ops(task, head, training=True))


def test_the_segmentation_cli_refuses_a_deterministic_gpu_fit_before_building_anything(tmp_path, monkeypatch):
    from tasks.segment import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"upsample_bilinear2d.*--trainer.deterministic warn"):
        main(["fit", "--trainer.accelerator", "gpu", "--trainer.deterministic", "true", "--trainer.logger", "false"])
