"""Training data-loader throughput of each task's paper recipe, per number of workers (issue 7).

For each recipe's ``data:`` section (augmentation and per-device batch size as configured)
the task's own datamodule is built, ``setup("fit")`` run and batches drawn from
``train_dataloader()`` exactly as ``fit`` draws them: seeded per-sample augmentation,
collation (and MixUp/CutMix for classification) inside the workers, persistent workers.
Reading the rate of 1 worker (or of 0: all in the main process) gives the number of workers
a GPU needs: workers = GPU images/s / images/s per worker (on enough free cores).

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
single-threaded loading process, like each DataLoader worker. The first ``max(1, workers)``
batches are skipped (worker start-up; all workers deliver their first batch at about the
same moment), then at least ``--images`` images, in whole batches and a multiple of the
workers, are timed from the last skipped batch on. Epochs roll over as in training.
Numbers depend on what else runs on the machine: with more workers than free cores the
per-worker rate drops.

    nice python benchmarks/bench_loaders.py                                  # all four, 0 1 2 workers
    nice python benchmarks/bench_loaders.py --pipelines ade20k voc --workers 0 4 8
    python benchmarks/bench_loaders.py --native --images 16 --batch-size 4 --workers 0 1
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from datamodules.coco import CocoDataModule  # noqa: E402
from datamodules.demo import demo_root  # noqa: E402
from datamodules.demo_text import demo_translation_root  # noqa: E402
from datamodules.imagefolder import ImageFolderDataModule  # noqa: E402
from datamodules.images import IMAGE_EXTENSIONS  # noqa: E402
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
    "imagenet": Pipeline("configs/classify/imagenet_mobilevitv2_100.yaml", ImageFolderDataModule, (500, 375),
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


# -- measuring -----------------------------------------------------------------------------------------------
def endless(loader):
    """Batches of ``loader`` over epoch after epoch (setting the sampler's epoch, as Lightning does)."""
    epoch = 0
    while True:
        loader.batch_sampler.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def batch_counts(batch, text: bool) -> tuple[int, int]:
    """(images or sentences, target tokens) of one training batch (tokens 0 for images)."""
    if text:
        return len(batch["tgt_out"]), int((batch["tgt_out"] != PAD_ID).sum())
    images = batch["image"] if isinstance(batch, dict) else batch[0]
    return len(images), 0


def measure(loader, workers: int, min_items: int, text: bool) -> tuple[int, float, float]:
    """Skip ``max(1, workers)`` batches, then time whole rounds of ``workers`` batches holding at
    least ``min_items`` items. Returns (timed batches, items/s, target tokens/s)."""
    batches = endless(loader)
    for _ in range(max(1, workers)):
        first = next(batches)
    per_batch = batch_counts(first, text)[0]
    rounds = max(1, math.ceil(min_items / per_batch / max(1, workers)))
    count = rounds * max(1, workers)
    items = tokens = 0
    start = time.perf_counter()
    for _ in range(count):
        n, t = batch_counts(next(batches), text)
        items, tokens = items + n, tokens + t
    seconds = time.perf_counter() - start
    return count, items / seconds, tokens / seconds


def run(args) -> None:
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)  # COCO's image counts per split
    print(f"machine: {os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable), torch {torch.__version__}, "
          f"torch threads per loading process 1, OpenCV threads {cv2.getNumThreads()} (albumentations; DataLoader "
          f"leaves them), load average {os.getloadavg()[0]:.1f}; "
          f"data: {'demo files as they are' if args.native else 'demo sets upscaled to benchmark image sizes'}", flush=True)
    vision = ["| pipeline | recipe | images (first, mean file) | batch | workers | batches timed | images/s "
              "| images/s per loading process |", "|---|---|---|---:|---:|---:|---:|---:|"]
    text = ["| pipeline | recipe | source sentence | max tokens | workers | batches timed | sentences/s "
            "| target tokens/s | target tokens/s per loading process |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for name in args.pipelines:
        pipeline = PIPELINES[name]
        recipe = recipe_data(pipeline)
        if pipeline.text and args.max_tokens:
            recipe["max_tokens"] = args.max_tokens
        elif not pipeline.text and args.batch_size:
            recipe["batch_size"] = args.batch_size
        root = dataset_root(name, pipeline, recipe, args.native)
        data = describe_data(pipeline, root, recipe)
        for workers in args.workers:
            dm = pipeline.datamodule(root=str(root), num_workers=workers, **recipe)
            start = time.perf_counter()
            dm.setup("fit")
            setup_s = time.perf_counter() - start
            loader = dm.train_dataloader()
            count, rate, token_rate = measure(loader, workers, args.sentences if pipeline.text else args.images,
                                              pipeline.text)
            del loader, dm
            gc.collect()  # stops the persistent workers now, before they prefetch into the next measurement
            processes = max(1, workers)
            recipe_name = Path(pipeline.config).name
            if pipeline.text:
                text.append(f"| {name} | {recipe_name} | {data} | {recipe['max_tokens']} | {workers} | {count} "
                            f"| {rate:.0f} | {token_rate:.0f} | {token_rate / processes:.0f} |")
            else:
                vision.append(f"| {name} | {recipe_name} | {data} | {recipe['batch_size']} | {workers} | {count} "
                              f"| {rate:.1f} | {rate / processes:.1f} |")
            print(f"  {name}, {workers} workers: setup {setup_s:.1f} s, {count} batches, {rate:.1f} items/s",
                  file=sys.stderr, flush=True)
    for table in (vision, text):
        if len(table) > 2:
            print("\n" + "\n".join(table))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipelines", nargs="+", choices=list(PIPELINES), default=["imagenet", "coco", "ade20k", "wmt14"])
    parser.add_argument("--workers", nargs="+", type=int, default=[0, 1, 2], help="num_workers values to measure")
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
