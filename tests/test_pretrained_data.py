"""The weights a network starts from set how its data is normalised (backbones/pretrained.py,
datamodules/input_spec.py::normalization): the entry's mean and std reach the detection transforms and
the checkpoint's input specification; the recipes that start from CVNets weights normalise [0, 1] pixels
as they are, one that starts from timm's DeiT with ImageNet's mean and std; a given mean or std wins, and
one the weights contradict is warned about."""
from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from torchvision.transforms.v2 import functional as F

from backbones.pretrained import IMAGENET_MEAN, IMAGENET_STD, PRETRAINED
from datamodules.coco import CocoDataModule
from datamodules.demo_scenes import write_coco_layout
from tests.conftest import REPO, run_task
from tests.recipes import resolve, value

UNNORMALISED = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
IMAGENET = (IMAGENET_MEAN, IMAGENET_STD)


def normalisation(data) -> tuple[tuple, tuple]:
    return data.input_spec.mean, data.input_spec.std


def test_the_weights_entry_sets_the_coco_transforms_normalisation():
    for augmentation in ("cvnets", "torchvision_ssd"):
        data = CocoDataModule(weights="mobilevitv2_050.cvnets_in1k", augmentation=augmentation, image_size=32)
        train, evaluate = data.transform(train=True), data.transform(train=False)
        assert (tuple(train.mean), tuple(train.std)) == UNNORMALISED == (tuple(evaluate.mean), tuple(evaluate.std))
    pixels = torch.randint(0, 256, (3, 40, 50), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(evaluate(pixels).as_subclass(torch.Tensor),
                               F.resize(pixels, [32, 32], antialias=True).float() / 255)  # pixel / 255, as CVNets
    assert normalisation(CocoDataModule(weights="deit_tiny_patch16_224.fb_in1k")) == IMAGENET
    inception = PRETRAINED.get("vit_small_patch16_224.augreg_in21k_ft_in1k").preprocessing
    assert normalisation(CocoDataModule(weights="vit_small_patch16_224.augreg_in21k_ft_in1k")) == (
        inception.mean, inception.std) == ((0.5,) * 3, (0.5,) * 3)


def test_given_values_win_and_one_the_weights_contradict_is_warned_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert normalisation(CocoDataModule()) == IMAGENET  # no weights: ImageNet's, silently
        assert normalisation(CocoDataModule(weights="mobilevitv2_050.cvnets_in1k", mean=(0.0, 0.0, 0.0))) == UNNORMALISED
    with pytest.warns(UserWarning, match=r"data.mean=\[0.5, 0.5, 0.5\] differs from the mean \[0.0, 0.0, 0.0\] that "
                                         r"mobilevitv2_050.cvnets_in1k was trained with"):
        data = CocoDataModule(weights="mobilevitv2_050.cvnets_in1k", mean=(0.5, 0.5, 0.5))
    assert normalisation(data) == ((0.5, 0.5, 0.5), (1.0, 1.0, 1.0))
    assert (data.hparams.mean, data.hparams.std) == normalisation(data)  # what the checkpoint's hparams record


def test_weights_whose_input_is_unknown_are_named_and_normalise_with_imagenet(tmp_path):
    timm = pytest.importorskip("timm")
    file = tmp_path / "deit.pth"
    torch.save(timm.create_model("deit_tiny_patch16_224", pretrained=False).state_dict(), file)
    with pytest.warns(UserWarning, match=rf"data.weights={file} does not say which input it was trained on"):
        assert normalisation(CocoDataModule(weights=str(file))) == IMAGENET
    with pytest.raises(ValueError, match="names neither registered weights"):
        CocoDataModule(weights="deit_tiny_patch16_224.fb_in1")


def test_the_checkpoint_records_the_weights_normalisation(tmp_path):
    """A fit whose datamodule is told the weights stores their mean and std as the checkpoint's input
    specification, which `predict` and `export` use."""
    data = write_coco_layout(tmp_path / "coco", {"train": 4, "val": 2}, size=64)
    run_task("detect", "fit", "--data.root", str(data), "--data.weights", "mobilevitv2_050.cvnets_in1k",
             "--data.image_size", "64", "--data.batch_size", "2", "--data.num_workers", "0",
             "--model.head.init_args.proj_channels", "[16, 16, 16, 8]", "--trainer.accelerator", "cpu",
             "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
             "--trainer.default_root_dir", str(tmp_path / "run"), cwd=REPO, env={"SUITE_DATA_CACHE": str(tmp_path)})
    checkpoint = torch.load(next((tmp_path / "run").rglob("last.ckpt")), map_location="cpu", weights_only=True)
    assert (tuple(checkpoint["input_spec"]["mean"]), tuple(checkpoint["input_spec"]["std"])) == UNNORMALISED
    assert checkpoint["datamodule_hyper_parameters"]["weights"] == "mobilevitv2_050.cvnets_in1k"


# -- recipes ---------------------------------------------------------------------------------------------------
def recipe_datamodule(config: dict):
    """The resolved recipe's datamodule, told the weights the model starts from as the CLI tells it (its own
    ``data.weights``, else the model's ``weights``, else the backbone's ``pretrained``)."""
    module, name = config["data"]["class_path"].rsplit(".", 1)
    arguments = dict(config["data"]["init_args"])
    arguments["weights"] = (arguments.get("weights") or value(config, "model.weights", None)
                            or value(config, "model.backbone.pretrained", None))
    return getattr(importlib.import_module(module), name)(**arguments)


@pytest.mark.parametrize("task, recipe", [
    ("detect", "coco_ssdlite_mobilevitv2_100.yaml"), ("detect", "coco_ssdlite_mobilevit_xxs.yaml"),
    ("detect", "voc_ssdlite_mobilevitv2_100.yaml"), ("segment", "ade20k_pspnet_mobilevitv2_050.yaml"),
    ("classify", "imagenet384_mobilevitv2_050.yaml"), ("classify", "imagenet21kp_ft1k384_mobilevitv2_150.yaml"),
])
def test_recipes_that_start_from_cvnets_weights_normalise_as_cvnets(task, recipe):
    config = resolve(task, recipe)
    assert value(config, "data.mean", None) is None and value(config, "data.std", None) is None  # named, not set
    assert normalisation(recipe_datamodule(config)) == UNNORMALISED


def test_a_recipe_that_starts_from_timm_deit_normalises_with_imagenet_mean_and_std(tmp_path):
    recipe = tmp_path / "deit_ssdlite.yaml"  # on the demo recipe, as a recipe without `base:` stacks
    recipe.write_text("model:\n  backbone:\n    class_path: backbones.ViT\n    init_args:\n      size: tiny\n"
                      "      patch_size: 16\n      pretrained: deit_tiny_patch16_224.fb_in1k\n")
    config = resolve("detect", recipe)
    assert value(config, "model.backbone.pretrained") == "deit_tiny_patch16_224.fb_in1k"
    assert normalisation(recipe_datamodule(config)) == IMAGENET


def test_the_cvnets_entry_is_the_input_of_the_recipe_that_trains_those_weights():
    """configs/classify/imagenet_mobilevitv2_100.yaml trains MobileViTv2-1.0 as CVNets does: its evaluation
    input is the one the CVNets weights are registered with."""
    from datamodules.input_spec import InputSpec

    data = recipe_datamodule(resolve("classify", "imagenet_mobilevitv2_100.yaml"))
    assert data.input_spec == InputSpec.of_weights("mobilevitv2_100.cvnets_in1k")
