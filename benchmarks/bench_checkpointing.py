"""What ``--model.activation_checkpointing`` saves and costs: MobileViTv2 on the CPU, side by side.

    python benchmarks/bench_checkpointing.py                     # MobileViTv2-1.0, 256 px, batch 8
    python benchmarks/bench_checkpointing.py --width 0.5 --size 64 --batch 4 --reps 2
    python benchmarks/bench_checkpointing.py --backbone vit_tiny --size 224   # ViT-Ti/16, 224 px

One process builds the network once and a copy with its repeated blocks checkpointed
(:mod:`layers.checkpointing`), and for each reports:

- the bytes kept for the backward pass (:func:`saved_for_backward_bytes`): every tensor autograd
  saves during the forward (``torch.autograd.graph.saved_tensors_hooks``), plus the inputs of the
  repeated blocks (which a checkpointed block keeps by reference, outside those hooks), each
  storage counted once and parameters left out. A deterministic proxy for the activation memory
  of a training step, independent of the allocator;
- the time of a training step (forward, loss, backward; train mode, fp32), after one warm-up step
  each, the two timed in turn, best of ``--reps``.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layers.checkpointing import checkpoint_blocks  # noqa: E402
from layers.compile import repeated_blocks  # noqa: E402


def saved_for_backward_bytes(model: nn.Module, x: torch.Tensor, forward=None) -> int:
    """Bytes of the distinct storages a forward pass of ``model`` keeps for its backward (see the module
    docstring): saved tensors and the repeated blocks' inputs, parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters and storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()

    def pack(t: torch.Tensor):
        keep(t)
        return t

    def block_inputs(module, args):
        for arg in args:
            if isinstance(arg, torch.Tensor):
                keep(arg)

    hooks = [block.register_forward_pre_hook(block_inputs) for _, block in repeated_blocks(model)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = (forward or model)(x)
    finally:
        for hook in hooks:
            hook.remove()
    del out
    return sum(storages.values())


def pooled_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.forward_pooled(x).square().mean()


def step_time(model: nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    pooled_loss(model, x).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    from backbones import ViT
    from backbones.mobilevitv2 import MobileViTv2

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", choices=("mobilevitv2", "vit_tiny"), default="mobilevitv2")
    parser.add_argument("--width", type=float, default=1.0, help="MobileViTv2's width")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    if args.backbone == "vit_tiny":
        plain, label = ViT("tiny", img_size=args.size).train(), "ViT-Ti/16"
    else:
        plain, label = MobileViTv2(width=args.width).train(), f"MobileViTv2-{args.width}"
    checkpointed = copy.deepcopy(plain)
    blocks = checkpoint_blocks(checkpointed)
    x = torch.randn(args.batch, 3, args.size, args.size)
    models = {"without": plain, "with": checkpointed}
    saved = {name: saved_for_backward_bytes(m, x, m.forward_pooled) for name, m in models.items()}
    for m in models.values():  # warm-up
        step_time(m, x)
    times = {name: [] for name in models}
    for _ in range(args.reps):
        for name, m in models.items():
            times[name].append(step_time(m, x))
    print(f"{label}, {args.size} px, batch {args.batch}, fp32 train step on the CPU "
          f"({torch.get_num_threads()} threads, torch {torch.__version__}); {len(blocks)} blocks checkpointed")
    print("| activation checkpointing | saved for backward (MiB) | step (s, best of %d) |" % args.reps)
    print("| --- | ---: | ---: |")
    for name in models:
        print(f"| {name} | {saved[name] / 2**20:.1f} | {min(times[name]):.3f} |")
    ratio = min(times["with"]) / min(times["without"])
    print(f"saved: {saved['with'] / saved['without']:.2f}x; step time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
