"""Layer-wise learning-rate decay (``--model.layer_decay``): each parameter's lr scale and weight decay equal
timm's ``param_groups_layer_decay`` on the same architecture (through the timm -> ours name mappings of the
checkpoint converters); the heads, the pyramid and the translation decoder by hand; the schedules scale with the
groups; one training step through the CLI."""
import math

import pytest
import torch
import torch.nn as nn

from backbones import ConvMixer, MlpMixer, ViT
from backbones.mobilevit import MobileViT
from backbones.mobilevitv2 import MobileViTv2
from backbones.weights import backbone_name, converters_for
from heads.classifier import ClassifierHead
from tasks.engine.optim import InverseSqrtLR, WarmupCosineLR, apply_lr_scale, layer_ids, param_groups

timm = pytest.importorskip("timm")
from timm.optim import param_groups_layer_decay  # noqa: E402

WEIGHT_DECAY = 0.05


def classifier(backbone: nn.Module, num_classes: int = 1000) -> nn.Module:
    """The classification task's networks: ``backbone`` and ``head`` (``head.fc``), in that order."""
    model = nn.Module()
    model.backbone = backbone
    model.head = ClassifierHead(backbone.num_features, num_classes)
    return model


def scales_and_decays(groups: list[dict], model: nn.Module) -> dict[str, tuple[float, float]]:
    """parameter name -> (lr scale, weight decay) of the group holding it."""
    by_id = {id(p): (group.get("lr_scale", 1.0), group.get("weight_decay", WEIGHT_DECAY))
             for group in groups for p in group["params"]}
    return {name: by_id[id(p)] for name, p in model.named_parameters()}


def timm_convmixer_768_4() -> nn.Module:
    """timm's ConvMixer-768/32 with 4 blocks (its factory fixes the depth)."""
    from timm.models.convmixer import ConvMixer as TimmConvMixer

    return TimmConvMixer(dim=768, depth=4, kernel_size=7, patch_size=7, act_layer=nn.ReLU)


@pytest.mark.parametrize("reference, build", [
    (lambda: timm.create_model("vit_tiny_patch16_224"), lambda: ViT("tiny")),
    (lambda: timm.create_model("mobilevitv2_050"), lambda: MobileViTv2(width=0.5)),
    (lambda: timm.create_model("mobilevit_xxs"), lambda: MobileViT("xxs")),  # v1: final_conv joins the last block
    (timm_convmixer_768_4, lambda: ConvMixer(dim=768, depth=4, kernel_size=7, patch_size=7, act="relu")),
    (lambda: timm.models.mlp_mixer.MlpMixer(patch_size=16, num_blocks=4, embed_dim=512),  # mixer_s16_224, 4 blocks
     lambda: MlpMixer("small", depth=4)),
], ids=["vit_tiny", "mobilevitv2_050", "mobilevit_xxs", "convmixer_768_4", "mixer_s16_4"])
@pytest.mark.parametrize("decay", [0.65, 0.75])
def test_lr_scales_and_weight_decays_equal_timm(reference, build, decay):
    torch.manual_seed(0)
    reference = reference()
    ours = classifier(build())
    # timm's rule exempts 1-d parameters; ours also norms' and biases' (all 1-d here): the same sets.
    # No name list: like param_groups, class token and position embeddings stay decayed.
    expected = scales_and_decays(param_groups_layer_decay(reference, WEIGHT_DECAY, (), layer_decay=decay), reference)
    got = scales_and_decays(param_groups(ours, True, layer_decay=decay), ours)
    _, convert = converters_for(backbone_name(ours.backbone))["timm"]
    mapped = {name: next(iter(convert({name: None}, ours.backbone))) for name in expected}
    assert sorted(mapped.values()) == sorted(got), "every parameter of timm's model has one of ours, and back"
    for name, (scale, weight_decay) in expected.items():
        assert got[mapped[name]][0] == pytest.approx(scale, rel=1e-12), (name, mapped[name])
        assert got[mapped[name]][1] == weight_decay, (name, mapped[name])
    assert len({scale for scale, _ in got.values()}) > 3  # the test compares layers, not one scale


def test_each_group_holds_one_layer_and_one_decay_and_the_head_trains_at_the_full_rate():
    model = classifier(ViT("tiny", depth=3), 10)
    groups = param_groups(model, True, layer_decay=0.5)
    ids, top = layer_ids(model)
    assert top == 4  # stem 0, blocks 1..3 (the final norm with block 3), head 4
    assert ids[id(model.head.fc.weight)] == top and ids[id(model.backbone.pos_embed)] == 0
    assert ids[id(model.backbone.norm.weight)] == 3
    for group in groups:
        assert {ids[id(p)] for p in group["params"]} == {group["layer_id"]}
        assert group["lr_scale"] == 0.5 ** (top - group["layer_id"])
        decayed = {p.ndim > 1 for p in group["params"]}
        assert decayed == {group.get("weight_decay") is None}  # norms, biases: weight_decay 0
    assert sum(len(g["params"]) for g in groups) == sum(1 for _ in model.parameters())
    # no decay of norms and biases switched off: one group per layer, all decayed
    groups = param_groups(model, False, layer_decay=0.5)
    assert len(groups) == top + 1 and all("weight_decay" not in g for g in groups)


def test_pyramid_and_dense_heads_sit_at_the_top():
    from heads.ssdlite import SSDLiteHead

    backbone = ViT("tiny", depth=2, img_size=64, pyramid_strides=(16, 32))
    model = nn.Module()
    model.backbone = backbone
    model.head = SSDLiteHead(dict(backbone.feature_channels), 3)
    ids, top = layer_ids(model)
    assert top == 3
    assert {ids[id(p)] for p in backbone.pyramid.parameters()} == {top}
    assert {ids[id(p)] for p in model.head.parameters()} == {top}
    assert {ids[id(p)] for n, p in backbone.named_parameters() if n.startswith("blocks.1.")} == {2}


def test_translation_encoder_layers_then_decoder_layers_then_the_tied_table():
    from tasks.translate import TranslationTask

    for share in (True, False):
        task = TranslationTask(vocab_size=50, dim=16, encoder_depth=2, decoder_depth=3, num_heads=2, ffn_dim=32,
                               pre_norm=True, share_embeddings=share)
        ids, top = layer_ids(task)
        assert top == 1 + 2 + 3  # encoder embeddings 0, encoder layers 1-2 (its final norm with 2), decoder 3-5
        assert ids[id(task.encoder.embed.tokens.weight)] == 0
        assert ids[id(task.encoder.norm.weight)] == 2
        for i, layer in enumerate(task.decoder.layers):
            assert {ids[id(p)] for p in layer.parameters()} == {3 + i}
        assert ids[id(task.decoder.norm.weight)] == top
        # the decoder's own table is also its output layer: at the top; shared, it keeps the encoder's layer 0
        assert ids[id(task.decoder.embed.tokens.weight)] == (0 if share else top)


@pytest.mark.parametrize("schedule", [
    lambda opt: WarmupCosineLR(opt, warmup_steps=3, total_steps=10, warmup_init_lr=1e-4, min_lr=2e-4),
    lambda opt: InverseSqrtLR(opt, warmup_steps=3, warmup_init_lr=1e-5),
], ids=["warmup_cosine", "inverse_sqrt"])
def test_schedules_give_each_group_the_one_schedule_times_its_scale(schedule):
    """timm's schedulers set ``lr = value * lr_scale`` for every group: warm-up start and floor scaled too."""
    params = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    scales = [0.25, 0.5, 1.0]
    optimizer = torch.optim.SGD([{"params": [p], "lr_scale": s} for p, s in zip(params, scales)], lr=0.01)
    apply_lr_scale(optimizer)
    reference = schedule(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.01))
    scheduler = schedule(optimizer)
    for _ in range(12):
        lrs = [g["lr"] for g in optimizer.param_groups]
        assert lrs == pytest.approx([s * reference.get_last_lr()[0] for s in scales], rel=1e-12)
        optimizer.step()
        scheduler.step()
        reference.optimizer.step()
        reference.step()


def test_without_layer_decay_the_groups_are_unchanged():
    model = classifier(MobileViTv2(width=0.5), 10)
    groups = param_groups(model)
    assert len(groups) == 2 and "lr_scale" not in groups[0] and groups[1]["weight_decay"] == 0.0


@pytest.mark.slow  # about 30 s: a CLI start and a fit
def test_one_training_step_through_the_cli_scales_the_group_rates(run_cli, tmp_path):
    decay = 0.75
    run_cli("classify", "fit", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
            "--trainer.num_sanity_val_steps", "0", "--trainer.logger", "false", "--data.batch_size", "8",
            "--data.num_workers", "0", "--data.image_size", "32", "--data.eval_resize", "32",
            "--model.scheduler.init_args.warmup_steps", "2", "--model.layer_decay", str(decay))
    checkpoint = torch.load(next((tmp_path / "runs/classify").rglob("last.ckpt")), weights_only=False)
    assert checkpoint["hyper_parameters"]["layer_decay"] == decay
    groups = checkpoint["optimizer_states"][0]["param_groups"]
    top = max(g["layer_id"] for g in groups)
    assert top == 1 + (1 + 2 + 2 + 2 + 2)  # MobileViTv2: stem 0, the blocks of stages 1..5 (1, 2, 2, 2, 2), head
    assert {g["layer_id"] for g in groups} == set(range(top + 1))
    for group in groups:
        assert group["lr_scale"] == decay ** (top - group["layer_id"])
        assert group["initial_lr"] == pytest.approx(0.004 * group["lr_scale"], rel=1e-12)  # the recipe's lr
    # after one step the warm-up is halfway, for every group the same schedule times its scale
    unscaled = {g["lr"] / g["lr_scale"] for g in groups}
    assert max(unscaled) == pytest.approx(min(unscaled), rel=1e-9)
    assert math.isclose(min(unscaled), 1e-5 + (0.004 - 1e-5) / 2, rel_tol=1e-9)
