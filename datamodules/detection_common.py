"""What every detection datamodule shares, whatever its annotation format (COCO JSON, Pascal VOC XML).

The SSD augmentation and the evaluation resize (``torchvision.transforms.v2`` on
``tv_tensors.BoundingBoxes``, so boxes follow the pixels), the collate functions that make the
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

from pathlib import Path
from typing import Sequence

import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from lightning.pytorch import LightningDataModule

from datamodules.images import IMAGE_EXTENSIONS, OnBadImage, collate_skipping, guarded, list_images, read_rgb
from datamodules.loaders import SplitLoaders, make_loader


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
        info = {"path": str(path), "orig_size": tuple(int(s) for s in pixels.shape[-2:])}
        return self.transform(tv_tensors.Image(pixels)), info


class IoUCropWhenBoxes(v2.RandomIoUCrop):
    """``RandomIoUCrop`` needs at least one box to constrain the crop; images without objects
    (negatives) pass through unchanged instead of failing."""

    def forward(self, *inputs):
        sample = inputs if len(inputs) > 1 else inputs[0]
        boxes = sample[1]["boxes"] if isinstance(sample, (tuple, list)) and isinstance(sample[1], dict) else None
        if boxes is not None and len(boxes) == 0:
            return sample
        return super().forward(*inputs)


def ssd_train_transform(image_size: int, mean: Sequence[float], std: Sequence[float],
                        zoom_out_max: float = 4.0, iou_crop: bool = True, hflip: float = 0.5) -> v2.Compose:
    """The SSD recipe's augmentation (Liu et al. 2016, sec. 2.2 / torchvision's SSD preset)."""
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


def eval_transform(image_size: int, mean: Sequence[float], std: Sequence[float]) -> v2.Compose:
    """Resize to the square model input (SSD does not keep the aspect ratio)."""
    return v2.Compose([v2.Resize((image_size, image_size), antialias=True), v2.ClampBoundingBoxes(),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


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


class DetectionDataModule(SplitLoaders, LightningDataModule):
    """What every detection format's datamodule shares: the stages' datasets and their loaders.

    A format implements ``split(name, train) -> Dataset`` (items as :class:`ImageFiles`' siblings:
    ``(image, target)`` with the detection target keys), ``test_split`` and ``test_images()`` (the
    images ``predict`` reads when no ``predict_path`` is given), and sets ``evaluation_metric``
    (``"coco"`` or ``"voc"``: which benchmark metric the task scores it with). Its ``hparams`` hold
    the common arguments (``train_split``, ``val_split``, ``predict_path``, ``image_size``, ``mean``,
    ``std``, ``batch_size``, ``eval_batch_size``, ``num_workers``, ``pin_memory``,
    ``persistent_workers``, ``on_bad_image``).
    """

    evaluation_metric = "coco"

    def split(self, name, train: bool = False) -> Dataset:
        raise NotImplementedError

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
            source = Path(h.predict_path).expanduser() if h.predict_path else self.test_images()
            self.predict_set = ImageFiles(source, eval_transform(h.image_size, h.mean, h.std), h.on_bad_image)

    def _loader(self, dataset, train: bool):
        h = self.hparams
        collate = collate_images if isinstance(dataset, ImageFiles) else collate_detection
        return make_loader(dataset, batch_size=h.batch_size if train else (h.eval_batch_size or h.batch_size),
                           num_workers=h.num_workers, train=train, pin_memory=h.pin_memory,
                           persistent_workers=h.persistent_workers, collate_fn=collate,
                           trainer=self.trainer if train else None)

