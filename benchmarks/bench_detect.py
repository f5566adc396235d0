"""Detection benchmarks, each side by side with its peer in the same process.

    python benchmarks/bench_detect.py sizes          # params + FLOPs at 320 vs the papers' tables
    python benchmarks/bench_detect.py train          # training images/s at 320, ours vs torchvision SSDLite
    python benchmarks/bench_detect.py data           # data pipeline images/s, ours vs torchvision's SSD preset
    python benchmarks/bench_detect.py eval           # COCO eval time: our metric vs pycocotools (same numbers checked)

The demo mAP curve is a plain run of the default recipe with a CSV logger, see results_detect.md.
Numbers depend on the machine and on what else runs on it: compare rows of one run only.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# SSDLite rows of the MobileViTv2 paper (Table 4) and the MobileViT paper (Table 2), millions of parameters
PAPER_PARAMS = {("mobilevitv2", 0.5): 2.0, ("mobilevitv2", 0.75): 3.6, ("mobilevitv2", 1.0): None,
                ("mobilevitv2", 1.75): 14.9, ("mobilevit", "xxs"): 1.7, ("mobilevit", "xs"): 2.7,
                ("mobilevit", "s"): 5.7}


def build_detector(family: str, arg, num_classes: int = 80):
    from backbones.mobilevit import MobileViT
    from backbones.mobilevitv2 import MobileViTv2
    from heads.ssdlite import SSDLiteHead

    backbone = MobileViTv2(width=arg) if family == "mobilevitv2" else MobileViT(size=arg)
    return backbone, SSDLiteHead(backbone.feature_channels, num_classes)


def bench_sizes(args) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    print("| model | params (M) | paper (M) | GMACs at 320 |")
    print("|---|---|---|---|")
    for (family, arg), paper in PAPER_PARAMS.items():
        backbone, head = build_detector(family, arg)
        backbone.eval(), head.eval()
        params = sum(p.numel() for n, p in backbone.named_parameters() if not n.startswith("final_conv"))
        params += sum(p.numel() for p in head.parameters())
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            head(backbone(torch.randn(1, 3, 320, 320)))
        name = f"SSDLite-{'MobileViTv2-' + str(arg) if family == 'mobilevitv2' else 'MobileViT-' + arg.upper()}"
        print(f"| {name} | {params / 1e6:.2f} | {paper if paper else '-'} | {counter.get_total_flops() / 2e9:.2f} |")


def _train_rate(model_step, batch, steps) -> float:
    model_step(batch)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        model_step(batch)
    return steps * len(batch[0]) / (time.perf_counter() - start)


def bench_train(args) -> None:
    """Training images/s at 320 (forward, loss, backward, AdamW step), synthetic images with 5 boxes each."""
    from torchvision.models.detection import ssdlite320_mobilenet_v3_large

    torch.manual_seed(0)
    bs = args.batch_size
    images = torch.randn(bs, 3, 320, 320)
    boxes = torch.tensor([[10.0, 20.0, 120.0, 200.0], [150, 40, 300, 120], [30, 220, 90, 300],
                          [200, 200, 310, 310], [100, 100, 180, 160]])
    targets = [{"boxes": boxes, "labels": torch.tensor([1, 5, 9, 30, 70])} for _ in range(bs)]

    backbone, head = build_detector("mobilevitv2", 0.5)
    params = list(backbone.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)

    def ours(batch):
        x, t = batch
        loss = head.loss(head(backbone(x)), t, (320, 320))["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()

    tv_model = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=81).train()
    tv_opt = torch.optim.AdamW(tv_model.parameters(), lr=1e-4)

    def torchvision_ssdlite(batch):
        x, t = batch
        # torchvision normalises and resizes inside the model; give it 320 px images already
        losses = tv_model(list(x), [{"boxes": d["boxes"], "labels": d["labels"] + 1} for d in t])
        loss = sum(losses.values())
        tv_opt.zero_grad()
        loss.backward()
        tv_opt.step()

    print(f"torch threads: {torch.get_num_threads()}, batch {bs}, {args.steps} timed steps")
    print("| model | params (M) | train images/s at 320 |")
    print("|---|---|---|")
    for name, step, n in [("SSDLite-MobileViTv2-0.5 (ours)", ours, sum(p.numel() for p in params)),
                          ("torchvision ssdlite320_mobilenet_v3_large", torchvision_ssdlite,
                           sum(p.numel() for p in tv_model.parameters()))]:
        print(f"| {name} | {n / 1e6:.2f} | {_train_rate(step, (images, targets), args.steps):.2f} |")


def bench_data(args) -> None:
    """Training-pipeline images/s with ``--workers`` workers on the demo train split, vs torchvision's
    SSD reference preset (torchvision.datasets.CocoDetection + transforms v2, PIL decoding)."""
    from collections import defaultdict

    import torchvision
    from torch.utils.data import DataLoader
    from torchvision import tv_tensors
    from torchvision.transforms import v2

    from datamodules.coco import CocoDataModule

    dm = CocoDataModule(image_size=320, batch_size=32, num_workers=args.workers, zoom_out_max=4.0, hflip=0.5)
    dm.setup("fit")
    ours = dm.train_dataloader()

    preset = v2.Compose([  # torchvision references/detection/presets.py, "ssdlite", tensor backend
        v2.ToImage(),
        v2.RandomPhotometricDistort(p=1),
        v2.RandomZoomOut(fill=defaultdict(lambda: 0, {tv_tensors.Image: (123, 117, 104)})),
        v2.RandomIoUCrop(),
        v2.RandomHorizontalFlip(p=0.5),
        v2.Resize((320, 320), antialias=True),  # done inside torchvision's model; here, for equal work
        v2.ToDtype(torch.float, scale=True),
        v2.SanitizeBoundingBoxes(),
    ])
    split = dm.hparams.train_split
    reference = torchvision.datasets.CocoDetection(str(dm.root / split), str(dm.annotation_file(split)),
                                                   transforms=preset)
    reference = torchvision.datasets.wrap_dataset_for_transforms_v2(reference, target_keys=("boxes", "labels"))
    # the reference recipe drops images without boxes (RandomIoUCrop needs one); do the same for timing
    keep = [i for i, image_id in enumerate(reference.ids) if reference.coco.getAnnIds(imgIds=image_id, iscrowd=False)]
    ref_loader = DataLoader(torch.utils.data.Subset(reference, keep), batch_size=32, shuffle=True,
                            num_workers=args.workers, collate_fn=lambda b: tuple(zip(*b)))

    print(f"{args.workers} workers, batch 32, 320 px, {args.batches} timed batches after one warm-up batch")
    print("| pipeline | images/s |")
    print("|---|---|")
    # ours: {"image": (B, 3, 320, 320), "targets": [...], "skipped": n}; the reference: (images, targets)
    for name, loader, images_of in [("ours (decode_image + v2 SSD augmentation)", ours, lambda b: b["image"]),
                                    ("torchvision SSD preset (CocoDetection, PIL)", ref_loader, lambda b: b[0])]:
        it = iter(loader)
        next(it)
        start, n = time.perf_counter(), 0
        for _ in range(args.batches):
            n += len(images_of(next(it)))
        print(f"| {name} | {n / (time.perf_counter() - start):.1f} |")


def synthetic_coco_eval_set(num_images: int, seed: int = 0):
    """``num_images`` images of 640x480 with 0-14 objects of 80 classes each and 100 detections per
    image (jittered copies of the objects, 30 % with a random class; images without objects get boxes
    around the origin) -> ``(dataset, results, preds, targets)``: the COCO annotation dict and results
    list pycocotools reads, and the same float32 numbers as the metric's per-image tensors
    (labels = category id - 1)."""
    rng = np.random.default_rng(seed)
    images, annotations, preds, targets, results = [], [], [], [], []
    for image_id in range(1, num_images + 1):
        images.append({"id": image_id, "width": 640, "height": 480, "file_name": f"{image_id}.jpg"})
        n = int(rng.integers(0, 15))
        xy = rng.uniform(0, 500, (n, 2))
        wh = rng.uniform(8, 200, (n, 2))
        gt_boxes = np.concatenate([xy, xy + wh], 1)
        gt_labels = rng.integers(0, 80, n)
        picks = rng.integers(0, max(n, 1), 100)
        det = (gt_boxes[picks] if n else np.zeros((100, 4))) + rng.normal(0, 10, (100, 4))
        det[:, 2:] = np.maximum(det[:, 2:], det[:, :2] + 1)
        det_labels = np.where(rng.random(100) < 0.7, gt_labels[picks] if n else 0, rng.integers(0, 80, 100))
        scores = rng.random(100)
        gt_boxes, det, scores = (torch.tensor(a, dtype=torch.float32) for a in (gt_boxes, det, scores))
        area = torch.tensor(wh[:, 0] * wh[:, 1], dtype=torch.float32)
        preds.append({"boxes": det, "scores": scores, "labels": torch.tensor(det_labels)})
        targets.append({"boxes": gt_boxes.reshape(-1, 4), "labels": torch.tensor(gt_labels), "area": area,
                        "iscrowd": torch.zeros(n, dtype=torch.long)})
        for box, label, a in zip(gt_boxes.tolist(), gt_labels.tolist(), area.tolist()):
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": label + 1,
                                "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]], "area": a, "iscrowd": 0})
        for box, s, label in zip(det.tolist(), scores.tolist(), det_labels.tolist()):
            results.append({"image_id": image_id, "category_id": label + 1,
                            "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]], "score": s})
    dataset = {"images": images, "annotations": annotations,
               "categories": [{"id": k + 1, "name": str(k)} for k in range(80)]}
    return dataset, results, preds, targets


def bench_eval(args) -> None:
    """COCO bbox evaluation of ``--images`` synthetic images (80 classes, ~7 objects, 100 detections
    each): our metric (update + compute) and the torchmetrics metric it replaced (faster_coco_eval
    backend) against pycocotools' COCOeval (load results + evaluate + accumulate + summarize), each
    timed from a process with the previous one's objects freed, best of ``--repeats``
    (pycocotools: of ``--reference-repeats``). Checks that all 12 stats and the per-class precision /
    recall arrays equal pycocotools'."""
    import gc
    import json

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    from torchmetrics.detection import MeanAveragePrecision

    from tasks.metrics.coco_map import CocoMeanAveragePrecision

    dataset, results, preds, targets = synthetic_coco_eval_set(args.images)
    image_ids = [image["id"] for image in dataset["images"]]

    def pycocotools(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        with contextlib.redirect_stdout(io.StringIO()):
            gt = COCO(str(path))
            evaluator = COCOeval(gt, gt.loadRes(results), "bbox")
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
        return evaluator.stats.copy(), evaluator.eval["precision"].copy(), evaluator.eval["recall"].copy()

    def ours() -> dict:
        metric = CocoMeanAveragePrecision(extended_summary=True)
        metric.update(preds, targets, image_ids)
        return metric.compute()

    def torchmetrics() -> dict:  # the metric before: torchmetrics, configured as ours was
        metric = MeanAveragePrecision(box_format="xyxy", iou_type="bbox", backend="faster_coco_eval",
                                      iou_thresholds=np.linspace(0.5, 0.95, 10).tolist(),
                                      rec_thresholds=np.linspace(0.0, 1.0, 101).tolist())
        metric.update(preds, targets)
        return metric.compute()

    def best_of(repeats: int, run) -> tuple[float, object]:
        times = []
        for _ in range(repeats):
            gc.collect()
            start = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - start)
        return min(times), out

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gt.json"
        path.write_text(json.dumps(dataset))
        t_reference, (stats, precision, recall) = best_of(args.reference_repeats, lambda: pycocotools(path))
    t_ours, values = best_of(args.repeats, ours)
    t_torchmetrics, previous = best_of(args.repeats, torchmetrics)

    from tasks.detect import MAP_KEYS

    stats_diff = max(abs(float(values[k]) - stats[i]) for i, k in enumerate(MAP_KEYS))
    # per category: ours holds the labels seen (K), pycocotools all 80 category ids (label + 1)
    columns = values["classes"].long().numpy()
    unseen = np.setdiff1d(np.arange(80), columns)
    arrays_diff = max(np.abs(values["precision"].numpy() - precision[:, :, columns]).max(),
                      np.abs(values["recall"].numpy() - recall[:, columns]).max(),
                      np.abs(precision[:, :, unseen] + 1).max(initial=0), np.abs(recall[:, unseen] + 1).max(initial=0))
    print(f"{args.images} images, {len(dataset['annotations'])} objects, {len(results)} detections; "
          f"ours vs pycocotools, max |difference|: 12 stats {stats_diff:.1e}, per-class precision/recall "
          f"arrays {arrays_diff:.1e}")
    print("| evaluator | seconds | AP | vs pycocotools |")
    print("|---|---|---|---|")
    print(f"| pycocotools COCOeval | {t_reference:.2f} | {stats[0]:.4f} | 1.0x |")
    print(f"| torchmetrics MeanAveragePrecision, faster_coco_eval backend (the metric before) | {t_torchmetrics:.2f} | "
          f"{float(previous['map']):.4f} | {t_reference / t_torchmetrics:.1f}x |")
    print(f"| ours: CocoMeanAveragePrecision (faster_coco_eval from flat arrays) | {t_ours:.2f} | "
          f"{float(values['map']):.4f} | {t_reference / t_ours:.1f}x |")


def main() -> None:
    from tasks.cli.runtime import reuse_freed_memory

    reuse_freed_memory()  # as the CLIs do; ours and the peer share this process, so both get it
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["sizes", "train", "data", "eval"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3, help="eval: best of this many runs of each metric")
    parser.add_argument("--reference-repeats", type=int, default=1, help="eval: best of this many pycocotools runs")
    args = parser.parse_args()
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    {"sizes": bench_sizes, "train": bench_train, "data": bench_data, "eval": bench_eval}[args.what](args)


if __name__ == "__main__":
    main()
