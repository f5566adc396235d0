"""layers.conv.DepthwiseConv2d: a depthwise conv whose CPU training backward computes the weight
gradient as one grouped convolution. Its gradients must be PyTorch's own (an ``nn.Conv2d`` with
the same weights is the reference), and everything that is not CPU training must see a plain conv."""
import pytest
import torch
import torch.nn as nn

from layers.conv import DepthwiseConv2d, depthwise_weight_grad


def reference_conv(conv: DepthwiseConv2d) -> nn.Conv2d:
    plain = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, padding=conv.padding,
                      groups=conv.groups, bias=conv.bias is not None).to(conv.weight.dtype)
    plain.load_state_dict(conv.state_dict())
    return plain


@pytest.mark.parametrize("kernel_size", [5, 7, 9])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_equal_pytorchs_depthwise_conv(kernel_size, channels_last, bias):
    torch.manual_seed(kernel_size)
    conv = DepthwiseConv2d(6, kernel_size, bias=bias).double()
    plain = reference_conv(conv)
    x = torch.randn(3, 6, 11, 8, dtype=torch.float64)  # not square, sides below and above the kernel
    if channels_last:
        x, conv, plain = (t.to(memory_format=torch.channels_last) for t in (x, conv, plain))
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()

    out = conv(x_ours)
    assert type(out.grad_fn).__name__ == "_DepthwiseConvFunctionBackward"  # the fast backward ran
    expected = plain(x_ref)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, [x_ours, *conv.parameters()], grad_out)
    want = torch.autograd.grad(expected, [x_ref, *plain.parameters()], grad_out)
    assert len(got) == (3 if bias else 2)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def test_weight_grad_alone_equals_autograd_for_a_batch_of_one():
    x, grad_out = torch.randn(1, 4, 9, 9, dtype=torch.float64), torch.randn(1, 4, 9, 9, dtype=torch.float64)
    weight = torch.randn(4, 1, 7, 7, dtype=torch.float64, requires_grad=True)
    out = torch.nn.functional.conv2d(x, weight, padding=3, groups=4)
    (expected,) = torch.autograd.grad(out, weight, grad_out)
    torch.testing.assert_close(depthwise_weight_grad(x, grad_out, 7), expected, rtol=0, atol=1e-10)


def test_only_large_kernel_cpu_training_takes_the_fast_backward():
    x = torch.randn(2, 8, 10, 10, requires_grad=True)
    assert type(DepthwiseConv2d(8, 3)(x).grad_fn).__name__ != "_DepthwiseConvFunctionBackward"  # oneDNN wins at 3x3
    conv = DepthwiseConv2d(8, 7)
    with torch.no_grad():  # inference, export and FLOP counting see nn.Conv2d
        assert conv(x).grad_fn is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert type(conv(x).grad_fn).__name__ != "_DepthwiseConvFunctionBackward"
    with pytest.raises(ValueError, match="odd kernel_size.*got 4"):
        DepthwiseConv2d(8, 4)


def test_convmixer_training_step_equals_the_plain_conv_model():
    """A whole ConvMixer step: the same loss and parameter gradients with the fast backward as with
    ``nn.Conv2d`` depthwise layers carrying the same weights."""
    from backbones.convmixer import ConvMixer

    torch.manual_seed(0)
    model = ConvMixer(dim=16, depth=2, kernel_size=7, patch_size=4).double().train()
    reference = ConvMixer(dim=16, depth=2, kernel_size=7, patch_size=4).double().train()
    for block in reference.blocks:
        block.depthwise = reference_conv(block.depthwise)
    reference.load_state_dict(model.state_dict())
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    grads = []
    for net in (model, reference):
        net.zero_grad()
        net.forward_pooled(images).square().sum().backward()
        grads.append({name: p.grad for name, p in net.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-9, atol=1e-10, msg=name)
