"""Inference fusion: at CPU inference ConvNormAct folds its BatchNorm into the convolution (the
``fold_batchnorm`` path of layers.cpu_speedups). The folded models must give the plain ops' results
(autograd on turns folding off, so the same model is its own reference), and tools that watch the
ops (FLOP counter) must count the same."""
import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from backbones import create_backbone
from layers.attention import register_cpu_sdpa_flops
from layers.compat import torch_dispatch_mode
from layers.conv import ACTIVATIONS, ConvNormAct
from layers.cpu_speedups import cpu_inference

BACKBONES = [
    ("vit", dict(size="tiny", img_size=64, depth=2), 64),
    ("vit", dict(size="tiny", img_size=64, depth=2, class_token=False), 64),
    ("mlp_mixer", dict(size="small", img_size=64, depth=2), 64),
    ("mobilevitv2", dict(width=0.5), 64),
    ("mobilevit", dict(size="xxs"), 64),
]


def perturbed(model: nn.Module) -> nn.Module:
    """Every weight and norm statistic moved off its init, so that no term vanishes."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("name, kwargs, size", BACKBONES, ids=lambda v: v if isinstance(v, str) else None)
def test_fused_inference_equals_the_plain_ops(name, kwargs, size):
    model = perturbed(create_backbone(name, **kwargs))
    x = torch.randn(2, 3, size, size)
    with torch.enable_grad():  # autograd on: the plain ops
        plain = model.forward_pooled(x)
        plain_map = model(x)
    with torch.inference_mode():
        assert cpu_inference("fold_batchnorm", x)
        fused = model.forward_pooled(x)
        fused_map = model(x)
    assert (fused - plain).abs().max() <= 1e-5
    for stride in plain_map:
        assert (fused_map[stride] - plain_map[stride]).abs().max() <= 1e-5


def test_autograd_and_flop_counting_see_the_plain_ops():
    model = perturbed(create_backbone("vit", size="tiny", img_size=32, patch_size=16, depth=1))
    x = torch.randn(1, 3, 32, 32)
    register_cpu_sdpa_flops()
    assert not cpu_inference("fold_batchnorm", x)  # autograd on: training takes the plain ops
    model.forward_pooled(x).sum().backward()
    assert model.blocks[0].mlp.fc1.weight.grad is not None
    counts = []
    for context in (torch.enable_grad, torch.inference_mode):
        with context(), FlopCounterMode(display=False) as counter:
            model.forward_pooled(x)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


class OpLog(torch_dispatch_mode()):
    """Records the name of every aten op that runs under it."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("act, inplace_op", [("silu", "silu_"), ("relu", "relu_")])
def test_conv_norm_act_runs_its_activation_in_place_only_where_autograd_keeps_no_copy(act, inplace_op):
    block = ConvNormAct(4, 6, kernel_size=3, act=act)
    reference = nn.Sequential(block.conv, block.bn, ACTIVATIONS[act]())  # same parameters, plain ops
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    with OpLog() as training:
        out = block(x)
    expected = reference(x)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.square().sum(), (x, block.conv.weight))
    torch.testing.assert_close(grads, torch.autograd.grad(expected.square().sum(), (x, block.conv.weight)))
    assert "clone" not in training.ops and "copy_" not in training.ops  # SiLU in place would clone its input
    assert (inplace_op in training.ops) == (act == "relu")  # ReLU's gradient reads its output: in place is free
    block.eval()
    with torch.inference_mode(), OpLog() as inference:
        block(x.detach())
    assert inplace_op in inference.ops
