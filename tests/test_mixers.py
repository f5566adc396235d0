"""ConvMixer and MLP-Mixer: parameter counts of the paper tables, logits equal to timm's
with converted weights, the feature contract and bad input."""
import pytest
import timm
import torch
import torch.nn as nn

from backbones import ConvMixer, MlpMixer, create_backbone
from backbones.convmixer import PRESETS
from backbones.weights import classifier_state, load_pretrained


def classification_params(model: nn.Module, num_classes: int = 1000) -> int:
    return sum(p.numel() for p in model.parameters()) + model.num_features * num_classes + num_classes


def randomized_timm(name: str) -> nn.Module:
    """timm's model with every weight and BatchNorm statistic moved off its init, so that a
    swapped key (two norms initialised alike) changes the logits."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).eval()
    with torch.no_grad():
        for key, t in model.state_dict().items():
            if key.endswith("running_var"):
                t.uniform_(0.5, 2.0)
            elif t.is_floating_point():
                t.add_(torch.randn_like(t) * 0.05)
    return model


@pytest.mark.parametrize("preset, expected", [("1536/20", 51.6), ("768/32", 21.1), ("1024/20", 24.4)])
def test_convmixer_parameter_count_matches_the_paper_table(preset, expected):
    with torch.device("meta"):
        model = ConvMixer(**PRESETS[preset])
    assert round(classification_params(model) / 1e6, 1) == expected


@pytest.mark.parametrize("size, expected", [("small", 18.5), ("base", 59.9)])
def test_mixer_parameter_count_matches_the_paper_table(size, expected):
    with torch.device("meta"):
        model = MlpMixer(size, patch_size=16, img_size=224)
    assert round(classification_params(model) / 1e6, 1) == expected


@pytest.mark.parametrize(
    "timm_name, build",
    [("convmixer_768_32", lambda: ConvMixer(**PRESETS["768/32"])), ("mixer_s16_224", lambda: MlpMixer("small"))],
    ids=["convmixer_768_32", "mixer_s16_224"],
)
def test_logits_equal_timm(timm_name, build, tmp_path):
    reference = randomized_timm(timm_name)
    torch.save(reference.state_dict(), tmp_path / "timm.pth")
    model = build().eval()
    # the checkpoint import every backbone offers: detects timm's naming, converts, loads strictly
    canonical_head = load_pretrained(model, tmp_path / "timm.pth")
    head = nn.Linear(model.num_features, 1000)
    head.load_state_dict(classifier_state(canonical_head, 1000))
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        expected = reference(x)
        # 1e-5 relative to the logits' scale: the randomized ConvMixer's reach ~3e4, where float32's
        # own step is 2e-3, so kernels that sum in another order (ours run channels-last) differ
        # there by ~1e-6 relative; a swapped or misloaded weight moves them by whole units
        assert (head(model.forward_pooled(x)) - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max())


@pytest.mark.parametrize("dim, depth, kernel_size, patch_size", [(32, 2, 3, 4), (24, 1, 5, 7)])
def test_convmixer_any_shape_gives_one_map_at_the_patch_stride(dim, depth, kernel_size, patch_size):
    model = create_backbone("convmixer", dim=dim, depth=depth, kernel_size=kernel_size, patch_size=patch_size).eval()
    assert len(model.blocks) == depth
    # like the reference, a remainder smaller than a patch is dropped by the patch conv
    x = torch.randn(2, 3, 30, 45)
    features = model(x)
    assert model.feature_channels == {patch_size: dim}
    assert features[patch_size].shape == (2, dim, 30 // patch_size, 45 // patch_size)
    assert torch.allclose(model.forward_pooled(x), features[patch_size].mean(dim=(2, 3)))


def test_mixer_map_is_the_normed_tokens_and_pooled_is_their_mean():
    model = create_backbone("mlp_mixer", size="small", patch_size=8, img_size=(32, 48), depth=2).eval()
    assert len(model.blocks) == 2
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        tokens = model.forward_tokens(x)
        fmap = model(x)[8]
        pooled = model.forward_pooled(x)
    assert fmap.shape == (2, 512, 4, 6)
    assert torch.equal(fmap[:, :, 1, 2], tokens[:, 1 * 6 + 2])
    assert torch.allclose(pooled, tokens.mean(dim=1))


def test_bad_input_names_the_expected_shape():
    convmixer = ConvMixer(dim=16, depth=1, kernel_size=3, patch_size=4).eval()
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        convmixer(torch.randn(1, 4, 32, 32))
    with pytest.raises(ValueError, match=r"\(B, 3, 4, 4\)"):
        convmixer(torch.randn(1, 3, 2, 32))
    with pytest.raises(ValueError, match="valid names: gelu"):
        ConvMixer(dim=16, depth=1, act="tanh")
    mixer = MlpMixer("small", patch_size=16, img_size=64, depth=1).eval()
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        mixer(torch.randn(1, 1, 64, 64))
    with pytest.raises(ValueError, match=r"\(B, 3, 64, 64\)"):
        mixer(torch.randn(1, 3, 80, 64))
    with pytest.raises(ValueError, match="small, base"):
        MlpMixer("tiny")
