"""Inference fusion (layers.feedforward.fused_linear): at CPU inference the shared layers run
Linear + bias + activation or + residual as one oneDNN kernel. The fused models must give the
plain ops' results (autograd on turns fusion off, so the same model is its own reference), and
tools that watch the ops (FLOP counter, export) must still see the plain ones."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from backbones import create_backbone
from layers.conv import ACTIVATIONS, ConvNormAct
from layers.feedforward import ONEDNN_LINEAR, fused_linear, onednn_inference

needs_onednn = pytest.mark.skipif(not ONEDNN_LINEAR, reason="torch built without oneDNN")

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


@needs_onednn
@pytest.mark.parametrize("name, kwargs, size", BACKBONES, ids=lambda v: v if isinstance(v, str) else None)
def test_fused_inference_equals_the_plain_ops(name, kwargs, size):
    model = perturbed(create_backbone(name, **kwargs))
    x = torch.randn(2, 3, size, size)
    with torch.enable_grad():  # autograd on: the plain ops
        plain = model.forward_pooled(x)
        plain_map = model(x)
    with torch.inference_mode():
        assert onednn_inference(x)
        fused = model.forward_pooled(x)
        fused_map = model(x)
    assert (fused - plain).abs().max() <= 1e-5
    for stride in plain_map:
        assert (fused_map[stride] - plain_map[stride]).abs().max() <= 1e-5


@needs_onednn
@pytest.mark.parametrize("activation", [None, nn.GELU(), nn.GELU(approximate="tanh"), nn.ReLU(), nn.SiLU(), nn.Tanh()])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_linear_equals_linear_activation_add(activation, with_residual):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    x = torch.randn(3, 7, 24)
    residual = torch.randn(3, 40, 7).transpose(1, 2) if with_residual else None  # strided, as the Mixer passes it
    expected = F.linear(x, layer.weight, layer.bias)
    if activation is not None:
        expected = activation(expected)
    if residual is not None:
        expected = expected + residual
    with torch.inference_mode():
        out = fused_linear(x, layer, activation, residual)
    assert out.shape == expected.shape
    assert (out - expected).abs().max() <= 1e-5


def test_autograd_and_flop_counting_see_the_plain_ops():
    model = perturbed(create_backbone("vit", size="tiny", img_size=32, patch_size=16, depth=1))
    x = torch.randn(1, 3, 32, 32)
    assert not onednn_inference(x)  # autograd on: the fused kernels have no backward
    model.forward_pooled(x).sum().backward()
    assert model.blocks[0].mlp.fc1.weight.grad is not None
    counts = []
    for context in (torch.enable_grad, torch.inference_mode):
        with context(), FlopCounterMode(display=False) as counter:
            model.forward_pooled(x)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


class OpLog(TorchDispatchMode):
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
