"""ViT: parameter counts of the paper/timm table, logits equal to timm's with converted
weights, position-embedding resampling, the feature contract and bad input."""
import pytest
import timm
import torch
import torch.nn as nn
from timm.models.vision_transformer import checkpoint_filter_fn

from backbones import ViT, create_backbone
from backbones.vit import resample_pos_embed
from backbones.weights import classifier_state, convert_state_dict


def count(model: nn.Module, exclude: str = "pyramid.") -> int:
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith(exclude))


def perturbed_timm(name: str, **kwargs) -> nn.Module:
    """timm's model with every weight moved off its init, so that a swapped key (two LayerNorms
    initialised to ones) changes the logits."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def ours_from_timm(reference: nn.Module, **kwargs) -> tuple[ViT, nn.Linear]:
    """Our ViT and a Linear classifier holding ``reference``'s weights, converted by the
    converter registered for timm checkpoints."""
    model = ViT(**kwargs).eval()
    canonical = convert_state_dict(reference.state_dict(), model)
    head = nn.Linear(model.num_features, reference.num_classes)
    head.load_state_dict(classifier_state(canonical, reference.num_classes))
    model.load_state_dict({k[len("backbone.") :]: v for k, v in canonical.items() if k.startswith("backbone.")})
    return model, head


@pytest.mark.parametrize("size, expected", [("tiny", 5.72e6), ("small", 22.05e6), ("base", 86.57e6)])
def test_parameter_count_matches_the_paper_table(size, expected):
    with torch.device("meta"):  # counting needs no memory and no init
        model = ViT(size, patch_size=16, img_size=224)
    total = count(model) + model.num_features * 1000 + 1000  # plus the 1000-class head
    assert round(total / 1e6, 2) == pytest.approx(expected / 1e6)


@pytest.mark.parametrize("name, size", [("vit_tiny_patch16_224", "tiny"), ("vit_small_patch16_224", "small")])
def test_logits_and_features_equal_timm(name, size):
    reference = perturbed_timm(name)
    model, head = ours_from_timm(reference, size=size)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        expected = reference(x)
        tokens = reference.forward_features(x)
        logits = head(model.forward_pooled(x))
        features = model(x)
    assert (logits - expected).abs().max() <= 1e-5
    # the dense map is the normed patch tokens, row-major
    assert list(features) == [16]
    expected_map = tokens[:, 1:].transpose(1, 2).reshape(1, model.num_features, 14, 14)
    assert (features[16] - expected_map).abs().max() <= 1e-5


def test_without_class_token_pools_like_timm_avg():
    reference = perturbed_timm("vit_tiny_patch16_224", class_token=False, global_pool="avg", img_size=64, depth=2)
    model, head = ours_from_timm(reference, size="tiny", class_token=False, img_size=64, depth=2)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert (head(model.forward_pooled(x)) - reference(x)).abs().max() <= 1e-5


def test_pretrained_timm_weights_for_another_resolution_are_resampled_like_timm(tmp_path):
    reference_224 = perturbed_timm("vit_tiny_patch16_224", depth=2)
    reference_96 = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=(96, 64), depth=2).eval()
    reference_96.load_state_dict(checkpoint_filter_fn(reference_224.state_dict(), reference_96))
    torch.save(reference_224.state_dict(), tmp_path / "vit_tiny.pth")
    model = ViT("tiny", img_size=(96, 64), depth=2, pretrained=str(tmp_path / "vit_tiny.pth")).eval()
    assert model.pos_embed.shape == (1, 1 + 6 * 4, 192)
    x = torch.randn(1, 3, 96, 64)
    with torch.no_grad():
        expected = reference_96.forward_head(reference_96.forward_features(x), pre_logits=True)
        assert (model.forward_pooled(x) - expected).abs().max() <= 1e-5


def test_our_checkpoint_for_another_resolution_is_resampled(tmp_path):
    source = ViT("tiny", img_size=64, depth=1)
    # a Lightning checkpoint of a task holding the backbone
    state = {f"backbone.{k}": v for k, v in source.state_dict().items()}
    torch.save({"state_dict": state}, tmp_path / "task.ckpt")
    target = ViT("tiny", img_size=32, depth=1, pretrained=str(tmp_path / "task.ckpt"))
    assert torch.equal(target.pos_embed, resample_pos_embed(source.pos_embed, (2, 2), (4, 4)))
    assert torch.equal(target.pos_embed[:, 0], source.pos_embed[:, 0])  # the class token's is kept
    assert torch.equal(target.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)


def test_checkpoint_of_another_width_is_refused_with_the_mismatches(tmp_path):
    torch.save(ViT("small", img_size=32, depth=1).state_dict(), tmp_path / "small.pth")
    with pytest.raises(ValueError, match="shape mismatches: .*pos_embed"):
        ViT("tiny", img_size=32, depth=1, pretrained=str(tmp_path / "small.pth"))


def test_dynamic_img_size_resamples_per_input_like_timm():
    reference = perturbed_timm("vit_tiny_patch16_224", dynamic_img_size=True, img_size=64, depth=2)
    model, head = ours_from_timm(reference, size="tiny", img_size=64, dynamic_img_size=True, depth=2)
    x = torch.randn(1, 3, 48, 80)
    with torch.no_grad():
        assert (head(model.forward_pooled(x)) - reference(x)).abs().max() <= 1e-5
        assert model(x)[16].shape == (1, 192, 3, 5)


@pytest.mark.parametrize("patch_size, img_size", [(8, (40, 24)), (14, 56), (32, 64)])
def test_any_patch_and_image_size_gives_one_map_at_the_patch_stride(patch_size, img_size):
    model = create_backbone("vit", size="tiny", patch_size=patch_size, img_size=img_size, depth=2).eval()
    assert len(model.blocks) == 2
    height, width = (img_size, img_size) if isinstance(img_size, int) else img_size
    features = model(torch.randn(2, 3, height, width))
    assert model.feature_channels == {patch_size: 192}
    assert features[patch_size].shape == (2, 192, height // patch_size, width // patch_size)
    assert model.forward_pooled(torch.randn(2, 3, height, width)).shape == (2, 192)


@pytest.mark.parametrize("attention, kwargs", [("separable", {}), ("linformer", {"max_len": 17, "proj_len": 8})])
def test_blocks_take_any_attention_of_the_zoo(attention, kwargs):
    model = ViT("tiny", img_size=64, depth=2, attention=attention, attention_kwargs=kwargs, drop_path_rate=0.1).train()
    assert type(model.blocks[0].attn).__name__ != "MultiHeadAttention"
    x = torch.randn(2, 3, 64, 64)
    model.forward_pooled(x).square().sum().backward()  # a plain sum of a LayerNorm output has no gradient
    assert model.patch_embed.proj.weight.grad.abs().sum() > 0


def test_unknown_size_or_attention_lists_the_valid_names():
    with pytest.raises(ValueError, match="tiny, small, base"):
        ViT("huge")
    with pytest.raises(KeyError, match="valid names: .*mha"):
        ViT("tiny", img_size=32, attention="nope")


def test_bad_input_names_the_expected_shape():
    model = ViT("tiny", img_size=64, depth=1).eval()
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        model(torch.randn(1, 1, 64, 64))
    with pytest.raises(ValueError, match=r"\(B, 3, 64, 64\)"):
        model(torch.randn(1, 3, 96, 64))
    with pytest.raises(ValueError, match=r"\(B, 3, 64, 64\)"):
        model.forward_pooled(torch.randn(1, 3, 64, 72))
    dynamic = ViT("tiny", img_size=64, depth=1, dynamic_img_size=True).eval()
    with pytest.raises(ValueError, match="multiples of patch_size=16"):
        dynamic(torch.randn(1, 3, 64, 72))
