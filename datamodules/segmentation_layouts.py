"""The two segmentation layouts on disk and what reads them: ADE20k's and VOC's sample lists, the
masks' own label encodings (:class:`MaskFormat`), and the dataset that turns a pair into an item.

:mod:`datamodules.segmentation` (the datamodule) and :mod:`datamodules.coco_voc` (COCO's images as
VOC-class masks) both build on it; the layouts themselves are described in
:mod:`datamodules.segmentation`'s docstring.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from datamodules.images import (
    BadImageError,
    OnBadImage,
    decode_rgb_bytes,
    exif_orientation,
    guarded,
    list_images,
    output_names,
    read_rgb_array,
)
from datamodules.segmentation_transforms import IGNORE_INDEX


VOC_CLASSES = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)
ADE20K_NUM_CLASSES = 150


def voc_palette(n: int = 256) -> np.ndarray:
    """(n, 3) uint8: PASCAL VOC's colour map (label bits spread over the high bits of R, G, B).

    Index 0 is black and 255 (ignore) is (224, 224, 192), as in VOC's own PNGs; used for
    every dataset's overlays so colours are stable across runs."""
    palette = np.zeros((n, 3), np.uint8)
    for label in range(n):
        c, rgb = label, [0, 0, 0]
        for bit in range(7, -1, -1):
            for channel in range(3):
                rgb[channel] |= ((c >> channel) & 1) << bit
            c >>= 3
        palette[label] = rgb
    return palette


@dataclass(frozen=True)
class MaskFormat:
    """How a dataset stores labels on disk.

    ``stored = label + offset``; ``reserved`` is the stored value that means "ignore"
    (ADE20k: offset 1, reserved 0; VOC: offset 0, reserved 255). ``palette`` writes
    VOC-style palette PNGs instead of grayscale ones.
    """

    num_classes: int
    offset: int
    reserved: int
    palette: bool

    @classmethod
    def of(cls, dataset: str, num_classes: int) -> "MaskFormat":
        """The encoding of ``dataset`` (``"ade20k"`` or ``"voc"``) with ``num_classes`` labels."""
        offset, reserved, palette = ENCODINGS[dataset]
        return cls(num_classes, offset, reserved, palette)

    def decode(self, stored: np.ndarray, path: Path | str) -> np.ndarray:
        """(H, W) stored values -> (H, W) uint8 labels in 0..K-1 or IGNORE_INDEX; other values are an error."""
        labels = stored.astype(np.int32) - self.offset
        reserved = stored == self.reserved
        bad = ~reserved & ((labels < 0) | (labels >= self.num_classes))
        if bad.any():
            values = np.unique(stored[bad])
            raise ValueError(
                f"mask {path} has values {values[:20].tolist()} outside the {self.num_classes} classes "
                f"(valid: {self.offset}..{self.offset + self.num_classes - 1}, and {self.reserved} = ignore)"
            )
        labels[reserved] = IGNORE_INDEX
        return labels.astype(np.uint8)

    def encode(self, labels: np.ndarray) -> Image.Image:
        """(H, W) int labels in 0..K-1 -> single-channel PNG-ready image in the dataset's encoding."""
        return encode_labels(labels, self.offset, self.palette)


#: ``(offset, reserved, palette)`` of each dataset's masks on disk; writing predictions needs
#: only these, not the number of classes, so ``predict`` never has to read the dataset's folder
ENCODINGS = {"ade20k": (1, 0, False), "voc": (0, IGNORE_INDEX, True)}


def encode_labels(labels: np.ndarray, offset: int, palette: bool) -> Image.Image:
    """(H, W) int labels -> single-channel image storing ``label + offset`` (a VOC palette PNG if ``palette``)."""
    stored = (np.asarray(labels).astype(np.int64) + offset).astype(np.uint8)
    return palette_png(stored) if palette else Image.fromarray(stored)


def palette_png(stored: np.ndarray) -> Image.Image:
    """(H, W) uint8 -> a palette ("P") image with VOC's colours, the format of VOC's own masks."""
    image = Image.fromarray(np.ascontiguousarray(stored, dtype=np.uint8))
    image.putpalette(voc_palette().tobytes())  # turns the "L" image into "P" with these indices
    return image


# -- listing samples ---------------------------------------------------------------------------------
Sample = tuple[Path, Path | None]  # (image, mask); mask None when predicting on plain images


def layout_hint(root: Path, dataset: str) -> str:
    """Why ``root`` may not be in ``dataset``'s layout, as a sentence to add to a "not found" error: it is
    in the other dataset's layout, or it holds the dataset's folder one level down; ``""`` otherwise.
    Only called on the way to an error, so a correct root costs nothing."""
    ade20k = any((root / top / split).is_dir() for top in ("images", "annotations")
                 for split in ("training", "validation"))
    voc = (root / "JPEGImages").is_dir() or (root / "ImageSets").is_dir()
    if dataset == "voc" and ade20k and not voc:
        return (f"; data.root={root} looks like ADE20k (images/training, annotations/training): "
                "pass --data.dataset ade20k")
    if dataset == "ade20k" and voc and not ade20k:
        return (f"; data.root={root} looks like PASCAL VOC (JPEGImages/, ImageSets/): pass --data.dataset voc "
                "(the default)")
    inner = ([root / "ADEChallengeData2016"] if dataset == "ade20k"
             else [root / "VOC2012", root / "VOCdevkit" / "VOC2012"])
    for folder in inner:
        if folder.is_dir():
            return f"; data.root should be the {folder.name} folder itself: --data.root {folder}"
    return ""


def ade20k_samples(root: Path, split: str) -> list[Sample]:
    """Pairs of ``images/<split>/<stem>.jpg`` and ``annotations/<split>/<stem>.png``; a missing mask is an error."""
    image_dir, mask_dir = root / "images" / split, root / "annotations" / split
    for folder in (image_dir, mask_dir):
        if not folder.is_dir():
            raise FileNotFoundError(f"ADE20k layout expects {folder} (data.root should be the ADEChallengeData2016 "
                                    f"folder holding images/ and annotations/){layout_hint(root, 'ade20k')}")
    images = list_images(image_dir)
    if not images:
        raise FileNotFoundError(f"{image_dir} holds no images")
    samples = []
    for image in images:
        mask = mask_dir / f"{image.stem}.png"
        if not mask.is_file():
            raise FileNotFoundError(f"image {image} has no annotation: expected {mask}")
        samples.append((image, mask))
    return samples


def split_list_entries(list_file: Path) -> list[tuple[int, str]]:
    """``(line number, stem)`` of each image of a VOC split list. Lines are ``<stem>`` or ``<image path>
    <mask path>`` (SBD's train_aug.txt); blank lines are skipped. An empty list, or an image listed twice
    (it would be trained on, or scored, twice), is an error naming the list and the lines."""
    if not list_file.is_file():
        raise FileNotFoundError(f"split list {list_file} does not exist")
    entries, first_line = [], {}
    for line_no, line in enumerate(list_file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        stem = Path(line.split()[0]).stem
        if stem in first_line:
            raise ValueError(f"{list_file} line {line_no} lists {stem!r} again (first at line {first_line[stem]}); "
                             "each image may be listed once: remove the repeated line")
        first_line[stem] = line_no
        entries.append((line_no, stem))
    if not entries:
        raise ValueError(f"split list {list_file} is empty")
    return entries


def read_split_list(list_file: Path) -> list[str]:
    """Stems of a VOC split list, in its order (:func:`split_list_entries`)."""
    return [stem for _, stem in split_list_entries(list_file)]


def voc_samples(root: Path, split: str, mask_dir: str = "SegmentationClass") -> list[Sample]:
    """``JPEGImages/<stem>.jpg`` and ``<mask_dir>/<stem>.png`` for every stem of ``ImageSets/Segmentation/<split>.txt``."""
    list_file = root / "ImageSets" / "Segmentation" / f"{split}.txt"
    if not list_file.is_file():
        raise FileNotFoundError(f"split list {list_file} does not exist (VOC layout: data.root is the VOC2012 folder "
                                f"holding JPEGImages/, {mask_dir}/ and ImageSets/Segmentation/)"
                                f"{layout_hint(root, 'voc')}")
    samples = []
    for line_no, stem in split_list_entries(list_file):
        image, mask = root / "JPEGImages" / f"{stem}.jpg", root / mask_dir / f"{stem}.png"
        for path in (image, mask):
            if not path.is_file():
                raise FileNotFoundError(f"{list_file} line {line_no} names {stem!r}, but {path} does not exist")
        samples.append((image, mask))
    return samples


# -- dataset -----------------------------------------------------------------------------------------------
def read_mask(path: Path | BinaryIO, name: str | None = None) -> np.ndarray:
    """(H, W) stored values of a palette or grayscale PNG (palette indices, not colours); ``path`` may be
    an open file (a streamed mask's bytes), named ``name`` in errors.

    A file that cannot be decoded (empty, truncated) raises :class:`BadImageError` naming it, so
    ``on_bad_image="skip"`` skips its sample like one with an unreadable image; a decodable mask
    of the wrong kind (RGB) is a ``ValueError``: the dataset is wrong, skipping would hide it."""
    name = name or path
    try:
        with Image.open(path) as img:
            mode = img.mode
            # np.asarray decodes the pixels: truncation surfaces here, not at open
            stored = np.asarray(img) if mode in ("P", "L", "I", "I;16") else None
    except Exception as err:  # PIL raises several types for empty, truncated or foreign files
        raise BadImageError(name, str(err) or type(err).__name__) from err
    if stored is None:
        raise ValueError(f"mask {name} is a {mode} image; expected a single-channel (palette or grayscale) PNG")
    return stored


def image_and_labels(image: np.ndarray, stored: np.ndarray | None, mask_format: MaskFormat | None, image_name,
                     mask_name, encoded: bytes | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(H, W, 3) image + its mask's stored values -> the image and (H, W) uint8 labels, the mask checked
    against the image's size and the dataset's values (errors name both files).

    The image is upright (its EXIF orientation applied); a mask of the stored, unturned size is named as
    such. ``encoded`` (a streamed image's bytes; by default the file ``image_name``) is read for that only
    on a mismatch."""
    if stored is None:
        return image, None
    if stored.shape != image.shape[:2]:
        message = (f"image {image_name} is {image.shape[1]}x{image.shape[0]} but its mask {mask_name} is "
                   f"{stored.shape[1]}x{stored.shape[0]} (width x height)")
        orientation = exif_orientation(encoded if encoded is not None else image_name)
        if stored.shape == image.shape[1::-1] and orientation >= 5:
            message += (f": the image carries EXIF orientation {orientation} (a quarter turn) and reads upright, as "
                        "viewers show it; the mask was drawn on the stored, unturned pixels. Turn the mask upright "
                        "too, or clear the image's tag (exiftool -Orientation=1 -n FILE)")
        raise ValueError(message)
    return image, mask_format.decode(stored, mask_name)


def segmentation_item(image: np.ndarray, labels: np.ndarray | None, index: int, path: str, transform,
                      mode: str, name: str | None = None) -> dict:
    """A loaded sample -> the item of :class:`SegmentationDataset` in ``mode``; shared by the folder and the
    streamed datasets, so both give the same items. ``name``: what the image's written mask is called
    (default: the stem of ``path``)."""
    if mode == "train":
        # albumentations draws from its own generators (OS-seeded unless told otherwise); seed them
        # from torch's RNG, which the loader seeds per worker / per sample, so runs are reproducible
        transform.set_random_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
        out = transform(image=image, mask=labels)
        return {"image": out["image"], "mask": out["mask"].long()}
    item = {"image": transform(image=image)["image"], "index": index, "path": path,
            "name": name if name is not None else Path(path).stem}
    if mode == "eval":
        item["mask"] = torch.from_numpy(labels).long()
    else:
        item["orig_size"] = torch.tensor(image.shape[:2], dtype=torch.long)
    return item


def streamed_segmentation_item(sample: dict, where: str, mask_format: MaskFormat | None, transform, mode: str,
                               on_bad_image: OnBadImage) -> dict | None:
    """A sample stored by ``datamodules.optimize`` -> the item of :class:`SegmentationDataset` (``predict``
    leaves the mask out); ``None`` when its image or mask cannot be decoded under ``on_bad_image="skip"``."""
    def load():
        image = decode_rgb_bytes(sample["image"], where).permute(1, 2, 0).numpy()
        stored = None if mode == "predict" else read_mask(io.BytesIO(sample["mask"]), f"{where} mask")
        return image_and_labels(image, stored, mask_format, where, f"{where} mask", sample["image"])

    loaded = guarded(load, where, on_bad_image)
    return None if loaded is None else segmentation_item(*loaded, int(sample["index"]), sample["path"], transform, mode)


class SegmentationDataset(Dataset):
    """Items for the three uses:

    - ``train``: ``{"image": (3, c, c) float, "mask": (c, c) int64}`` (joint augmentation);
    - ``eval``: ``{"image": (3, h, w) float, "mask": (H, W) int64, "index": int, "path": str, "name": str}``,
      the image resized for the network, the mask at the original size;
    - ``predict``: ``{"image": (3, h, w) float, "orig_size": (2,) int64 original (H, W), "index": int,
      "path": str, "name": str}``.

    Masks are checked on every read (values, size against the image). ``mask_format`` may be
    ``None`` when no sample has a mask (predict). ``on_bad_image="skip"`` returns ``None`` for a
    sample whose image or mask cannot be decoded; :func:`collate_skipping` counts it.
    """

    def __init__(self, samples: list[Sample], mask_format: MaskFormat | None, transform, mode: str,
                 on_bad_image: OnBadImage = "fail", root: Path | None = None):
        if mode not in ("train", "eval", "predict"):
            raise ValueError(f"unknown mode {mode!r}")
        self.root = root
        self.samples = samples
        # what test / predict call each image's mask: its stem, unless two images share it
        self.names = output_names(image for image, _ in samples) if mode != "train" else {}
        self.mask_format = mask_format
        self.transform = transform
        self.mode = mode
        self.on_bad_image = on_bad_image

    def __len__(self) -> int:
        return len(self.samples)

    def stem(self, index: int) -> str:
        return self.samples[index][0].stem

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(H, W, 3) uint8 image and (H, W) uint8 labels (or ``None`` without a mask)."""
        image_path, mask_path = self.samples[index]
        image = read_rgb_array(image_path)
        stored = None if mask_path is None else read_mask(mask_path)
        return image_and_labels(image, stored, self.mask_format, image_path, mask_path)

    def __getitem__(self, index: int) -> dict | None:
        loaded = guarded(lambda: self.load(index), self.samples[index][0], self.on_bad_image)
        if loaded is None:
            return None
        path = str(self.samples[index][0])
        return segmentation_item(*loaded, index, path, self.transform, self.mode, self.names.get(path))

    def stored_sample(self, index: int) -> dict:
        """What ``python -m datamodules.optimize`` stores: the image's and the mask's bytes as they are and
        the image's path relative to the dataset root."""
        image, mask = self.samples[index]
        return {"index": index, "image": image.read_bytes(), "mask": mask.read_bytes(),
                "path": image.relative_to(self.root).as_posix()}


# -- demo data in the VOC layout -----------------------------------------------------------------------------
#: images per split of the demo set, and the side of its square images
