"""Every segmentation recipe of the MobileViTv2 paper (Table 3's rows on ADE20k and PASCAL VOC, and CVNets'
width-1.0 configurations they stack on) states what CVNets' configuration states: each value is compared, as
the CLI resolves the recipe, with a reference table citing its source. A drifting recipe fails a named case
(``<recipe>-<fact>``). The one-step CPU run of every recipe is ``test_segment_cli.py::test_paper_recipes_run_one_step``."""
from __future__ import annotations

import pytest

from configs.tasks import is_recipe
from tests.recipes import REPO, assert_fact, checkpoint_stem, normalisation, resolve, training_facts, value

CVNETS = "CVNets config/segmentation/{dataset}/{head}_mobilevitv2.yaml"
TRANSFORMS = "CVNets data/transforms/image_pil.py"
ZOO = "CVNets docs/source/en/general/README-model-zoo.md"

#: the paper's Table 3 rows and the width-1.0 configurations: (dataset folder, head, width)
ROWS = [(dataset, head, width) for dataset in ("ade20k", "pascal_voc") for head, width in
        (("pspnet", 0.5), ("pspnet", 1.0), ("pspnet", 1.75), ("deeplabv3", 0.75), ("deeplabv3", 1.0),
         ("deeplabv3", 2.0))]
TAGS = {0.5: "050", 0.75: "075", 1.0: "100", 1.75: "175", 2.0: "200"}


def reference(dataset: str, head: str, width: float) -> dict:
    src = CVNETS.format(dataset=dataset, head=head)
    ade = dataset == "ade20k"
    optimisation = {
        "optimizer": ("torch.optim.SGD" if ade else "torch.optim.AdamW", f"{src} optim.name"),
        "momentum": (0.9 if ade else None, f"{src} optim.sgd.momentum" if ade else f"{src}: adamw"),
        "betas": (None if ade else [0.9, 0.999], f"{src}: sgd" if ade else f"{src} optim.adamw.beta1/beta2"),
        "lr": (0.02 if ade else 5e-4, f"{src} scheduler.cosine.max_lr"),
        "min_lr": (2e-4 if ade else 1e-6, f"{src} scheduler.cosine.min_lr"),
        "weight_decay": (1e-4 if ade else 0.05, f"{src} optim.weight_decay"),
        "no_decay_on_norm_and_bias": (True, f"{src} optim.no_decay_bn_filter_bias"),
        "schedule": ("cosine", f"{src} scheduler.name"),
        "warmup_steps": (0 if ade else 500, f"{src} scheduler.warmup_iterations"),
        "epochs": (120 if ade else 50, f"{src} scheduler.max_epochs"),
        "global_batch": (16 if ade else 128, f"{src} dataset.train_batch_size0 {4 if ade else 32} x 4 GPUs"),
        "grad_clip": (10.0, f"{src} common.grad_clip"),
        "mixed_precision": (True, f"{src} common.mixed_precision"),
        "sync_batchnorm": (True, f"{src} model.normalization.name: sync_batch_norm"),
        "ema_decay": (1 - 0.0005, f"{src} ema.momentum: 0.0005"),
    }
    if not ade:
        optimisation["warmup_init_lr"] = (5e-5, f"{src} scheduler.warmup_init_lr")
    model = {
        "width": (width, f"{ZOO}: the released {head} MobileViTv2-{width} differs only in width"),
        "output_stride": (8 if ade else 16, f"{src} model.segmentation.output_stride"),
        "head": ({"pspnet": "heads.pspnet.PSPNet", "deeplabv3": "heads.deeplabv3.DeepLabV3"}[head],
                 f"{src} model.segmentation.seg_head"),
        "head_channels": (512, f"{src} {head}.{'psp' if head == 'pspnet' else 'aspp'}_out_channels"),
        "head_dropout": (0.1, f"{src} {head}.{'psp' if head == 'pspnet' else 'aspp'}_dropout"),
        "aux": (True, f"{src} model.segmentation.use_aux_head"),
        "aux_stage": (4, "CVNets cvnets/models/segmentation/heads/base_seg_head.py: the aux head reads out_l4"),
        "aux_dropout": (0.1, "CVNets base_seg_head.py: aux_dropout default 0.1"),
        "aux_weight": (0.4, f"{src} loss.segmentation.cross_entropy.aux_weight"),
        "starts_from": (f"imagenet1k_256/mobilevitv2-{width}", f"{src} model.classification.pretrained"),
    }
    if head == "pspnet":
        model["pool_sizes"] = ([1, 2, 3, 6], f"{src} pspnet.psp_pool_sizes")
    else:
        model["atrous_rates"] = ([12, 24, 36] if ade else [6, 12, 18], f"{src} deeplabv3.aspp_rates")
    augmentation = {
        "augmentation": ("cvnets", f"{src} image_augmentation"),
        "crop_size": (512, f"{src} sampler.bs.crop_size_width / random_crop"),
        "short_side_range": ([256, 768], f"{src} random_short_size_resize.short_side_min/max"),
        "max_image_side": (1024, f"{src} random_short_size_resize.max_img_dim"),
        "seg_class_max_ratio": (0.75, f"{src} random_crop.seg_class_max_ratio"),
        "hflip": (0.5, f"{src} random_horizontal_flip ({TRANSFORMS} RandomHorizontalFlip p 0.5)"),
        "photometric": (0.5, f"{src} photo_metric_distort ({TRANSFORMS} PhotometricDistort, each step p 0.5)"),
        "blur": (0.5, f"{src} random_gaussian_noise ({TRANSFORMS} RandomGaussianBlur p 0.5)"),
        "rotate_degrees": (10.0, f"{src} random_rotate.angle"),
        "rotate_p": (1.0, f"{TRANSFORMS} RandomRotate: applied to every sample"),
        "normalisation": (([0.0] * 3, [1.0] * 3), f"{src}: no normalisation transform"),
    }
    data = {
        "dataset": ("ade20k" if ade else "voc", f"{src} dataset.name"),
        "aug_masks": (not ade, f"{src}: VOC trains on the SBD-augmented train_aug list" if not ade else f"{src}"),
        "coco": (not ade, f"{src} dataset.pascal.use_coco_data" if not ade else f"{src}: ADE20k alone"),
    }
    if not ade:
        data["coco_min_pixels"] = (1000, "PyTorch-Encoding's COCO preprocessing, whose masks CVNets' follow")
    return {**optimisation, **model, **augmentation, **data}


def recipe_name(dataset: str, head: str, width: float) -> str:
    return f"{'voc' if dataset == 'pascal_voc' else dataset}_{head}_mobilevitv2_{TAGS[width]}.yaml"


REFERENCES = {recipe_name(*row): reference(*row) for row in ROWS}


def facts(config: dict) -> dict:
    head = value(config, "model.head")
    return {
        **training_facts(config),
        "width": value(config, "model.backbone.width"),
        "output_stride": value(config, "model.backbone.output_stride"),
        "head": head["class_path"],
        "head_channels": value(head, "channels"),
        "head_dropout": value(head, "dropout"),
        "pool_sizes": value(head, "pool_sizes", None),
        "atrous_rates": value(head, "atrous_rates", None),
        "aux": value(head, "aux"),
        "aux_stage": value(head, "aux_stage"),
        "aux_dropout": value(head, "aux_dropout"),
        "aux_weight": value(config, "model.aux_weight"),
        "starts_from": checkpoint_stem(value(config, "model.backbone.pretrained")),
        **{key: value(config, f"data.{key}") for key in (
            "augmentation", "crop_size", "short_side_range", "max_image_side", "seg_class_max_ratio", "hflip",
            "photometric", "blur", "rotate_degrees", "rotate_p", "dataset", "aug_masks", "coco_min_pixels")},
        "normalisation": normalisation(config),
        "coco": value(config, "data.coco_root") is not None,
    }


CASES = [pytest.param(recipe, fact, id=f"{recipe.removesuffix('.yaml')}-{fact}")
         for recipe, table in REFERENCES.items() for fact in table]


def test_every_segmentation_paper_recipe_has_a_reference():
    shipped = {p.name for p in (REPO / "configs/segment").glob("*.yaml") if not p.name.startswith("demo_") and is_recipe(p)}
    assert shipped == set(REFERENCES)


@pytest.mark.parametrize("recipe, fact", CASES)
def test_recipe_value_equals_its_reference(recipe, fact):
    expected, source = REFERENCES[recipe][fact]
    assert_fact(recipe, fact, facts(resolve("segment", recipe))[fact], expected, source)
