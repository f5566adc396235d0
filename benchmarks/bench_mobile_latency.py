"""MobileViTv2 against MobileViT v1 at batch 1, 256 px, on the CPU runtimes we can run: the paper's
on-device latency claim, checked where the phone is not.

Each model is the suite's classifier (``backbone.forward_pooled`` -> ``heads.ClassifierHead``, 1000
classes, as ``tasks.classify.ClassificationTask.forward``) with random weights, in eval mode, run by

- eager PyTorch (``torch.inference_mode``),
- ExecuTorch with the XNNPACK delegate, float32 (``torch.export`` -> ``to_edge_transform_and_lower``),
- ExecuTorch XNNPACK INT8: PT2E static quantization with executorch's ``XNNPACKQuantizer`` (symmetric,
  per-channel weights), calibrated on ``--calibration`` random images (latency only: random weights and
  images say nothing of accuracy),
- ONNX Runtime float32 (CPU provider, default optimisations; torch's dynamo ONNX exporter, opset 18).

Every runtime's logits are compared with eager's (max |difference| in the table). Every model is built on
every runtime first, then the calls are interleaved over models and runtimes, so that load from other
processes hits the two models of a pair alike, and each
cell gives the median and the best of ``--runs`` single calls after two warm-up calls. PyTorch and ONNX
Runtime get ``--threads`` intra-op threads; XNNPACK's thread pool takes the machine's cores.

MobileViTv2 blocks run in the rank <= 5 layout that Core ML conversion uses
(``backbones.mobilevit_common.coreml_layout``) with ``--coreml-layout``; by default, as trained.

    nice python benchmarks/bench_mobile_latency.py --runs 30 --out benchmarks/results_mobile_latency.md
    python benchmarks/bench_mobile_latency.py --widths 0.5 --sizes xxs --runs 3 --size 64 --runtimes eager onnx
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from backbones import create_backbone  # noqa: E402
from backbones.mobilevit_common import coreml_layout  # noqa: E402
from bench_kernels import OursClassifier  # noqa: E402  (the suite's classifier, as tasks.classify runs it)

RUNTIMES = ("eager", "executorch", "executorch-int8", "onnx")
RUNTIME_NAMES = {"eager": "eager PyTorch", "executorch": "ExecuTorch XNNPACK fp32",
                 "executorch-int8": "ExecuTorch XNNPACK INT8", "onnx": "ONNX Runtime fp32"}
#: MobileViTv2 width -> the MobileViT v1 size it is set against (nearest in ImageNet-1k top-1 and
#: parameters: 0.5 / XXS, 0.75 / XS, 1.0 / S; tests/test_mobilevit.py holds the papers' parameter counts)
#: a cell of a runtime that a run (joined with --merge) did not measure
NOT_RUN = "not run"
PAIRS = {0.5: "xxs", 0.75: "xs", 1.0: "s"}
PAPER = ("The paper's iPhone latencies (MobileViTv2, arXiv 2206.02680, ImageNet-1k classification comparison, "
         "measured with Core ML on an iPhone) are not in this repository and are not copied here: see the paper. "
         "Its claim is that MobileViTv2 is faster than MobileViT v1 at similar accuracy on a mobile device.")


def build(label: str) -> nn.Module:
    torch.manual_seed(0)
    name, value = label.split("-", 1)
    backbone = create_backbone("mobilevitv2", width=float(value)) if name == "mobilevitv2" else \
        create_backbone("mobilevit", size=value)
    return OursClassifier(backbone).eval()  # images (B, 3, H, W) -> logits (B, 1000)


def executorch_runner(model: nn.Module, x: torch.Tensor, path: Path, calibration: list[torch.Tensor] | None):
    """Lower ``model`` (quantized first when ``calibration`` images are given) to an XNNPACK .pte at
    ``path`` and return a callable of ``x`` -> logits."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    if calibration is not None:
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
            XNNPACKQuantizer,
            get_symmetric_quantization_config,
        )
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
        prepared = prepare_pt2e(torch.export.export(model, (x,)).module(), quantizer)
        for images in calibration:
            prepared(images)
        model = convert_pt2e(prepared)
    program = to_edge_transform_and_lower(torch.export.export(model, (x,)), partitioner=[XnnpackPartitioner()])
    path.write_bytes(program.to_executorch().buffer)
    method = Runtime.get().load_program(str(path)).load_method("forward")
    return lambda images: method.execute([images])[0]


def onnx_runner(model: nn.Module, x: torch.Tensor, path: Path, threads: int):
    import onnxruntime as ort

    torch.onnx.export(model, (x,), dynamo=True, opset_version=18, input_names=["images"], verbose=False).save(path)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda images: torch.from_numpy(session.run(None, {"images": images.numpy()})[0])


def runners(model: nn.Module, x: torch.Tensor, runtimes: list[str], workdir: Path, calibration: int, threads: int):
    """runtime -> (callable of images -> logits, seconds to build it)."""
    built = {}
    for runtime in runtimes:
        start = time.perf_counter()
        path = workdir / f"{runtime}.{'onnx' if runtime == 'onnx' else 'pte'}"
        if runtime == "eager":
            run = model
        elif runtime == "onnx":
            run = onnx_runner(model, x, path, threads)
        else:
            images = None
            if runtime == "executorch-int8":
                generator = torch.Generator().manual_seed(1)
                images = [torch.randn(x.shape, generator=generator) for _ in range(calibration)]
            run = executorch_runner(model, x, path, images)
        built[runtime] = (run, time.perf_counter() - start)
        print(f"  built {runtime} in {built[runtime][1]:.0f} s", file=sys.stderr, flush=True)
    return built


def measure(labels: list[str], args, workdir: Path) -> list[dict]:
    """Build every model on every runtime, then time them round-robin over (model, runtime), so that load
    from other processes hits the two models of a pair alike and their ratio stays usable."""
    x = torch.randn(1, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
    built, diffs, params = {}, {}, {}
    layouts = contextlib.ExitStack()  # eager models stay in the layout they were exported in while timed
    for label in labels:
        model = build(label)
        params[label] = sum(p.numel() for p in model.parameters()) / 1e6
        (workdir / label).mkdir()
        if args.coreml_layout:
            layouts.enter_context(coreml_layout(model))
        with torch.inference_mode(False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built[label] = runners(model, x, args.runtimes, workdir / label, args.calibration, args.threads)
            with torch.inference_mode():
                expected = model(x)
                diffs[label] = {k: (run(x) - expected).abs().max().item() for k, (run, _) in built[label].items()}
        print(f"{label}: built", file=sys.stderr, flush=True)
    times = {(label, k): [] for label in labels for k in built[label]}
    with layouts, torch.inference_mode():
        for label in labels:  # warm-up
            for run, _ in built[label].values():
                run(x)
        for _ in range(args.runs):
            for label in labels:
                for k, (run, _) in built[label].items():
                    start = time.perf_counter()
                    run(x)
                    times[label, k].append(1e3 * (time.perf_counter() - start))
    rows = []
    for label in labels:
        cells = {k: {"median": statistics.median(times[label, k]), "best": min(times[label, k]),
                     "diff": diffs[label][k], "build_s": built[label][k][1]} for k in built[label]}
        rows.append({"model": label, "params": params[label], "cells": cells})
        print(f"{label}: " + ", ".join(f"{k} {c['median']:.1f} ms" for k, c in cells.items()), file=sys.stderr)
    return rows


def latency_table(rows: list[dict], runtimes: list[str]) -> str:
    head = "| model | params (M) | " + " | ".join(f"{RUNTIME_NAMES[r]} ms, median / best" for r in runtimes) + " |"
    lines = [head, "| --- | ---: |" + " ---: |" * len(runtimes)]
    for row in rows:
        cells = [f"{c['median']:.1f} / {c['best']:.1f}" if (c := row["cells"].get(r)) else NOT_RUN for r in runtimes]
        lines.append(f"| {row['model']} | {row['params']:.2f} | " + " | ".join(cells) + " |")
    lines += ["", "Largest |logit - eager logit| (random weights, one image) and seconds to build each runtime:", "",
              "| model | " + " | ".join(RUNTIME_NAMES[r] for r in runtimes) + " |",
              "| --- |" + " ---: |" * len(runtimes)]
    for row in rows:
        cells = [f"{c['diff']:.1e} ({c['build_s']:.0f} s)" if (c := row["cells"].get(r)) else NOT_RUN for r in runtimes]
        lines.append(f"| {row['model']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(rows: list[dict], runtimes: list[str]) -> str:
    """Per runtime and pair (v2 width / v1 size): v1 median / v2 median (> 1: v2 faster)."""
    by_label = {row["model"]: row for row in rows}
    pairs = [(f"mobilevitv2-{w:g}", f"mobilevit-{s}") for w, s in PAIRS.items()
             if f"mobilevitv2-{w:g}" in by_label and f"mobilevit-{s}" in by_label]
    if not pairs:
        return "No MobileViTv2 / MobileViT v1 pair was measured, so there is no ratio to report."
    lines = ["| runtime | " + " | ".join(f"{s} / {v2} (median)" for v2, s in pairs) + " | v2 faster in every pair |",
             "| --- |" + " ---: |" * len(pairs) + " --- |"]
    for runtime in runtimes:
        ratios = [by_label[s]["cells"][runtime]["median"] / by_label[v2]["cells"][runtime]["median"]
                  if runtime in by_label[s]["cells"] and runtime in by_label[v2]["cells"] else None for v2, s in pairs]
        measured = [r for r in ratios if r is not None]
        faster = ("yes" if all(r > 1 for r in measured) else "no") + ("" if len(measured) == len(ratios) else
                                                                      " (of the pairs measured)")
        lines.append(f"| {RUNTIME_NAMES[runtime]} | " + " | ".join(NOT_RUN if r is None else f"{r:.2f}" for r in ratios)
                     + f" | {faster if measured else NOT_RUN} |")
    return "\n".join(lines)


def machine(runtimes: list[str]) -> str:
    from importlib.metadata import version

    packages = ["torch"] + (["executorch"] if any(r.startswith("executorch") for r in runtimes) else []) \
        + (["onnxruntime"] if "onnx" in runtimes else [])
    return (f"{platform.machine()}, {os.cpu_count()} cores visible, shared with other processes; "
            + ", ".join(f"{p} {version(p)}" for p in packages) + f"; {torch.get_num_threads()} PyTorch / ORT threads")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", nargs="*", type=float, default=[0.5, 0.75, 1.0], help="MobileViTv2 widths")
    parser.add_argument("--sizes", nargs="*", default=["xxs", "xs", "s"], choices=["xxs", "xs", "s"],
                        help="MobileViT v1 sizes")
    parser.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=RUNTIMES)
    parser.add_argument("--size", type=int, default=256, help="image side (a multiple of 64)")
    parser.add_argument("--runs", type=int, default=30, help="timed calls per runtime (after 2 warm-up calls)")
    parser.add_argument("--calibration", type=int, default=8, help="random images that calibrate INT8")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of PyTorch and ONNX Runtime")
    parser.add_argument("--coreml-layout", action="store_true", help="MobileViTv2 blocks in the rank <= 5 layout")
    parser.add_argument("--out", type=Path, help="write the tables and the command to this markdown file "
                        "(and the measurements to the same name with .json)")
    parser.add_argument("--merge", nargs="*", type=Path, default=[],
                        help="the .json measurements of other runs (e.g. one pair each, run side by side): their "
                        "models are not measured again and join the tables")
    args = parser.parse_args(argv)
    if args.size <= 0 or args.size % 64:
        parser.error(f"--size must be a positive multiple of 64 (no block resizes then), got {args.size}")
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    unknown = [w for w in args.widths if w <= 0]
    if unknown:
        parser.error(f"--widths must be positive, got {unknown}")
    return args


def render(rows: list[dict], args: argparse.Namespace, command: str) -> str:
    """The markdown report; it names the command of every run whose rows it holds (--merge) and this one."""
    commands = list(dict.fromkeys(c for c in [*(row.get("command") for row in rows), command.strip()] if c))
    return "\n\n".join([
        f"Batch 1, {args.size}x{args.size}, random weights, {args.runs} timed calls per cell after 2 warm-up "
        f"calls, interleaved across models and runtimes; {machine(args.runtimes)}.",
        latency_table(rows, args.runtimes),
        "v1 latency / v2 latency per pair (> 1: MobileViTv2 is faster):",
        verdict(rows, args.runtimes),
        PAPER,
        "Commands: " + "; ".join(f"`{c}`" for c in commands),
    ])


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    v2 = [f"mobilevitv2-{w:g}" for w in args.widths]
    v1 = [f"mobilevit-{s}" for s in args.sizes]
    labels = [label for pair in zip(v2, v1) for label in pair] + v2[len(v1):] + v1[len(v2):]  # pairs first
    command = " ".join(["python benchmarks/bench_mobile_latency.py", *(sys.argv[1:] if argv is None else argv)])
    rows = [row for path in args.merge for row in json.loads(path.read_text())]
    labels += [row["model"] for row in rows if row["model"] not in labels]
    todo = [label for label in labels if label not in {row["model"] for row in rows}]
    with tempfile.TemporaryDirectory() as tmp:
        if todo:
            rows += [{**row, "command": command} for row in measure(todo, args, Path(tmp))]
    rows.sort(key=lambda row: labels.index(row["model"]))
    report = render(rows, args, command)
    if args.out:
        args.out.write_text(report + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(report)
    return report


if __name__ == "__main__":
    main()
