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

Training augmentation (``augmentation``): ``"default"`` is :func:`datamodules.segmentation_transforms.train_transform`
(albumentations, the demo recipes' pipeline); ``"cvnets"`` is CVNets' MobileViTv2 pipeline,
:class:`datamodules.segmentation_cvnets.CvnetsTrainTransform`. VOC training can add COCO's images with
masks rasterised to VOC's classes (``coco_root``, :mod:`datamodules.coco_voc`), as CVNets' VOC rows do.

Images are read by :func:`datamodules.images.read_rgb_array` (one decoder for every vision
datamodule, 16-bit PNGs scaled, errors naming the file). Batches are dicts:

- train: ``{"image": (B, 3, c, c) float, "mask": (B, c, c) int64, "skipped": int}``;
- val / test (one image per step): ``{"image": (1, 3, h, w) float (resized for the network),
  "mask": (1, H, W) int64 (original size), "index": (1,) int64, "path": [str], "name": [str], "skipped": int}``;
- predict: ``{"image": (B, 3, h, w) float, "orig_size": (B, 2) int64 (H, W), "index": (B,) int64,
  "path": list[str], "name": list[str], "skipped": int}``.

``path`` is the image file as listed (under ``root``, or as given by ``predict_path``); ``name`` is
what the mask written for it is called (:func:`datamodules.images.output_names`: the stem, or the
file name with its extension when two images of the split share a stem). Images are read upright
(EXIF orientation applied), so ``orig_size`` and the masks are those of the image as viewers show it.
A batch whose images were all skipped (``on_bad_image="skip"``) is ``{"skipped": n}``.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
from lightning.pytorch import LightningDataModule
from PIL import Image
from torch.utils.data import ConcatDataset, Dataset

from datamodules.demo import demo_root
from datamodules.images import collate_skipping, predict_images
from datamodules.input_spec import InputSpec, normalization, segmentation_spec
from datamodules.loaders import (SplitLoaders, StreamedSource, check_positive_counts, check_repeated_augmentation,
                                 make_loader)
from datamodules.segmentation_cvnets import CvnetsTrainTransform
from datamodules.segmentation_transforms import IGNORE_INDEX, train_transform
# the layouts' readers, shared with datamodules.coco_voc, and importable from here
from datamodules.segmentation_layouts import (  # noqa: F401
    ADE20K_NUM_CLASSES,
    ade20k_samples,
    encode_labels,
    ENCODINGS,
    image_and_labels,
    layout_hint,
    MaskFormat,
    palette_png,
    read_mask,
    read_split_list,
    Sample,
    segmentation_item,
    SegmentationDataset,
    streamed_segmentation_item,
    VOC_CLASSES,
    voc_palette,
    voc_samples,
)
from layers.machine import AUTO, NumWorkers

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


class SegmentationDataModule(SplitLoaders, StreamedSource, LightningDataModule):
    """ADE20k or PASCAL VOC 2012 (or the embedded demo in the VOC layout).

    Args:
        root: the ``ADEChallengeData2016`` or ``VOC2012`` folder; ``None`` builds and uses the demo.
        dataset: ``"ade20k"`` or ``"voc"`` (the layout and label encoding of ``root``).
        aug_masks: VOC only: train on ``train_aug.txt`` with ``SegmentationClassAug`` masks (SBD).
        augmentation: the training pipeline: ``"default"`` (albumentations: short side ``crop_size`` x
            ``scale_range``, crop padded at a random position, flip, colour jitter, blur, rotation) or
            ``"cvnets"`` (CVNets' MobileViTv2 pipeline, :mod:`datamodules.segmentation_cvnets`).
        crop_size: training crop side (both pipelines).
        scale_range: ``"default"`` only: random short side = ``crop_size`` x this range.
        short_side_range, max_image_side: ``"cvnets"`` only: random short side in these integers (both
            ends included), the scale capped so the long side stays <= ``max_image_side``.
        seg_class_max_ratio: ``"cvnets"`` only: the crop is re-drawn (10 checks) while one class covers
            this share or more of it; VOC leaves its ignore label out of the count, ADE20k counts every
            pixel, "other" and padding included, as CVNets does (its ADE20k masks hold no 255).
        hflip, photometric, blur, rotate_p: probabilities; ``None`` (blur, rotate_p) takes the pipeline's
            own value: 0.2 and 0.5 for ``"default"``, 0.5 and 1.0 (rotation always) for ``"cvnets"``.
            In ``"cvnets"``, ``photometric`` is the probability of each of torchvision's
            ``RandomPhotometricDistort`` steps, as in CVNets.
        rotate_degrees: rotation range (+-). Padding and rotation fill masks with the ignore label.
        coco_root: VOC only: also train on COCO images with their instances rasterised to VOC's classes
            (:mod:`datamodules.coco_voc`), appended to the VOC training list as CVNets does; the folder is
            in the COCO layout (``annotations/instances_<split>.json``, ``<split>/``).
        coco_splits: the COCO splits to add (CVNets: ``train2017``).
        coco_min_pixels: keep COCO images with more than this many VOC-class pixels (CVNets'
            preprocessing: 1000); ``None`` keeps every image.
        eval_short_side: evaluation resizes the image's short side to this (``None``: native size);
            logits are upsampled back and scored at the original size.
        weights: the weights the network starts from, registered (``backbones/pretrained.py``) or a checkpoint
            file; the CLI links the model's ``weights`` or its backbone's ``pretrained`` here. Its entry, or the
            input specification the checkpoint stores, gives ``mean`` and ``std``.
        mean, std: normalisation of [0, 1] pixels; ``None`` takes the weights' (ImageNet's without weights).
            ``hparams.mean`` / ``hparams.std`` hold the values used.
        batch_size: training batch per device. Evaluation runs one image per step, so every image
            is predicted exactly as it would be alone (metrics do not depend on batching or DDP).
        on_bad_image: ``"fail"`` names an unreadable image (or mask) file and stops; ``"skip"`` skips
            the sample and counts it (``batch["skipped"]``).
        predict_path: one image file or a folder of images for ``predict``; ``root`` is then not
            read. Default: the test split's images.
        streaming_root: a folder or object-store URL written by ``python -m datamodules.optimize --task
            segment`` (with the same ``dataset``); the splits are then streamed with LitData and ``root``
            is not read (:mod:`datamodules.streaming`). ``path`` is then relative to the dataset's root.
        repeated_augmentation: repeated augmentation (DeiT's ``RASampler``, timm's ``--aug-repeats``): each
            training image this many times an epoch, each copy under its own augmentation, the epoch still
            about the dataset's size (:class:`datamodules.loaders.RepeatedAugmentationSampler`); 1: off.

    Batches: see the module docstring.

    The MobileViTv2 paper's rows (CVNets ``config/segmentation/{pascal_voc,ade20k}/*_mobilevitv2.yaml``)
    train with ``augmentation: cvnets`` and the defaults of ``crop_size`` (512), ``short_side_range``
    ([256, 768]), ``max_image_side`` (1024), ``seg_class_max_ratio`` (0.75), ``hflip`` / ``photometric``
    (0.5), ``blur`` / ``rotate_p`` (``None``: 0.5 / 1.0) and ``rotate_degrees`` (10), from CVNets'
    ImageNet weights (``weights``: ``mobilevitv2_<width>.cvnets_in1k``, whose entry gives mean 0 and std 1:
    CVNets feeds pixels / 255). A recipe must set:

    - VOC: ``dataset: voc``, ``aug_masks: true`` (train_aug), ``coco_root`` (the COCO 2017 folder), and
      keep ``coco_splits: [train2017]``, ``coco_min_pixels: 1000``; ``batch_size: 32`` per device
      (CVNets: 32 x 4 GPUs);
    - ADE20k: ``dataset: ade20k``, no ``coco_root``; ``batch_size: 4`` per device (CVNets: 4 x 4 GPUs).
    """

    streaming_task, streaming_layout = "segment", "segmentation"

    def __init__(self, root: str | None = None, dataset: Literal["ade20k", "voc"] = "voc", aug_masks: bool = False,
                 augmentation: Literal["default", "cvnets"] = "default", crop_size: int = 512,
                 scale_range: tuple[float, float] = (0.5, 2.0), short_side_range: tuple[int, int] = (256, 768),
                 max_image_side: int = 1024, seg_class_max_ratio: float = 0.75, hflip: float = 0.5,
                 photometric: float = 0.5, blur: float | None = None, rotate_degrees: float = 10.0,
                 rotate_p: float | None = None, coco_root: str | None = None,
                 coco_splits: tuple[str, ...] = ("train2017",), coco_min_pixels: int | None = 1000,
                 eval_short_side: int | None = 512, weights: str | None = None,
                 mean: tuple[float, float, float] | None = None, std: tuple[float, float, float] | None = None, batch_size: int = 16, num_workers: NumWorkers = AUTO,
                 pin_memory: bool = True, persistent_workers: bool = True,
                 on_bad_image: Literal["fail", "skip"] = "fail", predict_path: str | None = None,
                 streaming_root: str | None = None, repeated_augmentation: int = 1):
        super().__init__()
        check_repeated_augmentation(repeated_augmentation)
        if dataset not in ("ade20k", "voc"):
            raise ValueError(f"dataset must be 'ade20k' or 'voc', got {dataset!r}")
        if aug_masks and dataset != "voc":
            raise ValueError("aug_masks (SBD-augmented masks) exists only for dataset='voc'")
        if root is None and streaming_root is None and dataset != "voc":
            raise ValueError("the embedded demo is in the VOC layout: use dataset='voc' or give data.root")
        if on_bad_image not in ("fail", "skip"):
            raise ValueError(f"on_bad_image must be 'fail' or 'skip', got {on_bad_image!r}")
        if augmentation not in ("default", "cvnets"):
            raise ValueError(f"augmentation must be 'default' or 'cvnets', got {augmentation!r}")
        if coco_root is not None and dataset != "voc":
            raise ValueError(f"coco_root adds COCO images with VOC's classes: it needs dataset='voc', got {dataset!r}")
        if coco_root is not None and streaming_root is not None:
            raise ValueError("coco_root is read from its folder; it cannot be mixed into a streamed dataset "
                             "(streaming_root)")
        self.save_hyperparameters()
        check_positive_counts(batch_size=batch_size)
        self.hparams.mean, self.hparams.std = normalization(weights, mean, std)
        self._root = Path(root).expanduser() if root else None
        self._class_names: list[str] | None = None
        self._streamed = None

    def check_streamed(self, streamed) -> None:
        if streamed.data["dataset"] != self.hparams.dataset:
            raise ValueError(f"data.streaming_root={streamed.root} holds a {streamed.data['dataset']!r} dataset, "
                             f"but data.dataset={self.hparams.dataset!r} (its label encoding): set "
                             f"--data.dataset {streamed.data['dataset']}")

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
        if self._class_names is None and self.streamed is not None:
            self._class_names = list(self.streamed.data["class_names"])
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
    def input_spec(self) -> InputSpec:
        """How images enter the network at evaluation: the short side resized to ``eval_short_side``,
        normalised with ``mean`` / ``std``; ``crop_size`` is the training (and export) size
        (:mod:`datamodules.input_spec`). The task keeps it in its checkpoint."""
        return segmentation_spec(self.hparams)

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
    def split_name(self, stage: str) -> str:
        """The split a stage reads (``train``, ``val``, ``test``): ADE20k's ``training`` / ``validation``, VOC's
        ``train`` (``train_aug`` with ``aug_masks``), ``val``, and ``test`` when its masks exist."""
        h = self.hparams
        if h.dataset == "ade20k":
            return "training" if stage == "train" else "validation"
        if stage == "train":
            return "train_aug" if h.aug_masks else "train"
        return "test" if stage == "test" and self._has_labelled_voc_test() else "val"

    def _split_samples(self, stage: str) -> list[Sample]:
        return self._samples(self.split_name(stage))

    def _samples(self, split: str) -> list[Sample]:
        if self.hparams.dataset == "ade20k":
            return ade20k_samples(self.root, split)
        return voc_samples(self.root, split, "SegmentationClassAug" if split == "train_aug" else "SegmentationClass")

    def _has_labelled_voc_test(self) -> bool:
        """VOC's official test list has no masks; a test list whose masks exist (the demo's) is scored."""
        if self.streamed is not None:
            return self.streamed.has_split("test")
        list_file = self.root / "ImageSets" / "Segmentation" / "test.txt"
        if not list_file.is_file():
            return False
        first = read_split_list(list_file)[0]
        return (self.root / "SegmentationClass" / f"{first}.png").is_file()

    def _streamed_dataset(self, stage: str, transform):
        h = self.hparams
        mode = {"train": "train", "predict": "predict"}.get(stage, "eval")
        item = partial(streamed_segmentation_item, mask_format=None if mode == "predict" else self.mask_format,
                       transform=transform, mode=mode, on_bad_image=h.on_bad_image)
        return self.streamed.split(self.split_name("test" if stage == "predict" else stage), item,
                                   train=stage == "train")

    def train_transform(self):
        """The joint training transform of ``augmentation`` (called as ``transform(image=, mask=)``)."""
        h = self.hparams
        if h.augmentation == "cvnets":
            # CVNets' crop ignores 255 in the class ratio; its ADE20k masks hold no 255 ("other" is 0), so
            # there every pixel counts: our "other" and padding (both 255 after decoding) included
            ratio_ignore = IGNORE_INDEX if h.dataset == "voc" else None
            return CvnetsTrainTransform(h.crop_size, h.short_side_range, h.max_image_side, h.seg_class_max_ratio,
                                        h.hflip, 0.5 if h.blur is None else h.blur, photometric=h.photometric,
                                        rotate_degrees=h.rotate_degrees,
                                        rotate_p=1.0 if h.rotate_p is None else h.rotate_p, mean=h.mean, std=h.std,
                                        mask_fill=IGNORE_INDEX, ratio_ignore_index=ratio_ignore)
        return train_transform(h.crop_size, h.scale_range, h.hflip, h.photometric, 0.2 if h.blur is None else h.blur,
                               h.rotate_degrees, 0.5 if h.rotate_p is None else h.rotate_p, h.mean, h.std, IGNORE_INDEX)

    def _train_set(self, transform) -> Dataset:
        """The training split; with ``coco_root``, VOC's items first and each COCO split's after them (CVNets
        appends COCO's list to VOC's), so VOC items keep their indices."""
        h = self.hparams
        voc = SegmentationDataset(self._split_samples("train"), self.mask_format, transform, "train", h.on_bad_image)
        if h.coco_root is None:
            return voc
        from datamodules.coco_voc import CocoVocSegmentation

        if self.class_names != list(VOC_CLASSES):
            raise ValueError(f"coco_root maps COCO to VOC's 21 classes, but data.root={self.root} has the classes "
                             f"{self.class_names}")
        coco = [CocoVocSegmentation(Path(h.coco_root).expanduser(), split, transform, h.coco_min_pixels,
                                    h.on_bad_image) for split in h.coco_splits]
        return ConcatDataset([voc, *coco])

    def _dataset(self, stage: str) -> Dataset:
        h = self.hparams
        if stage == "train":
            transform = self.train_transform()
            if self.streamed is not None:
                return self._streamed_dataset(stage, transform)
            return self._train_set(transform)
        transform = self.input_spec.eval_transform()
        if self.streamed is not None and not (stage == "predict" and h.predict_path):
            return self._streamed_dataset(stage, transform)
        if stage == "predict":
            if h.predict_path:  # only the given images: root (and the demo build) stay untouched
                # not recursive, as detection's predict: the masks are one flat folder
                images = predict_images(Path(h.predict_path))
            else:
                images = [image for image, _ in self._split_samples("test")]
            # no masks are read, so no mask format (which would need the class count, i.e. root)
            return SegmentationDataset([(image, None) for image in images], None, transform, "predict",
                                       h.on_bad_image)
        return SegmentationDataset(self._split_samples(stage), self.mask_format, transform, "eval", h.on_bad_image)

    # -- what python -m datamodules.optimize writes -----------------------------------------------------
    def streaming_sources(self, splits: Sequence[str] | None = None) -> dict[str, SegmentationDataset]:
        """The splits to convert (default: those fit and test read), each with ``stored_sample``."""
        names = splits or list(dict.fromkeys(self.split_name(stage) for stage in ("train", "val", "test")))
        return {name: SegmentationDataset(self._samples(name), self.mask_format, None, "eval", root=self.root)
                for name in names}

    def streaming_info(self) -> dict:
        """What the model learns from the data, stored with the optimized dataset."""
        return {"dataset": self.hparams.dataset, "class_names": self.class_names}

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
                           collate_fn=collate_skipping, trainer=self.trainer if train else None,
                           repeated_augmentation=h.repeated_augmentation)


__all__ = [
    "ENCODINGS", "IGNORE_INDEX", "MaskFormat", "SegmentationDataModule", "SegmentationDataset", "VOC_CLASSES",
    "ade20k_samples", "encode_labels", "read_mask", "voc_palette", "voc_samples", "write_voc_demo",
]

