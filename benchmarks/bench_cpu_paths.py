"""What each CPU speed path gains on a number a user sees (a path kept in the suite gains at least 5 %).

    python benchmarks/bench_cpu_paths.py --threads 2 --reps 7

Every model is a task class built from its recipe (``benchmarks/gpu_suite.py``'s ``build_task``), with
random weights and BatchNorm statistics moved off their init. The numbers:

- CPU inference latency through the task: MobileViTv2-1.0 classification at 256 px (the ImageNet
  recipe), batch 1 and 8; the detection demo's SSDLite-MobileViTv2-0.5 at 128 px (``detect``: the
  network and the box decoding), batch 1; the segmentation demo's DeepLabv3-ConvMixer at 96 px,
  batch 1; the translation demo's Transformer translating one 20-token sentence by beam search (beam 4);
- demo ``fit`` time per step: one training step (forward, loss, backward, the recipe's optimizer) of
  the segmentation demo (ConvMixer, batch 8 at 96 px, whose 7x7 depthwise convs take
  ``depthwise_weight_grad``) and the classification demo (MobileViTv2-0.5, batch 32 at 64 px).

Each path of :mod:`layers.cpu_speedups` is measured as all paths on against all on but that one, in
one process, interleaved, best of ``--reps`` (on a shared machine other processes only ever add
time); "all off" is the plain model. The outputs of every variant are compared with the plain ones.
``mallopt`` (``tasks.cli.runtime.reuse_freed_memory``) is process-wide, so its rows alternate child
processes with and without it (``SUITE_SYSTEM_MALLOC=1``), best of ``--reps`` each.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_suite import RECIPES, Recipe, build_task, compute_loss, make_batch, make_optimizer  # noqa: E402
from layers.cpu_speedups import PATHS, cpu_speedups  # noqa: E402

MIN_GAIN = 0.05


def recipe(task: str, source: str, **kwargs) -> Recipe:
    known = next(r for r in RECIPES if r.task == task)
    return Recipe(task, "bench", source, known.network, None, num_classes=kwargs.pop("num_classes", known.num_classes),
                  **kwargs)


def perturbed(model: nn.Module) -> nn.Module:
    """BatchNorm statistics off their init (folding them in then changes the weights) and eval mode."""
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.normal_(0, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    return model.eval()


def inference_cases() -> dict:
    """name -> (callable running the model once, the paths that can change it)."""
    cases = {}
    classify = perturbed(build_task(recipe("classify", "configs/classify/imagenet_mobilevitv2_100.yaml",
                                           num_classes=1000)))
    classify.channels_last = False  # the recipe's GPU layout; on CPU the plain layout is faster
    for batch in (1, 8):
        images = torch.rand(batch, 3, 256, 256, generator=torch.Generator().manual_seed(0))
        cases[f"classify MobileViTv2-1.0 256 px, batch {batch}"] = (lambda x=images: classify(x), 1)
    detect = perturbed(build_task(recipe("detect", "configs/detect/demo_ssdlite_mobilevitv2.yaml")))
    image = torch.rand(1, 3, 128, 128, generator=torch.Generator().manual_seed(1))
    cases["detect demo SSDLite-MobileViTv2-0.5 128 px, batch 1"] = (lambda: detect.detect(image)[0]["scores"], 1)
    segment = perturbed(build_task(recipe("segment", "configs/segment/demo_deeplabv3_convmixer.yaml")))
    crop = torch.rand(1, 3, 96, 96, generator=torch.Generator().manual_seed(2))
    cases["segment demo DeepLabv3-ConvMixer 96 px, batch 1"] = (lambda: segment(crop)["out"], 1)
    translate = build_task(recipe("translate", "configs/translate/demo_transformer.yaml", tokens=16)).eval()
    sentence = torch.randint(4, 2000, (1, 20), generator=torch.Generator().manual_seed(3))
    sentence[0, -1] = translate.eos_id
    cases["translate demo Transformer, one 20-token sentence, beam 4"] = (
        lambda: translate.translate(sentence).tokens, 1)
    return cases


def fit_step_cases() -> dict:
    cases = {}
    for task, source in (("segment", "configs/segment/demo_deeplabv3_convmixer.yaml"),
                         ("classify", "configs/classify/demo_mobilevitv2.yaml")):
        r = recipe(task, source)
        torch.manual_seed(0)
        model = build_task(r).train()
        optimizer = make_optimizer(model, r)
        inputs, target = make_batch(r, torch.device("cpu"))

        def step(model=model, optimizer=optimizer, inputs=inputs, target=target, r=r):
            optimizer.zero_grad(set_to_none=True)
            loss = compute_loss(model, r, model(*inputs), target)
            loss.backward()
            if r.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), r.clip)
            optimizer.step()
            return loss.detach()

        cases[f"{task} demo fit step ({r.network if task != 'segment' else 'ConvMixer-192/8'}, "
              f"batch {r.batch} at {r.size} px)"] = (step, 1)
    return cases


def best_times(run, variants: dict[str, tuple[bool, tuple[str, ...]]], reps: int) -> tuple[dict, dict]:
    """Best seconds of ``run()`` under each variant (interleaved), and each variant's first output."""
    outputs, times = {}, {name: float("inf") for name in variants}
    for name, (on, paths) in variants.items():  # warm-up, and the outputs to compare
        with cpu_speedups(True), cpu_speedups(on, paths):
            outputs[name] = run()
    for _ in range(reps):
        for name, (on, paths) in variants.items():
            with cpu_speedups(True), cpu_speedups(on, paths):
                start = time.perf_counter()
                run()
                times[name] = min(times[name], time.perf_counter() - start)
    return times, outputs


def max_difference(a, b) -> float:
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape:
            return float("inf")
        return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    if isinstance(a, (list, tuple)):
        return max([max_difference(x, y) for x, y in zip(a, b)] + [0.0 if len(a) == len(b) else float("inf")])
    if hasattr(a, "__dict__"):
        return max_difference(list(vars(a).values()), list(vars(b).values()))
    return 0.0 if a == b else float("inf")


def measure_paths(cases: dict, paths: tuple[str, ...], reps: int, grad: bool) -> list[dict]:
    variants = {"all on": (True, PATHS), "all off": (False, PATHS)}
    variants |= {f"without {path}": (False, (path,)) for path in paths}
    rows = []
    for case, (run, _) in cases.items():
        with torch.set_grad_enabled(grad):
            times, outputs = best_times(run, variants, reps)
        for path in paths:
            on, off = times["all on"], times[f"without {path}"]
            rows.append({"number": case, "path": path, "on_ms": 1e3 * on, "off_ms": 1e3 * off, "gain": off / on - 1,
                         "plain_ms": 1e3 * times["all off"],
                         "max_diff": max_difference(outputs["all on"], outputs["all off"]) if not grad else None})
        print(f"{case}: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in times.items()), flush=True)
    return rows


CHILD = """
import json, sys, time, torch
sys.path.insert(0, {repo!r}); sys.path.insert(0, {repo!r} + "/benchmarks")
from tasks.cli.runtime import reuse_freed_memory
applied = reuse_freed_memory()
torch.set_num_threads({threads})
import bench_cpu_paths
cases = bench_cpu_paths.fit_step_cases()
out = {{}}
for name, (run, _) in cases.items():
    run()
    best = float("inf")
    for _ in range({steps}):
        start = time.perf_counter(); run(); best = min(best, time.perf_counter() - start)
    out[name] = best
print(json.dumps({{"applied": applied, "times": out}}))
"""


def measure_mallopt(threads: int, reps: int, steps: int) -> list[dict]:
    best = {True: {}, False: {}}
    for _ in range(reps):
        for reuse in (True, False):
            env = {k: v for k, v in os.environ.items() if k not in ("SUITE_SYSTEM_MALLOC", "SUITE_CPU_SPEEDUPS")}
            if not reuse:
                env["SUITE_SYSTEM_MALLOC"] = "1"
            code = CHILD.format(repo=str(REPO), threads=threads, steps=steps)
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            assert result["applied"] == reuse, result
            for name, seconds in result["times"].items():
                best[reuse][name] = min(best[reuse].get(name, float("inf")), seconds)
        print("mallopt: " + json.dumps(best), flush=True)
    return [{"number": name, "path": "mallopt (reuse_freed_memory)", "on_ms": 1e3 * best[True][name],
             "off_ms": 1e3 * best[False][name], "gain": best[False][name] / best[True][name] - 1, "plain_ms": None,
             "max_diff": None} for name in best[True]]


def table(rows: list[dict]) -> str:
    lines = ["| path | number | on ms | off ms | gain | plain (all off) ms | max abs diff vs plain | verdict |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        diff = "-" if r["max_diff"] is None else f"{r['max_diff']:.1e}"
        plain = "-" if r["plain_ms"] is None else f"{r['plain_ms']:.1f}"
        verdict = "≥ 5 %" if r["gain"] >= MIN_GAIN else "< 5 %"
        lines.append(f"| {r['path']} | {r['number']} | {r['on_ms']:.1f} | {r['off_ms']:.1f} | "
                     f"{100 * r['gain']:+.1f} % | {plain} | {diff} | {verdict} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions; the best of them counts")
    p.add_argument("--only", nargs="+", choices=["inference", "fit", "mallopt"],
                   default=["inference", "fit", "mallopt"])
    p.add_argument("--cases", nargs="+", default=None, help="only the numbers whose name contains one of these")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    from tasks.cli.runtime import reuse_freed_memory

    reuse_freed_memory()  # as the CLIs do
    torch.set_num_threads(args.threads)
    rows = []
    if "inference" in args.only:
        inference_paths = tuple(path for path in PATHS if path != "depthwise_weight_grad")
        cases = {k: v for k, v in inference_cases().items() if not args.cases or any(c in k for c in args.cases)}
        rows += measure_paths(cases, inference_paths, args.reps, grad=False)
    if "fit" in args.only and "depthwise_weight_grad" in PATHS:
        rows += measure_paths(fit_step_cases(), ("depthwise_weight_grad",), args.reps, grad=True)
    if "mallopt" in args.only:
        rows += measure_mallopt(args.threads, max(2, args.reps // 2), steps=3)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
