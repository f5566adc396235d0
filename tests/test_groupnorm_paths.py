"""ChannelsLastGroupNorm's two ways to the same normalisation (layers/transformer.py): ``layer_norm`` over (H, W, C)
and ``var_mean`` + affine (the candidate benchmarks/gpu_groupnorm.py times on a GPU) both equal torch's
``nn.GroupNorm(1, C)`` on the NCHW map, forward and backward."""
import pytest
import torch

from layers.transformer import ChannelsLastGroupNorm


@pytest.mark.parametrize("statistics", ["layer_norm", "var_mean"])
def test_both_statistics_equal_torchs_group_norm(statistics, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 6, 8, dtype=torch.float64)  # (B, H, W, C)
    ours = ChannelsLastGroupNorm(1, 8).double()
    reference = torch.nn.GroupNorm(1, 8).double()
    with torch.no_grad():
        ours.weight.normal_(), ours.bias.normal_()
    reference.load_state_dict(ours.state_dict())
    monkeypatch.setattr(ours, "statistics", statistics)
    grad = torch.randn_like(x)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya = ours(xa)
    yb = reference(xb.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    torch.testing.assert_close(ya, yb)
    ya.backward(grad), yb.backward(grad)
    torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(ours.weight.grad, reference.weight.grad)
    torch.testing.assert_close(ours.bias.grad, reference.bias.grad)


def test_the_default_stays_layer_norm_until_a_gpu_timing():
    assert ChannelsLastGroupNorm.statistics == "layer_norm"
