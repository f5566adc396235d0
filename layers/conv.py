"""Convolution -> normalisation -> activation, the block every convolutional part is made of, and a
depthwise conv with a faster CPU weight gradient for large kernels."""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

from layers.cpu_speedups import cpu_inference, enabled

#: activation name -> class, for the ``act`` arguments of the backbones and blocks
ACTIVATIONS: dict[str, type[nn.Module]] = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU}


def activation_layer(name: str) -> type[nn.Module]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; valid names: {', '.join(ACTIVATIONS)}") from None


class ConvNormAct(nn.Sequential):
    """Conv2d -> BatchNorm2d -> activation: (B, in_chs, H, W) -> (B, out_chs, H / stride, W / stride).

    'Same' padding for odd kernels. ``groups=in_chs`` makes the conv depthwise;
    ``norm=False`` drops the BatchNorm, ``act=None`` the activation (else a name of
    :data:`ACTIVATIONS`). The conv has a bias only without a norm, unless ``bias`` says
    otherwise.

    The activation runs in place on the conv's or the norm's fresh output whenever that
    costs nothing: always for ReLU (its gradient reads the output), for SiLU only when
    autograd is not recording (its gradient reads the input, so in place autograd would keep
    a clone of the whole map; out of place, a MobileViTv2 training step is ~1 % faster).

    The children are named ``conv``, ``bn``, ``act`` (timm's names, which the
    backbones' checkpoints carry), or ``0``, ``1``, ``2`` with ``positional=True``
    (the plain ``nn.Sequential`` layout of the heads' checkpoints); absent parts
    leave no gap. ``nn.Sequential(*ConvNormAct(...), *ConvNormAct(...))`` chains
    the parts of several blocks under consecutive indices.

    At CPU inference the BatchNorm is folded into the convolution's weight and bias
    (same parameters, same results up to rounding), so inference skips the
    normalisation pass over the map: the ``fold_batchnorm`` path of :mod:`layers.cpu_speedups`.
    """

    def __init__(
        self,
        in_chs: int,
        out_chs: int,
        kernel_size: int = 1,
        stride: int = 1,
        groups: int = 1,
        dilation: int = 1,
        norm: bool = True,
        act: str | None = "silu",
        bias: bool | None = None,
        positional: bool = False,
    ):
        padding = dilation * (kernel_size - 1) // 2
        bias = not norm if bias is None else bias
        parts = [("conv", nn.Conv2d(in_chs, out_chs, kernel_size, stride, padding, dilation, groups, bias=bias))]
        if norm:
            parts.append(("bn", nn.BatchNorm2d(out_chs)))
        if act is not None:
            activation = activation_layer(act)()
            if isinstance(activation, nn.ReLU):
                activation.inplace = True
            parts.append(("act", activation))
        if positional:
            parts = [(str(i), module) for i, (_, module) in enumerate(parts)]
        super().__init__(OrderedDict(parts))
        self.has_norm = norm
        self.has_act = act is not None

    def _activate(self, x: torch.Tensor) -> torch.Tensor:
        act = self[-1]
        if isinstance(act, nn.SiLU) and not (torch.is_grad_enabled() and x.requires_grad):
            return F.silu(x, inplace=True)
        return act(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self[0]
        bn = self[1] if self.has_norm else None
        # (without running statistics BatchNorm uses the batch's: nothing to fold)
        if bn is not None and not bn.training and bn.running_mean is not None and cpu_inference("fold_batchnorm", x):
            scale = bn.weight * torch.rsqrt(bn.running_var + bn.eps)
            shift = bn.bias - bn.running_mean * scale
            if conv.bias is not None:
                shift = shift + conv.bias * scale
            weight = conv.weight * scale.view(-1, 1, 1, 1)
            x = F.conv2d(x, weight, shift, conv.stride, conv.padding, conv.dilation, conv.groups)
        else:
            x = conv(x)
            if bn is not None:
                x = bn(x)
        return self._activate(x) if self.has_act else x


def depthwise_weight_grad(x: torch.Tensor, grad_out: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """The weight gradient of a stride-1, 'same'-padded depthwise conv with an odd square kernel.

    x, grad_out: (B, C, H, W) -> (C, 1, k, k). Each (channel, image) pair is one group of a single
    grouped convolution that correlates the padded image with its output gradient; summing the
    groups over the batch gives the gradient. On CPU this runs 1.4-2.5x faster than oneDNN's own
    depthwise weight gradient for 5x5 and larger kernels (benchmarks/bench_depthwise.py), and slower
    for 3x3, which oneDNN special-cases.
    """
    batch, channels, height, width = x.shape
    pad = kernel_size // 2
    # one copy into (C, B, H + 2p, W + 2p) does the transpose and the zero padding together
    padded = x.new_zeros(channels, batch, height + 2 * pad, width + 2 * pad)
    padded[:, :, pad:pad + height, pad:pad + width] = x.transpose(0, 1)
    kernels = grad_out.transpose(0, 1).reshape(channels * batch, 1, height, width)
    per_image = F.conv2d(padded.view(1, channels * batch, *padded.shape[-2:]), kernels, groups=channels * batch)
    return per_image.view(channels, batch, kernel_size, kernel_size).sum(1).unsqueeze(1)


class _DepthwiseConvFunction(torch.autograd.Function):
    """A depthwise conv whose backward takes the input gradient alone from PyTorch's kernel, the
    weight gradient from :func:`depthwise_weight_grad` and the bias gradient from a sum."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        channels, pad = weight.shape[0], weight.shape[-1] // 2
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.conv2d(x, weight, bias, padding=pad, groups=channels)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        channels, kernel_size = weight.shape[0], weight.shape[-1]
        pad = kernel_size // 2
        grad_x = grad_bias = grad_weight = None
        need_x, need_weight, need_bias = ctx.needs_input_grad
        if need_x:
            grad_x = torch.ops.aten.convolution_backward(
                grad_out, x, weight, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], channels,
                [True, False, False])[0]
        if need_bias and ctx.has_bias:
            # asked of oneDNN's kernel, the bias gradient sends it down a path ~9x slower (7x7, 192 ch)
            grad_bias = grad_out.sum((0, 2, 3))
        if need_weight:
            grad_weight = depthwise_weight_grad(x, grad_out, kernel_size)
        return grad_x, grad_weight, grad_bias


class DepthwiseConv2d(nn.Conv2d):
    """A stride-1 depthwise conv with an odd ``kernel_size`` and 'same' padding:
    (B, channels, H, W) -> (B, channels, H, W). A plain ``nn.Conv2d`` (same parameters, same
    checkpoints) whose CPU training backward computes the weight gradient with
    :func:`depthwise_weight_grad` when the kernel is 5x5 or larger: the ``depthwise_weight_grad``
    path of :mod:`layers.cpu_speedups` (the segmentation demo's fit step: 10-24 % faster)."""

    #: smallest kernel that takes the grouped-conv weight gradient (oneDNN is faster at 3x3)
    MIN_FAST_KERNEL = 5

    def __init__(self, channels: int, kernel_size: int, bias: bool = True):
        if kernel_size % 2 == 0:
            raise ValueError(f"DepthwiseConv2d needs an odd kernel_size for 'same' padding, got {kernel_size}")
        super().__init__(channels, channels, kernel_size, padding=kernel_size // 2, groups=channels, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes_fast_backward(x):
            return _DepthwiseConvFunction.apply(x, self.weight, self.bias)
        return super().forward(x)

    def _takes_fast_backward(self, x: torch.Tensor) -> bool:
        return (
            enabled("depthwise_weight_grad")
            and torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
            and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
            and self.kernel_size[0] >= self.MIN_FAST_KERNEL
            and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing() and not torch.jit.is_scripting()
        )
