"""Every ImageNet recipe of the MobileViTv2 paper (Table 6's rows, Table 7's ImageNet-21k-P models) and of the
MobileViT (v1) paper (XXS, XS, S) states what its reference states: each value is compared, as the CLI resolves
the recipe (base chain included), with a reference table that cites where the value comes from. A recipe that
drifts fails a named case (``<recipe>-<fact>``). What a recipe knowingly does otherwise than its reference is
listed, with the reason, in :data:`V1_KNOWN_DIFFERENCES` (MobileViT v1) and configs/README.md."""
from __future__ import annotations

import pytest

from tests.conftest import run_task
from tests.recipes import REPO, assert_fact, checkpoint_stem, normalisation, resolve, training_facts, value

IN1K = "CVNets config/classification/imagenet/mobilevit_v2.yaml"
FT384 = "CVNets config/classification/finetune_higher_res_in1k/mobilevit_v2.yaml"
IN21K = "CVNets config/classification/imagenet_21k/mobilevit_v2.yaml"
FT21K = "CVNets config/classification/finetune_in21k_to_1k/mobilevit_v2.yaml"
README = "CVNets docs/source/en/models/classification/README-mobilevit-v2.md"

#: width -> (scheduler.cosine.max_lr, scheduler.cosine.min_lr, optim.weight_decay) of README's ImageNet-1k
#: command for that width (2.0's are also the yaml's own values)
IN1K_PER_WIDTH = {
    0.5: (0.009, 0.0009, 0.004), 0.75: (0.009, 0.0009, 0.008), 1.0: (0.0075, 0.00075, 0.013),
    1.25: (0.0049, 0.00049, 0.020), 1.5: (0.0035, 0.00035, 0.029), 1.75: (0.0026, 0.00026, 0.039),
    2.0: (0.002, 0.0002, 0.05),
}
#: width -> optim.weight_decay of README's ImageNet-21k-P command for that width
IN21K_WEIGHT_DECAY = {1.5: 0.029, 1.75: 0.039, 2.0: 0.05}
TAGS = {0.5: "050", 0.75: "075", 1.0: "100", 1.25: "125", 1.5: "150", 1.75: "175", 2.0: "200"}
NO_NORMALISATION = ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])  # CVNets feeds [0, 1] pixels to its models


def augmentation(source: str, size: int, eval_resize: int, strong: bool) -> dict:
    """The augmentation block: bicubic random_resized_crop and flip, resize + center_crop for evaluation and,
    in the strong (256x256 training) configurations, rand_augment, random_erase, mixup and cutmix."""
    off = f"{source}: not enabled"
    return {
        "image_size": (size, f"{source} sampler.bs.crop_size_width"),
        "variable_resolution": (None, f"{source} sampler.name: batch_sampler (one crop size)"),
        "eval_resize": (eval_resize, f"{source} image_augmentation.resize.size"),
        "interpolation": ("bicubic", f"{source} image_augmentation.random_resized_crop.interpolation"),
        "hflip": (0.5, f"{source} image_augmentation.random_horizontal_flip"),
        "rand_augment": (strong, f"{source} image_augmentation.rand_augment.enable" if strong else off),
        "random_erasing": (0.25 if strong else 0.0, f"{source} image_augmentation.random_erase.p" if strong else off),
        "mixup_alpha": (0.2 if strong else 0.0, f"{source} image_augmentation.mixup.alpha" if strong else off),
        "cutmix_alpha": (1.0 if strong else 0.0, f"{source} image_augmentation.cutmix.alpha" if strong else off),
        "normalisation": (NO_NORMALISATION, f"{source}: no normalisation transform"),
    }


def common(source: str, ema_momentum: float) -> dict:
    return {
        "label_smoothing": (0.1, f"{source} loss.classification.cross_entropy.label_smoothing"),
        "no_decay_on_norm_and_bias": (True, f"{source} optim.no_decay_bn_filter_bias"),
        "ema_decay": (1 - ema_momentum, f"{source} ema.momentum: {ema_momentum}"),
        "mixed_precision": (True, f"{source} common.mixed_precision"),
    }


def in1k_reference(width: float) -> dict:
    lr, min_lr, weight_decay = IN1K_PER_WIDTH[width]
    row = f"{README}, MobileViTv2-{width} ImageNet-1k command"
    return {
        **common(IN1K, 0.0005), **augmentation(IN1K, 256, 288, strong=True),
        "width": (width, row),
        "optimizer": ("torch.optim.AdamW", f"{IN1K} optim.name"),
        "betas": ([0.9, 0.999], f"{IN1K} optim.adamw.beta1/beta2"),
        "lr": (lr, f"{row}: scheduler.cosine.max_lr"),
        "min_lr": (min_lr, f"{row}: scheduler.cosine.min_lr"),
        "weight_decay": (weight_decay, f"{row}: optim.weight_decay"),
        "schedule": ("cosine", f"{IN1K} scheduler.name"),
        "warmup_steps": (20000, f"{IN1K} scheduler.warmup_iterations"),
        "warmup_init_lr": (1e-6, f"{IN1K} scheduler.warmup_init_lr"),
        "epochs": (300, f"{IN1K} scheduler.max_epochs"),
        "global_batch": (1024, f"{IN1K} dataset.train_batch_size0 128 x 8 GPUs ({README})"),
        "grad_clip": (10.0, f"{IN1K} common.grad_clip"),
        "channels_last": (True, f"{IN1K} common.channels_last"),
        "starts_from": (None, "paper Table 8: trained from scratch"),
    }


def ft384_reference(width: float, starts_from: str) -> dict:
    return {
        **common(FT384, 0.00005), **augmentation(FT384, 384, 384, strong=False),
        "width": (width, f"{README}, 384x384 fine-tuning commands: only the width changes"),
        "optimizer": ("torch.optim.SGD", f"{FT384} optim.name"),
        "momentum": (0.9, f"{FT384} optim.sgd.momentum"),
        "lr": (0.001, f"{FT384} scheduler.fixed.lr"),
        "weight_decay": (4e-5, f"{FT384} optim.weight_decay"),
        "schedule": ("fixed", f"{FT384} scheduler.name"),
        "epochs": (10, f"{FT384} scheduler.max_epochs"),
        "global_batch": (128, f"{FT384} dataset.train_batch_size0 64 x 2 GPUs"),
        "grad_clip": (10.0, f"{FT384} common.grad_clip"),
        "channels_last": (True, f"{FT384} common.channels_last"),
        "starts_from": (starts_from, f"{README}: model.classification.pretrained"),
    }


def in21k_reference(width: float) -> dict:
    row = f"{README}, MobileViTv2-{width} ImageNet-21k-P command"
    return {
        **common(IN21K, 0.0005), **augmentation(IN21K, 256, 288, strong=True),
        "width": (width, row),
        "optimizer": ("torch.optim.AdamW", f"{IN21K} optim.name"),
        "betas": ([0.9, 0.999], f"{IN21K} optim.adamw.beta1/beta2"),
        "lr": (3e-4, f"{IN21K} scheduler.cosine.max_lr"),
        "min_lr": (1e-6, f"{IN21K} scheduler.cosine.min_lr"),
        "weight_decay": (IN21K_WEIGHT_DECAY[width], f"{row}: optim.weight_decay"),
        "schedule": ("cosine", f"{IN21K} scheduler.name"),
        "warmup_steps": (0, f"{IN21K}: no scheduler.warmup_iterations"),
        "epochs": (80, f"{IN21K} scheduler.max_epochs"),
        "global_batch": (4096, f"{IN21K} train_batch_size0 128 x 32 GPUs (4 nodes of 8, {README})"),
        "grad_clip": (10.0, f"{IN21K} common.grad_clip"),
        "channels_last": (True, f"{IN21K} common.channels_last"),
        "starts_from": (f"imagenet1k_256/mobilevitv2-{width}", f"{row}: model.classification.pretrained"),
    }


def ft21k_reference(width: float) -> dict:
    return {
        **common(FT21K, 0.0005), **augmentation(FT21K, 256, 288, strong=True),
        "width": (width, f"{README}, ImageNet-21k-P -> 1k fine-tuning commands: only the width changes"),
        "optimizer": ("torch.optim.SGD", f"{FT21K} optim.name"),
        "momentum": (0.9, f"{FT21K} optim.sgd.momentum"),
        "lr": (0.01, f"{FT21K} scheduler.cosine.max_lr"),
        "min_lr": (0.001, f"{FT21K} scheduler.cosine.min_lr"),
        "weight_decay": (4e-5, f"{FT21K} optim.weight_decay"),
        "schedule": ("cosine", f"{FT21K} scheduler.name"),
        "warmup_steps": (0, f"{FT21K}: no scheduler.warmup_iterations"),
        "epochs": (50, f"{FT21K} scheduler.max_epochs"),
        "global_batch": (256, f"{FT21K} dataset.train_batch_size0 128 x 2 GPUs"),
        "grad_clip": (None, f"{FT21K}: no common.grad_clip"),
        "starts_from": (f"imagenet21k_p/mobilevitv2-{width}", f"{README}: model.classification.pretrained"),
    }


# -- MobileViT v1 (XXS, XS, S) ------------------------------------------------------------------------------------
# The paper's models come from CVNets v0.1 (the model zoo's "MobileViTv1 (Legacy)" section says so), trained with
# one configuration per size; v0.2 removed them, and the current tree keeps only an S file whose warm-up is longer.
V1_GIT = "git 2f6abfc (CVNets v0.1)"
V1_MODES = {"xxs": "xx_small", "xs": "x_small", "s": "small"}
#: size -> model.classification.mit.dropout of that size's v0.1 file
V1_DROPOUT = {"xxs": 0.05, "xs": 0.1, "s": 0.1}
V1_README = f"CVNets examples/README-mobilevit.md ({V1_GIT})"
V1_DATA = f"CVNets data/datasets/classification/imagenet.py ({V1_GIT})"
V1_TRANSFORMS = f"CVNets data/transforms/image.py ({V1_GIT})"
V1_CURRENT = "CVNets config/classification/imagenet/mobilevit.yaml (current tree, MobileViT-S)"
#: CVNets' variable-batch sampler (sampler.name: variable_batch_sampler, sampler.vbs.*)
V1_VBS = {"crop_size_width": 256, "crop_size_height": 256, "min_crop_size_width": 160, "max_crop_size_width": 320,
          "min_crop_size_height": 160, "max_crop_size_height": 320, "max_n_scales": 5, "check_scale": 32}


def v1_config(size: str) -> str:
    return f"CVNets config/classification/mobilevit_{V1_MODES[size]}.yaml ({V1_GIT})"


def v1_reference(size: str) -> dict:
    source = v1_config(size)
    off = f"{source}: not enabled"
    return {
        "size": (size, f"{source} model.classification.mit.mode: {V1_MODES[size]}"),
        "dropout": (V1_DROPOUT[size], f"{source} model.classification.mit.dropout"),
        "attn_dropout": (0.0, f"{source} model.classification.mit.attn_dropout"),
        "num_heads": (4, f"{source} model.classification.mit.number_heads"),
        "head_dropout": (0.1, f"{source} model.classification.classifier_dropout"),
        "label_smoothing": (0.1, f"{source} loss.classification.label_smoothing_factor"),
        "optimizer": ("torch.optim.AdamW", f"{source} optim.name"),
        "betas": ([0.9, 0.999], f"{source} optim.adamw.beta1/beta2"),
        "lr": (0.002, f"{source} scheduler.cosine.max_lr"),
        "min_lr": (0.0002, f"{source} scheduler.cosine.min_lr"),
        "weight_decay": (0.01, f"{source} optim.weight_decay"),
        "no_decay_on_norm_and_bias": (False, f"{source} optim.no_decay_bn_filter_bias"),
        "schedule": ("cosine", f"{source} scheduler.name"),
        "warmup_steps": (3000, f"{source} scheduler.warmup_iterations ({V1_CURRENT}: 20000, a later, longer "
                               "warm-up that did not produce the published models)"),
        "warmup_init_lr": (0.0002, f"{source} scheduler.warmup_init_lr"),
        "epochs": (300, f"{source} scheduler.max_epochs"),
        "global_batch": (1024, f"{source} dataset.train_batch_size0 128 x 8 GPUs ({V1_README}: 8 A100s; "
                               f"{V1_CURRENT} comment: 1024)"),
        "grad_clip": (None, f"{source}: no common.grad_clip"),
        "mixed_precision": (True, f"{source} common.mixed_precision"),
        "sync_batchnorm": (False, f"{source} model.normalization.name: batch_norm_2d"),
        "ema_decay": (1 - 0.0005, f"{source} ema.momentum: 0.0005"),
        "image_size": (V1_VBS["crop_size_width"], f"{source} sampler.vbs.crop_size_width/height: the base crop "
                                                  "(and the evaluation crop)"),
        "variable_resolution": ({"min_size": V1_VBS["min_crop_size_width"], "max_size": V1_VBS["max_crop_size_width"],
                                 "scales": V1_VBS["max_n_scales"], "multiple": V1_VBS["check_scale"],
                                 "rule": "cvnets_v0.1"},
                                f"{source} sampler.vbs.min/max_crop_size_width/height, max_n_scales, check_scale; "
                                f"CVNets data/sampler/utils.py _image_batch_pairs ({V1_GIT})"),
        "eval_resize": (288, f"{V1_DATA} validation_transforms: crop size + 32 ({V1_CURRENT} "
                             "image_augmentation.resize.size: 288)"),
        "interpolation": ("bilinear", f"{source} image_augmentation.random_resized_crop.interpolation "
                                      f"({V1_TRANSFORMS} Resize default: bilinear)"),
        "scale": ([0.08, 1.0], f"{V1_TRANSFORMS} RandomResizedCrop default scale"),
        "hflip": (0.5, f"{source} image_augmentation.random_horizontal_flip.enable, p default 0.5 ({V1_TRANSFORMS})"),
        "rand_augment": (False, off),
        "random_erasing": (0.0, off),
        "mixup_alpha": (0.0, off),
        "cutmix_alpha": (0.0, off),
        "normalisation": (NO_NORMALISATION, f"{V1_TRANSFORMS} NumpyToTensor: pixels / 255, no mean or std"),
        "starts_from": (None, f"{source}: no model.classification.pretrained (trained from scratch)"),
    }


#: What the MobileViT v1 recipes do otherwise than CVNets v0.1, on purpose: what -> (CVNets, the recipe, why).
#: None of these is compared in v1_reference; each recipe's header states them too.
V1_KNOWN_DIFFERENCES = {
    "sampler_order": ("each batch's (crop, batch size) drawn independently (random.choice)",
                      "each run of five batches takes each (crop, batch size) once, in a random order",
                      "the same share per size, and every epoch the same number of steps, which Lightning and the "
                      "schedules count ahead (datamodules/resolution.py)"),
    "cosine_steps": ("scheduler.is_iteration_based: false (cosine evaluated once per epoch after warm-up)",
                     "cosine evaluated every optimizer step", "the same curve without the stair steps"),
    "ffn_dropout": ("model.classification.mit.ffn_dropout: 0.0 (hidden units of the FFN), mit.dropout after the "
                    "attention and the FFN",
                    "mit.dropout also on the FFN's hidden units",
                    "layers/transformer.py gives its FeedForward one dropout rate"),
    "precision_and_ema": ("fp16 mixed precision with a scaler; CVNets' EMA", "bf16-mixed; Lightning's "
                          "EMAWeightAveraging with the same decay", "the suite's precision and EMA"),
    "channels_last": ("no such option in v0.1", "channels_last: true", "a memory layout; no value changes"),
    "decoding": ("OpenCV: BGR channel order, bilinear resampling without antialiasing",
                 "torchvision decoding (RGB) and resampling with antialiasing",
                 "the suite's one image pipeline; from scratch, the channel order only permutes the stem's inputs"),
}


REFERENCES: dict[str, dict] = {}
for _width, _tag in TAGS.items():
    REFERENCES[f"imagenet_mobilevitv2_{_tag}.yaml"] = in1k_reference(_width)
    REFERENCES[f"imagenet384_mobilevitv2_{_tag}.yaml"] = ft384_reference(_width, f"imagenet1k_256/mobilevitv2-{_width}")
for _width in IN21K_WEIGHT_DECAY:
    _tag = TAGS[_width]
    REFERENCES[f"imagenet21kp_mobilevitv2_{_tag}.yaml"] = in21k_reference(_width)
    REFERENCES[f"imagenet21kp_ft1k_mobilevitv2_{_tag}.yaml"] = ft21k_reference(_width)
    REFERENCES[f"imagenet21kp_ft1k384_mobilevitv2_{_tag}.yaml"] = ft384_reference(
        _width, f"imagenet21k_p_ft1k_256/mobilevitv2-{_width}")
for _size in V1_MODES:
    REFERENCES[f"imagenet_mobilevit_{_size}.yaml"] = v1_reference(_size)


def facts(config: dict) -> dict:
    """What a resolved classification recipe says, in the reference tables' terms."""
    return {
        **training_facts(config),
        "width": value(config, "model.backbone.width", None),
        **{key: value(config, f"model.backbone.{key}", None) for key in ("size", "dropout", "attn_dropout", "num_heads")},
        "head_dropout": value(config, "model.head_dropout"),
        "label_smoothing": value(config, "model.label_smoothing"),
        "variable_resolution": value(config, "data.variable_resolution", None),
        **{key: value(config, f"data.{key}") for key in (
            "image_size", "eval_resize", "interpolation", "scale", "hflip", "rand_augment", "random_erasing",
            "mixup_alpha", "cutmix_alpha")},
        "normalisation": normalisation(config),
        "starts_from": checkpoint_stem(value(config, "model.weights")),
    }


CASES = [pytest.param(recipe, fact, id=f"{recipe.removesuffix('.yaml')}-{fact}")
         for recipe, reference in REFERENCES.items() for fact in reference]


def test_every_imagenet_recipe_has_a_reference_and_every_reference_a_recipe():
    shipped = {p.name for p in (REPO / "configs/classify").glob("imagenet*.yaml")}
    assert shipped == set(REFERENCES)


@pytest.mark.parametrize("recipe, fact", CASES)
def test_recipe_value_equals_its_reference(recipe, fact):
    expected, source = REFERENCES[recipe][fact]
    assert_fact(recipe, fact, facts(resolve("classify", recipe))[fact], expected, source)


@pytest.mark.parametrize("size", sorted(V1_MODES))
def test_v1_recipe_trains_cvnets_variable_batch_table(size):
    """The v1 recipe's resolution table on its 8 GPUs is the one CVNets v0.1's rule gives for sampler.vbs (the
    rule itself is checked in tests/test_variable_resolution.py)."""
    from datamodules.resolution import VariableResolution, resolution_table
    from tests.test_variable_resolution import cvnets_table

    config = resolve("classify", f"imagenet_mobilevit_{size}.yaml")
    schedule = VariableResolution(**value(config, "data.variable_resolution"))
    devices = config["trainer"]["devices"]
    assert resolution_table(value(config, "data.image_size"), value(config, "data.batch_size"), schedule, devices) == \
        cvnets_table(V1_VBS["crop_size_width"], 128, 8, V1_VBS["max_n_scales"], V1_VBS["check_scale"],
                     V1_VBS["min_crop_size_width"], V1_VBS["max_crop_size_width"], v01=True)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(REFERENCES))
def test_recipe_takes_one_training_step_on_the_demo_data(recipe, tmp_path):
    """The whole recipe instantiates and trains one step on CPU: only the size, device and start-point
    options are overridden (the model, optimizer, schedule, EMA and augmentation are the recipe's)."""
    run_task("classify", "fit", "--config", str(REPO / "configs/classify" / recipe),
             "--data.root", "null", "--data.image_size", "64", "--data.eval_resize", "64", "--data.batch_size", "4",
             "--data.num_workers", "0", "--data.persistent_workers", "false", "--data.pin_memory", "false",
             "--model.weights", "null", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
             "--trainer.num_nodes", "1", "--trainer.strategy", "auto", "--trainer.precision", "32-true",
             "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
             "--trainer.default_root_dir", str(tmp_path), cwd=tmp_path)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_a_missing_start_checkpoint_stops_with_how_to_make_one(tmp_path):
    from backbones import MobileViTv2
    from tasks.classify import ClassificationTask

    missing = tmp_path / "checkpoints/imagenet1k_256/mobilevitv2-0.5.pt"
    with pytest.raises(FileNotFoundError) as error:
        ClassificationTask(MobileViTv2(width=0.5), class_names=["a", "b"], weights=str(missing))
    message = str(error.value)
    assert str(missing) in message and "model.weights" in message and "backbones/pretrained.py" in message
