"""timm architectures as suite backbones (``backbones.Timm``): feature maps, pooled embedding and layer-wise decay
equal timm's own on the same weights; repeated blocks are timm's blocks; refusals name the architecture; a tag's
pretrained_cfg is the datamodule's preprocessing and its file comes from the weights cache, offline; the real task
CLIs train, test, predict and export with one flag, and a checkpoint rebuilds without any weights file."""
from __future__ import annotations

import importlib
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

timm = pytest.importorskip("timm")

from backbones import Timm  # noqa: E402
from backbones.timm_backbone import TimmRefusal  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
SIZE = 64


def seeded(build):
    torch.manual_seed(0)
    return build()


# -- the backbone against timm's own modules ------------------------------------------------------------------
@pytest.mark.parametrize("name, output_stride", [
    ("convnext_atto", 32), ("mobilenetv3_small_050", 32), ("resnet10t", 32), ("resnet10t", 8),
    ("efficientnet_b0", 16),
])
def test_feature_maps_equal_timms_features_only_model(name, output_stride):
    """timm's ``features_only=True`` wrapper, given our weights, gives the same maps at the strides its
    ``feature_info`` reports. Its state dict is our trunk's, in the same order (the wrapper only renames)."""
    ours = Timm(name, output_stride=output_stride).eval()
    reference = timm.create_model(name, features_only=True, output_stride=output_stride).eval()
    trunk = list(ours.model.state_dict().values())[: len(reference.state_dict())]
    assert [v.shape for v in trunk] == [v.shape for v in reference.state_dict().values()]
    reference.load_state_dict(dict(zip(reference.state_dict(), trunk)))
    x = torch.randn(2, 3, SIZE, SIZE)
    with torch.no_grad():
        got, expected = ours(x), reference(x)
    strides = [min(r, output_stride) for r in reference.feature_info.reduction()]
    deepest = {s: i for i, s in enumerate(strides)}  # the deepest map at each stride
    assert sorted(got) == sorted(deepest)
    assert ours.feature_channels == {s: reference.feature_info.channels()[i] for s, i in deepest.items()}
    for stride, index in deepest.items():
        assert got[stride].shape[-1] == SIZE // stride
        torch.testing.assert_close(got[stride], expected[index], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["convnext_atto", "mobilenetv3_small_050", "vit_tiny_patch16_224"])
def test_pooled_embedding_is_timms_pre_logits(name):
    """``forward_pooled`` is what timm's classifier reads (``forward_head(pre_logits=True)``): with ConvNeXt's
    head norm, MobileNetV3's 1024-wide ``conv_head``, ViT's class token."""
    kwargs = {"img_size": SIZE} if name.startswith("vit") else {}
    ours = Timm(name, **kwargs).eval()
    reference = timm.create_model(name, **kwargs).eval()
    reference.load_state_dict(ours.model.state_dict(), strict=False)  # all but the classifier, which is unread
    x = torch.randn(2, 3, SIZE, SIZE)
    with torch.no_grad():
        expected = reference.forward_head(reference.forward_features(x), pre_logits=True)
        got = ours.forward_pooled(x)
    assert got.shape == (2, ours.num_features) == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_repeated_blocks_are_the_blocks_timm_numbers():
    """ConvNeXt-atto's depths (2, 2, 6, 2) (timm/models/convnext.py, convnext_atto) give 12 regional-compile /
    checkpointing units, named as timm's group_matcher numbers them; ResNet-10-T's 4 BasicBlocks."""
    from layers.compile import repeated_blocks

    convnext = Timm("convnext_atto")
    names = [name for name, _ in repeated_blocks(convnext)]
    assert len(names) == 12 and names[0] == "model.stages.0.blocks.0" and names[-1] == "model.stages.3.blocks.1"
    assert [type(b).__name__ for _, b in repeated_blocks(Timm("resnet10t"))] == ["BasicBlock"] * 4


def test_channels_last_and_checkpointed_blocks_give_the_same_maps_and_gradients():
    """The task's ``channels_last`` (module and input in NHWC) and ``activation_checkpointing`` (each of timm's
    blocks recomputed in backward) change no value: ConvNeXt-atto's maps and every gradient equal the plain run."""
    import copy

    from layers.checkpointing import checkpoint_networks

    plain = Timm("convnext_atto", drop_path_rate=0.0).train()
    other = copy.deepcopy(plain).to(memory_format=torch.channels_last)
    assert "ConvNeXtBlock" in checkpoint_networks([other])
    x = torch.randn(2, 3, SIZE, SIZE)
    losses = [sum(m.sum() for m in net(inp).values())
              for net, inp in ((plain, x), (other, x.contiguous(memory_format=torch.channels_last)))]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-3)
    for (name, p), q in zip(plain.named_parameters(), other.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["convnext_atto", "mobilenetv3_small_050", "resnet10t", "vit_tiny_patch16_224"])
def test_layer_decay_equals_timms_param_groups(name):
    """Each parameter's lr scale and weight decay in the suite's layer-decay groups equal timm's
    ``param_groups_layer_decay`` on timm's whole model (classifier included) of the same architecture."""
    from timm.optim import param_groups_layer_decay

    from tasks.engine.optim import param_groups
    from tests.test_layer_decay import WEIGHT_DECAY, classifier, scales_and_decays

    reference = timm.create_model(name)
    ours = classifier(Timm(name), 1000)
    expected = scales_and_decays(param_groups_layer_decay(reference, WEIGHT_DECAY, (), layer_decay=0.7), reference)
    got = scales_and_decays(param_groups(ours, True, layer_decay=0.7), ours)
    head = reference.pretrained_cfg["classifier"]
    mapped = {n: f"head.fc.{n[len(head) + 1:]}" if n.startswith(head + ".") else f"backbone.model.{n}" for n in expected}
    assert sorted(mapped.values()) == sorted(got)
    for timm_name, (scale, decay) in expected.items():
        assert got[mapped[timm_name]] == (pytest.approx(scale, rel=1e-12), decay), timm_name
    assert len({scale for scale, _ in got.values()}) > 3


# -- refusals --------------------------------------------------------------------------------------------------
def test_an_architecture_that_cannot_dilate_is_refused_by_name():
    with pytest.raises(TimmRefusal, match=r"mobilenetv3_small_050 \(mobilenetv3\) cannot run at output_stride 8"):
        Timm("mobilenetv3_small_050", output_stride=8)
    assert Timm("vit_tiny_patch16_224", output_stride=16).feature_channels == {16: 192}  # at 16 already


def test_unknown_names_and_untagged_weights_are_refused_with_what_to_write():
    with pytest.raises(ValueError, match=r"no architecture 'convnext_ato' \(closest: .*convnext_atto"):
        Timm("convnext_ato")
    with pytest.raises(ValueError, match=r"write pretrained=convnext_atto.d2_in1k"):
        Timm("convnext_atto", pretrained="convnext_atto")
    with pytest.raises(ValueError, match=r"weights of timm's resnet10t, not of convnext_atto"):
        Timm("convnext_atto", pretrained="resnet10t.c3_in1k")


def test_a_fixed_size_architecture_takes_its_size_only():
    """MLP-Mixer's token-mixing MLPs are sized for one grid (timm's MlpMixer takes no dynamic_img_size): built
    for 64 px, other sizes are refused with the size it takes; size_multiple None, so export keeps one size."""
    backbone = Timm("mixer_s16_224", img_size=SIZE)
    assert backbone.size_multiple is None and "fixed_input_size" in backbone.fixed_size_reason
    with pytest.raises(ValueError, match=r"takes only 64x64 inputs .* got \(96, 96\)"):
        backbone(torch.randn(1, 3, 96, 96))


# -- preprocessing and weights -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tag", ["vit_tiny_patch16_224.augreg_in21k_ft_in1k", "resnet10t.c3_in1k",
                                 "convnext_atto.d2_in1k"])
def test_a_tags_pretrained_cfg_is_the_resolved_preprocessing(tag):
    """What the datamodule normalises with, and the evaluation input (short side, crop, interpolation), equal
    timm's ``resolve_data_config`` and ``create_transform`` of the tag (timm/data/transforms_factory.py:
    ``scale_size = floor(img_size / crop_pct)``)."""
    from datamodules.input_spec import InputSpec, resolve_preprocessing

    config = timm.data.resolve_data_config({}, model=timm.create_model(tag, pretrained=False))
    resolved = resolve_preprocessing(tag)
    assert (resolved.mean, resolved.std) == (tuple(config["mean"]), tuple(config["std"]))
    spec = InputSpec.of_weights(tag)
    assert spec.image_size == config["input_size"][-1] and spec.interpolation == config["interpolation"]
    assert spec.resize_size == math.floor(config["input_size"][-1] / config["crop_pct"])


def put_in_cache(monkeypatch, tmp_path, tag: str) -> dict[str, torch.Tensor]:
    """timm's weights of ``tag`` (here: random, seeded) where the download cache keeps the hub's
    model.safetensors; downloading is switched off, so only the cache can answer."""
    from safetensors.torch import save_file

    from backbones.download import cache_path
    from backbones.pretrained import timm_weights

    monkeypatch.setenv("SUITE_WEIGHTS_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SUITE_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no checkpoints/timm/<tag>.pth of the working tree
    state = {k: v.contiguous() for k, v in seeded(lambda: timm.create_model(tag)).state_dict().items()}
    path = cache_path(timm_weights(tag))
    path.parent.mkdir(parents=True)
    save_file(state, str(path))
    return state


def test_a_tag_loads_from_the_download_cache_offline_through_timms_loader(monkeypatch, tmp_path):
    state = put_in_cache(monkeypatch, tmp_path, "resnet10t.c3_in1k")
    backbone = Timm("resnet10t", pretrained="resnet10t.c3_in1k")
    own = backbone.model.state_dict()
    assert set(own) == set(state) - {"fc.weight", "fc.bias"}  # timm's loader drops the classifier
    assert all(torch.equal(own[k], state[k]) for k in own)


def test_a_missing_tag_offline_is_one_line_naming_it(monkeypatch, tmp_path):
    from backbones.download import WeightsUnavailable

    monkeypatch.setenv("SUITE_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.setenv("SUITE_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WeightsUnavailable, match=r"weights resnet10t.c3_in1k are not on this machine and "
                                                 r"SUITE_OFFLINE=1 forbids downloading") as error:
        Timm("resnet10t", pretrained="resnet10t.c3_in1k")
    assert "\n" not in str(error.value)


def test_a_timm_state_dict_file_loads_and_a_whole_classifier_keeps_its_head(tmp_path):
    """A local file in timm's naming: as ``pretrained`` through timm's loader, as the classification task's
    ``weights`` with its classifier (the ``timm`` converter maps ``head.fc`` to the task's head)."""
    from backbones.weights import load_pretrained

    reference = seeded(lambda: timm.create_model("convnext_atto", num_classes=10))
    path = tmp_path / "convnext_atto.pth"
    torch.save(reference.state_dict(), path)
    backbone = Timm("convnext_atto", pretrained=str(path))
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in backbone.model.state_dict().items())
    head = load_pretrained(Timm("convnext_atto"), str(path))
    assert torch.equal(head["head.fc.weight"], reference.head.fc.weight)


# -- the real tasks, by one flag ---------------------------------------------------------------------------------
QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
         "--trainer.num_sanity_val_steps", "0", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
         "--trainer.limit_val_batches", "1", "--data.num_workers", "0"]
TINY = {"classify": ["--data.image_size", "32", "--data.eval_resize", "32", "--data.batch_size", "8",
                     "--model.scheduler.init_args.warmup_steps", "2"],
        "detect": ["--data.image_size", "64", "--data.batch_size", "4", "--data.eval_batch_size", "4",
                   "--model.head.init_args.proj_channels", "[16, 16, 16, 8]"],
        "segment": ["--data.crop_size", "64", "--data.batch_size", "4", "--data.eval_short_side", "null",
                    "--model.head.init_args.channels", "16"]}


def cli(task: str, *args: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module(f"tasks.{task}").main(list(args))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, demo_cache):
    """``fitted(task, name, *flags)`` -> last.ckpt of a 2-step in-process fit of the task's demo recipe with
    ``--model.backbone Timm --model.backbone.name <name>``; one per arguments per module."""
    made = {}

    def fit(task: str, name: str, *flags: str):
        key = (task, name, *flags)
        if key not in made:
            root = tmp_path_factory.mktemp(f"timm-{task}")
            cli(task, "fit", "--model.backbone", "Timm", "--model.backbone.name", name, *TINY[task], *QUIET, *flags,
                "--trainer.default_root_dir", str(root))
            made[key] = next(root.rglob("last.ckpt"))
        return made[key]

    return fit


@pytest.mark.parametrize("task, name", [
    ("classify", "convnext_atto"), ("classify", "mobilenetv3_small_050"), ("detect", "mobilenetv4_conv_small"),
    ("detect", "resnet10t"), ("segment", "efficientnet_b0"), ("segment", "convnext_atto"),
])
def test_each_task_trains_a_step_and_evaluates_on_a_timm_backbone(task, name):
    """The task modules themselves (classification head, SSDLite over the backbone's strides from 8, DeepLabv3 on
    the deepest map): a finite training loss, an SGD step, an evaluation forward (the sweep's cell, no ONNX)."""
    import sweep_timm

    assert sweep_timm.run_cell(task, name, SIZE, onnx=False) == ("pass", "ONNX not run")


@pytest.mark.slow  # an in-process CLI fit each: 30-60 s on 2 cores
@pytest.mark.parametrize("task, name, flags", [
    ("classify", "convnext_atto", ()),
    ("detect", "mobilenetv4_conv_small", ()),
    ("segment", "resnet10t", ("--model.backbone.output_stride", "8")),
])
def test_one_flag_trains_each_task_and_the_checkpoint_rebuilds_without_weights(fitted, task, name, flags):
    ckpt = fitted(task, name, *flags)
    saved = torch.load(ckpt, weights_only=True, map_location="cpu")
    backbone = saved["hyper_parameters"]["backbone"]
    assert backbone["class_path"] in ("backbones.Timm", "backbones.timm_backbone.Timm") and backbone["init_args"]["name"] == name
    module = {"classify": "tasks.classify.ClassificationTask", "detect": "tasks.detect.DetectionTask",
              "segment": "tasks.segment.SegmentationTask"}[task].rsplit(".", 1)
    model = getattr(importlib.import_module(module[0]), module[1]).load_from_checkpoint(ckpt, weights_only=True)
    assert isinstance(model.backbone, Timm) and model.backbone.name == name
    assert all(torch.equal(v, saved["state_dict"][k]) for k, v in model.state_dict().items())


@pytest.mark.slow  # reads the fits above
@pytest.mark.parametrize("task, name, flags", [
    ("classify", "convnext_atto", ()),
    ("detect", "mobilenetv4_conv_small", ()),
    ("segment", "resnet10t", ("--model.backbone.output_stride", "8")),
])
def test_predict_of_a_timm_checkpoint_answers_in_the_images_own_coordinates(fitted, task, name, flags):
    """``tasks.load(ckpt).predict(image)`` on a 70x90 image: the classifier's top classes are the softmax of the
    network's logits on the prepared image; boxes lie inside the image; the mask has the image's size."""
    import numpy as np

    import tasks

    model = tasks.load(fitted(task, name, *flags))
    assert isinstance(model.backbone, Timm)
    image = np.random.default_rng(0).integers(0, 256, (70, 90, 3), dtype=np.uint8)
    result = model.predict(image)
    if task == "classify":
        prepared, _ = model.prepared_images([image])
        with torch.no_grad():
            probabilities = model(torch.stack(prepared)).float().softmax(-1)[0]
        best = probabilities.topk(len(result))
        assert [label for label, _ in result] == [model.class_names[i] for i in best.indices]
        assert [p for _, p in result] == pytest.approx(best.values.tolist(), abs=1e-6)
    elif task == "detect":
        assert all(0 <= d["box"][0] <= d["box"][2] <= 90 and 0 <= d["box"][1] <= d["box"][3] <= 70 for d in result)
    else:
        assert result.shape == (70, 90) and 0 <= result.min() and result.max() < len(model.class_names)


@pytest.mark.slow  # a CLI fit and test: ~30 s
def test_a_tag_normalises_the_data_and_test_reads_no_weights_file(fitted, monkeypatch, tmp_path, demo_cache):
    """Fit from a tag (ViT-Ti/16 in21k->1k: Inception's mean and std, 0.5) found in the cache; the datamodule
    normalises with the tag's values, and ``test`` of the checkpoint runs offline with the cache emptied."""
    import shutil

    put_in_cache(monkeypatch, tmp_path, "vit_tiny_patch16_224.augreg_in21k_ft_in1k")
    ckpt = fitted("classify", "vit_tiny_patch16_224", "--model.backbone.pretrained",
                  "vit_tiny_patch16_224.augreg_in21k_ft_in1k")
    saved = torch.load(ckpt, weights_only=True, map_location="cpu")
    assert saved["input_spec"]["mean"] == [0.5, 0.5, 0.5] and saved["input_spec"]["std"] == [0.5, 0.5, 0.5]
    shutil.rmtree(tmp_path / "cache")
    cli("classify", "test", "--ckpt_path", str(ckpt), *TINY["classify"], *QUIET, "--trainer.limit_test_batches", "1",
        "--trainer.default_root_dir", str(tmp_path / "test"))
    assert list((tmp_path / "test").rglob("metrics.json")) or list(ckpt.parents[1].rglob("metrics.json"))


@pytest.mark.slow  # ONNX export through torch.export: ~40 s a graph on 2 cores
@pytest.mark.parametrize("task, name, flags", [
    ("detect", "mobilenetv4_conv_small", ()),
    ("segment", "resnet10t", ("--model.backbone.output_stride", "8")),
])
def test_export_of_a_timm_checkpoint_passes_parity(fitted, task, name, flags, capsys):
    ckpt = fitted(task, name, *flags)
    capsys.readouterr()
    cli(task, "export", "--ckpt_path", str(ckpt))
    out = capsys.readouterr().out
    assert "exported:" in out and "parity:" in out and "FAILED" not in out, out


@pytest.mark.slow  # ~10 min on 2 cores: 3 tasks x 6 families, with ONNX export
def test_the_sweep_passes_a_representative_subset_in_every_task(tmp_path):
    from sweep_timm import TASKS, sweep

    models = ["convnext_atto", "efficientnet_b0", "mobilenetv4_conv_small", "resnet10t", "regnetx_002",
              "vit_tiny_patch16_224"]
    counts = sweep(models, 64, 600, str(tmp_path / "table.md"))
    table = (tmp_path / "table.md").read_text()
    assert all(counts[task]["pass"] == len(models) for task in TASKS), table
    assert all(f"| {name} |" in table for name in models)


def test_the_sweep_refuses_by_name_and_never_raises(monkeypatch):
    """A cell the backbone refuses is 'refused' with the architecture's name; one that breaks is 'failed' with
    its first line; neither stops the sweep."""
    import sweep_timm

    def no_features(*args, **kwargs):
        raise TimmRefusal("timm's somenet (somefamily) has no forward_intermediates")

    monkeypatch.setattr(sweep_timm, "build_task", no_features)
    assert sweep_timm.run_cell("detect", "somenet", SIZE) == ("refused", "timm's somenet (somefamily) has no "
                                                                         "forward_intermediates")
    monkeypatch.setattr(sweep_timm, "build_task", lambda *a: nn.Identity())
    verdict, why = sweep_timm.run_cell("detect", "somenet", SIZE)
    assert verdict == "failed" and why.startswith("AttributeError")


def test_an_input_size_the_architecture_rejects_is_refused_with_the_size_it_takes():
    """halonet26t's attention blocks need a multiple of 256 px (timm's min_input_size): at 64 px its own assert
    fires deep inside timm; the backbone says which architecture, which size, and what to set."""
    from backbones.timm_backbone import InputSizeRefusal

    backbone = Timm("halonet26t").eval()
    for forward in (backbone.forward, backbone.forward_pooled):
        with pytest.raises(InputSizeRefusal, match=r"timm's halonet26t \(byoanet\) cannot take 64x64 inputs .*"
                                                   r"made for 256x256, at least 256: set data.image_size") as err:
            forward(torch.zeros(1, 3, 64, 64))
        assert err.value.size == 256


def test_the_sweep_runs_a_size_refusal_again_at_the_size_it_takes(monkeypatch):
    import sweep_timm
    from backbones.timm_backbone import InputSizeRefusal

    def refuses_64(task, name, size):
        if size == 64:
            raise InputSizeRefusal(f"timm's {name} cannot take 64x64 inputs", 96)
        raise TimmRefusal(f"timm's {name} reached at {size} px")

    monkeypatch.setattr(sweep_timm, "build_task", refuses_64)
    assert sweep_timm.run_cell("classify", "somenet", 64) == ("refused", "at 96 px, refuses 64 px; timm's somenet "
                                                                           "reached at 96 px")


@pytest.mark.slow
def test_the_cli_refuses_an_architecture_in_one_line(tmp_path):
    """A refusal by name reaches a command-line user as one ``error:`` line and exit code 1, no traceback."""
    from tests.conftest import run_task

    proc = run_task("segment", "fit", "--model.backbone", "Timm", "--model.backbone.name", "mobilenetv3_small_050",
                    "--model.backbone.output_stride", "8", "--trainer.max_steps", "1", cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: timm's mobilenetv3_small_050")
