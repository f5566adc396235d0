"""MobileViT v1/v2 in Core ML's rank <= 5: the unfold/fold written with rank-5 ops equal the rank-6
permute that defines MobileViT's patch sequences, the v2 blocks' unfolded layout (the one Core ML
conversion uses) equals their grid path forward and backward, and coremltools converts both versions
(``tasks.export.coreml.convert``; running the package needs macOS, so only the conversion is checked)."""
import pytest
import torch
import torch.nn as nn

from backbones import create_backbone
from backbones.mobilevit import MobileViTBlock
from backbones.mobilevit_common import coreml_layout, fold_patches, unfold_patches
from backbones.mobilevitv2 import MobileViTv2Block


def reference_unfold(x, patch):
    """(B, H, W, D) -> (B, P, N, D) by the one rank-6 permute (CVNets' ``unfolding``, channels-last):
    sequence p holds the pixel at position p inside every patch, patches in raster order."""
    b, h, w, d = x.shape
    (ph, pw), nh, nw = patch, h // patch[0], w // patch[1]
    return x.reshape(b, nh, ph, nw, pw, d).permute(0, 2, 4, 1, 3, 5).reshape(b, ph * pw, nh * nw, d)


def max_rank(exported):
    values = (node.meta.get("val") for node in exported.graph.nodes)
    return max(value.dim() for value in values if isinstance(value, torch.Tensor))


@pytest.mark.parametrize("shape,patch", [((2, 8, 12, 5), (2, 2)), ((1, 16, 16, 3), (4, 4)), ((3, 6, 8, 4), (3, 2))])
def test_unfold_and_fold_equal_the_rank6_permute(shape, patch):
    x = torch.randn(shape)
    unfolded = unfold_patches(x, patch)
    assert torch.equal(unfolded, reference_unfold(x, patch))
    assert torch.equal(fold_patches(unfolded, patch, shape[1:3]), x)
    # sequence 1 of the first image: the pixels at row 0, column 1 of every patch
    assert torch.equal(unfolded[0, 1], x[0, :: patch[0], 1 :: patch[1]].reshape(-1, shape[-1]))


@pytest.mark.parametrize("patch_size,size", [(2, (16, 16)), (4, (16, 24)), (2, (15, 21)), (4, (10, 13))])
def test_v1_block_equals_its_rank6_definition(patch_size, size):
    torch.manual_seed(0)
    block = MobileViTBlock(24, 32, depth=2, patch_size=patch_size).eval()
    x = torch.randn(2, 24, *size)
    with torch.no_grad():
        got = block(x)
        # the block spelled with the rank-6 permute of the reference, on the same layers
        y = block.to_tokens(block.local_conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        new_h, new_w = (-(-s // patch_size) * patch_size for s in size)
        y = nn.functional.interpolate(y, size=(new_h, new_w), mode="bilinear") if (new_h, new_w) != size else y
        tokens = reference_unfold(y.permute(0, 2, 3, 1), (patch_size, patch_size)).flatten(0, 1)
        tokens = block.norm(block.transformer(tokens)).unflatten(0, (2, -1))
        nh, nw, d = new_h // patch_size, new_w // patch_size, tokens.shape[-1]
        y = tokens.reshape(2, patch_size, patch_size, nh, nw, d).permute(0, 5, 3, 1, 4, 2).reshape(2, d, new_h, new_w)
        y = nn.functional.interpolate(y, size=size, mode="bilinear") if (new_h, new_w) != size else y
        expected = block.fusion(torch.cat([x, block.proj(y)], dim=1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("patch_size,size", [(2, (16, 16)), (4, (16, 24)), (2, (15, 21)), (4, (10, 13))])
def test_v2_unfolded_layout_equals_the_grid_path_forward_and_backward(patch_size, size):
    torch.manual_seed(0)
    block = MobileViTv2Block(24, 32, depth=2, patch_size=patch_size)
    x = torch.randn(2, 24, *size, requires_grad=True)
    grid_out = block(x)
    (grid_grad,) = torch.autograd.grad(grid_out.square().sum(), x)
    with coreml_layout(block):
        out = block(x)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, grid_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, grid_grad, rtol=1e-4, atol=1e-4)


def test_coreml_layout_switches_every_v2_block_and_restores_the_grid_path():
    torch.manual_seed(0)
    model = create_backbone("mobilevitv2", width=0.5).eval()
    blocks = [m for m in model.modules() if isinstance(m, MobileViTv2Block)]
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        grid = model(x)
        with coreml_layout(model):
            assert len(blocks) == 3 and all(block.coreml_layout for block in blocks)
            unfolded = model(x)
    assert not any(block.coreml_layout for block in blocks)
    for stride in grid:
        torch.testing.assert_close(unfolded[stride], grid[stride], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError), coreml_layout(model):
        raise RuntimeError("an export that fails")
    assert not any(block.coreml_layout for block in blocks)


def test_exported_blocks_hold_no_tensor_above_rank5_in_the_coreml_layout():
    torch.manual_seed(0)
    x = torch.randn(1, 16, 8, 8)
    v1, v2 = MobileViTBlock(16, 16, depth=1).eval(), MobileViTv2Block(16, 16, depth=1).eval()
    assert max_rank(torch.export.export(v2, (x,))) == 6  # the grid path: what Core ML refuses
    # v1 keeps its rank-6 view, one compiled graph per width under regional compile: coremltools'
    # expand_high_rank_reshape_and_transpose pass rewrites that reshape/transpose pattern (v1 converts, slow test)
    assert max_rank(torch.export.export(v1, (x,))) == 6
    with coreml_layout(v2):
        assert max_rank(torch.export.export(v2, (x,))) <= 5


class RankSix(nn.Module):
    def forward(self, x):
        return x.reshape(1, 2, 2, 2, 2, 4).exp().sum(dim=(1, 3))


def test_convert_checks_its_path_and_metadata_first(tmp_path):
    from tasks.export.coreml import convert

    with pytest.raises(ValueError, match="model.pt'"):
        convert(RankSix(), (torch.randn(16, 4),), tmp_path / "model.pt", {})
    with pytest.raises(ValueError, match="str to str"):
        convert(RankSix(), (torch.randn(16, 4),), tmp_path / "six.mlpackage", {"suite.classes": 10})


@pytest.mark.slow  # importing coremltools and converting: ~20 s here
def test_convert_refuses_a_rank6_graph_naming_the_op(tmp_path):
    pytest.importorskip("coremltools")
    from tasks.export.coreml import convert

    with pytest.raises(ValueError, match=r"at aten\.\w+\.default in the top module: Core ML only supports .*rank <= 5"):
        convert(RankSix(), (torch.randn(16, 4),), tmp_path / "six.mlpackage", {})
    assert not (tmp_path / "six.mlpackage").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name,kwargs", [("mobilevit", {"size": "xxs"}), ("mobilevitv2", {"width": 0.5})])
def test_coremltools_converts_the_backbones_at_256(tmp_path, name, kwargs):
    ct = pytest.importorskip("coremltools")
    from tasks.export.coreml import convert

    model = create_backbone(name, **kwargs)
    path = convert(model, (torch.randn(1, 3, 256, 256),), tmp_path / f"{name}.mlpackage", {"suite.backbone": name})
    assert path.is_dir() and model.training  # the module's mode is given back
    assert not any(getattr(m, "coreml_layout", False) for m in model.modules())
    spec = ct.models.MLModel(str(path), skip_model_load=True)  # loading to run needs macOS
    assert spec.user_defined_metadata["suite.backbone"] == name
    assert [o.name for o in spec.get_spec().description.output]  # the feature maps are outputs
