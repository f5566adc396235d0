"""``torch.compile`` for the suite's networks, whole or by their repeated blocks.

Two ways, chosen by a task's ``--model.compile``:

- ``network`` (or ``true``): each sub-network of the task (backbone, head; encoder, decoder) is
  compiled whole. Dynamo traces the full forward, so every block is a separate piece of one
  large graph, and a changed input size recompiles all of it.
- ``regional``: only the blocks a network repeats are compiled, each instance in place. The
  blocks of one class share their code, so Dynamo compiles one graph per distinct signature
  (shape, training flag) and reuses it for every instance: a ViT-B compiles one block, not
  twelve. What lies between the blocks (stems, downsampling convolutions, heads) runs eagerly.
  On a GPU most of the gain of compiling a transformer comes from fusing the blocks' norms,
  activations and residual adds, so this keeps most of the speed for a fraction of the
  compile time.

A network names its repeated blocks with a class attribute, ``repeated_blocks``: a tuple of
module classes (a backbone's is part of :class:`backbones.base.Backbone`'s interface; the
translation encoder and decoder carry their own). :func:`compile_regions` compiles every module
of those classes found in the tree, outermost first, so a declared block nested in another is
compiled once, as part of its parent.
"""
from __future__ import annotations

import getpass
import os
import tempfile
from collections import Counter
from typing import Literal

import torch.nn as nn

CompileMode = Literal["network", "regional"]


def compile_mode(value: bool | str) -> CompileMode | None:
    """``--model.compile``'s value as a mode: ``False`` -> ``None``, ``True`` -> ``"network"``."""
    if value is False or value is None:
        return None
    if value is True:
        return "network"
    if value in ("network", "regional"):
        return value
    raise ValueError(f"compile must be false, true, 'network' or 'regional', got {value!r}")


def repeated_block_types(network: nn.Module) -> tuple[type[nn.Module], ...]:
    """The block classes that ``network`` or any of its modules declare in ``repeated_blocks``."""
    found: dict[type[nn.Module], None] = {}
    for module in network.modules():
        for block in getattr(module, "repeated_blocks", ()):
            found.setdefault(block)
    return tuple(found)


def repeated_blocks(network: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of each declared repeated block in ``network``, outermost only."""
    types = repeated_block_types(network)
    blocks: list[tuple[str, nn.Module]] = []
    if not types:
        return blocks

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            qualified = f"{prefix}.{name}" if prefix else name
            if isinstance(child, types):
                blocks.append((qualified, child))
            else:
                visit(qualified, child)

    visit("", network)
    return blocks


def compile_regions(network: nn.Module, **compile_kwargs) -> list[tuple[str, nn.Module]]:
    """Compile each repeated block of ``network`` in place (``nn.Module.compile``: parameter names and
    the state dict are unchanged); returns the blocks. ``compile_kwargs`` go to ``torch.compile``."""
    blocks = repeated_blocks(network)
    for _, block in blocks:
        block.compile(**compile_kwargs)
    return blocks


def compile_networks(networks: list[nn.Module], mode: CompileMode, **compile_kwargs) -> str:
    """Compile ``networks`` (a task's sub-networks) the ``mode`` way, in place; returns one line saying
    what was compiled. ``regional`` on networks that repeat no declared block is an error naming them."""
    if mode == "network":
        for network in networks:
            network.compile(**compile_kwargs)
        return "torch.compile (network): " + ", ".join(type(n).__name__ for n in networks) + ", each whole"
    blocks = [block for network in networks for block in compile_regions(network, **compile_kwargs)]
    if not blocks:
        names = ", ".join(type(n).__name__ for n in networks)
        raise ValueError(f"--model.compile regional: {names} declare no repeated blocks to compile "
                         "(a network lists them in its `repeated_blocks` attribute); use --model.compile network")
    kinds = Counter(type(block).__name__ for _, block in blocks)
    return ("torch.compile (regional): " + ", ".join(f"{count} x {name}" for name, count in kinds.items())
            + "; the rest runs eagerly")


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled code between runs (``$TORCHINDUCTOR_CACHE_DIR``, documented default
    ``<tmp>/torchinductor_<user>``): a later run with the same graphs loads them from there."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")


def cpu_compile_notice(mode: CompileMode) -> str:
    """What compiling costs on a CPU, said before the first step (numbers: benchmarks/RESULTS.md, "Compile")."""
    return (
        f"compiling on the CPU ({mode}): inductor writes and builds C++ for every graph before the first "
        f"step that uses it, again for evaluation mode and for new input shapes. On 2 cores the "
        f"classification demo's one-epoch fit took 13 s eager, 146 s regional and 198 s network with an "
        f"empty cache (38 s and 27 s once the cache held the graphs), while a training step ran 1.02-1.06x "
        f"eager's speed regional and 0.9x network (benchmarks/RESULTS.md, 'Compile'). Built code is kept in "
        f"{inductor_cache_dir()} for later runs. Compile is meant for GPUs; on a CPU leave --model.compile false."
    )
