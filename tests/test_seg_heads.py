"""DeepLabv3 and PSPNet heads: shapes, the auxiliary head, any backbone, and parameter counts
against the MobileViTv2 paper (Table 3, ADE20k models)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from backbones import Backbone
from backbones.convmixer import ConvMixer
from backbones.mobilevitv2 import MobileViTv2
from heads.deeplabv3 import ASPP, ATROUS_RATES, DeepLabV3
from heads.pspnet import PSPNet, PyramidPooling


class TinyBackbone(Backbone):
    """Strided convs giving maps at strides 8, 16 and 32 with 8, 12, 16 channels."""

    def __init__(self):
        super().__init__()
        self.feature_channels = {8: 8, 16: 12, 32: 16}
        self.num_features = 16
        self.stem = nn.Conv2d(3, 8, 8, stride=8)
        self.down16 = nn.Conv2d(8, 12, 2, stride=2)
        self.down32 = nn.Conv2d(12, 16, 2, stride=2)

    def forward(self, x):
        f8 = self.stem(x)
        f16 = self.down16(f8)
        return {8: f8, 16: f16, 32: self.down32(f16)}


HEADS = [
    pytest.param(lambda fc, k, **kw: DeepLabV3(fc, k, channels=16, **kw), id="deeplabv3"),
    pytest.param(lambda fc, k, **kw: DeepLabV3(fc, k, channels=16, separable=True, **kw), id="deeplabv3-separable"),
    pytest.param(lambda fc, k, **kw: PSPNet(fc, k, channels=16, **kw), id="pspnet"),
]


@pytest.mark.parametrize("make_head", HEADS)
def test_shapes_and_aux_only_in_training(make_head):
    backbone = TinyBackbone()
    head = make_head(backbone.feature_channels, 5, aux=True)
    feats = backbone(torch.randn(2, 3, 96, 64))
    head.train()
    out = head(feats)
    assert out["out"].shape == (2, 5, 3, 2)  # deepest map: stride 32
    assert out["aux"].shape == (2, 5, 6, 4)  # stride 16
    head.eval()
    assert set(head(feats)) == {"out"}
    # the aux head takes no part in the inference parameter count
    aux_params = sum(p.numel() for p in head.aux_head.parameters())
    assert head.inference_parameters() == sum(p.numel() for p in head.parameters()) - aux_params > 0


@pytest.mark.parametrize("make_head", HEADS)
def test_every_parameter_gets_a_gradient(make_head):
    backbone = TinyBackbone()
    head = make_head(backbone.feature_channels, 3, aux=True).train()
    out = head(backbone(torch.randn(2, 3, 64, 64)))
    (out["out"].sum() + out["aux"].sum()).backward()
    missing = [n for n, p in head.named_parameters() if p.grad is None]
    assert not missing


def test_in_stride_picks_the_map_and_unknown_strides_are_named():
    backbone = TinyBackbone()
    head = DeepLabV3(backbone.feature_channels, 4, channels=8, in_stride=16).eval()
    assert head(backbone(torch.randn(1, 3, 64, 64)))["out"].shape == (1, 4, 4, 4)
    with pytest.raises(ValueError, match=r"aux_stride=4 .*strides \[8, 16, 32\]"):
        PSPNet(backbone.feature_channels, 4, aux=True, aux_stride=4)
    with pytest.raises(ValueError, match="three atrous rates"):
        DeepLabV3(backbone.feature_channels, 4, atrous_rates=(6, 12))


def test_aspp_branches_and_rates():
    aspp = ASPP(16, 8, atrous_rates=ATROUS_RATES[8])
    # 1x1, three dilated 3x3 at the OS-8 rates, image pooling
    dilations = [b[0].dilation[0] for b in aspp.branches[1:4]]
    assert dilations == [12, 24, 36] and len(aspp.branches) == 5
    # the pooling branch is constant over the map; others see position
    aspp.eval()
    x = torch.randn(1, 16, 9, 7)
    pooled = aspp.branches[4](x)
    assert torch.allclose(pooled, pooled[..., :1, :1].expand_as(pooled))
    assert aspp(x).shape == (1, 8, 9, 7)


def test_pyramid_pooling_branch_width_follows_cvnets_rule():
    psp = PyramidPooling(256, 512, pool_sizes=(1, 2, 3, 6))
    assert [b[1][0].out_channels for b in psp.branches] == [64] * 4
    assert [b[0].output_size for b in psp.branches] == [1, 2, 3, 6]
    assert psp.fuse[0].in_channels == 256 + 4 * 64


@pytest.mark.parametrize("output_stride, rates", [(16, ATROUS_RATES[16]), (8, ATROUS_RATES[8])])
def test_mobilevitv2_output_stride(output_stride, rates):
    backbone = MobileViTv2(width=0.5, output_stride=output_stride).eval()
    head = DeepLabV3(backbone.feature_channels, 11, channels=16, atrous_rates=rates).eval()
    with torch.no_grad():
        out = head(backbone(torch.randn(1, 3, 64, 96)))["out"]
    assert out.shape == (1, 11, 64 // output_stride, 96 // output_stride)


def test_single_scale_backbone_through_its_pyramid():
    backbone = ConvMixer(dim=32, depth=1, kernel_size=3, patch_size=8, pyramid_strides=(8, 16, 32),
                         pyramid_channels=16, pyramid_norm="batchnorm")
    head = PSPNet(backbone.feature_channels, 6, channels=16, in_stride=16, aux=True, aux_stride=32).train()
    out = head(backbone(torch.randn(2, 3, 64, 64)))
    assert out["out"].shape == (2, 6, 4, 4) and out["aux"].shape == (2, 6, 2, 2)


# MobileViTv2 paper, Table 3 (ADE20k, 150 classes): parameters in millions, one decimal;
# CVNets recipes: 512-channel ASPP / PSP, dense 3x3 convs; the aux head is training-only.
PAPER_PARAMS = [
    ("pspnet", 0.5, 3.6),
    ("deeplabv3", 0.75, 9.6),
    ("pspnet", 1.75, 22.5),
    ("deeplabv3", 2.0, 34.0),
]


@pytest.mark.parametrize("head_name, width, millions", PAPER_PARAMS)
def test_parameter_counts_match_paper(head_name, width, millions):
    backbone = MobileViTv2(width=width, output_stride=8)
    make = DeepLabV3 if head_name == "deeplabv3" else PSPNet
    head = make(backbone.feature_channels, 150, channels=512)
    total = sum(p.numel() for p in backbone.parameters()) + sum(p.numel() for p in head.parameters())
    assert round(total / 1e6, 1) == millions


def test_class_weighted_loss_is_the_weighted_mean_over_labelled_pixels():
    from tasks.segment import SegmentationTask

    names = ["background", "a", "b"]
    task = SegmentationTask(MobileViTv2(width=0.5), names, class_weights=[0.25, 1.0, 2.0])
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, 7)
    target = torch.randint(0, 3, (2, 5, 7))
    target[0, 0] = 255  # ignored pixels count neither in the sum nor in the weights
    labelled = target != 255
    log_probs = logits.log_softmax(1).permute(0, 2, 3, 1)[labelled]  # (P, 3)
    labels = target[labelled]
    weights = torch.tensor([0.25, 1.0, 2.0])[labels]
    expected = -(weights * log_probs.gather(1, labels[:, None])[:, 0]).sum() / weights.sum()
    assert torch.allclose(task.pixel_loss(logits, target), expected, atol=1e-6)
    with pytest.raises(ValueError, match="2 entries for 3 classes"):
        SegmentationTask(MobileViTv2(width=0.5), names, class_weights=[1.0, 1.0])
