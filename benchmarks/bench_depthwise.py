"""The depthwise conv's backward on CPU: PyTorch's own kernel (oneDNN) against
:func:`layers.conv.depthwise_weight_grad`, side by side in one process.

For each shape (batch, channels, side, kernel): the weight gradient alone, from
``aten.convolution_backward`` (what ``nn.Conv2d`` runs) and from the grouped convolution, and a
whole layer's forward + backward, ``nn.Conv2d`` against :class:`layers.conv.DepthwiseConv2d`;
channels-last maps, as ConvMixer runs them. Timings are interleaved (theirs, ours, theirs, ...)
and the best of ``--reps`` is kept; ratio = PyTorch's time / ours (> 1: ours is faster).

    python benchmarks/bench_depthwise.py --threads 2 --reps 30
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn

from layers.conv import DepthwiseConv2d, depthwise_weight_grad
from tasks.cli.runtime import reuse_freed_memory

#: (batch, channels, side, kernel, where the shape comes from)
SHAPES = [
    (8, 192, 12, 7, "segmentation demo (ConvMixer-192/8, 96 px crops)"),
    (4, 768, 32, 7, "ConvMixer-768/32, 224 px, batch 4"),
    (8, 768, 32, 7, "ConvMixer-768/32, 224 px, batch 8"),
    (4, 1536, 32, 9, "ConvMixer-1536/20, 224 px, batch 4"),
    (8, 256, 28, 5, "a 5x5 layer"),
    (8, 256, 28, 3, "a 3x3 layer (oneDNN special-cases it; the layer keeps PyTorch's backward)"),
]


def best_of(fns, reps: int) -> list[float]:
    for fn in fns:  # warm-up: oneDNN primitives, allocator
        fn(), fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reuse_freed_memory()
    cl = torch.channels_last
    print(f"torch {torch.__version__}, {args.threads} threads, best of {args.reps}; ms, ratio = PyTorch / ours\n")
    print("| shape (B, C, side, k) | weight grad: PyTorch | ours | ratio | layer fwd+bwd: nn.Conv2d | DepthwiseConv2d | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch, channels, side, kernel, where in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(batch, channels, side, side).contiguous(memory_format=cl)
        grad_out = torch.randn_like(x)
        ours = DepthwiseConv2d(channels, kernel).to(memory_format=cl)
        plain = nn.Conv2d(channels, channels, kernel, padding=kernel // 2, groups=channels).to(memory_format=cl)
        plain.load_state_dict(ours.state_dict())
        weight, pad = ours.weight.detach(), kernel // 2

        def theirs_weight_grad():
            torch.ops.aten.convolution_backward(grad_out, x, weight, None, [1, 1], [pad, pad], [1, 1], False,
                                                [0, 0], channels, [False, True, False])

        def layer(module):
            def run():
                inputs = x.detach().requires_grad_()
                module(inputs).backward(grad_out)
            return run

        wt, wo = best_of([theirs_weight_grad, lambda: depthwise_weight_grad(x, grad_out, kernel)], args.reps)
        lt, lo = best_of([layer(plain), layer(ours)], args.reps)
        print(f"| {batch}, {channels}, {side}, {kernel} ({where}) | {wt * 1e3:.2f} | {wo * 1e3:.2f} | {wt / wo:.2f} "
              f"| {lt * 1e3:.2f} | {lo * 1e3:.2f} | {lt / lo:.2f} |")


if __name__ == "__main__":
    main()
