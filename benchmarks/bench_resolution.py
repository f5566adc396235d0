"""What ``data.variable_resolution`` costs or saves per image against fixed crops: one process, side by side.

    python benchmarks/bench_resolution.py                         # MobileViT-XXS, base 256 px x 8, 2 runs of the table
    python benchmarks/bench_resolution.py --backbone mobilevitv2 --batch 16 --reps 3

The network trains (forward, loss, backward, SGD step; fp32, train mode) on random images: one run of the
variable-batch table (every size once, at its batch size: :func:`datamodules.resolution.resolution_table`,
CVNets' current rule and v0.1's), then as many images at the fixed base crop in batches of the base size.
Reported: images and pixels per CPU second of each (process CPU time, all threads), and the CPU time per image
of the table's run against the same images at the base crop. The loader is left out: the crop size barely changes a crop's decode and resize cost.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datamodules.resolution import VariableResolution, resolution_table  # noqa: E402

BACKBONES = {"mobilevit": ("backbones", "MobileViT", {"size": "xxs"}),
             "mobilevitv2": ("backbones", "MobileViTv2", {"width": 0.5})}


def build(name: str) -> nn.Module:
    import importlib

    module, cls, kwargs = BACKBONES[name]
    return Classifier(getattr(importlib.import_module(module), cls)(**kwargs))


class Classifier(nn.Module):
    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.num_features, 1000)

    def forward(self, x):
        return self.head(self.backbone.forward_pooled(x))


def train_steps(model: nn.Module, batches: list[tuple[int, int]], optimizer) -> float:
    """Seconds of this process's CPU time to train on ``batches`` of (side, batch size): on a machine shared
    with other work, CPU time moves less than the wall clock."""
    inputs = [(torch.randn(b, 3, s, s), torch.randint(0, 1000, (b,))) for s, b in batches]
    start = time.process_time()
    for images, labels in inputs:
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", choices=sorted(BACKBONES), default="mobilevit")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2, help="runs of the table per timing")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build(args.backbone).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_steps(model, [(args.size, args.batch)], optimizer)  # warm-up
    print(f"{args.backbone}, base {args.size} px x {args.batch}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for rule in ("cvnets", "cvnets_v0.1"):
        table = resolution_table(args.size, args.batch, VariableResolution(rule=rule))
        images = sum(b for _, _, b in table) * args.runs
        variable = [(s, b) for s, _, b in table] * args.runs
        fixed = [(args.size, args.batch)] * (images // args.batch)
        fixed_images = len(fixed) * args.batch
        best = {"variable": float("inf"), "fixed": float("inf")}
        for _ in range(args.reps):
            best["variable"] = min(best["variable"], train_steps(model, variable, optimizer))
            best["fixed"] = min(best["fixed"], train_steps(model, fixed, optimizer))
        pixels = sum(s * s * b for s, b in variable)
        per_image = {"variable": best["variable"] / images, "fixed": best["fixed"] / fixed_images}
        print(f"{rule:12s} table {[(s, b) for s, _, b in table]}")
        print(f"  variable: {images / best['variable']:.1f} img/cpu-s, {pixels / best['variable'] / 1e6:.2f} Mpx/cpu-s, "
              f"{len(variable)} steps; fixed: {fixed_images / best['fixed']:.1f} img/cpu-s, "
              f"{fixed_images * args.size ** 2 / best['fixed'] / 1e6:.2f} Mpx/cpu-s, {len(fixed)} steps; "
              f"CPU time per image variable/fixed = {per_image['variable'] / per_image['fixed']:.2f}x, "
              f"pixels per image {pixels / images / args.size ** 2:.2f}x")


if __name__ == "__main__":
    main()
