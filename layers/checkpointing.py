"""Activation checkpointing of the blocks a network repeats (``--model.activation_checkpointing``).

Each declared repeated block (``repeated_blocks``, the units of regional compilation,
:func:`layers.compile.repeated_blocks`) keeps only its inputs during the forward pass and
recomputes what it needs during the backward pass (:func:`torch.utils.checkpoint.checkpoint`
with ``use_reentrant=False``, timm's ``set_grad_checkpointing``, CVNets/CoreNet's
``--model.activation-checkpointing``). The memory that the activations inside the blocks held
is freed for about one more forward pass of the blocks.

The wrap is in place, as ``nn.Module.compile`` is: the block's ``forward`` is replaced by a
wrapper on the instance, so no module is added and parameter names and state-dict keys stay
as they were. Wrapping comes before compiling (a regionally compiled block compiles the
wrapper, which Dynamo traces as its checkpoint operator).

What the recomputation must not change:

- random draws (dropout, stochastic depth): the non-reentrant checkpoint restores the CPU and
  CUDA RNG states before recomputing (``preserve_rng_state=True``), so the same masks are drawn;
- BatchNorm running statistics (ConvMixer's blocks): recomputing in training mode would update
  them a second time, so the recomputation runs with each BatchNorm's running statistics put
  back as the forward pass left them.

Without gradients (evaluation, ``torch.no_grad``) the block runs as it is.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from layers.compat import is_batchnorm
from layers.compile import repeated_blocks


@contextlib.contextmanager
def _running_statistics_kept(norms: list[nn.Module]):
    """Run the body, then put the norms' running statistics back as they were before it."""
    saved = [[buffer.clone() for buffer in norm.buffers(recurse=False)] for norm in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for norm, buffers in zip(norms, saved):
                for buffer, value in zip(norm.buffers(recurse=False), buffers):
                    buffer.copy_(value)


class CheckpointedForward:
    """The ``forward`` of one block, run under :func:`torch.utils.checkpoint.checkpoint` when gradients
    are recorded. It holds the block and calls its class's ``forward``, so a deep copy of the block
    (EMA weights) carries a wrapper of the copy."""

    def __init__(self, block: nn.Module):
        self.block = block
        self.norms = [m for m in block.modules() if is_batchnorm(m) and m.track_running_stats]

    def _context(self):
        return contextlib.nullcontext(), _running_statistics_kept(self.norms)

    def __call__(self, *args, **kwargs):
        forward = type(self.block).forward.__get__(self.block)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if self.norms and self.block.training:
            return checkpoint(forward, *args, use_reentrant=False, context_fn=self._context, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(network: nn.Module) -> list[tuple[str, nn.Module]]:
    """Checkpoint each repeated block of ``network`` in place (state-dict keys unchanged); returns the blocks."""
    blocks = repeated_blocks(network)
    for _, block in blocks:
        if not isinstance(block.__dict__.get("forward"), CheckpointedForward):
            block.forward = CheckpointedForward(block)
    return blocks


def is_checkpointed(block: nn.Module) -> bool:
    return isinstance(block.__dict__.get("forward"), CheckpointedForward)


def checkpoint_networks(networks: list[nn.Module]) -> str:
    """Checkpoint the repeated blocks of ``networks`` (a task's sub-networks); one line saying which.
    Networks that repeat no declared block are an error naming them."""
    blocks = [block for network in networks for _, block in checkpoint_blocks(network)]
    if not blocks:
        names = ", ".join(type(n).__name__ for n in networks)
        raise ValueError(f"--model.activation_checkpointing: {names} declare no repeated blocks to checkpoint "
                         "(a network lists them in its `repeated_blocks` attribute)")
    kinds = Counter(type(block).__name__ for block in blocks)
    return "activation checkpointing: " + ", ".join(f"{count} x {name}" for name, count in kinds.items())
