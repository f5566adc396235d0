"""COCO-layout detection data: ``root/annotations/instances_{split}.json`` + ``root/{split}/*.jpg``.

Annotations are read with pycocotools. Category ids (COCO's run 1..90 with gaps) map to
contiguous labels ``0 .. num_classes - 1`` in sorted-id order and back
(:attr:`CocoDataModule.category_ids`). Crowd regions are left out of the training targets
but kept, with their areas, in the ground truth that evaluation sees; images without any
annotation stay in training as pure negatives.

Augmentation is the SSD recipe with ``torchvision.transforms.v2`` on ``tv_tensors.BoundingBoxes``
(photometric distortion, zoom-out, IoU-constrained crop, horizontal flip, resize to the
square model input), so boxes follow the pixels without hand-written geometry.

With no ``root`` the datamodule writes the handwritten-digit scenes of
:mod:`datamodules.demo_scenes` once into the demo cache, in this layout, and reads them
with the same code.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2

from datamodules.demo import demo_root
from datamodules.loaders import SplitLoaders, make_loader

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
DEMO_VERSION = 1


def build_demo(root: Path) -> None:
    from datamodules.demo_scenes import write_coco_layout

    write_coco_layout(root)


def load_coco(annotation_file: Path):
    """pycocotools ``COCO`` without its progress prints."""
    from pycocotools.coco import COCO

    if not annotation_file.is_file():
        raise FileNotFoundError(f"annotation file {annotation_file} not found (COCO layout: "
                                "root/annotations/instances_<split>.json)")
    with contextlib.redirect_stdout(io.StringIO()):
        return COCO(str(annotation_file))


class CocoDetection(Dataset):
    """One split of a COCO-layout dataset.

    Items are ``(image, target)``: ``image`` a (3, S, S) float tensor, normalised; ``target`` a dict
    with ``boxes`` ((G, 4) ``x1, y1, x2, y2`` in input pixels, crowds excluded), ``labels`` ((G,)
    contiguous), ``image_id``, ``orig_size`` ``(height, width)`` and, for evaluation, the untransformed
    ground truth in original pixels: ``gt_boxes`` (N, 4) xyxy, ``gt_labels``, ``gt_iscrowd``, ``gt_area``.

    Training boxes reaching outside the image are clipped to it; boxes with no area left are
    dropped and counted (:attr:`num_degenerate`, logged once). The evaluation ground truth keeps
    every annotation as the file has it, so mAP is COCOeval's on that file. An annotation naming an unknown image or
    category raises an error naming the annotation, the value and the file.
    """

    def __init__(self, image_dir: Path, annotation_file: Path, transform, category_ids: Sequence[int] | None = None):
        self.image_dir = Path(image_dir)
        self.annotation_file = Path(annotation_file)
        self.transform = transform
        self.coco = load_coco(self.annotation_file)
        file_categories = sorted(self.coco.cats)
        self.category_ids = list(category_ids) if category_ids is not None else file_categories
        self.label_of = {cat: i for i, cat in enumerate(self.category_ids)}
        self.image_ids = sorted(self.coco.imgs)
        self._index_annotations()

    def _index_annotations(self) -> None:
        """Check every annotation once and store per image the arrays ``__getitem__`` needs."""
        per_image: dict[int, list[dict]] = {i: [] for i in self.image_ids}
        degenerate = []
        for ann in self.coco.dataset.get("annotations", []):
            if ann["image_id"] not in per_image:
                raise ValueError(f"{self.annotation_file}: annotation {ann.get('id')} refers to image_id "
                                 f"{ann['image_id']}, which is not in 'images'")
            if ann["category_id"] not in self.label_of:
                raise ValueError(f"{self.annotation_file}: annotation {ann.get('id')} has category_id "
                                 f"{ann['category_id']}, which is not among the categories {self.category_ids}")
            per_image[ann["image_id"]].append(ann)
        self.targets: dict[int, dict[str, np.ndarray]] = {}
        for image_id, anns in per_image.items():
            info = self.coco.imgs[image_id]
            width, height = float(info["width"]), float(info["height"])
            xywh = np.array([a["bbox"] for a in anns], np.float64).reshape(-1, 4)
            xyxy = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1)
            clipped = xyxy.clip(0, [width, height, width, height])
            valid = (clipped[:, 2] > clipped[:, 0]) & (clipped[:, 3] > clipped[:, 1])
            iscrowd = np.array([int(a.get("iscrowd", 0)) for a in anns], np.int64)
            labels = np.array([self.label_of[a["category_id"]] for a in anns], np.int64)
            # COCOeval sizes objects by the annotation's area (the mask's), not the box's
            area = np.array([float(a.get("area", 0.0)) or (a["bbox"][2] * a["bbox"][3]) for a in anns], np.float32)
            self.targets[image_id] = {
                # training: clipped boxes with area, crowds left out later
                "boxes": clipped[valid].astype(np.float32), "labels": labels[valid], "iscrowd": iscrowd[valid],
                # evaluation: every annotation as written, exactly what COCOeval reads from the file
                "gt_boxes": xyxy.astype(np.float32), "gt_labels": labels, "gt_iscrowd": iscrowd, "gt_area": area,
            }
            degenerate += [a.get("id") for a, ok in zip(anns, valid) if not ok]
        self.num_degenerate = len(degenerate)
        if degenerate:
            rank_zero_warn(f"{self.annotation_file}: dropped {len(degenerate)} boxes with no area inside the image "
                           f"(annotation ids {degenerate[:10]}{' ...' if len(degenerate) > 10 else ''})")

    def __len__(self) -> int:
        return len(self.image_ids)

    def image_path(self, image_id: int) -> Path:
        return self.image_dir / self.coco.imgs[image_id]["file_name"]

    def __getitem__(self, index: int):
        image_id = self.image_ids[index]
        path = self.image_path(image_id)
        if not path.is_file():
            raise FileNotFoundError(f"image file {path} of image_id {image_id} ({self.annotation_file}) not found")
        image = tv_tensors.Image(decode_image(str(path), mode=ImageReadMode.RGB))
        height, width = image.shape[-2:]
        gt = self.targets[image_id]
        train = gt["iscrowd"] == 0
        target = {
            "boxes": tv_tensors.BoundingBoxes(torch.from_numpy(gt["boxes"][train]), format="XYXY",
                                              canvas_size=(height, width)),
            "labels": torch.from_numpy(gt["labels"][train]),
        }
        image, target = self.transform(image, target)
        target.update({
            "image_id": image_id,
            "orig_size": (int(height), int(width)),
            **{key: torch.from_numpy(gt[key]) for key in ("gt_boxes", "gt_labels", "gt_iscrowd", "gt_area")},
        })
        return image, target


class ImageFiles(Dataset):
    """Images of a folder (or one file), for ``predict``: items ``(image, {"path", "orig_size"})``."""

    def __init__(self, path: Path, transform):
        path = Path(path)
        if path.is_file():
            self.files = [path]
        elif path.is_dir():
            self.files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
        else:
            raise FileNotFoundError(f"predict path {path} is neither an image nor a folder")
        if not self.files:
            raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) in {path}")
        self.transform = transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        image = tv_tensors.Image(decode_image(str(self.files[index]), mode=ImageReadMode.RGB))
        info = {"path": str(self.files[index]), "orig_size": tuple(int(s) for s in image.shape[-2:])}
        return self.transform(image), info


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


def collate_detection(batch: list) -> tuple[torch.Tensor, list[dict]]:
    """Stack images (all the same size after resizing); keep targets as a list (box counts vary)."""
    images, targets = zip(*batch)
    return torch.stack(images), list(targets)


class CocoDataModule(SplitLoaders, LightningDataModule):
    """Object detection data in the COCO layout.

    Args:
        root: folder holding ``annotations/`` and the split image folders; ``None`` builds and uses
            the embedded handwritten-digit scenes.
        train_split, val_split: split names (``instances_<split>.json`` and ``<split>/``).
        test_split: the split ``test`` scores; ``None`` = ``test2017`` when it has an annotation
            file, else ``val_split`` (COCO's own test2017 is unlabelled).
        predict_path: an image or a folder of images for ``predict``; ``None`` = the test split's images.
        image_size: side of the square model input.
        zoom_out_max: largest zoom-out canvas factor (1 disables zoom-out).
        iou_crop: SSD's IoU-constrained random crop. hflip: flip probability.
        mean, std: normalisation (0/1 for CVNets checkpoints, which expect unnormalised input).
    """

    def __init__(self, root: str | None = None, train_split: str = "train2017", val_split: str = "val2017",
                 test_split: str | None = None, predict_path: str | None = None, image_size: int = 320,
                 zoom_out_max: float = 4.0, iou_crop: bool = True, hflip: float = 0.5,
                 mean: tuple[float, float, float] = IMAGENET_MEAN, std: tuple[float, float, float] = IMAGENET_STD,
                 batch_size: int = 32, eval_batch_size: int | None = None, num_workers: int = 4,
                 pin_memory: bool = True, persistent_workers: bool = True):
        super().__init__()
        self.save_hyperparameters()
        self._root = Path(root).expanduser() if root else None
        self._categories: list[dict] | None = None

    # -- what the model needs to know about the data ---------------------------------------------------
    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = demo_root("coco-digits", build_demo, version=DEMO_VERSION)
        return self._root

    def annotation_file(self, split: str) -> Path:
        return self.root / "annotations" / f"instances_{split}.json"

    @property
    def categories(self) -> list[dict]:
        """``categories`` of the training annotation file (or the validation one), sorted by id."""
        if self._categories is None:
            source = self.annotation_file(self.hparams.train_split)
            if not source.is_file():
                source = self.annotation_file(self.hparams.val_split)
            if not source.is_file():
                raise FileNotFoundError(
                    f"data.root={self.root} does not look like a COCO dataset: expected "
                    f"{self.annotation_file(self.hparams.train_split)} or {self.annotation_file(self.hparams.val_split)}")
            with open(source) as f:
                self._categories = sorted(json.load(f)["categories"], key=lambda c: c["id"])
            if not self._categories:
                raise ValueError(f"{source} lists no categories")
        return self._categories

    @property
    def num_classes(self) -> int:
        return len(self.categories)

    @property
    def category_ids(self) -> list[int]:
        """Label i is category id ``category_ids[i]`` of the annotation files."""
        return [c["id"] for c in self.categories]

    @property
    def category_names(self) -> list[str]:
        return [c["name"] for c in self.categories]

    @property
    def test_split(self) -> str:
        if self.hparams.test_split:
            return self.hparams.test_split
        return "test2017" if self.annotation_file("test2017").is_file() else self.hparams.val_split

    # -- datasets and loaders --------------------------------------------------------------------------
    def split(self, name: str, train: bool = False) -> CocoDetection:
        h = self.hparams
        transform = (ssd_train_transform(h.image_size, h.mean, h.std, h.zoom_out_max, h.iou_crop, h.hflip) if train
                     else eval_transform(h.image_size, h.mean, h.std))
        dataset = CocoDetection(self.root / name, self.annotation_file(name), transform, self.category_ids)
        rank_zero_info(f"{name}: {len(dataset)} images, {len(dataset.coco.anns)} annotations")
        return dataset

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.train_set = self.split(self.hparams.train_split, train=True)
        if stage in ("fit", "validate"):
            self.val_set = self.split(self.hparams.val_split)
        if stage == "test":
            self.test_set = self.split(self.test_split)
        if stage == "predict":
            h = self.hparams
            path = Path(h.predict_path).expanduser() if h.predict_path else self.root / self.test_split
            self.predict_set = ImageFiles(path, eval_transform(h.image_size, h.mean, h.std))

    def _loader(self, dataset, train: bool):
        h = self.hparams
        return make_loader(dataset, batch_size=h.batch_size if train else (h.eval_batch_size or h.batch_size),
                           num_workers=h.num_workers, train=train, pin_memory=h.pin_memory,
                           persistent_workers=h.persistent_workers, collate_fn=collate_detection,
                           trainer=self.trainer if train else None)

