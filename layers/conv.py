"""Convolution -> normalisation -> activation, the block every convolutional part is made of."""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn

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
    :data:`ACTIVATIONS`, run in place where it can be). The conv has a bias only without a norm, unless ``bias`` says
    otherwise.

    The children are named ``conv``, ``bn``, ``act`` (timm's names, which the
    backbones' checkpoints carry), or ``0``, ``1``, ``2`` with ``positional=True``
    (the plain ``nn.Sequential`` layout of the heads' checkpoints); absent parts
    leave no gap. ``nn.Sequential(*ConvNormAct(...), *ConvNormAct(...))`` chains
    the parts of several blocks under consecutive indices.

    In eval mode the BatchNorm is folded into the convolution's weight and bias
    (same parameters, same results up to rounding), so inference skips the
    normalisation pass over the map.
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
            if hasattr(activation, "inplace"):  # it reads only the conv's or the norm's fresh output
                activation.inplace = True
            parts.append(("act", activation))
        if positional:
            parts = [(str(i), module) for i, (_, module) in enumerate(parts)]
        super().__init__(OrderedDict(parts))
        self.has_norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training or not self.has_norm:
            return super().forward(x)
        conv, bn, *act = self
        if bn.running_mean is None:  # no running statistics: the batch's are used, nothing to fold
            return super().forward(x)
        scale = bn.weight * torch.rsqrt(bn.running_var + bn.eps)
        shift = bn.bias - bn.running_mean * scale
        if conv.bias is not None:
            shift = shift + conv.bias * scale
        x = conv._conv_forward(x, conv.weight * scale.view(-1, 1, 1, 1), shift)
        return act[0](x) if act else x
