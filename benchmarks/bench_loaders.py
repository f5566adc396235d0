"""Training data-loader throughput of each task's paper recipe per worker: the suite's pipelines and the former ones.

For each recipe's ``data:`` section (augmentation and per-device batch size as configured)
the task's own datamodule is built, ``setup("fit")`` run and batches drawn from
``train_dataloader()`` exactly as ``fit`` draws them: seeded per-sample augmentation,
collation (and MixUp/CutMix for classification) inside the workers, persistent workers.
Reading the rate of 1 worker (or of 0: all in the main process) gives the number of workers
a GPU needs: workers = GPU images/s / images/s per worker (on enough free cores).

Before and after. ``before`` builds the suite's former pipelines, the baseline (defined below:
torchvision's SSD chain on the full-size photo, torchvision's RandAugment kernels and MixUp /
CutMix, OpenCV's default thread pool in each worker); ``after`` the current ones
(:mod:`datamodules.detection_transforms`, :mod:`datamodules.classification_transforms`, one
OpenCV thread per worker, set in the main process before the workers fork). The variant is
chosen by pointing the datamodule modules' builder names at it for the measurement. Both
variants are measured in one process, alternately (``--repeats`` rounds), and the best of each
is reported with their ratio, so a busy machine slows both alike.

Reading. ``folder``: the image files in the dataset's layout. ``streamed``: the same copy
converted once by ``python -m datamodules.optimize`` into LitData chunks, trained from with
``streaming_root``.

Data. The embedded demo sets are tiny images (8x8 digits upsampled to 32 px, 128-192 px
scenes), far cheaper to decode and resize than the benchmarks' photos. So each demo set is
copied once, in the same layout, with its images upscaled to the benchmark's typical size
(ImageNet 500x375, COCO 640x480, ADE20k 683x512, VOC 500x375; masks resized nearest, COCO
boxes, areas and RLE masks scaled with them) and saved as JPEG with added grain
(:data:`GRAIN`) so that files are photo-like in size (the "mean file" column; ImageNet
averages ~110 KB, COCO ~160 KB): smooth upscaled digits would compress to a fraction and
decode faster than photos. For translation the copy joins consecutive demo lines into
sentences of WMT14 length (~24 words). Copies live in the demo cache
(``$SUITE_DATA_CACHE``, see ``datamodules/demo.py``). ``--native`` measures the demo files as
they are (ADE20k: the VOC-layout demo converted to the ADE20k layout, not resized).

Timing. ``torch.set_num_threads(1)`` in the main process too, so 0 workers is one
single-threaded loading process, like each DataLoader worker (OpenCV aside: before, its pool
uses every core even with 0 workers). The first ``max(1, workers)`` batches are skipped (worker
start-up; all workers deliver their first batch at about the same moment), then at least
``--images`` images, in whole batches and a multiple of the workers, are timed from the last
skipped batch on. Epochs roll over as in training. Rates depend on what else runs on the
machine: with more workers than free cores the per-worker rate drops. The CPU time that the main
process and its workers spend in the timed window, per image ("CPU ms per image"), depends much
less on it: it is what a loader core has to give per image, so 1000 / it is the images/s of one
dedicated core, and GPU images/s x it / 1000 the cores a GPU needs.

    nice python benchmarks/bench_loaders.py                                  # all four, 0 1 2 workers
    nice python benchmarks/bench_loaders.py --pipelines coco imagenet ade20k --reading folder streamed
    nice python benchmarks/bench_loaders.py --pipelines ade20k voc --workers 0 4 8 --variants after
    python benchmarks/bench_loaders.py --native --images 16 --batch-size 4 --workers 0 1 --repeats 1
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import cv2
import numpy as np
import torch
import yaml
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from datamodules import classification_transforms, detection_transforms  # noqa: E402
from datamodules.coco import CocoDataModule  # noqa: E402
from datamodules.demo import demo_root  # noqa: E402
from datamodules.demo_text import demo_translation_root  # noqa: E402
from datamodules.imagefolder import ImageFolderDataModule  # noqa: E402
from datamodules.images import IMAGE_EXTENSIONS, collate_skipping  # noqa: E402
from datamodules.segmentation import (IGNORE_INDEX, SegmentationDataModule, read_mask,  # noqa: E402
                                      read_split_list)
from datamodules.tokenizer import PAD_ID  # noqa: E402
from datamodules.wmt import TranslationDataModule, read_parallel  # noqa: E402

#: std (grey levels) of the Gaussian grain added to upscaled images: at JPEG quality 90 a
#: 500x375 image then takes ~75 KB instead of ~13 KB smooth (real ImageNet: ~110 KB)
GRAIN = 16.0
JPEG_QUALITY = 90
#: mean words per source sentence of WMT14 en-de training data
WMT_WORDS = 24
#: bump when a builder below changes, so stale copies are rebuilt
BUILD_VERSION = 1


# -- benchmark-sized copies of the demo sets ----------------------------------------------------------------
_grain_cache: dict[tuple[int, int], np.ndarray] = {}


def upscale(src: Path, dst: Path, size: tuple[int, int] | None) -> None:
    """Write image ``src`` as JPEG ``dst``, resized to ``size`` (width, height) with grain; ``None``: as is."""
    with Image.open(src) as img:
        image = img.convert("RGB")
    if size is not None:
        image = image.resize(size, Image.BICUBIC)
        if size not in _grain_cache:  # one field for all images: JPEG size and decode time do not need fresh noise
            _grain_cache[size] = np.random.default_rng(0).normal(0, GRAIN, (size[1], size[0], 3)).astype(np.float32)
        image = Image.fromarray(np.clip(np.asarray(image) + _grain_cache[size], 0, 255).astype(np.uint8))
    dst.parent.mkdir(parents=True, exist_ok=True)
    image.save(dst, format="JPEG", quality=JPEG_QUALITY)


def save_mask(labels: np.ndarray | Image.Image, dst: Path, size: tuple[int, int] | None) -> None:
    """Write a label mask as PNG, resized nearest (palette images keep their palette)."""
    mask = labels if isinstance(labels, Image.Image) else Image.fromarray(labels)
    dst.parent.mkdir(parents=True, exist_ok=True)
    (mask if size is None else mask.resize(size, Image.NEAREST)).save(dst)


def build_imagefolder(demo: Path, root: Path, size, recipe: dict) -> None:
    """ImageFolder ``train/`` and ``val/`` (what ``setup("fit")`` reads), images upscaled to JPEG."""
    for split in ("train", "val"):
        for src in sorted((demo / split).rglob("*")):
            if src.suffix in IMAGE_EXTENSIONS:
                upscale(src, (root / src.relative_to(demo)).with_suffix(".JPEG"), size)


def scale_segmentation(segmentation, sx: float, sy: float, size: tuple[int, int]):
    """A COCO segmentation (polygons or RLE) of an image stretched by ``sx``, ``sy`` to ``size`` (w, h)."""
    from pycocotools import mask as mask_utils

    if isinstance(segmentation, list):  # polygons: [[x0, y0, x1, y1, ...], ...]
        return [[v * (sy if i % 2 else sx) for i, v in enumerate(polygon)] for polygon in segmentation]
    if isinstance(segmentation["counts"], list):  # uncompressed RLE (crowds)
        segmentation = mask_utils.frPyObjects(segmentation, *segmentation["size"])
    mask = Image.fromarray(mask_utils.decode(segmentation)).resize(size, Image.NEAREST)
    rle = mask_utils.encode(np.asfortranarray(np.asarray(mask)))
    return {"size": list(rle["size"]), "counts": rle["counts"].decode("ascii")}


def build_coco(demo: Path, root: Path, size, recipe: dict) -> None:
    """COCO ``train2017``/``val2017`` with images stretched to ``size`` and boxes, areas, masks scaled alike."""
    for split in ("train2017", "val2017"):
        dataset = json.loads((demo / "annotations" / f"instances_{split}.json").read_text())
        scale = {}
        for info in dataset["images"]:
            width, height = size or (info["width"], info["height"])
            scale[info["id"]] = (width / info["width"], height / info["height"])
            info["width"], info["height"] = width, height
            upscale(demo / split / info["file_name"], root / split / info["file_name"], size)
        for ann in dataset["annotations"]:
            sx, sy = scale[ann["image_id"]]
            x, y, w, h = ann["bbox"]
            ann["bbox"] = [x * sx, y * sy, w * sx, h * sy]
            ann["area"] *= sx * sy
            if size is not None:
                ann["segmentation"] = scale_segmentation(ann["segmentation"], sx, sy, size)
        (root / "annotations").mkdir(parents=True, exist_ok=True)
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(dataset))


def build_ade20k(demo: Path, root: Path, size, recipe: dict) -> None:
    """The VOC-layout demo as ``ADEChallengeData2016``: ``images/`` + ``annotations/`` (training,
    validation), masks in ADE20k's encoding (label + 1, ignore = 0)."""
    voc_format = SegmentationDataModule(root=str(demo)).mask_format
    for voc_split, ade_split in (("train", "training"), ("val", "validation")):
        for stem in read_split_list(demo / "ImageSets" / "Segmentation" / f"{voc_split}.txt"):
            upscale(demo / "JPEGImages" / f"{stem}.jpg", root / "images" / ade_split / f"{stem}.jpg", size)
            mask_path = demo / "SegmentationClass" / f"{stem}.png"
            labels = voc_format.decode(read_mask(mask_path), mask_path)
            ade = np.where(labels == IGNORE_INDEX, 0, labels.astype(np.int64) + 1).astype(np.uint8)
            save_mask(ade, root / "annotations" / ade_split / f"{stem}.png", size)


def build_voc(demo: Path, root: Path, size, recipe: dict) -> None:
    """VOC 2012 layout, with ``SegmentationClassAug`` + ``train_aug.txt`` (here: the train masks) for
    recipes that train on the SBD-augmented set."""
    lists = root / "ImageSets" / "Segmentation"
    lists.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        list_file = demo / "ImageSets" / "Segmentation" / f"{split}.txt"
        for stem in read_split_list(list_file):
            upscale(demo / "JPEGImages" / f"{stem}.jpg", root / "JPEGImages" / f"{stem}.jpg", size)
            with Image.open(demo / "SegmentationClass" / f"{stem}.png") as mask:
                for folder in ("SegmentationClass", "SegmentationClassAug"):
                    save_mask(mask, root / folder / f"{stem}.png", size)
        (lists / f"{split}.txt").write_text(list_file.read_text())
    (lists / "train_aug.txt").write_text((lists / "train.txt").read_text())
    (root / "class_names.txt").write_text((demo / "class_names.txt").read_text())


def build_wmt(demo: Path, root: Path, words, recipe: dict) -> None:
    """Parallel files whose line i joins demo lines i, i+1, ... (cyclically) to ``words`` source words on average."""
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid", "test"):
        sides = read_parallel(demo / f"{split}.{recipe['src_lang']}", demo / f"{split}.{recipe['tgt_lang']}")
        n = len(sides[0])
        k = max(1, round(words * n / sum(len(line.split()) for line in sides[0])))
        for lang, lines in zip((recipe["src_lang"], recipe["tgt_lang"]), sides):
            joined = (" ".join(lines[(i + j) % n] for j in range(k)) for i in range(n))
            (root / f"{split}.{lang}").write_text("".join(line + "\n" for line in joined), encoding="utf-8")


# -- the pipelines -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pipeline:
    config: str                         # paper recipe whose ``data:`` section is measured
    datamodule: type
    size: tuple[int, int] | int         # typical benchmark image (width, height); words per sentence for text
    demo: Callable[[dict], Path]        # recipe data -> root of the embedded demo set
    build: Callable[[Path, Path, object, dict], None]  # (demo root, new root, size or None, recipe data)
    demo_in_layout: bool = True         # False: ``--native`` still converts the demo's layout

    @property
    def text(self) -> bool:
        return self.datamodule is TranslationDataModule


PIPELINES = {
    "imagenet": Pipeline("configs/classify/imagenet_mobilevitv2_200.yaml", ImageFolderDataModule, (500, 375),
                         lambda recipe: ImageFolderDataModule().root, build_imagefolder),
    "coco": Pipeline("configs/detect/coco_ssdlite_mobilevitv2_100.yaml", CocoDataModule, (640, 480),
                     lambda recipe: CocoDataModule().root, build_coco),
    "ade20k": Pipeline("configs/segment/ade20k_deeplabv3_mobilevitv2_100.yaml", SegmentationDataModule, (683, 512),
                       lambda recipe: SegmentationDataModule().root, build_ade20k, demo_in_layout=False),
    "voc": Pipeline("configs/segment/voc_deeplabv3_mobilevitv2_100.yaml", SegmentationDataModule, (500, 375),
                    lambda recipe: SegmentationDataModule().root, build_voc, demo_in_layout=False),
    "wmt14": Pipeline("configs/translate/wmt14_en_de_transformer_base.yaml", TranslationDataModule, WMT_WORDS,
                      lambda recipe: demo_translation_root(recipe["src_lang"], recipe["tgt_lang"]), build_wmt),
}


def recipe_data(pipeline: Pipeline) -> dict:
    """The recipe's ``data:`` arguments, without ``root`` and ``num_workers`` (set here)."""
    data = yaml.safe_load((REPO / pipeline.config).read_text())["data"]
    data = dict(data.get("init_args", data))
    data.pop("root", None)
    data.pop("num_workers", None)
    return data


def dataset_root(name: str, pipeline: Pipeline, recipe: dict, native: bool) -> Path:
    """Root of the data to measure: the benchmark-sized copy (built once), or with ``native`` the demo itself."""
    if native and pipeline.demo_in_layout:
        return pipeline.demo(recipe)
    size = None if native else pipeline.size
    tag = "native" if native else ("x".join(map(str, size)) if isinstance(size, tuple) else f"{size}words")
    return demo_root(f"bench-{name}-{tag}", lambda root: pipeline.build(pipeline.demo(recipe), root, size, recipe),
                     version=BUILD_VERSION)


def describe_data(pipeline: Pipeline, root: Path, recipe: dict) -> str:
    """What one training item is: the first image's size and the mean file size, or the words per sentence."""
    if pipeline.text:
        lines = (root / f"train.{recipe['src_lang']}").read_text(encoding="utf-8").splitlines()
        return f"{sum(len(line.split()) for line in lines) / len(lines):.0f} words"
    files = [p for p in root.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png") and
             "annotations" not in p.parts and not p.parent.name.startswith("Segmentation")]
    with Image.open(files[0]) as img:
        width, height = img.size
    return f"{width}x{height}, {np.mean([p.stat().st_size for p in files]) / 1024:.0f} KB"


# -- the former pipelines (the ``before`` baseline) ------------------------------------------------------------
class IoUCropWhenBoxes(v2.RandomIoUCrop):
    """``RandomIoUCrop`` that passes images without boxes through (the former pipeline's)."""

    def forward(self, *inputs):
        sample = inputs if len(inputs) > 1 else inputs[0]
        if len(sample[1]["boxes"]) == 0:
            return sample
        return super().forward(*inputs)


def former_ssd_train_transform(image_size, mean, std, zoom_out_max=4.0, iou_crop=True, hflip=0.5) -> v2.Compose:
    """The former SSD augmentation: torchvision's chain on the full-size photo."""
    fill = {tv_tensors.Image: [round(255 * m) for m in mean], "others": 0}
    steps = [v2.RandomPhotometricDistort(p=0.5)]
    if zoom_out_max > 1:
        steps.append(v2.RandomZoomOut(fill=fill, side_range=(1.0, zoom_out_max), p=0.5))
    if iou_crop:
        steps.append(IoUCropWhenBoxes())
    if hflip > 0:
        steps.append(v2.RandomHorizontalFlip(hflip))
    steps += [v2.Resize((image_size, image_size), antialias=True), v2.ClampBoundingBoxes(),
              v2.SanitizeBoundingBoxes(min_size=1.0), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    return v2.Compose(steps)


def former_classification_train_transform(image_size, scale, hflip, rand_augment, rand_augment_magnitude,
                                          random_erasing, mean, std, interpolation) -> v2.Compose:
    """The former ImageNet augmentation: torchvision's RandAugment kernels."""
    steps = [v2.RandomResizedCrop(image_size, scale=scale, interpolation=v2.InterpolationMode(interpolation),
                                  antialias=True)]
    if hflip > 0:
        steps.append(v2.RandomHorizontalFlip(hflip))
    if rand_augment:
        steps.append(v2.RandAugment(magnitude=rand_augment_magnitude, interpolation=v2.InterpolationMode.BILINEAR))
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    if random_erasing > 0:
        steps.append(v2.RandomErasing(p=random_erasing, value=0))
    return v2.Compose(steps)


class FormerMixCollate:
    """The former MixUp / CutMix: torchvision's, on new batch-sized tensors."""

    def __init__(self, num_classes: int, mixup_alpha: float, cutmix_alpha: float):
        choices = [v2.MixUp(alpha=mixup_alpha, num_classes=num_classes)] if mixup_alpha > 0 else []
        choices += [v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)] if cutmix_alpha > 0 else []
        self.mix = v2.RandomChoice(choices)

    def __call__(self, batch: list) -> dict:
        out = collate_skipping(batch)
        if "image" in out:
            out["image"], out["target"] = self.mix(out["image"], out["target"])
        return out


@dataclass(frozen=True)
class Variant:
    """What a datamodule builds its training pipeline from, and OpenCV's threads in each worker."""
    builders: dict[str, dict[str, object]]  # module -> {name: builder} set in that module for the measurement
    opencv_threads: int | None              # in each worker; None: OpenCV's default (one per core)


VARIANTS = {
    "before": Variant({"datamodules.detection_common": {"ssd_train_transform": former_ssd_train_transform},
                       "datamodules.imagefolder": {"train_transform": former_classification_train_transform,
                                                   "MixCollate": FormerMixCollate}}, opencv_threads=None),
    "after": Variant({"datamodules.detection_common": {"ssd_train_transform": detection_transforms.ssd_train_transform},
                      "datamodules.imagefolder": {"train_transform": classification_transforms.train_transform,
                                                  "MixCollate": classification_transforms.MixCollate}},
                     opencv_threads=1),
}


@contextlib.contextmanager
def builders_in_use(variant: Variant):
    """Point the datamodules' builder names at ``variant``'s; restore them after."""
    saved = []
    for module_name, names in variant.builders.items():
        module = importlib.import_module(module_name)
        for name, builder in names.items():
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, builder)
    try:
        yield
    finally:
        for module, name, builder in saved:
            setattr(module, name, builder)


# -- streamed reading ----------------------------------------------------------------------------------------
OPTIMIZE_TASKS = {CocoDataModule: "detect", ImageFolderDataModule: "classify", SegmentationDataModule: "segment",
                  TranslationDataModule: "translate"}


def streamed_root(name: str, pipeline: Pipeline, root: Path, recipe: dict) -> str:
    """LitData chunks of the measured copy (``python -m datamodules.optimize``), written once next to it."""
    from datamodules.streaming import LAYOUT_VERSION

    output = root.with_name(f"{root.name}-streamed-v{LAYOUT_VERSION}")
    if not (output / "streaming.json").is_file():
        arguments = [f"--data.{key}={json.dumps(value)}" for key, value in recipe.items()]  # JSON is YAML
        subprocess.run([sys.executable, "-m", "datamodules.optimize", "--task", OPTIMIZE_TASKS[pipeline.datamodule],
                        "--root", str(root), "--output", str(output), "--num-workers", "1", *arguments],
                       check=True, cwd=REPO, stdout=sys.stderr)  # stdout keeps only the tables
    return str(output)


# -- measuring -----------------------------------------------------------------------------------------------
def endless(loader):
    """Batches of ``loader`` over epoch after epoch (setting the sampler's epoch, as Lightning does;
    LitData's loader counts its epochs itself)."""
    epoch = 0
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    while True:
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def batch_counts(batch, text: bool) -> tuple[int, int]:
    """(images or sentences, target tokens) of one training batch (tokens 0 for images)."""
    if text:
        return len(batch["tgt_out"]), int((batch["tgt_out"] != PAD_ID).sum())
    images = batch["image"] if isinstance(batch, dict) else batch[0]
    return len(images), 0


def cpu_seconds() -> float:
    """CPU time (user + system) so far of this process and of its live children, the loader's workers
    (Linux ``/proc``; NaN elsewhere)."""
    me, total = os.getpid(), 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, ...
        except OSError:  # a process that ended meanwhile
            continue
        if int(stat.parent.name) == me or int(fields[1]) == me:
            total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK") if total else math.nan


def measure(loader, workers: int, min_items: int, text: bool) -> tuple[int, float, float, float]:
    """Skip ``max(1, workers)`` batches, then time whole rounds of ``workers`` batches holding at
    least ``min_items`` items. Returns (timed batches, items/s, target tokens/s, CPU seconds per item
    of all loading processes together: what a loader core has to give per item, however busy the
    machine)."""
    batches = endless(loader)
    for _ in range(max(1, workers)):
        first = next(batches)
    per_batch = batch_counts(first, text)[0]
    rounds = max(1, math.ceil(min_items / per_batch / max(1, workers)))
    count = rounds * max(1, workers)
    items = tokens = 0
    start, cpu_start = time.perf_counter(), cpu_seconds()
    for _ in range(count):
        n, t = batch_counts(next(batches), text)
        items, tokens = items + n, tokens + t
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    return count, items / seconds, tokens / seconds, cpu / items


def measure_variant(pipeline: Pipeline, recipe: dict, data_root: dict, workers: int, variant: Variant,
                    default_opencv_threads: int, min_items: int) -> tuple[int, float, float, float]:
    """One measurement: a fresh datamodule under ``variant``, its training loader as ``fit`` draws it."""
    with builders_in_use(variant):
        dm = pipeline.datamodule(**data_root, num_workers=workers, **recipe)
        dm.setup("fit")
        loader = dm.train_dataloader()
        # OpenCV's threads in the workers are those of this process when they fork, at the first batch
        # (set here, after the loader is built: that may set them too; in a forked worker it can deadlock)
        cv2.setNumThreads(variant.opencv_threads if variant.opencv_threads and workers else default_opencv_threads)
        try:
            result = measure(loader, workers, min_items, pipeline.text)
        finally:
            cv2.setNumThreads(default_opencv_threads)
        del loader, dm
        gc.collect()  # stops the persistent workers now, before they prefetch into the next measurement
    return result


def run(args) -> None:
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)  # COCO's image counts per split
    default_opencv_threads = cv2.getNumThreads()
    print(f"machine: {os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable), torch {torch.__version__}, "
          f"torch threads per loading process 1, OpenCV threads per loading process {default_opencv_threads} "
          f"(before) / 1 (after), load average {os.getloadavg()[0]:.1f}; data: "
          f"{'demo files as they are' if args.native else 'demo sets upscaled to benchmark image sizes'}; "
          f"best of {args.repeats} alternating runs per variant", flush=True)
    names = args.variants
    vision = ["| pipeline | reading | images (first, mean file) | batch | workers | "
              + " | ".join(f"{v} images/s" for v in names) + " | "
              + " | ".join(f"{v} per loading process" for v in names) + " | "
              + ("after / before | " if len(names) == 2 else "")
              + " | ".join(f"{v} CPU ms per image" for v in names) + " |",
              "|---|---|---|---:|---:|" + "---:|" * (3 * len(names) + (len(names) == 2))]
    text = ["| pipeline | reading | source sentence | max tokens | workers | "
            + " | ".join(f"{v} target tokens/s" for v in names) + " | "
            + " | ".join(f"{v} tokens/s per loading process" for v in names) + " |",
            "|---|---|---|---:|---:|" + "---:|" * (2 * len(names))]
    for name in args.pipelines:
        pipeline = PIPELINES[name]
        recipe = recipe_data(pipeline)
        if pipeline.text and args.max_tokens:
            recipe["max_tokens"] = args.max_tokens
        elif not pipeline.text and args.batch_size:
            recipe["batch_size"] = args.batch_size
        root = dataset_root(name, pipeline, recipe, args.native)
        data = describe_data(pipeline, root, recipe)
        for reading in args.reading:
            data_root = ({"root": str(root)} if reading == "folder" else
                         {"streaming_root": streamed_root(name, pipeline, root, recipe)})
            for workers in args.workers:
                best = {v: (0, 0.0, 0.0) for v in names}
                cpu = {v: math.inf for v in names}
                items = args.sentences if pipeline.text else args.images
                for _ in range(args.repeats):  # alternate, so both variants see the same machine load
                    for v in names:
                        result = measure_variant(pipeline, recipe, data_root, workers, VARIANTS[v],
                                                 default_opencv_threads, items)
                        key = 2 if pipeline.text else 1
                        if result[key] > best[v][key]:
                            best[v] = result[:3]
                        cpu[v] = min(cpu[v], result[3])
                        print(f"  {name}, {reading}, {workers} workers, {v}: {result[0]} batches, "
                              f"{result[1]:.1f} items/s, {1000 * result[3]:.1f} CPU ms per item, "
                              f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
                processes = max(1, workers)
                if pipeline.text:
                    rates = [best[v][2] for v in names]
                    text.append(f"| {name} | {reading} | {data} | {recipe['max_tokens']} | {workers} | "
                                + " | ".join(f"{r:.0f}" for r in rates) + " | "
                                + " | ".join(f"{r / processes:.0f}" for r in rates) + " |")
                else:
                    rates = [best[v][1] for v in names]
                    ratio = f"{rates[1] / rates[0]:.2f}x | " if len(rates) == 2 and rates[0] else ""
                    vision.append(f"| {name} | {reading} | {data} | {recipe['batch_size']} | {workers} | "
                                  + " | ".join(f"{r:.1f}" for r in rates) + " | "
                                  + " | ".join(f"{r / processes:.1f}" for r in rates) + " | " + ratio
                                  + " | ".join(f"{1000 * cpu[v]:.1f}" for v in names) + " |")
    for table in (vision, text):
        if len(table) > 2:
            print("\n" + "\n".join(table))


def main(argv=None) -> None:
    from tasks.cli.runtime import reuse_freed_memory

    reuse_freed_memory()  # as the CLIs do; ours and the peer share this process, so both get it
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipelines", nargs="+", choices=list(PIPELINES), default=["imagenet", "coco", "ade20k", "wmt14"])
    parser.add_argument("--workers", nargs="+", type=int, default=[0, 1, 2], help="num_workers values to measure")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="before: the former pipelines with OpenCV's own thread pool in every worker; after: the suite's")
    parser.add_argument("--reading", nargs="+", choices=["folder", "streamed"], default=["folder"],
                        help="folder: image files as the dataset's layout holds them; streamed: LitData chunks "
                             "written once by python -m datamodules.optimize")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per variant; the best is reported")
    parser.add_argument("--images", type=int, default=512,
                        help="at least this many images timed per measurement, in whole batches")
    parser.add_argument("--sentences", type=int, default=5000, help="the same for translation")
    parser.add_argument("--batch-size", type=int, help="images per batch instead of the recipe's")
    parser.add_argument("--max-tokens", type=int, help="translation: tokens per batch instead of the recipe's")
    parser.add_argument("--native", action="store_true", help="measure the demo files as they are (no upscaling)")
    args = parser.parse_args(argv)
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    run(args)


if __name__ == "__main__":
    main()
