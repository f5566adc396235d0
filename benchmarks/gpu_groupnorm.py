"""MobileViTv2's one-group GroupNorm on channels-last maps, timed two ways on the GPU: ``F.layer_norm`` over
(H, W, C) (``ChannelsLastGroupNorm``'s default: one CUDA block per image) against ``torch.var_mean`` plus one
affine (:func:`layers.transformer.group_norm_by_var_mean`: the reduction spread over many blocks), forward and
backward under bf16 autocast, at per-device batches 4, 32 and 128 (the segmentation, detection and
classification recipes'), on the maps MobileViTv2-1.0 normalises.

The two are timed in interleaved rounds (A B, B A, ...: the order alternates), each round ``--iters`` steps between two CUDA events,
and reported as the median and the spread (min-max) of the rounds, so a slow moment of the machine hits both.
The decision it informs: ``ChannelsLastGroupNorm.statistics`` (layers/transformer.py), left at ``layer_norm``
until this has run on a GPU.

    python benchmarks/gpu_groupnorm.py --out OUT            # on a GPU (~10 s)
    python benchmarks/gpu_groupnorm.py --out OUT --tiny     # on the CPU: values compared, times meaningless
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from interleaved import timed_rounds  # noqa: E402
from layers.transformer import ChannelsLastGroupNorm  # noqa: E402

#: (name, H, W, C) of the maps MobileViTv2-1.0 normalises: its three transformer stages at 256 px (classification,
#: detection at 320 is close), and the output-stride-8 segmentation backbone's widest at 512 px
MAPS = [("256px stage 3", 32, 32, 128), ("256px stage 4", 16, 16, 192), ("256px stage 5", 8, 8, 256),
        ("512px os8 stage 5", 64, 64, 256)]
BATCHES = (4, 32, 128)
METHODS = ("layer_norm", "var_mean")


def step(norm: ChannelsLastGroupNorm, x: torch.Tensor, grad: torch.Tensor, autocast: bool) -> None:
    x.grad = None
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = norm(x)
    y.backward(grad)


def time_rounds(norms: dict, x: torch.Tensor, grad: torch.Tensor, rounds: int, iters: int) -> dict[str, list[float]]:
    """Milliseconds per forward+backward of each method, one value per round, the methods interleaved
    (:func:`interleaved.timed_rounds`: the order alternates round by round)."""
    cuda = x.device.type == "cuda"
    for norm in norms.values():  # warm-up: kernels chosen, caches filled
        for _ in range(3):
            step(norm, x, grad, cuda)
    seconds, _ = timed_rounds({name: (lambda norm=norm: step(norm, x, grad, cuda)) for name, norm in norms.items()},
                              rounds, iters, x.device)
    return {name: [value * 1e3 / iters for value in values] for name, values in seconds.items()}


def compare_values(norms: dict, x: torch.Tensor, grad: torch.Tensor) -> float:
    """Largest difference between the methods' outputs and input gradients (float32, no autocast)."""
    results = []
    for norm in norms.values():
        xi = x.detach().float().clone().requires_grad_(True)
        y = norm.float()(xi)
        y.backward(grad.float())
        results.append((y.detach(), xi.grad))
    (y0, g0), (y1, g1) = results
    return max((y0 - y1).abs().max().item(), (g0 - g1).abs().max().item())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU, small maps and batches: the values compared")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    maps = [(name, 8, 8, 16) for name, *_ in MAPS[:1]] if args.tiny else MAPS
    batches = (2, 4) if args.tiny else BATCHES
    rounds, iters = (3, 2) if args.tiny else (args.rounds, args.iters)
    rows = []
    torch.manual_seed(0)
    for name, h, w, c in maps:
        norms = {}
        for method in METHODS:
            norm = ChannelsLastGroupNorm(1, c).to(device)
            norm.statistics = method
            with torch.no_grad():
                norm.weight.normal_()
                norm.bias.normal_()
            norms[method] = norm
        norms["var_mean"].load_state_dict(norms["layer_norm"].state_dict())
        for batch in batches:
            x = torch.randn(batch, h, w, c, device=device, requires_grad=True)
            grad = torch.randn(batch, h, w, c, device=device)
            difference = compare_values(norms, x, grad)
            times = time_rounds(norms, x, grad, rounds, iters)
            row = {"map": name, "shape": [batch, h, w, c], "batch": batch, "device": str(device),
                   "max_abs_difference": difference}
            for method, values in times.items():
                row[method] = {"median_ms": statistics.median(values), "min_ms": min(values), "max_ms": max(values)}
            row["var_mean_over_layer_norm"] = row["var_mean"]["median_ms"] / row["layer_norm"]["median_ms"]
            rows.append(row)
            print(f"{name} batch {batch}: layer_norm {row['layer_norm']['median_ms']:.3f} ms, var_mean "
                  f"{row['var_mean']['median_ms']:.3f} ms (x{row['var_mean_over_layer_norm']:.2f}), "
                  f"max difference {difference:.2e}", flush=True)
    machine = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (--tiny: times mean nothing)"
    (out / "gpu_groupnorm.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    lines = [f"GroupNorm(1, C) on channels-last maps, forward + backward, bf16 autocast, {machine}; median of "
             f"{rounds} interleaved rounds of {iters} steps (min-max)", "",
             "| map (B, H, W, C) | layer_norm ms | var_mean ms | var_mean / layer_norm | max difference |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for row in rows:
        cells = [f"{row[m]['median_ms']:.3f} ({row[m]['min_ms']:.3f}-{row[m]['max_ms']:.3f})" for m in METHODS]
        lines.append(f"| {row['map']} {tuple(row['shape'])} | {cells[0]} | {cells[1]} | "
                     f"{row['var_mean_over_layer_norm']:.2f} | {row['max_abs_difference']:.1e} |")
    (out / "gpu_groupnorm.md").write_text("\n".join(lines) + "\n")
    worst = max(row["max_abs_difference"] for row in rows)
    if worst > 1e-3:
        print(f"the two methods differ by {worst:.2e} (float32): not the same normalisation", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
