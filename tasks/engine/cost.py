"""A model's cost as ``metrics.json`` and the model summary state it: parameters and FLOPs.

FLOPs are counted by PyTorch's own ``torch.utils.flop_counter.FlopCounterMode`` on one batch-1
input at the data's evaluation size (the same count Lightning's model summary shows). It counts
a multiply-add as 2 FLOPs; the MobileViT papers' "FLOPs" are multiply-adds, so their tables
compare with ``gmacs`` = ``gflops / 2``. Only matrix products and convolutions are counted
(normalisation, activations and softmax are not), as in the papers' counters.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode


def count_parameters(model: nn.Module) -> int:
    """Parameters of ``model``, each shared tensor once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@torch.no_grad()
def count_flops(model: nn.Module, example_input: Any) -> int:
    """FLOPs (2 per multiply-add) of ``model(example_input)`` in eval mode; a tuple/list input is
    unpacked into positional arguments, a dict into keyword arguments. The training mode of every
    sub-module is restored afterwards."""
    from layers.attention import register_cpu_sdpa_flops

    register_cpu_sdpa_flops()  # torch's counter does not know the CPU attention kernels yet
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        counter = FlopCounterMode(display=False)
        with counter:
            if isinstance(example_input, dict):
                model(**example_input)
            elif isinstance(example_input, (list, tuple)):
                model(*example_input)
            else:
                model(example_input)
    finally:
        for module, training in modes.items():
            module.training = training
    return counter.get_total_flops()


def model_cost(model: nn.Module, example_input: Any | None) -> dict[str, float]:
    """``{"params", "gflops", "gmacs"}`` of ``model`` (FLOPs only when an example input is known)."""
    cost: dict[str, float] = {"params": count_parameters(model)}
    if example_input is not None:
        flops = count_flops(model, example_input)
        cost |= {"gflops": flops / 1e9, "gmacs": flops / 2e9}
    return cost


def move_to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(move_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: move_to(v, device) for k, v in value.items()}
    return value
