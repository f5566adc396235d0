"""layers.cpu_speedups: one switch turns the CPU speed paths off; with it on they give the plain
ops' results, and training, GPUs and tools that watch the ops always get the plain ops."""
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from backbones import create_backbone
from layers.cpu_speedups import PATHS, cpu_inference, cpu_speedups, enabled
from tests.conftest import REPO, clean_env
from tests.test_fusion import OpLog


def test_switch_turns_paths_off_inside_a_block_and_back_after():
    x = torch.randn(2, 3)
    with torch.inference_mode():
        assert all(cpu_inference(path, x) for path in PATHS)
        with cpu_speedups(False):
            assert not any(cpu_inference(path, x) for path in PATHS)
            with cpu_speedups(True, (PATHS[0],)):
                assert cpu_inference(PATHS[0], x) and not any(cpu_inference(p, x) for p in PATHS[1:])
        assert all(enabled(path) for path in PATHS)
    assert not any(cpu_inference(path, x) for path in PATHS)  # autograd on: training takes the plain ops
    with torch.inference_mode():
        assert not cpu_inference(PATHS[0], x.double())
        with OpLog():  # a dispatch mode (the FLOP counter is one) must see the plain ops
            assert not cpu_inference(PATHS[0], x)
    with pytest.raises(ValueError, match="unknown CPU speed path"):
        with cpu_speedups(False, ("no_such_path",)):
            pass


def test_model_with_every_path_equals_the_plain_model():
    """MobileViT v1: ConvNormAct blocks throughout."""
    torch.manual_seed(0)
    model = create_backbone("mobilevit", size="xxs").eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        fast = model.forward_pooled(x)
        with cpu_speedups(False), OpLog() as plain_ops:
            plain = model.forward_pooled(x)
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
    assert "batch_norm" in plain_ops.ops or "native_batch_norm" in plain_ops.ops


def test_environment_variable_turns_every_path_off():
    code = ("from layers.cpu_speedups import PATHS, enabled; from tasks.cli.runtime import reuse_freed_memory; "
            "print(any(enabled(p) for p in PATHS), reuse_freed_memory())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(SUITE_CPU_SPEEDUPS="0"),
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_switch_off_gives_the_plain_depthwise_backward():
    from layers.conv import DepthwiseConv2d

    conv, x = DepthwiseConv2d(4, 7), torch.randn(1, 4, 9, 9, requires_grad=True)
    assert type(conv(x).grad_fn).__name__ == "_DepthwiseConvFunctionBackward"
    with cpu_speedups(False):
        assert type(conv(x).grad_fn).__name__ != "_DepthwiseConvFunctionBackward"
