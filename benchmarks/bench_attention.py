"""Figure 1 of the MobileViTv2 paper: latency of one attention layer against the number of tokens k.

One layer (d=512, 8 heads; Linformer projects to p=256 tokens) maps a (1, k, 512)
sequence to (1, k, 512), forward only, eval mode, ``torch.inference_mode``; the
minimum latency over ``--reps`` runs (after a warm-up; on a shared machine other
processes only ever add time) is reported for k = 64 .. 4096. Variants that need
a maximum length (Linformer, Synthesizers) are built for exactly k tokens.
Writes a markdown table and a log-log PNG plot::

    nice python benchmarks/bench_attention.py --out benchmarks/attention_latency --reps 5

produces ``benchmarks/attention_latency.md`` and ``benchmarks/attention_latency.png``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layers.attention import build_attention  # noqa: E402

DIM, HEADS, PROJ_LEN = 512, 8, 256
TOKENS = [64, 128, 256, 512, 1024, 2048, 4096]
#: label -> (registered name, extra kwargs given k)
VARIANTS = {
    "standard (MHA)": ("mha", lambda k: {}),
    "Linformer (p=256)": ("linformer", lambda k: {"max_len": k, "proj_len": PROJ_LEN}),
    "separable (MobileViTv2)": ("separable", lambda k: {}),
    "Synthesizer dense": ("synthesizer_dense", lambda k: {"max_len": k}),
    "Synthesizer random": ("synthesizer_random", lambda k: {"max_len": k}),
}


def latency_ms(name: str, kwargs: dict, k: int, reps: int, device: torch.device) -> float:
    torch.manual_seed(0)
    layer = build_attention(name, DIM, HEADS, **kwargs).to(device).eval()
    x = torch.randn(1, k, DIM, device=device)
    times = []
    with torch.inference_mode():
        layer(x)  # warm-up
        for _ in range(reps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            layer(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return 1e3 * min(times)  # the least disturbed run: other processes only ever add time


def main() -> None:
    from tasks.cli.runtime import reuse_freed_memory

    reuse_freed_memory()  # as the CLIs do; ours and the peer share this process, so both get it
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="path stem: writes <out>.md and <out>.png")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    results: dict[str, list[float]] = {}
    for label, (name, extra) in VARIANTS.items():
        results[label] = []
        for k in args.tokens:
            results[label].append(latency_ms(name, extra(k), k, args.reps, device))
            print(f"{label:>24} k={k:5d}: {results[label][-1]:9.3f} ms", flush=True)

    header = (
        f"One attention layer, d={DIM}, {HEADS} heads, batch 1, forward, best of {args.reps}; "
        f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads. Latency in ms."
    )
    lines = [header, "", "| k | " + " | ".join(results) + " |", "| ---: |" + " ---: |" * len(results)]
    for i, k in enumerate(args.tokens):
        lines.append(f"| {k} | " + " | ".join(f"{results[label][i]:.3f}" for label in results) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label, values in results.items():
        ax.plot(args.tokens, values, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("number of tokens k")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"One attention layer (d={DIM}, {HEADS} heads), {device}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
