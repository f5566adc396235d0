"""Knowledge distillation (tasks/engine/distillation.py): each loss against a hand computation, DeiT's
token model against timm's ``VisionTransformerDistilled`` and the paper's equation, the three teacher
sources, and real fits of the classification CLI: the teacher stays frozen, in eval mode and out of
everything that is trained or saved; the checkpoint serves without it; resumes and two processes (slow)."""
from __future__ import annotations

import copy
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import timm
import torch
import torch.nn as nn

from backbones import MobileViTv2, ViT
from backbones.weights import convert_state_dict
from tasks.classify import ClassificationTask
from tasks.engine.distillation import (Distillation, Teacher, hard_distillation_loss, load_teacher,
                                       soft_distillation_loss)
from tests.conftest import run_task
from layers.compat import weight_averaging_model

CLASSES = [str(i) for i in range(10)]
#: the classification demo at CPU test sizes, as command-line flags
TINY = ["--data.image_size", "32", "--data.eval_resize", "32", "--data.batch_size", "16", "--data.num_workers", "0",
        "--model.scheduler.init_args.warmup_steps", "2", "--trainer.enable_progress_bar", "false",
        "--trainer.accelerator", "cpu", "--trainer.logger", "false", "--trainer.num_sanity_val_steps", "0"]


def hand_log_softmax(z: torch.Tensor) -> torch.Tensor:
    z = z.double()
    return z - z.exp().sum(-1, keepdim=True).log()


def hand_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean of -log p(target); ``target`` labels (N,) or probabilities (N, C)."""
    log_p = hand_log_softmax(logits)
    if target.ndim == 1:
        target = torch.eye(logits.shape[-1], dtype=torch.float64)[target]
    return -(target.double() * log_p).sum(-1).mean()


def hand_soft_kd(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """sum_c p_t (log p_t - log p_s) at temperature T, mean over rows, times T^2 (Hinton et al. 2015)."""
    log_p_s, log_p_t = hand_log_softmax(student / temperature), hand_log_softmax(teacher / temperature)
    return (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1).mean() * temperature ** 2


class Linear32(nn.Module):
    """A stand-in teacher: 32 x 32 images -> 10 logits, with a BatchNorm that must never update."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 32 * 32, 10)

    def forward(self, x):
        return self.fc(self.norm(x).flatten(1))


# -- the losses ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_soft_loss_is_the_temperature_scaled_kl_divergence(temperature):
    torch.manual_seed(0)
    student, teacher = torch.randn(6, 10) * 3, torch.randn(6, 10) * 3
    loss = soft_distillation_loss(student, teacher, temperature)
    assert loss.item() == pytest.approx(hand_soft_kd(student, teacher, temperature).item(), rel=1e-5)
    assert soft_distillation_loss(teacher, teacher, temperature).item() == pytest.approx(0.0, abs=1e-6)


def test_hard_loss_is_cross_entropy_on_the_teachers_argmax():
    torch.manual_seed(0)
    student, teacher = torch.randn(6, 10), torch.randn(6, 10)
    picked = [teacher[i].tolist().index(max(teacher[i].tolist())) for i in range(6)]
    expected = -sum(hand_log_softmax(student)[i, c] for i, c in enumerate(picked)) / 6
    assert hard_distillation_loss(student, teacher).item() == pytest.approx(expected.item(), rel=1e-6)


def task_with_teacher(backbone: nn.Module, config: Distillation) -> tuple[ClassificationTask, Teacher]:
    torch.manual_seed(0)
    task = ClassificationTask(backbone, CLASSES, distillation=config)
    task.teacher = Teacher(Linear32(), "stand-in")
    return task, task.teacher


@pytest.mark.parametrize("kind", ["soft", "hard"])
def test_the_task_mixes_the_label_loss_and_the_distillation_loss_with_mixup_targets(kind):
    """(1 - alpha) CE(student, soft MixUp target) + alpha KD(student, teacher), one network output for both."""
    config = Distillation("stand-in", kind=kind, alpha=0.3, temperature=2.0)
    task, teacher = task_with_teacher(MobileViTv2(width=0.25), config)
    images = torch.randn(4, 3, 32, 32)
    target = torch.softmax(torch.randn(4, 10), -1)  # what MixUp/CutMix hand the task
    loss = task.training_loss({"image": images, "target": target}, 0)
    with torch.no_grad():  # train mode still (BatchNorm on the batch's statistics), no dropout in this model
        logits, teacher_logits = task(images), teacher.network(images)
    distill = hand_soft_kd(logits, teacher_logits, 2.0) if kind == "soft" else hand_cross_entropy(
        logits, teacher_logits.argmax(-1))
    expected = 0.7 * hand_cross_entropy(logits, target) + 0.3 * distill
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)


def tiny_deit(**kwargs) -> ViT:
    return ViT("tiny", patch_size=16, img_size=32, depth=2, distillation_token=True, **kwargs)


def test_deit_hard_distillation_is_the_papers_equation():
    """DeiT Sec. 3: L = 1/2 CE(psi(Z_s), y) + 1/2 CE(psi(Z_dist), y_t), y_t = argmax Z_t, on the class and
    distillation heads; at inference the two heads' logits are averaged (timm, DeiT's code)."""
    task, teacher = task_with_teacher(tiny_deit(), Distillation("stand-in", kind="hard", alpha=0.5))
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([1, 2, 3, 4])
    loss = task.training_loss({"image": images, "target": labels}, 0)
    with torch.no_grad():
        z_cls, z_dist = task.forward_heads(images)
        y_t = teacher.network.eval()(images).argmax(-1)
    expected = 0.5 * hand_cross_entropy(z_cls, labels) + 0.5 * hand_cross_entropy(z_dist, y_t)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()  # the label trains the class head, the teacher the distillation head
    assert task.head.fc.weight.grad.abs().sum() > 0 and task.head_dist.fc.weight.grad.abs().sum() > 0
    task.eval()
    assert torch.equal(task(images), (z_cls + z_dist) / 2)


def test_distilled_vit_equals_timms_deit_with_converted_weights():
    torch.manual_seed(0)
    reference = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=32, depth=2,
                                  num_classes=10).eval()
    with torch.no_grad():
        for p in reference.parameters():  # off the init, so that a swapped key changes the logits
            p.add_(torch.randn_like(p) * 0.02)
    task = ClassificationTask(tiny_deit(), CLASSES)
    task.load_state_dict(convert_state_dict(reference.state_dict(), task.backbone), strict=True)
    task.eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (task(images) - reference(images)).abs().max() < 1e-5  # eval: the averaged heads
        reference.set_distilled_training(True)
        reference.train()  # no dropout here: train mode only makes timm return both heads
        for ours, theirs in zip(task.forward_heads(images), reference(images)):
            assert (ours - theirs).abs().max() < 1e-5


def test_the_distillation_token_is_off_by_default_and_sits_in_the_stem():
    from tasks.engine.optim import layer_ids

    plain, deit = ViT("tiny", img_size=32, depth=2), tiny_deit()
    assert set(deit.state_dict()) - set(plain.state_dict()) == {"dist_token"}
    assert plain.num_prefix_tokens == 1 and deit.num_prefix_tokens == 2
    assert deit.pos_embed.shape[1] == plain.pos_embed.shape[1] + 1
    assert ClassificationTask(plain, CLASSES).head_dist is None
    task = ClassificationTask(deit, CLASSES)
    ids, top = layer_ids(task)
    # timm's VisionTransformerDistilled.group_matcher: dist_token in the stem; the heads on top
    assert ids[id(deit.dist_token)] == ids[id(deit.cls_token)] == 0
    assert ids[id(task.head_dist.fc.weight)] == ids[id(task.head.fc.weight)] == top
    with pytest.raises(ValueError, match="distillation_token=True needs class_token=True"):
        ViT("tiny", img_size=32, depth=1, class_token=False, distillation_token=True)


# -- the teacher -------------------------------------------------------------------------------------------------
def test_the_teacher_gets_images_renormalised_for_it_and_follows_the_students_dtype():
    identity = nn.Conv2d(3, 3, 1, bias=False)
    with torch.no_grad():
        identity.weight.copy_(torch.eye(3)[:, :, None, None])
    teacher = Teacher(identity, "identity", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    student_mean, student_std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    images = torch.randn(2, 3, 4, 4)
    pixels = images * torch.tensor(student_std).view(1, 3, 1, 1) + torch.tensor(student_mean).view(1, 3, 1, 1)
    got = teacher(images, torch.zeros(1), student_mean, student_std)
    assert torch.allclose(got, (pixels - 0.5) / 0.5, atol=1e-6)
    assert torch.equal(teacher(images, torch.zeros(1), (0.5,) * 3, (0.5,) * 3), images)  # same: untouched
    assert not got.requires_grad
    # under a true-precision run (bf16-true) the student's parameters and inputs are bf16: so is the teacher
    out = teacher(images.bfloat16(), torch.zeros(1, dtype=torch.bfloat16), (0.5,) * 3, (0.5,) * 3)
    assert identity.weight.dtype == out.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):  # inside the student's autocast (bf16-mixed), as the student
        assert teacher(images, torch.zeros(1), (0.5,) * 3, (0.5,) * 3).dtype == torch.bfloat16
    identity.train()  # whoever switches it back to training, the teacher runs in eval mode
    teacher(images.bfloat16(), torch.zeros(1, dtype=torch.bfloat16))
    assert not identity.training


def test_a_timm_teacher_reads_a_local_file_and_refuses_other_classes(tmp_path):
    torch.manual_seed(0)
    source = timm.create_model("mobilevitv2_050", pretrained=False, num_classes=10).eval()
    torch.save(source.state_dict(), tmp_path / "ten.pth")
    teacher = load_teacher(Distillation("timm:mobilevitv2_050", teacher_file=str(tmp_path / "ten.pth")),
                           ClassificationTask, CLASSES)
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(teacher(images, torch.zeros(1)), source(images))
    assert teacher.mean == (0.0, 0.0, 0.0) and teacher.std == (1.0, 1.0, 1.0)  # timm's cfg: CVNets' raw pixels
    with pytest.raises(ValueError, match="has a 10-class classifier; the student has 3 classes"):
        load_teacher(Distillation("timm:mobilevitv2_050", teacher_file=str(tmp_path / "ten.pth")),
                     ClassificationTask, ["a", "b", "c"])
    with pytest.raises(FileNotFoundError, match="Nothing is downloaded at run time"):
        load_teacher(Distillation("timm:mobilevitv2_050", teacher_file=str(tmp_path / "absent.pth")),
                     ClassificationTask, CLASSES)
    with pytest.raises(ValueError, match="timm has no model 'mobilevitv9_050'"):
        load_teacher(Distillation("timm:mobilevitv9_050"), ClassificationTask, CLASSES)


def test_a_registered_teacher_is_read_from_its_file_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SUITE_OFFLINE", "1")  # no weights from the network, whatever backbones.weights may fetch
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SUITE_WEIGHTS_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    name = "deit_tiny_patch16_224.fb_in1k"
    with pytest.raises(Exception, match=re.escape(name)) as missing:  # weights not on this machine: named
        load_teacher(Distillation(name), ClassificationTask, CLASSES)
    assert isinstance(missing.value, (FileNotFoundError, OSError, RuntimeError, ValueError))
    with pytest.raises(ValueError, match="closest: deit_tiny_patch16_224.fb_in1k"):
        load_teacher(Distillation("deit_tiny_patch16_224.fb_in1"), ClassificationTask, CLASSES)
    torch.manual_seed(0)
    source = timm.create_model("deit_tiny_patch16_224", pretrained=False, depth=12).eval()
    Path("checkpoints/timm").mkdir(parents=True)
    torch.save(source.state_dict(), f"checkpoints/timm/{name}.pth")
    with pytest.raises(ValueError, match="has a 1000-class classifier; the student has 10 classes"):
        load_teacher(Distillation(name), ClassificationTask, CLASSES)
    teacher = load_teacher(Distillation(name), ClassificationTask, [str(i) for i in range(1000)])
    images = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert (teacher(images, torch.zeros(1)) - source(images)).abs().max() < 1e-4
    assert teacher.mean == (0.485, 0.456, 0.406)


@pytest.mark.parametrize("fields, message", [
    ({"alpha": 1.5}, "alpha must be in"), ({"kind": "medium"}, "kind must be one of soft, hard"),
    ({"temperature": 0.0}, "temperature must be positive"), ({"teacher": ""}, "teacher is empty"),
])
def test_bad_settings_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        Distillation(**{"teacher": "x.ckpt", **fields})


# -- real fits -----------------------------------------------------------------------------------------------------
def cli(*args: str):
    """The classification CLI in this process; the environment it sets for its own run (the thread plan,
    Lightning's seed variables) is taken back, so that the subprocesses of later tests start as on a command line."""
    from tasks.cli.suite import main

    environment = dict(os.environ)
    try:
        return main("classify", [*args], exit_on_error=False)
    finally:
        os.environ.clear()
        os.environ.update(environment)


@pytest.fixture(scope="module")
def teacher_checkpoint(tmp_path_factory) -> Path:
    """A MobileViTv2-0.5 (BatchNorm inside) fitted for 2 steps on the digits demo."""
    root = tmp_path_factory.mktemp("teacher")
    cli("fit", *TINY, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
        "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", str(root))
    return root / "checkpoints" / "last.ckpt"


def test_the_teacher_stays_frozen_and_out_of_the_trained_and_saved_state(teacher_checkpoint, tmp_path):
    teacher_file = tmp_path / "teacher.ckpt"
    shutil.copy(teacher_checkpoint, teacher_file)
    ema = tmp_path / "ema.yaml"
    ema.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.EMAWeightAveraging\n"
                   "      init_args: {decay: 0.9}\n")
    fit = cli("fit", "--config", str(ema), *TINY, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "1",
              "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", str(tmp_path / "student"),
              "--model.backbone.init_args.width", "0.25", "--model.layer_decay", "0.75",
              "--model.distillation.teacher", str(teacher_file), "--model.distillation.temperature", "2.0")
    model, teacher = fit.model, fit.model.teacher
    assert teacher.name == str(teacher_file) and fit.trainer.global_step == 2
    assert {"train/task_loss", "train/distill_loss"} <= fit.trainer.logged_metrics.keys()
    # eval mode throughout two epochs (Lightning calls model.train() at each): BatchNorm statistics unchanged
    assert not any(m.training for m in teacher.network.modules())
    saved = torch.load(teacher_checkpoint, weights_only=True)["state_dict"]
    assert all(torch.equal(v, saved[k]) for k, v in teacher.network.state_dict().items())
    # outside the optimizer (every layer-decay group), EMA's copy (shared, not copied) and the state dict
    teacher_ids = {id(p) for p in teacher.network.parameters()}
    optimized = [p for group in fit.trainer.optimizers[0].param_groups for p in group["params"]]
    assert not teacher_ids & {id(p) for p in optimized} and len(optimized) == len(list(model.parameters()))
    # Lightning's EMA copies the task before the task's setup builds the teacher; a later copy shares it
    average = weight_averaging_model(next(cb for cb in fit.trainer.callbacks if type(cb).__name__ == "EMAWeightAveraging"))
    assert average.module.teacher is None and copy.deepcopy(model).teacher is teacher
    last = tmp_path / "student" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    plain = ClassificationTask(MobileViTv2(width=0.25), CLASSES)
    assert set(checkpoint["state_dict"]) == set(plain.state_dict())
    assert checkpoint["hyper_parameters"]["distillation"]["temperature"] == 2.0
    # test, predict and export need no teacher: the checkpoint serves with the teacher's file gone
    teacher_file.unlink()
    import tasks

    served = tasks.load(last)
    assert served.teacher is None and served.distillation.teacher == str(teacher_file)
    plain.load_state_dict(checkpoint["state_dict"])
    scored = cli("test", "--ckpt_path", str(last), *TINY, "--trainer.limit_test_batches", "1",
                 "--trainer.default_root_dir", str(tmp_path / "student"))
    assert scored.model.teacher is None and "test/top1" in scored.model.test_metrics


def test_deit_token_distillation_fits_and_validates_on_the_averaged_heads(teacher_checkpoint, tmp_path):
    vit = ["--model.backbone", "backbones.ViT", "--model.backbone.init_args.size", "tiny",
           "--model.backbone.init_args.depth", "2", "--model.backbone.init_args.img_size", "32",
           "--model.backbone.init_args.distillation_token", "true"]
    fit = cli("fit", *TINY, *vit, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
              "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", str(tmp_path),
              "--model.distillation.teacher", str(teacher_checkpoint), "--model.distillation.kind", "hard")
    model = fit.model.eval()
    assert model.head_dist is not None and math.isfinite(fit.trainer.logged_metrics["train/distill_loss"])
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        z_cls, z_dist = model.forward_heads(images)
        assert torch.equal(model(images), (z_cls + z_dist) / 2)  # what validate, test, predict and export call
    reloaded = ClassificationTask.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert reloaded.head_dist is not None and reloaded.teacher is None


def test_a_teacher_of_other_classes_is_refused(teacher_checkpoint, tmp_path):
    checkpoint = torch.load(teacher_checkpoint, weights_only=True)
    checkpoint["hyper_parameters"]["class_names"] = [f"c{i}" for i in range(10)]
    torch.save(checkpoint, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match=r"trained on 10 classes \(c0, c1, c2, c3, c4, c5, ...\), the student on 10"):
        load_teacher(Distillation(str(tmp_path / "other.ckpt")), ClassificationTask, CLASSES)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_teacher(Distillation(str(tmp_path / "absent.ckpt")), ClassificationTask, CLASSES)


def test_a_teacher_that_cannot_take_the_students_images_is_refused_at_fit(teacher_checkpoint, tmp_path):
    checkpoint = torch.load(teacher_checkpoint, weights_only=True)
    names = checkpoint["hyper_parameters"]["class_names"]  # the digits demo's
    vit = ClassificationTask(ViT("tiny", img_size=64, depth=1), names)  # position embeddings for 64 px only
    checkpoint["state_dict"] = vit.state_dict()
    checkpoint["hyper_parameters"]["backbone"] = {"class_path": "backbones.ViT",
                                                  "init_args": {"size": "tiny", "img_size": 64, "depth": 1}}
    torch.save(checkpoint, tmp_path / "vit64.ckpt")
    assert load_teacher(Distillation(str(tmp_path / "vit64.ckpt")), ClassificationTask, names).network.head_dist is None
    with pytest.raises(ValueError, match=r"does not take the student's 32 px images \(ViT\(img_size=\(64, 64\)"):
        cli("fit", *TINY, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "1",
            "--trainer.default_root_dir", str(tmp_path / "run"), "--model.backbone.init_args.width", "0.25",
            "--model.distillation.teacher", str(tmp_path / "vit64.ckpt"))


@pytest.mark.slow
def test_killed_mid_epoch_a_distilled_fit_resumes_exactly(teacher_checkpoint, tmp_path):
    from tests.test_contract import assert_resumed_equals_straight

    run = [*TINY, "--model.backbone.init_args.width", "0.25", "--trainer.max_epochs", "2",
           "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1",
           "--checkpoint.every_n_train_steps", "1", "--model.distillation.teacher", str(teacher_checkpoint)]
    run_task("classify", "fit", *run, "--trainer.default_root_dir", "straight", cwd=tmp_path)
    killed = run_task("classify", "fit", *run, "--trainer.default_root_dir", "resumed",
                      "--trainer.callbacks+=tests.callbacks.KillAtStep", "--trainer.callbacks.init_args.step", "2",
                      cwd=tmp_path, check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    run_task("classify", "fit", *run, "--trainer.default_root_dir", "resumed", "--ckpt_path", "last", cwd=tmp_path)
    assert_resumed_equals_straight(tmp_path, steps=6)


@pytest.mark.slow
def test_distillation_under_two_processes(teacher_checkpoint, tmp_path):
    proc = run_task("classify", "fit", *TINY, "--model.backbone.init_args.width", "0.25", "--trainer.max_epochs", "1",
                    "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1", "--data.batch_size", "4",
                    "--model.distillation.teacher", str(teacher_checkpoint), "--model.distillation.kind", "hard",
                    "--trainer.strategy", "ddp", "--trainer.devices", "2", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert "distillation: hard" in proc.stdout + proc.stderr
    checkpoint = torch.load(next((tmp_path / "runs/classify").rglob("last.ckpt")), weights_only=True)
    assert checkpoint["global_step"] == 2
    assert set(checkpoint["state_dict"]) == set(ClassificationTask(MobileViTv2(width=0.25), CLASSES).state_dict())


# -- segmentation: the same losses on every labelled pixel -----------------------------------------------------------
class PixelTeacher(nn.Module):
    """A stand-in segmentation teacher: a 1x1 convolution to 11 classes, as a task's ``{"out": ...}``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 11, 1)

    def forward(self, x):
        return {"out": self.conv(x)}


@pytest.mark.parametrize("kind", ["soft", "hard"])
def test_segmentation_distils_the_main_heads_logits_at_every_labelled_pixel(kind):
    from backbones.convmixer import ConvMixer
    from tasks.segment import SegmentationTask

    torch.manual_seed(0)
    config = Distillation("stand-in", kind=kind, alpha=0.25, temperature=3.0)
    task = SegmentationTask(ConvMixer(dim=16, depth=1, kernel_size=3, patch_size=8), [str(i) for i in range(11)],
                            distillation=config)
    task.teacher = Teacher(PixelTeacher(), "stand-in")
    images, mask = torch.randn(2, 3, 32, 32), torch.randint(0, 11, (2, 32, 32))
    mask[0, :5] = 255  # ignored pixels: neither loss sees them
    task.eval()  # the head's dropout off, so that the second forward below gives the same logits
    loss = task.training_loss({"image": images, "mask": mask}, 0)
    with torch.no_grad():
        student, teacher = task(images)["out"], task.teacher.network(images)["out"]
    rows = lambda maps: maps.permute(0, 2, 3, 1)[mask != 255]  # noqa: E731 - (pixels, classes)
    s, t, y = rows(student), rows(teacher), mask[mask != 255]
    distill = hand_soft_kd(s, t, 3.0) if kind == "soft" else hand_cross_entropy(s, t.argmax(-1))
    expected = 0.75 * hand_cross_entropy(s, y) + 0.25 * distill
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)
    with pytest.raises(ValueError, match="learns only from a checkpoint of its own task"):
        load_teacher(Distillation("timm:resnet18"), SegmentationTask, task.class_names, image_classifier=False)
