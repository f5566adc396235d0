"""Deterministic scenes of handwritten digits: the embedded demo data for the dense tasks.

Scikit-learn ships 1,797 handwritten digits (8x8, 16 grey levels). A scene pastes a
few of them, upsampled to varied sizes and aspect ratios and painted in a colour that
contrasts with what lies under them, onto a varied background (gradients, smooth
noise, stripes, checkerboards, with grain and a few non-digit distractor blobs).
Every instance comes with its visible pixel mask (the digit's strokes minus whatever
is painted over it later), so the same scenes serve detection (boxes from masks),
instance and semantic segmentation.

The API, kept stable because detection (COCO layout, :func:`write_coco_layout`) and
segmentation (VOC layout, written elsewhere) both build on it::

    rng = np.random.default_rng(scene_seed(seed=0, split="train", index=17))
    image, instances = make_scene(rng, size=192)
    # image: (H, W, 3) uint8, H == W == size
    # instances: list of Instance(label: int 0..9, mask: (H, W) bool, iscrowd: bool),
    #            in paint order; masks are disjoint and non-empty

    for index, image, instances in generate_scenes("val", count=200, seed=0, size=192):
        ...

``make_scene`` is a pure function of the generator state, so a scene depends only on
``(seed, split, index)``. Each split draws its digits from its own disjoint share
of the scikit-learn images, so validation and test digits are never seen in training.
"""
from __future__ import annotations

import json
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
from PIL import Image

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SPLITS = ("train", "val", "test")
#: share of scikit-learn's digit images each split draws from (disjoint)
SPLIT_FRACTIONS = {"train": 0.7, "val": 0.15, "test": 0.15}


class Instance(NamedTuple):
    """One object of a scene."""

    label: int  #: digit 0..9
    mask: np.ndarray  #: (H, W) bool, the visible pixels
    iscrowd: bool = False  #: a cluster of small digits of one class, annotated as one region


def coco_category_id(digit: int) -> int:
    """Category id of ``digit`` in the demo COCO files: non-contiguous on purpose (10, 13, ..., 37)
    so that code confusing labels with category ids fails visibly."""
    return 10 + 3 * digit


@lru_cache(maxsize=None)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.images / 16.0).astype(np.float32), data.target.astype(np.int64)


@lru_cache(maxsize=None)
def split_digits(split: str) -> tuple[np.ndarray, np.ndarray]:
    """The scikit-learn digits ``split`` draws from: ((N, 8, 8) float in [0, 1], (N,) labels)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    images, labels = _digits()
    order = np.random.default_rng(12345).permutation(len(images))  # fixed, independent of any seed
    bounds = np.cumsum([0] + [int(round(SPLIT_FRACTIONS[s] * len(images))) for s in SPLITS])
    bounds[-1] = len(images)
    i = SPLITS.index(split)
    chosen = np.sort(order[bounds[i]:bounds[i + 1]])
    return images[chosen], labels[chosen]


def scene_seed(seed: int, split: str, index: int) -> list[int]:
    """Entropy for scene ``index`` of ``split``: one scene never depends on another."""
    return [seed, SPLITS.index(split) if split in SPLITS else zlib.crc32(split.encode()), index]


# -- backgrounds -----------------------------------------------------------------------------------
def _random_colour(rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(0, 255, size=3).astype(np.float32)


def _upsample(field: np.ndarray, height: int, width: int, resample=Image.BICUBIC) -> np.ndarray:
    """(h, w) float -> (height, width) float."""
    return np.asarray(Image.fromarray(field.astype(np.float32), mode="F").resize((width, height), resample))


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """(size, size, 3) float32 in [0, 255]."""
    kind = rng.choice(["flat", "gradient", "noise", "stripes", "checker"], p=[0.1, 0.3, 0.3, 0.15, 0.15])
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    c0, c1 = _random_colour(rng), _random_colour(rng)
    if kind == "flat":
        weight = np.zeros((size, size), np.float32)
    elif kind == "gradient":
        angle = rng.uniform(0, 2 * np.pi)
        t = np.cos(angle) * xx + np.sin(angle) * yy
        weight = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    elif kind == "noise":
        cells = int(rng.integers(3, 9))
        weight = np.clip(_upsample(rng.uniform(0, 1, (cells, cells)), size, size), 0, 1)
    elif kind == "stripes":
        angle, period = rng.uniform(0, np.pi), rng.uniform(0.08, 0.4)
        t = np.cos(angle) * xx + np.sin(angle) * yy
        weight = 0.5 + 0.5 * np.sin(2 * np.pi * t / period)
        # soften so stripes are texture, not digit-like strokes
        c1 = c0 + rng.uniform(0.2, 0.5) * (c1 - c0)
    else:  # checker
        period = rng.uniform(0.1, 0.35)
        weight = ((np.floor(xx / period) + np.floor(yy / period)) % 2).astype(np.float32)
        c1 = c0 + rng.uniform(0.2, 0.5) * (c1 - c0)
    image = c0 + weight[..., None] * (c1 - c0)
    return image


def _add_distractors(rng: np.random.Generator, image: np.ndarray) -> None:
    """Paint 0-2 ellipses / rectangles: things that are not digits, so background is not trivially flat."""
    size = image.shape[0]
    yy, xx = np.mgrid[0:size, 0:size]
    for _ in range(int(rng.integers(0, 3))):
        cy, cx = rng.uniform(0, size, 2)
        ry, rx = rng.uniform(0.03, 0.15, 2) * size
        if rng.random() < 0.5:
            region = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1
        else:
            region = (np.abs(yy - cy) <= ry) & (np.abs(xx - cx) <= rx)
        alpha = rng.uniform(0.3, 0.8)
        image[region] = (1 - alpha) * image[region] + alpha * _random_colour(rng)


# -- digits ------------------------------------------------------------------------------------------
def _luminance(rgb: np.ndarray) -> np.ndarray:
    return rgb @ np.array([0.299, 0.587, 0.114], np.float32)


def _contrasting_colour(rng: np.random.Generator, under: np.ndarray) -> np.ndarray:
    """A random colour whose luminance differs from the mean of ``under`` (N, 3) by >= 70."""
    base = float(_luminance(under.reshape(-1, 3).mean(0)))
    for _ in range(20):
        colour = _random_colour(rng)
        if abs(float(_luminance(colour)) - base) >= 70:
            return colour
    return np.full(3, 0.0 if base > 127 else 255.0, np.float32)


def _digit_alpha(digit: np.ndarray, height: int, width: int) -> np.ndarray:
    """(8, 8) intensity in [0, 1] -> (height, width) opacity in [0, 1] with soft edges.

    The stroke mask is ``alpha >= 0.5`` (the upsampled intensity above ~0.45)."""
    padded = np.pad(digit, 1)  # strokes touch the 8x8 border; pad so they fade out inside the box
    up = _upsample(padded, height + 2 * height // 8, width + 2 * width // 8, Image.BILINEAR)
    up = up[height // 8: height // 8 + height, width // 8: width // 8 + width]
    return np.clip((up - 0.2) / 0.5, 0.0, 1.0)


def _paint(image: np.ndarray, alpha: np.ndarray, top: int, left: int, colour: np.ndarray) -> np.ndarray:
    """Alpha-blend ``colour`` into ``image`` in place; return the full-size stroke mask (alpha >= 0.5)."""
    h, w = alpha.shape
    patch = image[top:top + h, left:left + w]
    patch[:] = (1 - alpha[..., None]) * patch + alpha[..., None] * colour
    mask = np.zeros(image.shape[:2], bool)
    mask[top:top + h, left:left + w] = alpha >= 0.5
    return mask


def _overlaps(box: tuple[int, int, int, int], boxes: list[tuple[int, int, int, int]], limit: float) -> bool:
    """True when ``box`` covers more than ``limit`` of its own area or of any of ``boxes``."""
    y0, x0, y1, x1 = box
    area = (y1 - y0) * (x1 - x0)
    for b0, a0, b1, a1 in boxes:
        inter = max(0, min(y1, b1) - max(y0, b0)) * max(0, min(x1, a1) - max(x0, a0))
        if inter > limit * min(area, (b1 - b0) * (a1 - a0)):
            return True
    return False


def make_scene(rng: np.random.Generator, size: int = 192, *, digits: tuple[np.ndarray, np.ndarray] | None = None,
               max_instances: int = 5, empty: bool | None = None, crowd: bool = False,
               min_digit: float = 0.14, max_digit: float = 0.55) -> tuple[np.ndarray, list[Instance]]:
    """Draw one scene.

    Args:
        rng: the only source of randomness (the scene is a pure function of its state).
        size: side of the square image in pixels.
        digits: ``((N, 8, 8) float in [0, 1], (N,) int)`` to draw from; default all of scikit-learn's.
        max_instances: at most this many separate digits (at least one unless empty).
        empty: force a scene with no digits (True) or with some (False); ``None`` draws it (4%).
        crowd: also paint one cluster of 4-8 small digits of one class, returned as a single
            ``iscrowd=True`` instance whose mask is the union of their strokes.
        min_digit, max_digit: digit height range as a fraction of ``size``.

    Returns:
        ``image``: (size, size, 3) uint8; ``instances``: list of :class:`Instance` in paint
        order, with disjoint non-empty visible masks; every digit keeps at least 60 % of its
        strokes visible (placements that would hide more of an earlier digit are redrawn).
    """
    images, labels = digits if digits is not None else _digits()
    image = _background(rng, size)
    _add_distractors(rng, image)
    if empty is None:
        empty = rng.random() < 0.04
    count = 0 if empty else int(rng.integers(1, max_instances + 1))

    placed: list[tuple[int, int, int, int]] = []
    painted: list[list] = []  # [label, full stroke mask, visible mask, iscrowd]
    if crowd:
        painted.append(_paint_crowd(rng, image, images, labels, placed))
    for _ in range(count):
        for _attempt in range(30):
            h = int(rng.uniform(min_digit, max_digit) * size)
            w = int(np.clip(h * rng.uniform(0.65, 1.3), 8, size))
            top, left = int(rng.integers(0, size - h + 1)), int(rng.integers(0, size - w + 1))
            if _overlaps((top, left, top + h, left + w), placed, limit=0.25):
                continue
            k = int(rng.integers(len(images)))
            alpha = _digit_alpha(images[k], h, w)
            strokes = np.zeros((size, size), bool)
            strokes[top:top + h, left:left + w] = alpha >= 0.5
            # keep every earlier digit at least 60 % visible, so no half-hidden digit goes unlabelled
            if strokes.sum() >= 4 and all((v & ~strokes).sum() >= 0.6 * m.sum() for _, m, v, _ in painted):
                break
        else:
            continue  # crowded scene: fewer digits than drawn
        colour = _contrasting_colour(rng, image[strokes])
        _paint(image, alpha, top, left, colour)
        for entry in painted:
            entry[2] = entry[2] & ~strokes
        painted.append([int(labels[k]), strokes, strokes.copy(), False])
        placed.append((top, left, top + h, left + w))
    instances = [Instance(label, visible, iscrowd) for label, _, visible, iscrowd in painted]

    image += rng.normal(0, rng.uniform(1, 8), size=image.shape).astype(np.float32)  # sensor grain
    return np.clip(image, 0, 255).round().astype(np.uint8), instances


def _paint_crowd(rng: np.random.Generator, image: np.ndarray, images: np.ndarray, labels: np.ndarray,
                 placed: list[tuple[int, int, int, int]]) -> list:
    """A tight cluster of small digits of one class (COCO's "crowd": one region, many objects)."""
    size = image.shape[0]
    label = int(rng.integers(10))
    pool = np.flatnonzero(labels == label)
    cell = max(8, int(size * rng.uniform(0.06, 0.09)))
    rows, cols = int(rng.integers(2, 4)), int(rng.integers(2, 4))
    top = int(rng.integers(0, size - rows * cell + 1))
    left = int(rng.integers(0, size - cols * cell + 1))
    colour = _contrasting_colour(rng, image[top:top + rows * cell, left:left + cols * cell])
    union = np.zeros((size, size), bool)
    for r in range(rows):
        for c in range(cols):
            alpha = _digit_alpha(images[int(rng.choice(pool))], cell, cell)
            union |= _paint(image, alpha, top + r * cell, left + c * cell, colour)
    placed.append((top, left, top + rows * cell, left + cols * cell))
    return [label, union, union.copy(), True]


def generate_scenes(split: str, count: int, seed: int = 0, size: int = 192, *, crowd_every: int = 0,
                    empty_every: int = 0, **scene_kwargs) -> Iterator[tuple[int, np.ndarray, list[Instance]]]:
    """Yield ``(index, image, instances)`` for scenes ``0 .. count-1`` of ``split``.

    Digits come from the split's own share of scikit-learn's images (:func:`split_digits`).
    ``crowd_every=n`` adds a crowd cluster to every n-th scene and ``empty_every=n`` makes every
    n-th scene empty (offset so the two never coincide), on top of the random empty scenes.
    """
    digits = split_digits(split)
    for index in range(count):
        rng = np.random.default_rng(scene_seed(seed, split, index))
        crowd = bool(crowd_every) and index % crowd_every == 3 % crowd_every
        empty = True if empty_every and index % empty_every == empty_every // 2 and not crowd else None
        image, instances = make_scene(rng, size, digits=digits, crowd=crowd, empty=empty, **scene_kwargs)
        yield index, image, instances


# -- COCO layout -------------------------------------------------------------------------------------
def coco_categories() -> list[dict]:
    return [{"id": coco_category_id(d), "name": DIGIT_NAMES[d], "supercategory": "digit"} for d in range(10)]


def _rle(mask: np.ndarray, compressed: bool) -> dict:
    """pycocotools RLE of a (H, W) bool mask; COCO stores crowd regions uncompressed."""
    from pycocotools import mask as mask_utils

    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    if compressed:
        return {"size": list(rle["size"]), "counts": rle["counts"].decode("ascii")}
    flat = mask.astype(np.uint8).flatten(order="F")  # column-major runs, starting with zeros
    change = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.concatenate([[0], change, [flat.size]])
    counts = np.diff(bounds).tolist()
    if flat[0] == 1:
        counts = [0] + counts
    return {"size": [int(mask.shape[0]), int(mask.shape[1])], "counts": counts}


def _bbox(mask: np.ndarray) -> list[float]:
    ys, xs = np.nonzero(mask)
    x0, y0, x1, y1 = xs.min(), ys.min(), xs.max() + 1, ys.max() + 1
    return [float(x0), float(y0), float(x1 - x0), float(y1 - y0)]


#: default sizes of the demo COCO set (images per split); the image-id offset keeps ids unique across splits
DEFAULT_COCO_SPLITS = {"train": 1600, "val": 250, "test": 250}
_ID_OFFSET = {"train": 1, "val": 100_001, "test": 200_001}


def write_coco_layout(root: str | Path, counts: dict[str, int] | None = None, seed: int = 0, size: int = 192,
                      year: str = "2017", crowd_every: int = 40, empty_every: int = 30, jpeg_quality: int = 92) -> Path:
    """Write scenes in the COCO 2017 layout under ``root``:
    ``annotations/instances_{split}2017.json`` and ``{split}2017/<12-digit id>.jpg``.

    Category ids are :func:`coco_category_id` (non-contiguous), names "zero".."nine";
    segmentations are RLE (compressed for objects, uncompressed for crowds, as COCO does),
    ``area`` is the mask area, ``bbox`` the mask's tight ``[x, y, w, h]``. Each split has
    a few crowd regions and a few images without annotations.
    """
    root = Path(root)
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    counts = counts or DEFAULT_COCO_SPLITS
    for split, count in counts.items():
        folder = root / f"{split}{year}"
        folder.mkdir(parents=True, exist_ok=True)
        images, annotations = [], []
        for index, image, instances in generate_scenes(split, count, seed, size, crowd_every=crowd_every,
                                                       empty_every=empty_every):
            image_id = _ID_OFFSET.get(split, 1) + index
            file_name = f"{image_id:012d}.jpg"
            Image.fromarray(image).save(folder / file_name, quality=jpeg_quality)
            images.append({"id": image_id, "file_name": file_name, "height": size, "width": size})
            for inst in instances:
                annotations.append({
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": coco_category_id(inst.label),
                    "segmentation": _rle(inst.mask, compressed=not inst.iscrowd),
                    "area": float(inst.mask.sum()),
                    "bbox": _bbox(inst.mask),
                    "iscrowd": int(inst.iscrowd),
                })
        dataset = {
            "info": {"description": f"Handwritten-digit scenes ({split}), made from scikit-learn's digits",
                     "version": "1", "year": int(year)},
            "licenses": [],
            "images": images,
            "annotations": annotations,
            "categories": coco_categories(),
        }
        (root / "annotations" / f"instances_{split}{year}.json").write_text(json.dumps(dataset))
    return root
