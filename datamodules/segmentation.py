"""Semantic segmentation data: ADE20k (SceneParsing, 150 classes) and PASCAL VOC 2012.

Layouts (what ``root`` points at):

- ADE20k: the ``ADEChallengeData2016`` folder, ``images/{training,validation}/*.jpg`` and
  ``annotations/{training,validation}/*.png`` (same stems). Mask value 0 is "other"
  and is ignored; 1..150 become labels 0..149. Class names come from
  ``objectInfo150.txt`` when the folder has it.
- VOC 2012: the ``VOC2012`` folder, ``JPEGImages/<stem>.jpg``,
  ``SegmentationClass/<stem>.png`` (palette PNGs: 0 background, 1..20 objects, 255
  object outlines = ignored) and ``ImageSets/Segmentation/{train,val}.txt``. With
  ``aug_masks=True`` training reads the SBD-augmented set instead:
  ``ImageSets/Segmentation/train_aug.txt`` and ``SegmentationClassAug/<stem>.png``.

A VOC-layout folder may carry ``class_names.txt`` (line i = name of label i); the number
of classes follows it, so a VOC-layout dataset with other classes needs no flag. The
embedded demo (no ``root``) is such a folder: handwritten-digit scenes from
:mod:`datamodules.demo_scenes` (the generator detection's demo uses too) with
background + 10 digit classes and 1-pixel ignore outlines around the digits, as VOC
marks object boundaries.

Inside the pipeline every dataset is "labels 0..K-1, 255 ignored". What ``test``
writes goes back to the dataset's own encoding (:class:`MaskFormat`).

Images are read by :func:`datamodules.images.read_rgb_array` (one decoder for every vision
datamodule, 16-bit PNGs scaled, errors naming the file). Batches are dicts:

- train: ``{"image": (B, 3, c, c) float, "mask": (B, c, c) int64, "skipped": int}``;
- val / test (one image per step): ``{"image": (1, 3, h, w) float (resized for the network),
  "mask": (1, H, W) int64 (original size), "index": (1,) int64, "path": [str], "skipped": int}``;
- predict: ``{"image": (B, 3, h, w) float, "orig_size": (B, 2) int64 (H, W), "index": (B,) int64,
  "path": list[str], "skipped": int}``.

``path`` is the image file as listed (under ``root``, or as given by ``predict_path``). A batch
whose images were all skipped (``on_bad_image="skip"``) is ``{"skipped": n}``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from PIL import Image
from torch.utils.data import Dataset

from datamodules.demo import demo_root
from datamodules.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BadImageError,
    OnBadImage,
    collate_skipping,
    guarded,
    list_images,
    predict_images,
    read_rgb_array,
)
from datamodules.loaders import SplitLoaders, make_loader
from datamodules.segmentation_transforms import IGNORE_INDEX, eval_transform, train_transform

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


def ade20k_samples(root: Path, split: str) -> list[Sample]:
    """Pairs of ``images/<split>/<stem>.jpg`` and ``annotations/<split>/<stem>.png``; a missing mask is an error."""
    image_dir, mask_dir = root / "images" / split, root / "annotations" / split
    for folder in (image_dir, mask_dir):
        if not folder.is_dir():
            raise FileNotFoundError(f"ADE20k layout expects {folder} (data.root should be the ADEChallengeData2016 "
                                    f"folder holding images/ and annotations/)")
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


def read_split_list(list_file: Path) -> list[str]:
    """Stems of a VOC split list. Lines are ``<stem>`` or ``<image path> <mask path>`` (SBD's train_aug.txt)."""
    if not list_file.is_file():
        raise FileNotFoundError(f"split list {list_file} does not exist")
    stems = []
    for line in list_file.read_text().splitlines():
        if line.strip():
            stems.append(Path(line.split()[0]).stem)
    if not stems:
        raise ValueError(f"split list {list_file} is empty")
    return stems


def voc_samples(root: Path, split: str, mask_dir: str = "SegmentationClass") -> list[Sample]:
    """``JPEGImages/<stem>.jpg`` and ``<mask_dir>/<stem>.png`` for every stem of ``ImageSets/Segmentation/<split>.txt``."""
    list_file = root / "ImageSets" / "Segmentation" / f"{split}.txt"
    samples = []
    for line_no, stem in enumerate(read_split_list(list_file), start=1):
        image, mask = root / "JPEGImages" / f"{stem}.jpg", root / mask_dir / f"{stem}.png"
        for path in (image, mask):
            if not path.is_file():
                raise FileNotFoundError(f"{list_file} line {line_no} names {stem!r}, but {path} does not exist")
        samples.append((image, mask))
    return samples


# -- dataset -----------------------------------------------------------------------------------------------
def read_mask(path: Path) -> np.ndarray:
    """(H, W) stored values of a palette or grayscale PNG (palette indices, not colours).

    A file that cannot be decoded (empty, truncated) raises :class:`BadImageError` naming it, so
    ``on_bad_image="skip"`` skips its sample like one with an unreadable image; a decodable mask
    of the wrong kind (RGB) is a ``ValueError``: the dataset is wrong, skipping would hide it."""
    try:
        with Image.open(path) as img:
            mode = img.mode
            # np.asarray decodes the pixels: truncation surfaces here, not at open
            stored = np.asarray(img) if mode in ("P", "L", "I", "I;16") else None
    except Exception as err:  # PIL raises several types for empty, truncated or foreign files
        raise BadImageError(path, str(err) or type(err).__name__) from err
    if stored is None:
        raise ValueError(f"mask {path} is a {mode} image; expected a single-channel (palette or grayscale) PNG")
    return stored


class SegmentationDataset(Dataset):
    """Items for the three uses:

    - ``train``: ``{"image": (3, c, c) float, "mask": (c, c) int64}`` (joint augmentation);
    - ``eval``: ``{"image": (3, h, w) float, "mask": (H, W) int64, "index": int, "path": str}``,
      the image resized for the network, the mask at the original size;
    - ``predict``: ``{"image": (3, h, w) float, "orig_size": (2,) int64 original (H, W), "index": int,
      "path": str}``.

    Masks are checked on every read (values, size against the image). ``mask_format`` may be
    ``None`` when no sample has a mask (predict). ``on_bad_image="skip"`` returns ``None`` for a
    sample whose image or mask cannot be decoded; :func:`collate_skipping` counts it.
    """

    def __init__(self, samples: list[Sample], mask_format: MaskFormat | None, transform, mode: str,
                 on_bad_image: OnBadImage = "fail"):
        if mode not in ("train", "eval", "predict"):
            raise ValueError(f"unknown mode {mode!r}")
        self.samples = samples
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
        if mask_path is None:
            return image, None
        stored = read_mask(mask_path)
        if stored.shape != image.shape[:2]:
            raise ValueError(f"image {image_path} is {image.shape[1]}x{image.shape[0]} but its mask {mask_path} is "
                             f"{stored.shape[1]}x{stored.shape[0]} (width x height)")
        return image, self.mask_format.decode(stored, mask_path)

    def __getitem__(self, index: int) -> dict | None:
        loaded = guarded(lambda: self.load(index), self.samples[index][0], self.on_bad_image)
        if loaded is None:
            return None
        image, labels = loaded
        if self.mode == "train":
            # albumentations draws from its own generators (OS-seeded unless told otherwise); seed them
            # from torch's RNG, which the loader seeds per worker / per sample, so runs are reproducible
            self.transform.set_random_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
            out = self.transform(image=image, mask=labels)
            return {"image": out["image"], "mask": out["mask"].long()}
        item = {"image": self.transform(image=image)["image"], "index": index, "path": str(self.samples[index][0])}
        if self.mode == "eval":
            item["mask"] = torch.from_numpy(labels).long()
        else:
            item["orig_size"] = torch.tensor(image.shape[:2], dtype=torch.long)
        return item


# -- demo data in the VOC layout -----------------------------------------------------------------------------
#: images per split of the demo set, and the side of its square images
DEMO_SPLITS = {"train": 1000, "val": 100, "test": 200}
DEMO_SIZE = 128
DEMO_VERSION = 2


def _dilate(mask: np.ndarray) -> np.ndarray:
    """(H, W) bool -> the mask grown by one pixel (8-neighbourhood)."""
    padded = np.pad(mask, 1)
    h, w = mask.shape
    return np.logical_or.reduce([padded[dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3)])


def scene_to_labels(instances, size: int) -> np.ndarray:
    """Demo scene instances -> (size, size) uint8 VOC-style mask: 0 background, 1 + digit on the
    strokes, 255 on the background pixels touching a digit (VOC's outline convention)."""
    labels = np.zeros((size, size), np.uint8)
    objects = np.zeros((size, size), bool)
    for inst in instances:
        labels[inst.mask] = 1 + inst.label
        objects |= inst.mask
    labels[_dilate(objects) & ~objects] = IGNORE_INDEX
    return labels


def write_voc_demo(root: Path, counts: dict[str, int] | None = None, seed: int = 0, size: int = DEMO_SIZE,
                   min_digit: float = 0.3, max_digit: float = 0.7, max_instances: int = 4) -> Path:
    """Write handwritten-digit scenes in the VOC 2012 layout under ``root`` (+ ``class_names.txt``).

    Digits are drawn larger than detection's (``min_digit``/``max_digit`` of the image
    height) so their strokes stay a few pixels wide at the demo's small size.
    """
    from datamodules.demo_scenes import DIGIT_NAMES, generate_scenes

    root = Path(root)
    for folder in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for split, count in (counts or DEMO_SPLITS).items():
        stems = []
        for index, image, instances in generate_scenes(split, count, seed, size, min_digit=min_digit,
                                                       max_digit=max_digit, max_instances=max_instances):
            stem = f"{split}_{index:05d}"
            Image.fromarray(image).save(root / "JPEGImages" / f"{stem}.jpg", quality=92)
            palette_png(scene_to_labels(instances, size)).save(root / "SegmentationClass" / f"{stem}.png")
            stems.append(stem)
        (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(stems) + "\n")
    (root / "class_names.txt").write_text("\n".join(["background", *DIGIT_NAMES]) + "\n")
    return root


# -- class names ---------------------------------------------------------------------------------------------
def read_class_names(path: Path) -> list[str]:
    names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not names:
        raise ValueError(f"{path} lists no class names")
    return names


def read_ade20k_names(path: Path) -> list[str]:
    """Names from ADE20k's ``objectInfo150.txt`` (tab-separated: Idx, Ratio, Train, Val, Name)."""
    rows = [line.split("\t") for line in path.read_text().splitlines()[1:] if line.strip()]
    names = [row[-1].split(",")[0].split(";")[0].strip() for row in rows]
    if len(names) != ADE20K_NUM_CLASSES:
        raise ValueError(f"{path} lists {len(names)} classes, expected {ADE20K_NUM_CLASSES}")
    return names


class SegmentationDataModule(SplitLoaders, LightningDataModule):
    """ADE20k or PASCAL VOC 2012 (or the embedded demo in the VOC layout).

    Args:
        root: the ``ADEChallengeData2016`` or ``VOC2012`` folder; ``None`` builds and uses the demo.
        dataset: ``"ade20k"`` or ``"voc"`` (the layout and label encoding of ``root``).
        aug_masks: VOC only: train on ``train_aug.txt`` with ``SegmentationClassAug`` masks (SBD).
        crop_size: training crop side; scale_range: random short side = ``crop_size`` x this range.
        hflip, photometric, blur, rotate_p: probabilities; rotate_degrees: rotation range (+-).
        eval_short_side: evaluation resizes the image's short side to this (``None``: native size);
            logits are upsampled back and scored at the original size.
        mean, std: normalisation (MobileViT/CVNets checkpoints expect 0/1, i.e. none).
        batch_size: training batch per device. Evaluation runs one image per step, so every image
            is predicted exactly as it would be alone (metrics do not depend on batching or DDP).
        on_bad_image: ``"fail"`` names an unreadable image (or mask) file and stops; ``"skip"`` skips
            the sample and counts it (``batch["skipped"]``).
        predict_path: one image file or a folder of images for ``predict``; ``root`` is then not
            read. Default: the test split's images.

    Batches: see the module docstring.
    """

    def __init__(self, root: str | None = None, dataset: Literal["ade20k", "voc"] = "voc", aug_masks: bool = False,
                 crop_size: int = 512, scale_range: tuple[float, float] = (0.5, 2.0), hflip: float = 0.5,
                 photometric: float = 0.5, blur: float = 0.2, rotate_degrees: float = 10.0, rotate_p: float = 0.5,
                 eval_short_side: int | None = 512, mean: tuple[float, float, float] = IMAGENET_MEAN,
                 std: tuple[float, float, float] = IMAGENET_STD, batch_size: int = 16, num_workers: int = 4,
                 pin_memory: bool = True, persistent_workers: bool = True,
                 on_bad_image: Literal["fail", "skip"] = "fail", predict_path: str | None = None):
        super().__init__()
        if dataset not in ("ade20k", "voc"):
            raise ValueError(f"dataset must be 'ade20k' or 'voc', got {dataset!r}")
        if aug_masks and dataset != "voc":
            raise ValueError("aug_masks (SBD-augmented masks) exists only for dataset='voc'")
        if root is None and dataset != "voc":
            raise ValueError("the embedded demo is in the VOC layout: use dataset='voc' or give data.root")
        if on_bad_image not in ("fail", "skip"):
            raise ValueError(f"on_bad_image must be 'fail' or 'skip', got {on_bad_image!r}")
        self.save_hyperparameters()
        self._root = Path(root).expanduser() if root else None
        self._class_names: list[str] | None = None

    # -- what the model needs to know about the data ------------------------------------------------------
    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = demo_root("digits-voc", write_voc_demo, version=DEMO_VERSION)
        if not self._root.is_dir():
            raise FileNotFoundError(f"data.root={self._root} does not exist")
        return self._root

    @property
    def class_names(self) -> list[str]:
        """Label i is ``class_names[i]`` (the ignore label is not a class)."""
        if self._class_names is None:
            listed = self.root / "class_names.txt"
            if listed.is_file():
                self._class_names = read_class_names(listed)
            elif self.hparams.dataset == "voc":
                self._class_names = list(VOC_CLASSES)
            elif (self.root / "objectInfo150.txt").is_file():
                self._class_names = read_ade20k_names(self.root / "objectInfo150.txt")
            else:
                self._class_names = [f"class {i}" for i in range(1, ADE20K_NUM_CLASSES + 1)]
        return self._class_names

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def mask_format(self) -> MaskFormat:
        """Decoding masks checks values against the number of classes, so this reads ``root``."""
        return MaskFormat.of(self.hparams.dataset, self.num_classes)

    @property
    def palette(self) -> np.ndarray:
        """(256 - offset, 3) uint8 overlay colours: row i is label i's colour (VOC's colour map at
        the label's stored value). Rows past the number of classes are never indexed; the table
        does not depend on it, so ``predict`` needs no dataset folder to draw overlays."""
        offset, _, _ = ENCODINGS[self.hparams.dataset]
        return voc_palette()[offset:]

    def encode_prediction(self, labels: np.ndarray) -> Image.Image:
        """(H, W) predicted labels -> the PNG image ``test``/``predict`` write, in the dataset's own
        encoding. Needs only ``dataset`` (not ``root``)."""
        offset, _, palette = ENCODINGS[self.hparams.dataset]
        return encode_labels(labels, offset, palette)

    # -- splits --------------------------------------------------------------------------------------------
    def _split_samples(self, stage: str) -> list[Sample]:
        h = self.hparams
        if h.dataset == "ade20k":
            return ade20k_samples(self.root, "training" if stage == "train" else "validation")
        if stage == "train":
            return voc_samples(self.root, "train_aug", "SegmentationClassAug") if h.aug_masks else \
                voc_samples(self.root, "train")
        if stage == "test" and self._has_labelled_voc_test():
            return voc_samples(self.root, "test")
        return voc_samples(self.root, "val")

    def _has_labelled_voc_test(self) -> bool:
        """VOC's official test list has no masks; a test list whose masks exist (the demo's) is scored."""
        list_file = self.root / "ImageSets" / "Segmentation" / "test.txt"
        if not list_file.is_file():
            return False
        first = read_split_list(list_file)[0]
        return (self.root / "SegmentationClass" / f"{first}.png").is_file()

    def _dataset(self, stage: str) -> SegmentationDataset:
        h = self.hparams
        if stage == "train":
            transform = train_transform(h.crop_size, h.scale_range, h.hflip, h.photometric, h.blur, h.rotate_degrees,
                                        h.rotate_p, h.mean, h.std, IGNORE_INDEX)
            return SegmentationDataset(self._split_samples("train"), self.mask_format, transform, "train",
                                       h.on_bad_image)
        transform = eval_transform(h.eval_short_side, h.mean, h.std)
        if stage == "predict":
            if h.predict_path:  # only the given images: root (and the demo build) stay untouched
                # not recursive: outputs are named by the image's stem, which must be unique
                images = predict_images(Path(h.predict_path))
            else:
                images = [image for image, _ in self._split_samples("test")]
            # no masks are read, so no mask format (which would need the class count, i.e. root)
            return SegmentationDataset([(image, None) for image in images], None, transform, "predict",
                                       h.on_bad_image)
        return SegmentationDataset(self._split_samples(stage), self.mask_format, transform, "eval", h.on_bad_image)

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.train_set = self._dataset("train")
        if stage in ("fit", "validate"):
            self.val_set = self._dataset("val")
        if stage == "test":
            self.test_set = self._dataset("test")
        if stage == "predict":
            self.predict_set = self._dataset("predict")

    def _loader(self, dataset: SegmentationDataset, train: bool):
        h = self.hparams
        return make_loader(dataset, batch_size=h.batch_size if train else 1, num_workers=h.num_workers, train=train,
                           pin_memory=h.pin_memory, persistent_workers=h.persistent_workers,
                           collate_fn=collate_skipping, trainer=self.trainer if train else None)


__all__ = [
    "ENCODINGS", "IGNORE_INDEX", "MaskFormat", "SegmentationDataModule", "SegmentationDataset", "VOC_CLASSES",
    "ade20k_samples", "encode_labels", "read_mask", "voc_palette", "voc_samples", "write_voc_demo",
]

