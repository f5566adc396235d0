"""Data at scale: the datamodules' start-up time and memory on synthetic real-size datasets.

Writes synthetic datasets in the real benchmarks' layouts and sizes (any ``--fraction`` of them) once
under ``--data-root`` and reuses them:

- ImageNet-1k: ``train/<wnid>/<wnid>_<k>.JPEG`` (1,281,167 files over 1000 class folders) and
  ``val/<wnid>/ILSVRC2012_val_<k>.JPEG`` (50,000). Every file holds the same 64x64 JPEG (about 1 KB),
  hardlinked: the first file of each class folder is a copy and the others link to it. Each path is a
  real directory entry that listing and ``stat`` must visit, but a folder's files share one inode, so
  the tree costs next to no disk and a first step still decodes a valid image.
- COCO 2017: ``annotations/instances_{train,val}2017.json`` with 118,287 / 5,000 images and about
  7.3 annotations per image (860 k in train), COCO's 80 categories with their ids (1..90 with gaps)
  and names, polygon segmentations (24 points) and about 1 % crowd annotations with uncompressed RLE,
  boxes inside the image with COCO-like sizes; ``{train,val}2017/<12-digit id>.jpg`` hardlinks of
  one JPEG per image size (640x480, 480x640, 640x427 ...; a new copy every 60,000 links, ext4's
  limit being 65,000), so decoded sizes match the annotation file.
- WMT14 en-de: ``train.en`` / ``train.de`` (4.5 M lines of about 26 words; each side its own
  200 k-type Zipfian vocabulary, German words longer, with umlauts), ``valid.*`` and ``test.*``
  (3,000 lines), the layout :class:`datamodules.wmt.TranslationDataModule` reads.

Then, for each format, starts fresh processes that do what a training start does with the paper
recipe's ``data:`` settings (``configs/``; ``root`` the synthetic data, 2 loader workers, no pinned
memory on this CPU machine): construct the datamodule, read what the model links from it (classes,
categories, vocabulary size), ``setup("fit")``, build the training loader and fetch its first batch.
Each process reports CPU seconds (its own plus its reaped loader workers') and wall seconds of that
data work, its peak RSS (``ru_maxrss``) and the RSS kept after setup beyond what the imports held.
The first start runs with an empty prepared-index cache (``$SUITE_PREPARED_DIR``, a fresh folder), the
later start with the cache the first left; with ``--ranks 2`` two processes start together and share it.
With ``--worker-epoch`` the single-process later start then reads one epoch's worth of sample
index entries in 2 loader workers (image decoding replaced by a constant) and reports each worker's
private memory (``Private_Clean + Private_Dirty`` of ``/proc/self/smaps_rollup``) growth. torchvision's
``ImageFolder`` on the same ImageNet tree runs beside the suite (format ``imagenet_torchvision``).

The page cache stays warm between runs (this measures the process's work, not the disk). The WMT
tokenizer is trained before the runs (``tokenizer`` row, on 200,000 sampled sentences instead of the
suite's 2,000,000, to save minutes; encoding cost does not depend on it) and reused by every start, as
the suite reuses it; the starts measured here are later starts for the tokenizer.

    python benchmarks/bench_scale.py --fraction 0.01 --formats imagenet,coco,wmt --ranks 1,2 --json out.json
    python benchmarks/bench_scale.py --code /tmp/suite_before ...   # the suite of another checkout
    python benchmarks/bench_scale.py --malloc both ...              # also with SUITE_SYSTEM_MALLOC=1
"""
from __future__ import annotations

import argparse
import gc
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from operator import itemgetter
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SUITE = HERE.parent

# -- full sizes --------------------------------------------------------------------------------------
IMAGENET_TRAIN, IMAGENET_VAL, IMAGENET_CLASSES = 1_281_167, 50_000, 1000
COCO_TRAIN_IMAGES, COCO_VAL_IMAGES, COCO_ANNOTATIONS_PER_IMAGE, COCO_CROWD_SHARE = 118_287, 5_000, 7.27, 0.009
WMT_TRAIN_PAIRS, WMT_EVAL_PAIRS, WMT_WORDS_PER_LINE, WMT_VOCABULARY = 4_500_000, 3_000, 26, 200_000

#: COCO 2017's 80 instance categories: (id, name, supercategory)
COCO_CATEGORIES = [
    (1, "person", "person"), (2, "bicycle", "vehicle"), (3, "car", "vehicle"), (4, "motorcycle", "vehicle"),
    (5, "airplane", "vehicle"), (6, "bus", "vehicle"), (7, "train", "vehicle"), (8, "truck", "vehicle"),
    (9, "boat", "vehicle"), (10, "traffic light", "outdoor"), (11, "fire hydrant", "outdoor"),
    (13, "stop sign", "outdoor"), (14, "parking meter", "outdoor"), (15, "bench", "outdoor"),
    (16, "bird", "animal"), (17, "cat", "animal"), (18, "dog", "animal"), (19, "horse", "animal"),
    (20, "sheep", "animal"), (21, "cow", "animal"), (22, "elephant", "animal"), (23, "bear", "animal"),
    (24, "zebra", "animal"), (25, "giraffe", "animal"), (27, "backpack", "accessory"),
    (28, "umbrella", "accessory"), (31, "handbag", "accessory"), (32, "tie", "accessory"),
    (33, "suitcase", "accessory"), (34, "frisbee", "sports"), (35, "skis", "sports"), (36, "snowboard", "sports"),
    (37, "sports ball", "sports"), (38, "kite", "sports"), (39, "baseball bat", "sports"),
    (40, "baseball glove", "sports"), (41, "skateboard", "sports"), (42, "surfboard", "sports"),
    (43, "tennis racket", "sports"), (44, "bottle", "kitchen"), (46, "wine glass", "kitchen"), (47, "cup", "kitchen"),
    (48, "fork", "kitchen"), (49, "knife", "kitchen"), (50, "spoon", "kitchen"), (51, "bowl", "kitchen"),
    (52, "banana", "food"), (53, "apple", "food"), (54, "sandwich", "food"), (55, "orange", "food"),
    (56, "broccoli", "food"), (57, "carrot", "food"), (58, "hot dog", "food"), (59, "pizza", "food"),
    (60, "donut", "food"), (61, "cake", "food"), (62, "chair", "furniture"), (63, "couch", "furniture"),
    (64, "potted plant", "furniture"), (65, "bed", "furniture"), (67, "dining table", "furniture"),
    (70, "toilet", "furniture"), (72, "tv", "electronic"), (73, "laptop", "electronic"), (74, "mouse", "electronic"),
    (75, "remote", "electronic"), (76, "keyboard", "electronic"), (77, "cell phone", "electronic"),
    (78, "microwave", "appliance"), (79, "oven", "appliance"), (80, "toaster", "appliance"), (81, "sink", "appliance"),
    (82, "refrigerator", "appliance"), (84, "book", "indoor"), (85, "clock", "indoor"), (86, "vase", "indoor"),
    (87, "scissors", "indoor"), (88, "teddy bear", "indoor"), (89, "hair drier", "indoor"),
    (90, "toothbrush", "indoor"),
]
#: COCO's common image sizes (width, height) and how often they occur, roughly
COCO_SIZES = [(640, 480), (640, 427), (480, 640), (640, 426), (427, 640), (640, 424), (500, 375), (640, 360),
              (612, 612), (640, 512)]
COCO_SIZE_WEIGHTS = [0.33, 0.22, 0.12, 0.08, 0.06, 0.05, 0.05, 0.04, 0.03, 0.02]

#: the recipes whose ``data:`` settings the starts use
RECIPES = {"imagenet": "classify/imagenet_mobilevitv2_100.yaml", "coco": "detect/coco_ssdlite_mobilevitv2_100.yaml",
           "wmt": "translate/wmt14_en_de_transformer_base.yaml"}
#: what the task's DATA_LINKS read from the datamodule before setup (the model's construction)
LINKS = {"imagenet": ["classes"], "coco": ["num_classes", "category_ids", "category_names"], "wmt": ["vocab_size"]}
#: sentences the tokenizer is trained on here (the suite samples 2,000,000)
TOKENIZER_SENTENCES = 200_000
LOADER_WORKERS = 2


# ======================================================================================================
# synthetic datasets
# ======================================================================================================
def scaled(count: int, fraction: float) -> int:
    return max(1, round(count * fraction))


def dataset_root(data_root: Path, fmt: str, fraction: float) -> Path:
    return data_root / f"{fmt}-f{fraction:g}"


def complete(root: Path) -> bool:
    return (root / ".complete").is_file()


def small_jpeg(width: int, height: int, seed: int = 0) -> bytes:
    """A valid baseline JPEG of a smooth gradient with a little noise (about 1 KB at 64x64)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], -1)
    pixels = (pixels + rng.integers(0, 8, pixels.shape)).clip(0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=75)
    return out.getvalue()


def hardlink_all(source: Path, paths, links_per_copy: int = 60_000) -> None:
    """Each of ``paths`` a hardlink of ``source``'s bytes: a copy, then links to it (ext4 allows 65,000
    links to one inode, so another copy every ``links_per_copy`` paths)."""
    link = os.link
    for n, path in enumerate(paths):
        if n % links_per_copy == 0:
            shutil.copyfile(source, path)
            target = path
        else:
            link(target, path)


def write_imagenet(root: Path, fraction: float) -> None:
    """ImageNet-1k in ImageFolder layout, every file a hardlink of one 64x64 JPEG."""
    rng = np.random.default_rng(0)
    wnids = [f"n{v:08d}" for v in sorted(rng.choice(16_000_000, IMAGENET_CLASSES, replace=False))]
    image = root / "image.jpeg"
    image.write_bytes(small_jpeg(64, 64))
    for split, total, name in (("train", IMAGENET_TRAIN, "{wnid}_{k}.JPEG"),
                               ("val", IMAGENET_VAL, "ILSVRC2012_val_{k:08d}.JPEG")):
        n = max(IMAGENET_CLASSES, scaled(total, fraction))  # every class folder holds an image
        per_class = np.full(IMAGENET_CLASSES, n // IMAGENET_CLASSES)
        per_class[: n % IMAGENET_CLASSES] += 1
        k = 0
        for wnid, count in zip(wnids, per_class):
            folder = root / split / wnid
            folder.mkdir(parents=True, exist_ok=True)
            hardlink_all(image, [folder / name.format(wnid=wnid, k=k + j) for j in range(count)])
            k += count
    counts = [max(IMAGENET_CLASSES, scaled(n, fraction)) for n in (IMAGENET_TRAIN, IMAGENET_VAL)]
    print(f"  {root}: {counts[0]:,} + {counts[1]:,} hardlinked files")


def coco_annotation(rng, ann_id: int, image_id: int, width: int, height: int, crowd: bool) -> dict:
    """One annotation: a box inside the image, COCO-like in size; a 24-point polygon in it, or for a
    crowd an uncompressed column-major RLE of the box."""
    w = float(np.clip(np.exp(rng.uniform(np.log(4), np.log(width))), 2, width - 1))
    h = float(np.clip(w * np.exp(rng.normal(0, 0.5)), 2, height - 1))
    x, y = rng.uniform(0, width - w), rng.uniform(0, height - h)
    category = COCO_CATEGORIES[min(79, int(rng.exponential(12)))][0]  # person-heavy, as COCO
    if crowd:
        x0, y0, bw, bh = int(x), int(y), max(1, int(w)), max(1, int(h))
        counts = [x0 * height + y0]
        for _ in range(bw):
            counts += [bh, height - bh]
        counts[-1] += height * width - sum(counts)  # the rest of the image is background
        segmentation = {"counts": counts, "size": [height, width]}
        area = float(bw * bh)
    else:
        t = np.sort(rng.uniform(0, 2 * np.pi, 24))
        r = rng.uniform(0.75, 1.0, 24)
        px = x + w / 2 + r * w / 2 * np.cos(t)
        py = y + h / 2 + r * h / 2 * np.sin(t)
        segmentation = [np.round(np.stack([px, py], 1).ravel(), 2).tolist()]
        area = round(0.72 * w * h, 4)
    return {"segmentation": segmentation, "area": area, "iscrowd": int(crowd), "image_id": image_id,
            "bbox": [round(x, 2), round(y, 2), round(w, 2), round(h, 2)], "category_id": category, "id": ann_id}


def write_coco_split(root: Path, split: str, n_images: int, rng, first_ann_id: int) -> int:
    """``annotations/instances_<split>.json`` written in pieces (never the whole object in memory) and
    ``<split>/<id>.jpg`` hardlinks of one JPEG per image size. Returns the annotation count."""
    folder = root / split
    folder.mkdir(parents=True, exist_ok=True)
    sizes = rng.choice(len(COCO_SIZES), n_images, p=COCO_SIZE_WEIGHTS)
    ids = np.sort(rng.choice(np.arange(1, 581_930), n_images, replace=False))
    per_image = rng.poisson(rng.gamma(1.6, COCO_ANNOTATIONS_PER_IMAGE / 1.6, n_images))
    sources = []
    for s, (w, h) in enumerate(COCO_SIZES):
        source = root / f"size_{w}x{h}.jpg"
        if not source.is_file():
            source.write_bytes(small_jpeg(w, h, seed=s))
        sources.append(source)
    images = [{"license": int(rng.integers(1, 9)), "file_name": f"{i:012d}.jpg",
               "coco_url": f"http://images.cocodataset.org/{split}/{i:012d}.jpg", "height": COCO_SIZES[s][1],
               "width": COCO_SIZES[s][0], "date_captured": "2013-11-14 11:18:45",
               "flickr_url": f"http://farm4.staticflickr.com/3153/{i}_0f0ac3c5a6_z.jpg", "id": int(i)}
              for i, s in zip(ids, sizes)]
    for s, source in enumerate(sources):
        hardlink_all(source, [folder / f"{i:012d}.jpg" for i in ids[sizes == s]])
    (root / "annotations").mkdir(exist_ok=True)
    ann_id = first_ann_id
    with open(root / "annotations" / f"instances_{split}.json", "w") as out:
        out.write('{"info": {"description": "synthetic COCO 2017 (benchmarks/bench_scale.py)", "year": 2017}, '
                  '"licenses": [' + ", ".join(json.dumps({"url": "http://creativecommons.org/licenses/", "id": i,
                                                           "name": "license"}) for i in range(1, 9)) + '], ')
        out.write('"images": ' + json.dumps(images) + ', "annotations": [')
        first = True
        for image, count in zip(images, per_image):
            for _ in range(count):
                crowd = rng.random() < COCO_CROWD_SHARE
                ann = coco_annotation(rng, ann_id, image["id"], image["width"], image["height"], crowd)
                out.write(("" if first else ", ") + json.dumps(ann))
                first = False
                ann_id += 1
        out.write('], "categories": ' + json.dumps([{"supercategory": sup, "id": i, "name": name}
                                                     for i, name, sup in COCO_CATEGORIES]) + "}")
    return ann_id - first_ann_id


def write_coco(root: Path, fraction: float) -> None:
    rng = np.random.default_rng(1)
    n_train = write_coco_split(root, "train2017", scaled(COCO_TRAIN_IMAGES, fraction), rng, 1)
    n_val = write_coco_split(root, "val2017", scaled(COCO_VAL_IMAGES, fraction), rng, 1_000_000_000)
    size = (root / "annotations" / "instances_train2017.json").stat().st_size
    print(f"  {root}: train2017 {scaled(COCO_TRAIN_IMAGES, fraction):,} images, {n_train:,} annotations "
          f"({size / 1e6:.0f} MB JSON); val2017 {scaled(COCO_VAL_IMAGES, fraction):,} images, {n_val:,} annotations")


def vocabulary(rng, letters: str, size: int, longer: float) -> list[bytes]:
    """``size`` distinct made-up words, short for frequent ranks and longer down the tail."""
    alphabet = np.array(list(letters))
    lengths = np.clip(np.round(1.5 + longer * np.log1p(np.arange(size)) * 0.55 + rng.normal(0, 1.2, size)),
                      1, 20).astype(int)
    text = "".join(alphabet[rng.integers(0, len(alphabet), int(lengths.sum()))])
    ends = np.cumsum(lengths)
    words, seen = [], set()
    for start, end in zip(ends - lengths, ends):
        word = text[start:end]
        while word in seen:  # a repeat (among the short words) grows by a letter until it is new
            word += letters[int(rng.integers(len(letters)))]
        seen.add(word)
        words.append(word.encode())
    return words


def write_wmt_side(path: Path, lines: int, words: list[bytes], line_lengths, rng) -> None:
    """``lines`` lines of Zipf-distributed words (exponent 1.0 over the ranks of ``words``)."""
    p = 1.0 / np.arange(1, len(words) + 1)
    cdf = np.cumsum(p / p.sum())
    space, newline = len(words), len(words) + 1
    table = words + [b" ", b"\n"]
    with open(path, "wb") as out:
        for start in range(0, lines, 100_000):
            lengths = line_lengths[start:start + 100_000]
            ids = np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), len(words) - 1)
            # word, space, word, ..., word, newline: a separator after every word, newline after each line's last
            tokens = np.empty(2 * len(ids), np.int64)
            tokens[0::2] = ids
            tokens[1::2] = space
            tokens[2 * np.cumsum(lengths) - 1] = newline
            out.write(b"".join(itemgetter(*tokens.tolist())(table)))


def write_wmt(root: Path, fraction: float) -> None:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2)
    english = vocabulary(rng, "abcdefghijklmnopqrstuvwxyz", WMT_VOCABULARY, 1.0)
    german = vocabulary(rng, "abcdefghijklmnopqrstuvwxyzäöüßabcdefghiklmnorstu", WMT_VOCABULARY, 1.25)
    for split, lines in (("train", scaled(WMT_TRAIN_PAIRS, fraction)), ("valid", WMT_EVAL_PAIRS),
                         ("test", WMT_EVAL_PAIRS)):
        en = np.clip(np.round(rng.gamma(4.0, WMT_WORDS_PER_LINE / 4.0, lines)), 1, 120).astype(np.int64)
        de = np.clip(np.round(en * rng.normal(0.95, 0.12, lines)), 1, 120).astype(np.int64)
        write_wmt_side(root / f"{split}.en", lines, english, en, rng)
        write_wmt_side(root / f"{split}.de", lines, german, de, rng)
    size = (root / "train.en").stat().st_size + (root / "train.de").stat().st_size
    print(f"  {root}: {scaled(WMT_TRAIN_PAIRS, fraction):,} training pairs ({size / 1e9:.2f} GB)")


WRITERS = {"imagenet": write_imagenet, "coco": write_coco, "wmt": write_wmt}


def ensure_dataset(data_root: Path, fmt: str, fraction: float) -> Path:
    """The synthetic dataset of ``fmt`` at ``fraction``, written once (a folder without its
    ``.complete`` mark is an interrupted write, and is written again)."""
    root = dataset_root(data_root, fmt, fraction)
    if complete(root):
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    start = time.perf_counter()
    print(f"writing the synthetic {fmt} dataset at fraction {fraction:g} ...", flush=True)
    WRITERS[fmt](root, fraction)
    (root / ".complete").write_text(f"fraction {fraction}\n")
    print(f"  written in {time.perf_counter() - start:.0f} s", flush=True)
    return root


# ======================================================================================================
# what one process measures (python bench_scale.py probe ...; runs in a fresh process)
# ======================================================================================================
def memory_status() -> dict:
    """VmRSS, RssAnon and RssFile of this process, in MB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) / 1024
    return out


def private_mb() -> float:
    """This process's private memory (USS): Private_Clean + Private_Dirty, MB."""
    total = 0
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1])
    return total / 1024


def cpu_seconds(who=resource.RUSAGE_SELF) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def recipe_data(fmt: str) -> dict:
    """The ``data:`` section of the format's paper recipe in the suite under test, its ``base:`` chain merged."""
    import yaml

    def read(path: Path) -> dict:
        config = yaml.safe_load(path.read_text())
        data = dict(config.get("data") or {})
        if config.get("base"):
            data = {**read(path.parent / config["base"]), **data}
        return data

    import configs

    return read(Path(configs.__file__).parent / RECIPES[fmt])


def make_datamodule(fmt: str, root: Path):
    """The recipe's datamodule on ``root``; 2 workers and no pinned memory on this CPU machine."""
    data = {**recipe_data(fmt), "root": str(root)}
    if fmt == "imagenet":
        from datamodules.imagefolder import ImageFolderDataModule as cls
    elif fmt == "coco":
        from datamodules.coco import CocoDataModule as cls
    else:
        from datamodules.wmt import TranslationDataModule as cls
    data["num_workers"] = LOADER_WORKERS
    if "pin_memory" in data:
        data["pin_memory"] = False
    return cls(**data)


class TouchIndex:
    """Reads sample index entries by chunks (a worker's epoch without image decoding) and reports
    the worker's private memory before and after each chunk."""

    def __init__(self, read):
        self.read = read

    def __getitem__(self, chunk):
        import torch.utils.data

        before = private_mb()
        for i in chunk:
            self.read(int(i))
        info = torch.utils.data.get_worker_info()
        return {"worker": info.id if info else 0, "pid": os.getpid(), "before": before, "after": private_mb()}


def index_reader(fmt: str, dataset):
    """What a worker does with sample i, minus pixels: the dataset's own read with the image file
    read replaced by a constant (ImageFolder), :meth:`annotation` (COCO), the item itself (WMT)."""
    import torch

    if fmt == "coco" and hasattr(dataset, "annotation"):
        return dataset.annotation
    if fmt in ("imagenet", "coco"):
        pixels = torch.zeros(3, 8, 8, dtype=torch.uint8)
        for module in {sys.modules[type(dataset).__module__], sys.modules["datamodules.images"]}:
            for name in ("read_rgb", "read_rgb_array"):
                if hasattr(module, name):
                    setattr(module, name, lambda *args, **kwargs: pixels)
        if hasattr(dataset, "transform"):
            dataset.transform = lambda image: image
    if fmt == "imagenet_torchvision":
        dataset.loader, dataset.transform = (lambda path: None), None
    return dataset.__getitem__


def worker_epoch(fmt: str, dataset, chunk: int = 1024) -> dict:
    """One epoch's worth of index reads, shuffled, in 2 loader workers: each worker's private growth."""
    from torch.utils.data import DataLoader

    order = np.random.default_rng(0).permutation(len(dataset))
    chunks = [order[i:i + chunk] for i in range(0, len(order), chunk)]
    loader = DataLoader(TouchIndex(index_reader(fmt, dataset)), batch_size=None, sampler=chunks,
                        num_workers=LOADER_WORKERS, collate_fn=lambda x: x)
    start, first, last = time.perf_counter(), {}, {}
    for report in loader:
        first.setdefault(report["worker"], report["before"])
        last[report["worker"]] = report["after"]
    growth = {w: last[w] - first[w] for w in first}
    return {"worker_growth_mb": max(growth.values()), "worker_growth_each_mb": growth,
            "worker_start_mb": first, "worker_epoch_s": time.perf_counter() - start, "worker_samples": len(order)}


def probe(args) -> dict:
    """One start: construct, link, setup("fit"), first training batch. Prints a JSON line."""
    fmt, root = args.format, Path(args.root)
    applied = None
    if fmt != "imagenet_torchvision":
        from tasks.cli.runtime import reuse_freed_memory

        applied = reuse_freed_memory()  # as the CLIs do, before anything is built
    import torch
    import torchvision  # noqa: F401  (imports are not data work: done before the clock starts)
    import lightning.pytorch  # noqa: F401

    torch.set_num_threads(1)
    if fmt == "wmt":
        import datamodules.wmt  # noqa: F401
    elif fmt != "imagenet_torchvision":
        import datamodules.imagefolder, datamodules.coco  # noqa: F401,E401
    gc.collect()
    base = memory_status()
    if args.barrier:  # ranks started together begin together
        Path(args.barrier + f".{os.getpid()}").touch()
        while len(list(Path(args.barrier).parent.glob(Path(args.barrier).name + ".*"))) < args.ranks:
            time.sleep(0.01)
    wall0, cpu0 = time.perf_counter(), cpu_seconds()
    if fmt == "imagenet_torchvision":
        from torchvision import transforms
        from torchvision.datasets import ImageFolder

        transform = transforms.Compose([transforms.RandomResizedCrop(256), transforms.ToTensor()])
        train = ImageFolder(str(root / "train"), transform=transform)
        ImageFolder(str(root / "val"))
        datamodule, linked = None, len(train.classes)
    else:
        datamodule = make_datamodule(fmt, root)
        linked = [getattr(datamodule, name) for name in LINKS[fmt]]
    wall_link, cpu_link = time.perf_counter(), cpu_seconds()
    if datamodule is not None:
        datamodule.setup("fit")
    wall_setup, cpu_setup = time.perf_counter(), cpu_seconds()
    gc.collect()
    kept = memory_status()
    if datamodule is not None:
        loader = datamodule.train_dataloader()
    else:
        from torch.utils.data import DataLoader

        loader = DataLoader(train, batch_size=128, shuffle=True, num_workers=LOADER_WORKERS)
    iterator = iter(loader)
    next(iterator)
    wall_batch, cpu_batch = time.perf_counter(), cpu_seconds()
    # dropping the loader and its iterator stops and reaps the workers, so their CPU time is counted below
    del iterator, loader
    gc.collect()
    workers_cpu = cpu_seconds(resource.RUSAGE_CHILDREN)
    result = {
        "format": fmt, "root": str(root), "pid": os.getpid(), "malloc_setting_applied": applied,
        "system_malloc_env": bool(os.environ.get("SUITE_SYSTEM_MALLOC")),
        "link_wall_s": wall_link - wall0, "link_cpu_s": cpu_link - cpu0,
        "setup_wall_s": wall_setup - wall0, "setup_cpu_s": cpu_setup - cpu0,
        "first_batch_wall_s": wall_batch - wall0, "first_batch_cpu_s": cpu_batch - cpu0 + workers_cpu,
        "workers_cpu_s": workers_cpu,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "base_rss_mb": base["VmRSS"], "kept_rss_mb": kept["VmRSS"] - base["VmRSS"],
        "kept_anon_mb": kept["RssAnon"] - base["RssAnon"], "kept_file_mb": kept["RssFile"] - base["RssFile"],
        "linked": str(linked)[:80],
    }
    result["peak_data_mb"] = result["peak_rss_mb"] - base["VmRSS"]
    if args.worker_epoch:
        dataset = train if datamodule is None else datamodule.train_set if hasattr(datamodule, "train_set") \
            else datamodule.dataset(datamodule.splits["fit"], training=True)
        result.update(worker_epoch(fmt, dataset))
    return result


def train_tokenizer(args) -> dict:
    """The WMT recipe's tokenizer, trained once beside the data on TOKENIZER_SENTENCES sampled sentences."""
    import functools

    import datamodules.tokenizer as tokenizer

    tokenizer.train_sentencepiece = functools.partial(tokenizer.train_sentencepiece,
                                                      input_sentence_size=TOKENIZER_SENTENCES)
    wall0, cpu0 = time.perf_counter(), cpu_seconds()
    datamodule = make_datamodule("wmt", Path(args.root))
    return {"format": "tokenizer", "vocab_size": datamodule.vocab_size, "wall_s": time.perf_counter() - wall0,
            "cpu_s": cpu_seconds() - cpu0, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


# ======================================================================================================
# the driver: fresh processes per start
# ======================================================================================================
def run_starts(code: Path, fmt: str, root: Path, prepared: Path, ranks: int, env_extra: dict,
               worker_epoch: bool = False, timeout: float = 3600) -> list[dict]:
    """``ranks`` probe processes started together; their JSON results."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(HERE)]), "SUITE_PREPARED_DIR": str(prepared),
           "WANDB_MODE": "offline", "NO_ALBUMENTATIONS_UPDATE": "1", **env_extra}
    env.pop("SUITE_SYSTEM_MALLOC", None) if "SUITE_SYSTEM_MALLOC" not in env_extra else None
    barrier = prepared.parent / f".barrier-{time.time_ns()}"
    command = [sys.executable, str(Path(__file__).resolve()), "probe", "--format", fmt, "--root", str(root),
               "--ranks", str(ranks), "--barrier", str(barrier)] + (["--worker-epoch"] if worker_epoch else [])
    procs = [subprocess.Popen(command, env=env, cwd=str(code), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(ranks)]
    results = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=timeout)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{fmt} probe (rank {rank}) failed with exit code {proc.returncode}:\n{err[-4000:]}")
        results.append({**json.loads(lines[-1]), "rank": rank})
    for leftover in prepared.parent.glob(barrier.name + ".*"):
        leftover.unlink()
    return results


def measure(args) -> list[dict]:
    code = Path(args.code).resolve()
    data_root = Path(args.data_root)
    rows = []
    for fmt in args.formats:
        root = ensure_dataset(data_root, fmt, args.fraction)
        if fmt == "wmt":
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(HERE)])}
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "tokenizer", "--root", str(root)],
                                 env=env, cwd=str(code), capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"tokenizer training failed:\n{out.stderr[-4000:]}")
            row = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
            rows.append({**row, "code": str(code), "fraction": args.fraction})
            print(f"tokenizer ready ({row['vocab_size']} pieces; {row['cpu_s']:.1f} CPU s)", flush=True)
        mallocs = [{}] + ([{"SUITE_SYSTEM_MALLOC": "1"}] if args.malloc == "both" and fmt in ("coco", "wmt") else [])
        peers = [fmt] + (["imagenet_torchvision"] if fmt == "imagenet" and not args.no_torchvision else [])
        for peer in peers:
            for malloc in (mallocs if peer == fmt else [{}]):
                for ranks in args.ranks:
                    prepared = Path(args.prepared_root) / f"{peer}-f{args.fraction:g}-r{ranks}"
                    shutil.rmtree(prepared, ignore_errors=True)
                    prepared.mkdir(parents=True)
                    for start in args.starts:
                        epoch = args.worker_epoch and start == args.starts[-1] and ranks == 1 and not malloc
                        results = run_starts(code, peer, root, prepared, ranks, malloc, worker_epoch=epoch)
                        for result in results:
                            result.update(start=start, ranks=ranks, code=str(code), fraction=args.fraction,
                                          system_malloc=bool(malloc))
                            rows.append(result)
                        print(row_line(results), flush=True)
                    shutil.rmtree(prepared, ignore_errors=True)
    return rows


def row_line(results: list[dict]) -> str:
    r = results[0]
    return (f"{r['format']:<21} {r['start']:<5} ranks {r['ranks']} malloc {'system' if r['system_malloc'] else 'suite '} "
            + " | ".join(f"cpu {x['first_batch_cpu_s']:.1f} s wall {x['first_batch_wall_s']:.1f} s setup cpu "
                         f"{x['setup_cpu_s']:.1f} s peak {x['peak_rss_mb']:.0f} MB kept {x['kept_rss_mb']:.0f} MB"
                         + (f" worker +{x['worker_growth_mb']:.0f} MB/epoch" if "worker_growth_mb" in x else "")
                         for x in results))


def markdown_table(rows: list[dict]) -> str:
    """One line per format, malloc setting, rank count and start; 2-rank values are per rank (max)."""
    lines = ["| code | fraction | format | malloc | ranks | start | setup CPU s | first batch CPU s | "
             "first batch wall s | peak RSS MB (above imports) | kept RSS MB (anon / file) | worker growth MB/epoch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = {}
    for row in rows:
        if row["format"] == "tokenizer":
            continue
        key = (row["code"], row["fraction"], row["format"], row["system_malloc"], row["ranks"], row["start"])
        groups.setdefault(key, []).append(row)
    for (code, fraction, fmt, system, ranks, start), group in groups.items():
        worst = lambda key: max(r[key] for r in group)  # noqa: E731
        growth = [r["worker_growth_mb"] for r in group if "worker_growth_mb" in r]
        lines.append(
            f"| {Path(code).name} | {fraction:g} | {fmt} | {'system' if system else 'suite'} | {ranks} | {start} | "
            f"{worst('setup_cpu_s'):.1f} | {worst('first_batch_cpu_s'):.1f} | {worst('first_batch_wall_s'):.1f} | "
            f"{worst('peak_rss_mb'):.0f} ({worst('peak_data_mb'):.0f}) | {worst('kept_rss_mb'):.0f} ({worst('kept_anon_mb'):.0f} / "
            f"{worst('kept_file_mb'):.0f}) | {f'{max(growth):.0f}' if growth else ''} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("probe", help="(internal) one start in this process")
    p.add_argument("--format", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--barrier")
    p.add_argument("--worker-epoch", action="store_true")
    t = sub.add_parser("tokenizer", help="(internal) train the WMT tokenizer beside the data")
    t.add_argument("--root", required=True)
    parser.add_argument("--fraction", type=float, default=0.01, help="of the full datasets' sizes (0 < f <= 1)")
    parser.add_argument("--formats", default="imagenet,coco,wmt", type=lambda s: s.split(","))
    parser.add_argument("--ranks", default="1,2", type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--starts", default="first,later", type=lambda s: s.split(","),
                        help="first (empty prepared cache), later (the cache the first left), or both")
    parser.add_argument("--code", default=str(SUITE), help="the suite checkout to measure (default: this one)")
    parser.add_argument("--data-root", default="/tmp/bench_scale", help="where the synthetic datasets are written")
    parser.add_argument("--prepared-root", default="/tmp/bench_scale_prepared",
                        help="parent of the prepared-index caches ($SUITE_PREPARED_DIR, emptied per measurement)")
    parser.add_argument("--malloc", choices=["suite", "both"], default="suite",
                        help="both: COCO and WMT also with SUITE_SYSTEM_MALLOC=1")
    parser.add_argument("--worker-epoch", action="store_true",
                        help="the last single-process start also reads one epoch of index entries in 2 workers")
    parser.add_argument("--no-torchvision", action="store_true", help="leave out torchvision's ImageFolder")
    parser.add_argument("--generate-only", action="store_true", help="write the datasets and stop")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    if args.command == "probe":
        print(json.dumps(probe(args)), flush=True)
        return
    if args.command == "tokenizer":
        print(json.dumps(train_tokenizer(args)), flush=True)
        return
    if not 0 < args.fraction <= 1:
        parser.error("--fraction must be in (0, 1]")
    if args.generate_only:
        for fmt in args.formats:
            ensure_dataset(Path(args.data_root), fmt, args.fraction)
        return
    rows = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
