"""Our backbones against their timm twins, side by side in one process.

For every (our backbone, timm model) pair: training images/s (forward + backward +
SGD step, train mode), inference images/s at ``--batch`` and latency at batch 1
(eval mode, ``torch.inference_mode``), the same input for both, measurements
interleaved (ours, timm, ours, timm, ...) so that load from other processes hits
both alike; the best of ``--reps`` runs is reported (on a shared machine other
processes only ever add time, so the minimum is the least disturbed estimate),
with the ratio ours/timm (> 1: ours is faster).

Peak memory of one training step (``--memory``): each model runs in a fresh
subprocess, does one warm-up step, then a measured one. On CPU we report how
much the resident set grows at most during the measured step (sampled every
0.5 ms, after ``malloc_trim`` returned free heap memory to the OS), i.e. what the
step's activations, gradients and temporaries add; on CUDA, the growth of
``torch.cuda.max_memory_allocated`` over the same step.

    nice python benchmarks/bench_backbones.py --models mobilevitv2 --batch 8 --reps 5 --memory

Share of the CPU's GEMM throughput (``--gemm-share``): how close each model's inference
comes to the machine's dense float32 matmul rate, measured in the same run with the
same threads: ``inference img/s x FLOPs per image / GEMM FLOP/s``, FLOPs = 2 x
multiply-adds as PyTorch's FLOP counter counts them (``tasks.engine.cost.count_flops``),
the GEMM rate the best of ``--reps`` timings of a ``--gemm-size``³ matmul, one per
repetition, interleaved with the models. 100 % would be a model made only of
large, perfectly efficient matmuls; what is missing is time outside GEMMs (norms,
activations, attention softmax, depthwise convs, copies) and the lower efficiency
of smaller GEMMs. Unless ``--inference-only`` (which skips the training measurement), the
same share is reported for training: training img/s x the counted FLOPs of one training
step (forward, loss, backward) per image / GEMM FLOP/s.

    nice -n 19 python benchmarks/bench_backbones.py --gemm-share --inference-only --batch 8 --reps 5 --threads 2

The ceiling set by the GEMMs (``--gemm-bound``): the share of our model's time spent in
matrix-multiply kernels (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``, oneDNN's fused linear,
and 1x1 single-group convolutions, forward and backward; profiler self time over the same
call's wall time) in one training step, one inference batch and one batch-1 forward, applied
to the interleaved best time. ``timm's time / our GEMM time`` is the ratio ours would reach if
everything outside those kernels (norms, activations, other convolutions, copies, autograd)
took no time at all, and inside the fused attention kernel (SDPA) nothing but its two
products, which are charged at the machine's GEMM rate (their counted FLOPs / the reference
matmul's rate; so ``--gemm-bound`` implies ``--gemm-share``). Where this ceiling is below a
goal, the goal needs faster GEMMs than this machine runs, not a better implementation of
the model. The profiler's own overhead counts as non-GEMM time, so the ceiling errs high.

    python benchmarks/bench_backbones.py --models vit mixer --gemm-bound --batch 4 --reps 3 --threads 2
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backbones import create_backbone, list_backbones  # noqa: E402  (importing backbones registers them all)

#: (label, our backbone name, its kwargs, timm twin, input size)
TWINS: list[tuple[str, str, dict, str, int]] = [
    ("mobilevitv2-0.5", "mobilevitv2", {"width": 0.5}, "mobilevitv2_050", 256),
    ("mobilevitv2-1.0", "mobilevitv2", {"width": 1.0}, "mobilevitv2_100", 256),
    ("mobilevitv2-2.0", "mobilevitv2", {"width": 2.0}, "mobilevitv2_200", 256),
    ("mobilevit-xxs", "mobilevit", {"size": "xxs"}, "mobilevit_xxs", 256),
    ("mobilevit-xs", "mobilevit", {"size": "xs"}, "mobilevit_xs", 256),
    ("mobilevit-s", "mobilevit", {"size": "s"}, "mobilevit_s", 256),
    ("vit-tiny/16", "vit", {"size": "tiny", "patch_size": 16}, "vit_tiny_patch16_224", 224),
    ("vit-small/16", "vit", {"size": "small", "patch_size": 16}, "vit_small_patch16_224", 224),
    ("vit-base/16", "vit", {"size": "base", "patch_size": 16}, "vit_base_patch16_224", 224),
    ("convmixer-768/32", "convmixer", {"dim": 768, "depth": 32, "kernel_size": 7, "patch_size": 7, "act": "relu"},
     "convmixer_768_32", 224),
    ("mixer-s/16", "mlp_mixer", {"size": "small", "patch_size": 16}, "mixer_s16_224", 224),
]
#: backbones whose token grid is fixed at construction: ``--img-size`` builds both sides for that size
FIXED_INPUT_SIZE = {"vit", "mlp_mixer"}


class Classifier(nn.Module):
    """Our backbone + a linear classifier: the reference architecture's full classification path."""

    def __init__(self, name: str, kwargs: dict, num_classes: int = 1000):
        super().__init__()
        self.backbone = create_backbone(name, **kwargs)
        self.fc = nn.Linear(self.backbone.num_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.backbone.forward_pooled(x))


def build(which: str, twin: tuple, device: torch.device, size: int) -> nn.Module:
    import timm

    _, name, kwargs, timm_name, native = twin
    sized = {"img_size": size} if size != native and name in FIXED_INPUT_SIZE else {}
    torch.manual_seed(0)
    model = (Classifier(name, {**kwargs, **sized}) if which == "ours"
             else timm.create_model(timm_name, pretrained=False, **sized))
    return model.to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def timed(fn, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def matmul_flops(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    """FLOP/s of one ``a @ b`` (square float32 matrices)."""
    return 2 * a.shape[0] ** 3 / timed(lambda: a @ b, device)


#: profiler names of the matrix-multiply kernels (prefixes: oneDNN's linear has overloads)
GEMM_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise")
#: convolution kernels -> index of (input, weight) among their recorded input shapes
CONV_KERNELS = {"aten::mkldnn_convolution": (0, 1), "aten::convolution_backward": (1, 2)}


def is_gemm(event) -> bool:
    """Whether a profiler event (grouped by input shapes) is a GEMM: a matmul kernel, or a
    convolution (forward or backward) with a 1x1 kernel and one group, which is a GEMM over pixels."""
    if event.key.startswith(GEMM_KERNELS):
        return True
    if event.key not in CONV_KERNELS:
        return False
    x_at, w_at = CONV_KERNELS[event.key]
    shapes = event.input_shapes
    if len(shapes) <= w_at or len(shapes[w_at]) != 4 or len(shapes[x_at]) != 4:
        return False
    weight, x = shapes[w_at], shapes[x_at]
    return weight[2:] == [1, 1] and weight[1] == x[1]


def gemm_fraction(fn, reps: int) -> tuple[float, float]:
    """(seconds in GEMM kernels, wall seconds) of one profiled call of ``fn``: the least
    disturbed of ``reps`` (shortest wall time). Both come from the same call, so the fraction
    holds however fast the shared machine runs at that moment."""
    from torch.profiler import ProfilerActivity, profile

    best = (math.nan, math.inf)
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            start = time.perf_counter()
            fn()
            wall = time.perf_counter() - start
        kernel_us = sum(e.self_cpu_time_total for e in prof.key_averages(group_by_input_shape=True) if is_gemm(e))
        if wall < best[1]:
            best = (kernel_us / 1e6, wall)
    return best


def attention_flops(fn) -> int:
    """FLOPs of the fused attention kernels (SDPA forward and backward) in one call of ``fn``."""
    from torch.utils.flop_counter import FlopCounterMode

    from layers.attention import register_cpu_sdpa_flops

    register_cpu_sdpa_flops()  # teaches the counter the CPU attention kernels

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return sum(flops for op, flops in counter.get_flop_counts()["Global"].items()
               if "scaled_dot_product" in str(op))


def compare(
    twin: tuple,
    batch: int,
    reps: int,
    device: torch.device,
    img_size: int | None,
    train: bool = True,
    gemm_size: int = 0,
    gemm_bound: bool = False,
) -> dict:
    """Ours vs timm for one twin; with ``gemm_size`` also each one's share of the GEMM throughput,
    with ``gemm_bound`` the time our model spends in GEMMs (see the module docstring)."""
    size = img_size or twin[4]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=gen).to(device)
    x1 = x[:1].clone()
    y = torch.randint(0, 1000, (batch,), generator=gen).to(device)
    models = {which: build(which, twin, device, size) for which in ("ours", "timm")}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for k, m in models.items()}
    times: dict[str, dict[str, list[float]]] = {k: {"train": [], "infer": [], "latency": []} for k in models}
    gemm_rates: list[float] = []
    if gemm_size:
        a, b = (torch.randn(gemm_size, gemm_size, generator=gen).to(device) for _ in range(2))
        a @ b
    for k, m in models.items():  # warm-up: allocator, kernels, optimizer state
        if train:
            m.train()
            train_step(m, opts[k], x, y)
        m.eval()
        with torch.inference_mode():
            m(x)
            m(x1)
    for _ in range(reps):
        if gemm_size:
            gemm_rates.append(matmul_flops(a, b, device))
        for k, m in models.items():
            if train:
                m.train()
                times[k]["train"].append(timed(lambda: train_step(m, opts[k], x, y), device))
            m.eval()
            with torch.inference_mode():
                times[k]["infer"].append(timed(lambda: m(x), device))
                times[k]["latency"].append(timed(lambda: m(x1), device))
    result = {"model": twin[0], "timm": twin[3], "size": size, "batch": batch}
    for k in models:
        result[f"{k}_train_ips"] = batch / min(times[k]["train"]) if train else float("nan")
        result[f"{k}_infer_ips"] = batch / min(times[k]["infer"])
        result[f"{k}_latency_ms"] = 1e3 * min(times[k]["latency"])
    if gemm_size:
        from tasks.engine.cost import count_flops

        result["gemm_gflops"] = max(gemm_rates) / 1e9
        for k, m in models.items():
            result[f"{k}_gflop_per_image"] = count_flops(m, x1) / 1e9
            achieved = result[f"{k}_infer_ips"] * result[f"{k}_gflop_per_image"]
            result[f"{k}_gemm_share"] = achieved / result["gemm_gflops"]
            if train:
                result[f"{k}_train_gflop_per_image"] = train_step_flops(m, x, y) / batch / 1e9
                achieved = result[f"{k}_train_ips"] * result[f"{k}_train_gflop_per_image"]
                result[f"{k}_train_gemm_share"] = achieved / result["gemm_gflops"]
    if gemm_bound:
        ours = models["ours"]
        runs = {"infer": lambda: ours(x), "latency": lambda: ours(x1)}
        if train:
            runs["train"] = lambda: train_step(ours, opts["ours"], x, y)
        for mode, fn in runs.items():
            ours.train(mode == "train")
            with torch.inference_mode(mode != "train"):
                gemm_s, wall_s = gemm_fraction(fn, reps)
                attention_s = attention_flops(fn) / max(gemm_rates)
            ours_ms, timm_ms = (1e3 * min(times[k][mode]) for k in ("ours", "timm"))
            # GEMM and attention shares of our step, scaled to its interleaved best time
            result[f"ours_{mode}_gemm_ms"] = ours_ms * gemm_s / wall_s
            result[f"ours_{mode}_attention_ms"] = ours_ms * attention_s / wall_s
            result[f"ours_{mode}_ms"], result[f"timm_{mode}_ms"] = ours_ms, timm_ms
            result[f"{mode}_ceiling"] = timm_ms / (result[f"ours_{mode}_gemm_ms"] + result[f"ours_{mode}_attention_ms"])
    result["train_ratio"] = result["ours_train_ips"] / result["timm_train_ips"]
    result["infer_ratio"] = result["ours_infer_ips"] / result["timm_infer_ips"]
    result["latency_ratio"] = result["timm_latency_ms"] / result["ours_latency_ms"]
    return result


def memory_probe(which: str, index: int, batch: int, device_name: str, img_size: int | None) -> float:
    """Run in a fresh process: MB added by one training step (see module docstring)."""
    device = torch.device(device_name)
    twin = TWINS[index]
    size = img_size or twin[4]
    model = build(which, twin, device, size).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    train_step(model, opt, x, y)  # warm-up: optimizer state, allocator caches
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        train_step(model, opt, x, y)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    return peak_rss_growth(lambda: train_step(model, opt, x, y))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def conv_backward_flops(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                        _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    """A convolution's backward: each gradient asked for (input, weight) costs what the forward
    costs. PyTorch's own formula ignores ``groups`` and counts a depthwise convolution's weight
    gradient ``groups`` times over (ConvMixer-768/32: 2,015 instead of 124 GFLOP per image)."""
    out_spatial = x_shape[2:] if transposed else grad_out_shape[2:]
    forward = 2 * grad_out_shape[0] * math.prod(w_shape) * math.prod(out_spatial)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def train_step_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """FLOPs of one training step's forward, loss and backward (PyTorch's counter, train mode);
    about 3x the forward's, since each layer's backward computes the gradients of its input and
    of its weights."""
    from torch.utils.flop_counter import FlopCounterMode

    from layers.attention import register_cpu_sdpa_flops

    register_cpu_sdpa_flops()  # teaches the counter the CPU attention kernels

    model.train()
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: conv_backward_flops})
    with counter:
        nn.functional.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def peak_rss_growth(fn) -> float:
    """MB by which the resident set grows at most while ``fn`` runs (sampled every 0.5 ms).

    Free heap memory is handed back to the OS first (``malloc_trim``), so that the
    step cannot hide its allocations in memory freed earlier.
    """
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = peak = _rss_mb()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_mb())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak, _rss_mb()) - base


def peak_memory(index: int, batch: int, device: str, img_size: int | None) -> dict[str, float]:
    out = {}
    for which in ("ours", "timm"):
        cmd = [sys.executable, __file__, "--probe", which, str(index), "--batch", str(batch), "--device", device]
        if img_size:
            cmd += ["--img-size", str(img_size)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[which] = float(proc.stdout.strip().splitlines()[-1])
    return out


def markdown_table(columns: list[str], lines: list[str]) -> str:
    """A markdown table: a header of ``columns``, then ``lines`` (each already '| a | b |')."""
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns), *lines])


def markdown(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        mem = f"{r['ours_mem_mb']:.0f} / {r['timm_mem_mb']:.0f}" if "ours_mem_mb" in r else "-"
        train = (f"{r['ours_train_ips']:.1f} / {r['timm_train_ips']:.1f} ({r['train_ratio']:.2f})"
                 if r["ours_train_ips"] == r["ours_train_ips"] else "-")  # NaN: not measured
        lines.append(
            f"| {r['model']} ({r['timm']}) | {r['batch']}x{r['size']}² | {train} "
            f"| {r['ours_infer_ips']:.1f} / {r['timm_infer_ips']:.1f} ({r['infer_ratio']:.2f}) "
            f"| {r['ours_latency_ms']:.1f} / {r['timm_latency_ms']:.1f} ({r['latency_ratio']:.2f}) | {mem} |"
        )
    return markdown_table(["model (timm twin)", "input", "train img/s ours / timm (ratio)", "infer img/s ours / timm (ratio)",
                  "latency b=1 ms ours / timm (ratio)", "train-step peak MB ours / timm"], lines)


def gemm_share_markdown(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        train = (f"{r['ours_train_gflop_per_image']:.1f} / {r['timm_train_gflop_per_image']:.1f}, "
                 f"{100 * r['ours_train_gemm_share']:.0f} % / {100 * r['timm_train_gemm_share']:.0f} %"
                 if "ours_train_gemm_share" in r else "-")
        lines.append(
            f"| {r['model']} ({r['timm']}) | {r['batch']}x{r['size']}² "
            f"| {r['ours_gflop_per_image']:.2f} / {r['timm_gflop_per_image']:.2f} "
            f"| {r['ours_infer_ips']:.1f} / {r['timm_infer_ips']:.1f} | {r['gemm_gflops']:.0f} "
            f"| {100 * r['ours_gemm_share']:.0f} % / {100 * r['timm_gemm_share']:.0f} % | {train} |"
        )
    return markdown_table(["model (timm twin)", "input", "GFLOP / image ours / timm", "infer img/s ours / timm",
                  "GEMM GFLOP/s (same run)", "share of GEMM throughput ours / timm",
                  "training: GFLOP / image ours / timm, share ours / timm"], lines)


def gemm_bound_markdown(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        cells = [
            (f"{r[f'ours_{mode}_ms']:.1f} / {r[f'timm_{mode}_ms']:.1f} / {r[f'ours_{mode}_gemm_ms']:.1f} + "
             f"{r[f'ours_{mode}_attention_ms']:.1f} (**{r[f'{mode}_ceiling']:.2f}x**)") if f"{mode}_ceiling" in r else "-"
            for mode in ("train", "infer", "latency")
        ]
        lines.append(f"| {r['model']} ({r['timm']}) | {r['batch']}x{r['size']}² | " + " | ".join(cells) + " |")
    return markdown_table(["model (timm twin)", "input",
                  "training step ms: ours / timm / our GEMMs + attention products (ceiling)",
                  "inference batch ms: same", "batch-1 ms: same"], lines)


def main() -> None:
    from tasks.cli.runtime import reuse_freed_memory

    reuse_freed_memory()  # as the CLIs do; ours and the peer share this process, so both get it
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=None, help="label prefixes to run, e.g. mobilevitv2 vit-tiny (default: all)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=None, help="override each pair's input size")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--memory", action="store_true", help="also measure a training step's peak memory")
    parser.add_argument("--inference-only", action="store_true", help="skip the training measurement")
    parser.add_argument("--gemm-share", action="store_true", help="also report each model's share of the GEMM rate")
    parser.add_argument("--gemm-size", type=int, default=2048, help="side of the square matmul that sets the GEMM rate")
    parser.add_argument("--gemm-bound", action="store_true",
                        help="also profile the time our model spends in GEMMs, and the ratio that allows")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table (and .json) here")
    parser.add_argument("--probe", nargs=2, metavar=("WHICH", "INDEX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:
        print(memory_probe(args.probe[0], int(args.probe[1]), args.batch, args.device, args.img_size))
        return

    device = torch.device(args.device)
    registered = set(list_backbones())
    rows = []
    for index, twin in enumerate(TWINS):
        if args.models and not any(twin[0].startswith(m) for m in args.models):
            continue
        if twin[1] not in registered:
            print(f"skip {twin[0]}: backbone {twin[1]!r} is not registered", file=sys.stderr)
            continue
        row = compare(twin, args.batch, args.reps, device, args.img_size, train=not args.inference_only,
                      gemm_size=args.gemm_size if args.gemm_share or args.gemm_bound else 0,
                      gemm_bound=args.gemm_bound)
        if args.memory:
            mem = peak_memory(index, args.batch, args.device, args.img_size)
            row["ours_mem_mb"], row["timm_mem_mb"] = mem["ours"], mem["timm"]
        rows.append(row)
        print(
            f"{row['model']:>18}: train x{row['train_ratio']:.2f}  infer x{row['infer_ratio']:.2f}  "
            f"latency x{row['latency_ratio']:.2f}" + (f"  mem {mem['ours']:.0f}/{mem['timm']:.0f} MB" if args.memory else "")
            + (f"  GEMM share {100 * row['ours_gemm_share']:.0f}%/{100 * row['timm_gemm_share']:.0f}%"
               if args.gemm_share or args.gemm_bound else "")
            + (f" (training {100 * row['ours_train_gemm_share']:.0f}%/{100 * row['timm_train_gemm_share']:.0f}%)"
               if "ours_train_gemm_share" in row else "")
            + (f"  ceiling x{row.get('train_ceiling', float('nan')):.2f}/x{row['infer_ceiling']:.2f}"
               f"/x{row['latency_ceiling']:.2f}" if args.gemm_bound else ""),
            flush=True,
        )
    table = markdown(rows)
    if args.gemm_share or args.gemm_bound:
        table += "\n\n" + gemm_share_markdown(rows)
    if args.gemm_bound:
        table += "\n\n" + gemm_bound_markdown(rows)
    header = f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, batch {args.batch}, reps {args.reps}"
    print(f"\n{header}\n\n{table}")
    if args.out:
        args.out.write_text(f"{header}\n\n{table}\n")
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
