"""MobileViT v1/v2: paper parameter counts, feature contract, dilation, and logits equal to timm's."""
from decimal import ROUND_HALF_UP, Decimal

import pytest
import torch
import torch.nn as nn

from backbones import create_backbone
from backbones.mobilevit import MobileViT
from backbones.mobilevitv2 import MobileViTv2
from backbones.weights import check_fit, convert_state_dict

timm = pytest.importorskip("timm")

# MobileViTv2 paper, Table 6 (millions, 1000-class linear classifier included)
V2_PARAMS = {0.5: 1.4, 0.75: 2.9, 1.0: 4.9, 1.25: 7.5, 1.5: 10.6, 1.75: 14.3, 2.0: 18.5}
# MobileViT paper (xxs, xs, s)
V1_PARAMS = {"xxs": 1.27, "xs": 2.32, "s": 5.58}


def count_with_classifier(backbone, num_classes=1000):
    return sum(p.numel() for p in backbone.parameters()) + backbone.num_features * num_classes + num_classes


def paper_millions(count: int) -> float:
    """Table 6 reports the count rounded to 0.01M, then to 0.1M half up (18,449,329 -> 18.45 -> 18.5)."""
    hundredths = Decimal(count / 1e6).quantize(Decimal("0.01"), ROUND_HALF_UP)
    return float(hundredths.quantize(Decimal("0.1"), ROUND_HALF_UP))


@pytest.mark.parametrize("width", sorted(V2_PARAMS))
def test_v2_parameter_count_matches_paper_table6(width):
    model = MobileViTv2(width=width)
    assert paper_millions(count_with_classifier(model)) == V2_PARAMS[width]


@pytest.mark.parametrize("size", sorted(V1_PARAMS))
def test_v1_parameter_count_matches_paper(size):
    assert round(count_with_classifier(MobileViT(size)) / 1e6, 2) == V1_PARAMS[size]


@pytest.mark.parametrize(
    "name,kwargs,channels",
    [
        ("mobilevitv2", {"width": 0.5}, {2: 32, 4: 64, 8: 128, 16: 192, 32: 256}),
        ("mobilevitv2", {"width": 0.75}, {2: 48, 4: 96, 8: 192, 16: 288, 32: 384}),
        ("mobilevit", {"size": "xxs"}, {2: 16, 4: 24, 8: 48, 16: 64, 32: 80}),
    ],
)
def test_feature_dict_strides_and_channels(name, kwargs, channels):
    model = create_backbone(name, **kwargs).eval()
    assert model.feature_channels == channels
    with torch.no_grad():
        feats = model(torch.randn(1, 3, 64, 128))
    assert sorted(feats) == sorted(channels)
    for stride, fmap in feats.items():
        assert fmap.shape == (1, channels[stride], 64 // stride, 128 // stride)
    assert model.forward_pooled(torch.randn(2, 3, 32, 32)).shape == (2, model.num_features)


@pytest.mark.parametrize("cls,kwargs", [(MobileViTv2, {"width": 0.5}), (MobileViT, {"size": "xxs"})])
@pytest.mark.parametrize("output_stride", [8, 16])
def test_output_stride_dilates_instead_of_downsampling(cls, kwargs, output_stride):
    model = cls(output_stride=output_stride, **kwargs).eval()
    full = cls(**kwargs)
    assert max(model.feature_channels) == output_stride
    assert model.feature_channels[output_stride] == full.feature_channels[32]  # deepest map kept
    assert count_with_classifier(model) == count_with_classifier(full)  # same weights, only dilation differs
    model.load_state_dict(full.state_dict())
    with torch.no_grad():
        feats = model(torch.randn(1, 3, 64, 64))
    assert sorted(feats) == sorted(model.feature_channels)
    assert feats[output_stride].shape[-2:] == (64 // output_stride, 64 // output_stride)


def randomize_norms(model: nn.Module) -> None:
    """Random BN statistics and norm affines, so that no normalisation is an identity."""
    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
        if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)):
            m.weight.data.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
            m.bias.data.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))


def ours_from_timm(timm_name, cls, **kwargs):
    """timm's model (random weights, randomised norms) and ours with its converted weights;
    ``output_stride`` goes to both."""
    torch.manual_seed(0)
    timm_kwargs = {"output_stride": kwargs["output_stride"]} if "output_stride" in kwargs else {}
    reference = timm.create_model(timm_name, pretrained=False, **timm_kwargs).eval()
    with torch.no_grad():
        randomize_norms(reference)
    ours = cls(**kwargs).eval()
    canonical = convert_state_dict(reference.state_dict(), ours)
    weights = {k.removeprefix("backbone."): v for k, v in canonical.items() if k.startswith("backbone.")}
    check_fit(weights, ours, timm_name)
    ours.load_state_dict(weights)
    head = nn.Linear(ours.num_features, canonical["head.fc.weight"].shape[0])
    head.load_state_dict({"weight": canonical["head.fc.weight"], "bias": canonical["head.fc.bias"]})
    return reference, ours, head


@pytest.mark.parametrize(
    "timm_name,cls,kwargs",
    [
        ("mobilevitv2_050", MobileViTv2, {"width": 0.5}),
        ("mobilevitv2_100", MobileViTv2, {"width": 1.0}),
        ("mobilevitv2_200", MobileViTv2, {"width": 2.0}),
        ("mobilevit_xxs", MobileViT, {"size": "xxs"}),
        ("mobilevit_xs", MobileViT, {"size": "xs"}),
        ("mobilevit_s", MobileViT, {"size": "s"}),
    ],
)
def test_logits_equal_timm_with_converted_weights(timm_name, cls, kwargs):
    reference, ours, head = ours_from_timm(timm_name, cls, **kwargs)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = reference(x)
        pooled = ours.forward_pooled(x)
        logits = head(pooled)
        expected_pooled = reference.forward_head(reference.forward_features(x), pre_logits=True)
    assert (logits - expected).abs().max().item() <= 1e-5
    torch.testing.assert_close(pooled, expected_pooled, rtol=1e-4, atol=1e-5)  # the embedding too, scale-free


@pytest.mark.parametrize("output_stride", [8, 16])
def test_stage_maps_equal_timm_forward_intermediates(output_stride):
    """Stage i (CVNets' layer_i) is timm's feature index i - 1, at the same dilated stride."""
    reference, ours, _ = ours_from_timm("mobilevitv2_100", MobileViTv2, width=1.0, output_stride=output_stride)
    expected_strides = {8: [2, 4, 8, 8, 8], 16: [2, 4, 8, 16, 16]}[output_stride]
    assert [s.stride for s in ours.stage_info] == expected_strides
    assert [s.stride for s in ours.stage_info] == [info["reduction"] for info in reference.feature_info]
    assert [s.channels for s in ours.stage_info] == [info["num_chs"] for info in reference.feature_info]
    assert [s.index for s in ours.stage_info] == [1, 2, 3, 4, 5]
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        _, expected = reference.forward_intermediates(x, indices=[0, 1, 2, 3, 4])
        features, stage_maps = ours.forward_stages(x, [1, 2, 3, 4, 5])
        plain = ours(x)
    for index, reference_map in enumerate(expected, start=1):
        torch.testing.assert_close(stage_maps[index], reference_map, rtol=1e-4, atol=1e-5, msg=f"stage {index}")
    # the stride dict is forward's, unchanged: the deepest stage at each stride
    assert sorted(features) == sorted(plain) == sorted(set(expected_strides))
    for stride in plain:
        torch.testing.assert_close(features[stride], plain[stride], rtol=0, atol=0)
    assert features[output_stride] is not stage_maps[4] and torch.equal(features[output_stride], stage_maps[5])


@pytest.mark.parametrize("cls,kwargs", [(MobileViTv2, {"width": 0.5}), (MobileViT, {"size": "xxs"})])
def test_forward_stages_returns_only_the_chosen_stages_from_one_pass(cls, kwargs):
    model = cls(output_stride=8, **kwargs).eval()
    calls = []
    model.stem.register_forward_hook(lambda *_: calls.append(1))
    stage4 = []
    model.stages[3].register_forward_hook(lambda module, inputs, output: stage4.append(output))
    with torch.no_grad():
        features, stage_maps = model.forward_stages(torch.randn(1, 3, 64, 64), [4])
    assert len(calls) == 1 and list(stage_maps) == [4] and stage_maps[4] is stage4[0]
    assert stage_maps[4].shape == (1, model.stage_channels[4], 8, 8) and sorted(features) == [2, 4, 8]
    with pytest.raises(ValueError, match=rf"{cls.__name__} has no stage 6; its stages are 1 \(stride 2"):
        model.forward_stages(torch.randn(1, 3, 64, 64), [6])


@pytest.mark.parametrize("timm_name,cls,kwargs", [("mobilevitv2_050", MobileViTv2, {"width": 0.5}),
                                                  ("mobilevit_xxs", MobileViT, {"size": "xxs"})])
def test_sizes_not_multiple_of_the_patch_are_resized_like_the_reference(timm_name, cls, kwargs):
    reference, ours, head = ours_from_timm(timm_name, cls, **kwargs)
    x = torch.randn(1, 3, 40, 54)  # stage maps of odd size: the blocks resize
    with torch.no_grad():
        assert (head(ours.forward_pooled(x)) - reference(x)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("output_stride,multiple", [(32, 64), (16, 32), (8, 16)])
def test_size_multiple_is_where_no_block_resizes(output_stride, multiple):
    """Any multiple of ``size_multiple`` passes every block without its resize branch; half a multiple
    more does not (the stage maps no longer split into whole 2x2 patches)."""
    model = MobileViTv2(width=0.5, output_stride=output_stride).eval()
    assert model.size_multiple == multiple
    resized = []
    for block in (b for stage in model.stages for b in stage if hasattr(b, "patch_size")):
        block.register_forward_hook(lambda m, args, out: resized.append(args[0].shape[-1] % m.patch_size[1] != 0))
    with torch.no_grad():
        model(torch.randn(1, 3, 2 * multiple, multiple))
        assert not any(resized)
        model(torch.randn(1, 3, 2 * multiple, multiple + multiple // 2))
    assert any(resized)


@pytest.mark.parametrize("attention,kwargs", [("mha", {"num_heads": 2}),
                                              ("linformer", {"attention_kwargs": {"max_len": 64, "proj_len": 8}})])
def test_v2_takes_any_attention_of_the_zoo(attention, kwargs):
    model = MobileViTv2(width=0.5, attention=attention, **kwargs)
    x = torch.randn(2, 3, 32, 32)
    model(x)[32].mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_training_mode_with_stochastic_depth_backpropagates():
    model = MobileViTv2(width=0.5, drop_path_rate=0.1, dropout=0.1).train()
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    model.forward_pooled(x).square().sum().backward()
    assert x.grad.abs().sum() > 0


def test_bad_input_names_the_expected_shape():
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        MobileViTv2(width=0.5)(torch.randn(1, 1, 64, 64))
    with pytest.raises(KeyError, match="valid sizes: xxs, xs, s"):
        MobileViT("xl")
    with pytest.raises(ValueError, match="output_stride"):
        MobileViTv2(output_stride=4)
    with pytest.raises(KeyError, match="valid names"):
        MobileViTv2(width=0.5, attention="nope")
