"""What every detection datamodule shares, whatever its annotation format (COCO JSON, Pascal VOC XML).

The training augmentations (torchvision's SSD preset or CVNets' pipeline) and the evaluation resize (from :mod:`datamodules.detection_transforms`; boxes
are ``tv_tensors.BoundingBoxes`` and follow the pixels), the collate functions that make the
batches of the one detection contract, and :class:`ImageFiles`, the plain images ``predict``
reads. :mod:`datamodules.coco` and :mod:`datamodules.voc_detection` both build on them, so
their batches are the same thing:

- fit / validate / test: ``{"image": (B, 3, S, S) float, "targets": [B dicts], "skipped": int}``;
  each target has ``boxes`` ((G, 4) xyxy in input pixels, the training objects), ``labels`` (G,),
  ``image_id`` (int), ``path`` (str), ``orig_size`` ``(height, width)`` and the ground truth in
  original pixels ``gt_boxes`` (N, 4) xyxy, ``gt_labels``, ``gt_iscrowd``, ``gt_area`` (VOC adds
  ``gt_difficult``);
- predict: ``{"image": (B, 3, S, S) float, "path": [B str], "orig_size": (B, 2) long, "skipped": int}``.

``skipped`` counts the unreadable images left out of the batch under ``on_bad_image="skip"``; a
batch whose images were all unreadable is ``{"skipped": n}``.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning.pytorch import LightningDataModule

from datamodules.images import (IMAGE_EXTENSIONS, OnBadImage, collate_skipping, decode_rgb_bytes, exif_orientation,
                               guarded, list_images, read_rgb)
from datamodules.detection_transforms import (AUGMENTATIONS, detection_train_transform, eval_transform,  # noqa: F401
                                             ssd_train_transform)
from datamodules.input_spec import InputSpec, detection_spec
from datamodules.loaders import SplitLoaders, StreamedSource, make_loader


def check_on_bad_image(value: str) -> None:
    # guarded() treats anything but "skip" as "fail": a typo must not silently mean "fail"
    if value not in ("fail", "skip"):
        raise ValueError(f"on_bad_image must be 'fail' or 'skip', not {value!r}")


class ImageFiles(Dataset):
    """Images of a folder (hidden files left out), one file, or a given list of files, for ``predict``.

    Items are ``(image, {"path": str, "orig_size": (height, width)})`` with ``image`` a (3, S, S)
    float tensor, or ``None`` for an unreadable file under ``on_bad_image="skip"``."""

    def __init__(self, path: Path | str | Sequence[Path | str], transform, on_bad_image: OnBadImage = "fail"):
        check_on_bad_image(on_bad_image)
        if not isinstance(path, (str, Path)):  # the files themselves (e.g. a split list's images)
            self.files = [Path(p) for p in path]
            if not self.files:
                raise FileNotFoundError("no images to predict on: the list of files is empty")
            self.transform = transform
            self.on_bad_image = on_bad_image
            return
        path = Path(path)
        if path.is_file():
            self.files = [path]
        elif path.is_dir():
            self.files = list_images(path)
        else:
            raise FileNotFoundError(f"predict path {path} is neither an image nor a folder")
        if not self.files:
            raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}; hidden files ignored) in {path}")
        self.transform = transform
        self.on_bad_image = on_bad_image

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        path = self.files[index]
        pixels = guarded(lambda: read_rgb(path), path, self.on_bad_image)
        if pixels is None:
            return None
        return image_item(pixels, str(path), self.transform)


def image_item(pixels: torch.Tensor, path: str, transform) -> tuple[torch.Tensor, dict]:
    """(3, H, W) uint8 upright pixels -> the ``predict`` item ``(image, {"path", "orig_size"})``; shared by
    :class:`ImageFiles`, the streamed predict split and ``DetectionTask.predict`` (:mod:`tasks.engine.predictor`)."""
    info = {"path": path, "orig_size": tuple(int(s) for s in pixels.shape[-2:])}
    return transform(pixels), info


def check_augmentation(augmentation: str, zoom_out_max: float | None) -> None:
    """Refuse, when the datamodule is built, a training pipeline name that does not exist or a zoom-out
    the pipeline does not have (:func:`datamodules.detection_transforms.detection_train_transform`)."""
    detection_train_transform(augmentation, 32, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), zoom_out_max)


#: the ground truth of a detection target, in original pixels, as evaluation reads it (VOC adds ``gt_difficult``)
GROUND_TRUTH_KEYS = ("gt_boxes", "gt_labels", "gt_iscrowd", "gt_area", "gt_difficult")


def check_image_size(pixels: torch.Tensor, width: int | None, height: int | None, image: str, annotation: str,
                     encoded: Path | str | bytes | None = None) -> None:
    """Boxes are placed in, and evaluated at, the annotation's size: an image of another size is an error
    naming ``image`` and ``annotation`` (a size of 0 or ``None`` is unknown and not checked).

    ``pixels`` are upright (:func:`datamodules.images.read_rgb` applies the EXIF orientation). When the
    annotation has the size of the stored, unturned pixels, the error says so: it was made by a tool that
    ignored the orientation. ``encoded`` (the file's bytes, for a streamed sample) is where the orientation
    is read; by default the file ``image``. It is read only on a mismatch."""
    actual_height, actual_width = (int(s) for s in pixels.shape[-2:])
    if not (width and height) or (actual_height, actual_width) == (int(height), int(width)):
        return
    message = (f"image file {image} is {actual_width}x{actual_height} (width x height) but {annotation} "
               f"says {width}x{height}")
    if (actual_height, actual_width) == (int(width), int(height)):
        orientation = exif_orientation(encoded if encoded is not None else image)
        if orientation >= 5:
            message += (f": the file carries EXIF orientation {orientation} (a quarter turn), so it reads, as "
                        f"viewers show it, upright at {actual_width}x{actual_height}; the annotation was made on "
                        "the stored, unturned pixels. Re-annotate it upright, or clear the tag "
                        "(exiftool -Orientation=1 -n FILE) so the file reads as it was annotated")
    raise ValueError(message)


def has_area_inside(boxes: np.ndarray, width: int | np.ndarray | None, height: int | np.ndarray | None) -> np.ndarray:
    """(N,) bool: which (N, 4) xyxy boxes keep an area once :func:`detection_item` clips them to a ``width`` x
    ``height`` image (one size, or one per box); with the size unknown (``None``), which have a positive size."""
    if width is None or height is None:
        return (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    x1, y1 = np.maximum(boxes[:, 0], 0), np.maximum(boxes[:, 1], 0)
    return (np.minimum(boxes[:, 2], width) > x1) & (np.minimum(boxes[:, 3], height) > y1)


def detection_item(pixels: torch.Tensor, sample: dict, transform, use_difficult: bool = True) -> tuple:
    """(3, H, W) uint8 pixels + their ``sample`` -> ``(image, target)`` of the detection contract.

    ``sample`` holds ``image_id``, ``path``, the training objects ``boxes`` (G, 4) xyxy in original
    pixels and ``labels`` (G,) (VOC: with ``difficult`` (G,), left out unless ``use_difficult``) and the
    ground truth (:data:`GROUND_TRUTH_KEYS`). Training boxes are clipped to the image here, and boxes with
    no area left dropped; ``transform`` gets plain tensors and returns the item's tv_tensors. Shared by the
    folder-read and the streamed datasets of COCO and VOC, so all give the same items."""
    height, width = (int(s) for s in pixels.shape[-2:])
    boxes, labels = torch.from_numpy(sample["boxes"]), torch.from_numpy(sample["labels"])
    if not use_difficult and "difficult" in sample:
        easy = ~torch.from_numpy(sample["difficult"])
        boxes, labels = boxes[easy], labels[easy]
    # The detection path's one clip. Annotated boxes may reach past the image (COCO has such boxes; a VOC
    # file need not state its size, known only once the pixels are decoded), while the augmentations judge
    # crops by box centres and overlaps on the photo and a target must lie on the pixels it describes.
    boxes = boxes.clamp(min=torch.zeros(4), max=torch.tensor([width, height, width, height], dtype=torch.float32))
    keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    image, target = transform(pixels, {"boxes": boxes[keep], "labels": labels[keep]})
    target.update({
        "image_id": int(sample["image_id"]),
        "path": sample["path"],
        "orig_size": (height, width),
        **{key: torch.from_numpy(sample[key]) for key in GROUND_TRUTH_KEYS if key in sample},
    })
    return image, target


def streamed_detection_item(sample: dict, where: str, transform, on_bad_image: OnBadImage,
                            use_difficult: bool = True) -> tuple | None:
    """A sample stored by ``datamodules.optimize`` -> the ``(image, target)`` the folder dataset gives;
    ``None`` for an unreadable image under ``on_bad_image="skip"``."""
    pixels = guarded(lambda: decode_rgb_bytes(sample["image"], where), where, on_bad_image)
    if pixels is None:
        return None
    check_image_size(pixels, int(sample["width"]), int(sample["height"]), where, "its annotation", sample["image"])
    return detection_item(pixels, sample, transform, use_difficult)


def streamed_image_item(sample: dict, where: str, transform, on_bad_image: OnBadImage) -> tuple | None:
    """A stored sample -> the ``predict`` item of :class:`ImageFiles` (``path`` relative to the dataset root)."""
    pixels = guarded(lambda: decode_rgb_bytes(sample["image"], where), where, on_bad_image)
    if pixels is None:
        return None
    return image_item(pixels, sample["path"], transform)


def stack_detection(items: list[tuple[torch.Tensor, dict]]) -> dict:
    """``(image, target)`` items -> ``{"image": (B, 3, S, S), "targets": [B dicts]}``: images stack
    (all the same size after resizing), targets stay a list (box counts vary)."""
    images, targets = zip(*items)
    return {"image": torch.stack(images), "targets": list(targets)}


def collate_detection(batch: list) -> dict:
    """Detection dataset items (``CocoDetection``, ``VocDetection``) -> ``{"image", "targets", "skipped"}``; ``None`` items
    (unreadable images under ``on_bad_image="skip"``) are dropped and counted in ``skipped``."""
    return collate_skipping(batch, collate=stack_detection)


def stack_images(items: list[tuple[torch.Tensor, dict]]) -> dict:
    """:class:`ImageFiles` items -> ``{"image": (B, 3, S, S), "path": [B str], "orig_size": (B, 2) long}``."""
    images, infos = zip(*items)
    return {"image": torch.stack(images), "path": [info["path"] for info in infos],
            "orig_size": torch.tensor([info["orig_size"] for info in infos], dtype=torch.long).reshape(-1, 2)}


def collate_images(batch: list) -> dict:
    """:class:`ImageFiles` items -> ``{"image", "path", "orig_size", "skipped"}``, ``None`` items dropped and counted."""
    return collate_skipping(batch, collate=stack_images)


class DetectionDataModule(SplitLoaders, StreamedSource, LightningDataModule):
    """What every detection format's datamodule shares: the stages' datasets and their loaders.

    A format implements ``split(name, train) -> Dataset`` (items as :class:`ImageFiles`' siblings:
    ``(image, target)`` with the detection target keys), ``test_split`` and ``test_images()`` (the
    images ``predict`` reads when no ``predict_path`` is given), and sets ``evaluation_metric``
    (``"coco"`` or ``"voc"``: which benchmark metric the task scores it with). Its ``hparams`` hold
    the common arguments (``train_split``, ``val_split``, ``predict_path``, ``image_size``,
    ``augmentation``, ``zoom_out_max``, ``iou_crop``, ``hflip``, ``mean``,
    ``std``, ``batch_size``, ``eval_batch_size``, ``num_workers``, ``pin_memory``,
    ``persistent_workers``, ``on_bad_image``).
    """

    evaluation_metric = "coco"
    streaming_task = "detect"

    def split(self, name, train: bool = False) -> Dataset:
        raise NotImplementedError


    @property
    def input_spec(self) -> InputSpec:
        """How images enter the network at evaluation: resized to the ``image_size`` square, normalised
        with ``mean`` / ``std`` (:mod:`datamodules.input_spec`); the task keeps it in its checkpoint."""
        return detection_spec(self.hparams)

    def transform(self, train: bool):
        h = self.hparams
        return (detection_train_transform(h.augmentation, h.image_size, h.mean, h.std, h.zoom_out_max, h.iou_crop,
                                          h.hflip) if train
                else self.input_spec.eval_transform())

    def streamed_split(self, name, train: bool = False, use_difficult: bool = True):
        """Split ``name`` of the optimized dataset, its items those of the folder-read split."""
        item = partial(streamed_detection_item, transform=self.transform(train), on_bad_image=self.hparams.on_bad_image,
                       use_difficult=use_difficult)
        return self.streamed.split(name, item, train=train)

    def test_images(self) -> Path | list[Path]:
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        h = self.hparams
        if stage == "fit":
            self.train_set = self.split(h.train_split, train=True)
        if stage in ("fit", "validate"):
            self.val_set = self.split(h.val_split)
        if stage == "test":
            self.test_set = self.split(self.test_split)
        if stage == "predict":
            # with predict_path, root is not touched: no demo build, no annotation read
            transform = self.transform(train=False)
            if not h.predict_path and self.streamed is not None:
                item = partial(streamed_image_item, transform=transform, on_bad_image=h.on_bad_image)
                self.predict_set = self.streamed.split(self.test_split, item)
                return
            source = Path(h.predict_path).expanduser() if h.predict_path else self.test_images()
            self.predict_set = ImageFiles(source, transform, h.on_bad_image)

    def _loader(self, dataset, train: bool):
        h = self.hparams
        collate = collate_images if dataset is getattr(self, "predict_set", None) else collate_detection
        return make_loader(dataset, batch_size=h.batch_size if train else (h.eval_batch_size or h.batch_size),
                           num_workers=h.num_workers, train=train, pin_memory=h.pin_memory,
                           persistent_workers=h.persistent_workers, collate_fn=collate,
                           trainer=self.trainer if train else None,
                           repeated_augmentation=h.get("repeated_augmentation", 1))

