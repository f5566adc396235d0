"""The ViTDet-style simple feature pyramid, alone and attached to the single-scale backbones."""
import pytest
import torch

from backbones import ConvMixer, MlpMixer, SimpleFeaturePyramid, ViT
from heads.deeplabv3 import DeepLabV3
from heads.pspnet import PSPNet
from heads.ssdlite import SSDLiteHead


def small_backbones(**pyramid):
    """One of each single-scale family, tiny enough for a CPU test, all at patch stride 16."""
    return [
        ViT("tiny", img_size=64, depth=2, **pyramid),
        ConvMixer(dim=32, depth=2, kernel_size=3, patch_size=16, **pyramid),
        MlpMixer("small", img_size=64, depth=2, **pyramid),
    ]


@pytest.mark.parametrize("norm", ["layernorm", "batchnorm"])
def test_levels_from_a_quarter_to_four_times_the_input_stride(norm):
    pyramid = SimpleFeaturePyramid(48, in_stride=16, strides=[4, 8, 16, 32, 64], out_channels=24, norm=norm).eval()
    fmap = torch.randn(2, 48, 7, 5)  # odd sizes: going down rounds up, like a padded stride-2 conv
    features = pyramid(fmap)
    assert pyramid.feature_channels == {4: 24, 8: 24, 16: 24, 32: 24, 64: 24}
    assert {s: tuple(t.shape) for s, t in features.items()} == {
        4: (2, 24, 28, 20),
        8: (2, 24, 14, 10),
        16: (2, 24, 7, 5),
        32: (2, 24, 4, 3),
        64: (2, 24, 2, 2),
    }
    # x4 up uses two transposed convs, x2 one, identity none
    def deconvs(stride: int) -> int:
        return sum(isinstance(m, torch.nn.ConvTranspose2d) for m in pyramid.levels[str(stride)].modules())

    assert [deconvs(4), deconvs(8), deconvs(16)] == [2, 1, 0]


def test_unreachable_stride_or_unknown_norm_is_refused_with_the_options():
    with pytest.raises(ValueError, match=r"7 times a power of two, e\.g\. \[7, 14, 28, 56"):
        SimpleFeaturePyramid(32, in_stride=7, strides=[8, 16])
    with pytest.raises(ValueError, match="layernorm, batchnorm"):
        SimpleFeaturePyramid(32, in_stride=16, norm="instancenorm")
    with pytest.raises(ValueError, match="distinct"):
        SimpleFeaturePyramid(32, in_stride=16, strides=[16, 16])


@pytest.mark.parametrize("index", [0, 1, 2], ids=["vit", "convmixer", "mlp_mixer"])
def test_backbone_with_pyramid_reports_its_strides_and_keeps_the_classification_path(index):
    torch.manual_seed(0)
    plain = small_backbones()[index].eval()
    torch.manual_seed(0)
    with_pyramid = small_backbones(pyramid_strides=[8, 16, 32, 64], pyramid_channels=40)[index].eval()
    # the pyramid's parameters are extra; the trunk is the same module for module
    trunk = {k: v for k, v in with_pyramid.state_dict().items() if not k.startswith("pyramid.")}
    assert trunk.keys() == plain.state_dict().keys()
    with_pyramid.load_state_dict(plain.state_dict(), strict=False)

    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        features = with_pyramid(x)
        assert torch.equal(with_pyramid.forward_pooled(x), plain.forward_pooled(x))
    assert with_pyramid.feature_channels == {8: 40, 16: 40, 32: 40, 64: 40}
    assert {s: tuple(t.shape) for s, t in features.items()} == {
        8: (2, 40, 8, 8),
        16: (2, 40, 4, 4),
        32: (2, 40, 2, 2),
        64: (2, 40, 1, 1),
    }


def test_gradients_reach_the_trunk_through_every_level():
    model = ViT("tiny", img_size=32, depth=2, pyramid_strides=[8, 32], pyramid_channels=16).train()
    for stride, fmap in model(torch.randn(2, 3, 32, 32)).items():
        model.zero_grad()
        fmap.square().sum().backward(retain_graph=True)
        assert model.patch_embed.proj.weight.grad.abs().sum() > 0, stride


@pytest.mark.parametrize("head_cls", [DeepLabV3, PSPNet])
def test_segmentation_heads_accept_single_scale_backbones(head_cls):
    for backbone in small_backbones(pyramid_strides=[8, 16, 32], pyramid_channels=32):
        backbone.eval()
        head = head_cls(backbone.feature_channels, num_classes=5, channels=16, in_stride=8, aux=True, aux_stride=16)
        with torch.no_grad():
            out = head.train()(backbone(torch.randn(2, 3, 64, 64)))
        assert out["out"].shape == (2, 5, 8, 8), type(backbone).__name__
        assert out["aux"].shape == (2, 5, 4, 4), type(backbone).__name__


@pytest.mark.parametrize("index", [0, 1, 2], ids=["vit", "convmixer", "mlp_mixer"])
def test_single_scale_backbones_have_no_stages_and_say_so_by_name(index):
    backbone = small_backbones(pyramid_strides=[8, 16], pyramid_channels=16)[index].eval()
    name = type(backbone).__name__
    assert backbone.stage_info == () and backbone.stage_channels == {}
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        features, stage_maps = backbone.forward_stages(x)  # no stage asked: forward's dict
        assert stage_maps == {} and all(torch.equal(features[s], backbone(x)[s]) for s in (8, 16))
    with pytest.raises(ValueError, match=rf"{name} has no numbered stages .*\[8, 16\].*aux_stride instead of aux_stage"):
        backbone.forward_stages(x, [4])
    # a head asked for a stage of such a backbone says what to write instead
    with pytest.raises(ValueError, match=r"aux_stage=4 .*no numbered stages .*aux_stride: <one of \[8, 16\]>"):
        PSPNet(backbone.feature_channels, 5, aux=True, aux_stage=4, stage_channels=backbone.stage_channels)


def test_ssdlite_head_accepts_single_scale_backbones():
    for backbone in small_backbones(pyramid_strides=[16, 32], pyramid_channels=32):
        backbone.eval()
        head = SSDLiteHead(backbone.feature_channels, num_classes=3).eval()
        with torch.no_grad():
            cls_logits, box_regression, anchors = head(backbone(torch.randn(1, 3, 64, 64)))
        assert cls_logits.shape == (1, anchors.shape[0], 4), type(backbone).__name__
        assert box_regression.shape == (1, anchors.shape[0], 4)
