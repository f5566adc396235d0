"""CPU latency of the exported graphs on ONNX Runtime against our eager PyTorch and timm, in one process.

For each model, the graph ``python -m tasks.<task> export`` would write (built here with random
weights through the same :mod:`tasks.export.command` code, so no checkpoint is needed) is run by ONNX
Runtime (CPU provider, default graph optimisations) beside the eager PyTorch model
(``torch.inference_mode``, eval mode) and, for the classifiers, timm's twin, on the same input
at batch 1 and batch 8. Eager runs the same computation as the graph: logits for the classifiers,
``detect()`` (decoding + NMS) for SSDLite, the upsampled arg-max map for DeepLabv3.

Measurements are interleaved (ORT, ours, timm, ORT, ...) so that load from other processes hits all
alike, and the best of ``--reps`` repetitions (each the mean of ``--iters`` calls) is reported: on a
shared machine other processes only ever add time. PyTorch and ONNX Runtime get the same number of
threads (``--threads``, intra-op; one inter-op thread). The ratios are eager / ORT (> 1: ORT is faster).

    nice python benchmarks/bench_export.py --threads 1 --reps 5
    nice python benchmarks/bench_export.py --models mobilevitv2-0.5 ssdlite-demo --threads 2
"""
from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backbones import create_backbone  # noqa: E402
from tasks.classify import ClassificationTask  # noqa: E402
from tasks.export.classification import ClassifierGraph  # noqa: E402
from tasks.export.detection import CUSTOM_TRANSLATIONS, DetectorGraph  # noqa: E402
from tasks.export.onnx import export_graph  # noqa: E402
from tasks.export.segmentation import SegmenterGraph  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

#: label -> (our backbone, its kwargs, timm twin, input size)
CLASSIFIERS = {
    "mobilevitv2-0.5": ("mobilevitv2", {"width": 0.5}, "mobilevitv2_050", 256),
    "mobilevitv2-1.0": ("mobilevitv2", {"width": 1.0}, "mobilevitv2_100", 256),
    "mobilevit-xs": ("mobilevit", {"size": "xs"}, "mobilevit_xs", 256),
    "vit-tiny/16": ("vit", {"size": "tiny", "patch_size": 16}, "vit_tiny_patch16_224", 224),
}
#: label -> (task, demo recipe): the demo models, built from their recipes' model sections
DEMOS = {"ssdlite-demo": ("detect", "demo_ssdlite_mobilevitv2.yaml"),
         "deeplabv3-demo": ("segment", "demo_deeplabv3_mobilevitv2.yaml")}


def instantiate(spec: dict, factory: bool = False):
    """A ``{class_path, init_args}`` recipe entry as an object (or, ``factory``, a partial to call later)."""
    module, name = spec["class_path"].rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    return partial(cls, **spec.get("init_args", {})) if factory else cls(**spec.get("init_args", {}))


def demo_model(task: str, recipe: str) -> tuple[nn.Module, nn.Module, int]:
    """(the demo task module, its export graph, its evaluation image size) from the recipe, random weights."""
    config = yaml.safe_load((REPO / "configs" / task / recipe).read_text())
    model_args, data_args = config["model"], config["data"]
    backbone = instantiate(model_args["backbone"])
    head = instantiate(model_args["head"], factory=True)
    if task == "detect":
        from tasks.detect import DetectionTask

        model = DetectionTask(backbone=backbone, num_classes=10, head=head).eval()
        return model, DetectorGraph(model), data_args["image_size"]
    from tasks.segment import SegmentationTask

    model = SegmentationTask(backbone=backbone, class_names=["background", *map(str, range(10))], head=head).eval()
    return model, SegmenterGraph(model), 128  # the demo scenes are evaluated at their native 128 px


def eager_call(label: str, model: nn.Module):
    """What eager PyTorch runs for the same result as the graph."""
    if label == "ssdlite-demo":
        return model.detect
    if label == "deeplabv3-demo":
        return lambda x: model(x)["out"].argmax(1)
    return model


def session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def best_mean(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def measure(label: str, workdir: Path, batches: list[int], reps: int, iters: int, threads: int) -> list[dict]:
    import timm

    torch.manual_seed(0)
    timm_model = None
    if label in CLASSIFIERS:
        name, kwargs, timm_name, size = CLASSIFIERS[label]
        model = ClassificationTask(backbone=create_backbone(name, **kwargs), class_names=list(map(str, range(1000))))
        model.eval()
        graph = ClassifierGraph(model)
        timm_model = timm.create_model(timm_name, pretrained=False).eval()
        dynamic = {0: "batch"} if name == "vit" else {0: "batch", 2: "height", 3: "width"}
    else:
        model, graph, size = demo_model(*DEMOS[label])
        dynamic = {0: "batch"} if label == "ssdlite-demo" else {0: "batch", 2: "height", 3: "width"}
    x = torch.randn(2, 3, size, size)
    eager = eager_call(label, model)
    with torch.inference_mode():
        eager(x)  # the detector's anchors are cached for this size before the export reads them
    path = workdir / f"{label.replace('/', '_')}.onnx"
    start = time.perf_counter()
    export_graph(graph.eval(), (x,), path, ["images"], ["logits"] if label in CLASSIFIERS else
                 (["boxes", "scores", "labels", "num_detections"] if label == "ssdlite-demo" else ["labels"]),
                 {"images": dynamic}, 18, {}, {}, CUSTOM_TRANSLATIONS if label == "ssdlite-demo" else None)
    export_s = time.perf_counter() - start
    ort_session = session(path, threads)
    rows = []
    for batch in batches:
        images = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))
        feed = {"images": images.numpy()}
        runners = {"ort": lambda: ort_session.run(None, feed)}
        with torch.inference_mode():
            runners["eager"] = lambda: eager(images)
            if timm_model is not None:
                runners["timm"] = lambda: timm_model(images)
            for run in runners.values():  # warm-up
                run()
                run()
            times = {k: [] for k in runners}
            for _ in range(reps):
                for k, run in runners.items():
                    times[k].append(best_mean(run, iters))
        ms = {k: 1e3 * min(v) for k, v in times.items()}
        row = {"model": label, "input": f"{size}x{size}", "batch": batch, "export_s": export_s, **ms,
               "eager/ort": ms["eager"] / ms["ort"]}
        if "timm" in ms:
            row["timm/ort"] = ms["timm"] / ms["ort"]
        rows.append(row)
        print(markdown_row(row), flush=True)
    return rows


HEADER = ("| model | input | batch | ONNX Runtime ms | eager PyTorch ms | timm ms | eager / ORT | timm / ORT |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")


def markdown_row(row: dict) -> str:
    timm_ms = f"{row['timm']:.1f}" if "timm" in row else "-"
    timm_ratio = f"{row['timm/ort']:.2f}" if "timm/ort" in row else "-"
    return (f"| {row['model']} | {row['input']} | {row['batch']} | {row['ort']:.1f} | {row['eager']:.1f} | {timm_ms} "
            f"| {row['eager/ort']:.2f} | {timm_ratio} |")


def main() -> None:
    from tasks.cli.runtime import reuse_freed_memory

    reuse_freed_memory()  # as the CLIs do; ours and the peer share this process, so both get it
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=[*CLASSIFIERS, *DEMOS], choices=[*CLASSIFIERS, *DEMOS])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5, help="calls per repetition (their mean is one measurement)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of PyTorch and ONNX Runtime")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    import onnxruntime
    import timm

    print(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, timm {timm.__version__}, "
          f"{args.threads} thread(s), best of {args.reps} x {args.iters} calls\n\n{HEADER}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for label in args.models:
            measure(label, Path(tmp), args.batches, args.reps, args.iters, args.threads)


if __name__ == "__main__":
    main()
