"""COCO-layout detection data: ``root/annotations/instances_{split}.json`` + ``root/{split}/*.jpg``.

Annotations are read with pycocotools. Category ids (COCO's run 1..90 with gaps) map to
contiguous labels ``0 .. num_classes - 1`` in sorted-id order and back
(:attr:`CocoDataModule.category_ids`). Crowd regions are left out of the training targets
but kept, with their areas, in the ground truth that evaluation sees; images without any
annotation stay in training as pure negatives.

Augmentation is the SSD recipe on ``tv_tensors.BoundingBoxes``, torchvision's preset (photometric
distortion, zoom-out, IoU-constrained crop, horizontal flip, resize to the square model input) or
CVNets' (``augmentation="cvnets"``: its IoU crop, photometric distortion, flip, resize; no zoom-out). Transforms,
collate functions and :class:`ImageFiles` live in :mod:`datamodules.detection_common`, shared with
the Pascal VOC datamodule (:mod:`datamodules.voc_detection`), and are importable from here too.

With no ``root`` the datamodule writes the handwritten-digit scenes of
:mod:`datamodules.demo_scenes` once into the demo cache, in this layout, and reads them
with the same code.

Batches are dicts. Training, validation and test: ``{"image": (B, 3, S, S) float, "targets":
[B dicts, see CocoDetection], "skipped": int}``; predict: ``{"image": (B, 3, S, S) float, "path":
[B str], "orig_size": (B, 2) long (height, width), "skipped": int}``. ``skipped`` counts the
unreadable images left out of the batch under ``on_bad_image="skip"``; a batch whose images were
all unreadable is ``{"skipped": n}``.

Faults in the data are errors naming the file and the offending id or value: an annotation file
that is not JSON, a ``bbox`` that is not 4 numbers or is missing, an image id listed twice, an
image whose pixel size differs from the annotation file's, a validation/test file declaring
categories the training file does not have. Unreadable image files (truncated, empty, not an
image) stop with :class:`datamodules.images.BadImageError` unless ``on_bad_image="skip"``.
"""
from __future__ import annotations

import contextlib
import io
import json
from collections import Counter
from numbers import Real
from pathlib import Path
from typing import Sequence

import numpy as np
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import Dataset

from datamodules.demo import demo_root
# shared with the VOC datamodule; importable from here as before
from datamodules.detection_common import (DetectionDataModule, ImageFiles,  # noqa: F401
                                          check_augmentation, check_image_size, check_on_bad_image, collate_detection,
                                          collate_images,
                                          detection_item, eval_transform, ssd_train_transform, stack_detection,
                                          stack_images)
from datamodules.images import IMAGENET_MEAN, IMAGENET_STD, OnBadImage, guarded, read_rgb

DEMO_VERSION = 1


def build_demo(root: Path) -> None:
    from datamodules.demo_scenes import write_coco_layout

    write_coco_layout(root)


def read_annotation_json(annotation_file: Path) -> dict:
    """The parsed annotation file; one that is not JSON (truncated by a copy, an HTML error page
    saved under the name) raises ``ValueError`` naming the file and where parsing stopped."""
    try:
        dataset = json.loads(Path(annotation_file).read_bytes())
    except json.JSONDecodeError as err:
        raise ValueError(f"annotation file {annotation_file} is not valid JSON (truncated or not an annotation "
                         f"file?): {err.msg} (line {err.lineno}, column {err.colno})") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"annotation file {annotation_file} is not JSON text: {err}") from err
    if not isinstance(dataset, dict):
        raise ValueError(f"annotation file {annotation_file} holds a JSON {type(dataset).__name__}, "
                         "not a COCO object with 'images', 'annotations' and 'categories'")
    return dataset


def load_coco(annotation_file: Path):
    """pycocotools ``COCO`` of ``annotation_file``, without its progress prints; parse errors name the file."""
    from pycocotools.coco import COCO

    if not annotation_file.is_file():
        raise FileNotFoundError(f"annotation file {annotation_file} not found (COCO layout: "
                                "root/annotations/instances_<split>.json)")
    # parsed here rather than by COCO(file), whose bare JSONDecodeError does not say which file
    coco = COCO()
    coco.dataset = read_annotation_json(annotation_file)
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def is_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


class CocoDetection(Dataset):
    """One split of a COCO-layout dataset.

    Items are ``(image, target)``: ``image`` a (3, S, S) float tensor, normalised; ``target`` a dict
    with ``boxes`` ((G, 4) ``x1, y1, x2, y2`` in input pixels, crowds excluded), ``labels`` ((G,)
    contiguous), ``image_id``, ``path`` (the image file, str), ``orig_size`` ``(height, width)`` and, for
    evaluation, the untransformed ground truth in original pixels: ``gt_boxes`` (N, 4) xyxy,
    ``gt_labels`` (N,), ``gt_iscrowd`` (N,), ``gt_area`` (N,). Under ``on_bad_image="skip"`` an unreadable
    image file gives ``None`` (dropped and counted by :func:`collate_detection`).

    Training boxes reaching outside the image are clipped to it; boxes with no area left are
    dropped and counted (:attr:`num_degenerate`, logged once). The evaluation ground truth keeps
    every annotation as the file has it, so mAP is COCOeval's on that file. An annotation naming an
    unknown image or category, a ``bbox`` missing or not 4 numbers, an image id listed twice, or
    (with ``category_ids`` given) a declared category outside ``category_ids`` raises an error naming
    the file and the id or value; ``category_source`` is the file ``category_ids`` came from, named
    in that last error. An image whose decoded size differs from the file's ``width``/``height``
    raises when it is read.
    """

    def __init__(self, image_dir: Path, annotation_file: Path, transform, category_ids: Sequence[int] | None = None,
                 on_bad_image: OnBadImage = "fail", category_source: Path | str | None = None):
        check_on_bad_image(on_bad_image)
        self.image_dir = Path(image_dir)
        self.annotation_file = Path(annotation_file)
        self.transform = transform
        self.on_bad_image = on_bad_image
        self.coco = load_coco(self.annotation_file)
        self._check_unique_image_ids()
        file_categories = sorted(self.coco.cats)
        if category_ids is not None:
            self._check_declared_categories(category_ids, category_source)
        self.category_ids = list(category_ids) if category_ids is not None else file_categories
        self.label_of = {cat: i for i, cat in enumerate(self.category_ids)}
        self.image_ids = sorted(self.coco.imgs)
        self._index_annotations()

    def _check_unique_image_ids(self) -> None:
        # pycocotools keys images by id, so a second entry silently replaces the first
        counts = Counter(info.get("id") for info in self.coco.dataset.get("images", []))
        repeated = [image_id for image_id, n in counts.items() if n > 1]
        if repeated:
            raise ValueError(f"{self.annotation_file}: image id {repeated[0]} is listed more than once in 'images' "
                             f"(all repeated ids: {repeated[:10]}{' ...' if len(repeated) > 10 else ''})")

    def _check_declared_categories(self, category_ids: Sequence[int], category_source: Path | str | None) -> None:
        # a category declared here but absent from training would be ignored by the metric without a word
        extra = sorted(set(self.coco.cats) - set(category_ids))
        if extra:
            source = category_source if category_source is not None else "the given category_ids"
            raise ValueError(f"{self.annotation_file} declares category ids {extra}, which {source} does not have "
                             f"(its categories: {list(category_ids)}); the model cannot predict them")

    def _check_bbox(self, ann: dict) -> None:
        if "bbox" not in ann:
            raise ValueError(f"{self.annotation_file}: annotation {ann.get('id')} has no 'bbox' "
                             "(segmentation only?); detection needs a box for every annotation")
        bbox = ann["bbox"]
        if not (isinstance(bbox, (list, tuple)) and len(bbox) == 4 and all(is_number(v) for v in bbox)):
            raise ValueError(f"{self.annotation_file}: annotation {ann.get('id')} has bbox {bbox!r}; "
                             "expected 4 numbers [x, y, width, height]")

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
            self._check_bbox(ann)
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

    def existing_image(self, index: int) -> Path:
        image_id = self.image_ids[index]
        path = self.image_path(image_id)
        if not path.is_file():
            raise FileNotFoundError(f"image file {path} of image_id {image_id} ({self.annotation_file}) not found")
        return path

    def annotation(self, index: int) -> dict:
        """Sample ``index`` without its pixels: ``image_id``, the annotation file's ``width`` and
        ``height``, the training objects (crowds left out) and the ground truth (:func:`detection_item`)."""
        image_id = self.image_ids[index]
        info, gt = self.coco.imgs[image_id], self.targets[image_id]
        train = gt["iscrowd"] == 0
        return {"index": index, "image_id": image_id, "width": int(info["width"]), "height": int(info["height"]),
                "boxes": gt["boxes"][train], "labels": gt["labels"][train],
                **{key: gt[key] for key in ("gt_boxes", "gt_labels", "gt_iscrowd", "gt_area")}}

    def __getitem__(self, index: int):
        path = self.existing_image(index)
        pixels = guarded(lambda: read_rgb(path), path, self.on_bad_image)
        if pixels is None:
            return None
        sample = {**self.annotation(index), "path": str(path)}
        # boxes are clipped to, and evaluated in, the file's size: a different real size puts them in the wrong place
        check_image_size(pixels, sample["width"], sample["height"], f"{path} (image_id {sample['image_id']})",
                         str(self.annotation_file))
        return detection_item(pixels, sample, self.transform)

    def stored_sample(self, index: int) -> dict:
        """What ``python -m datamodules.optimize`` stores: the image file's bytes as they are, its path
        relative to the dataset root, and :meth:`annotation`."""
        path = self.existing_image(index)
        return {**self.annotation(index), "image": path.read_bytes(),
                "path": f"{self.image_dir.name}/{self.coco.imgs[self.image_ids[index]]['file_name']}"}


class CocoDataModule(DetectionDataModule):
    """Object detection data in the COCO layout.

    Args:
        root: folder holding ``annotations/`` and the split image folders; ``None`` builds and uses
            the embedded handwritten-digit scenes.
        train_split, val_split: split names (``instances_<split>.json`` and ``<split>/``).
        test_split: the split ``test`` scores; ``None`` = ``test2017`` when it has an annotation
            file, else ``val_split`` (COCO's own test2017 is unlabelled).
        predict_path: an image or a folder of images (hidden files ignored) for ``predict``; ``None`` =
            the test split's images. When given, ``predict`` does not read ``root`` at all, so a
            checkpoint predicts on a folder with nothing else.
        image_size: side of the square model input.
        augmentation: the training pipeline: ``"torchvision_ssd"`` (torchvision's SSD preset: photometric
            distortion, zoom-out, IoU crop, flip) or ``"cvnets"`` (CVNets' SSD pipeline: its IoU crop,
            photometric distortion, flip, bicubic resize; no zoom-out), see
            :mod:`datamodules.detection_transforms`.
        zoom_out_max: largest zoom-out canvas factor (1 disables zoom-out); ``None``: the pipeline's own
            (4 for ``torchvision_ssd``; ``cvnets`` has none and refuses any other value than 1).
        iou_crop: SSD's IoU-constrained random crop. hflip: flip probability.
        mean, std: normalisation (0/1 for CVNets checkpoints, which expect unnormalised input).
        on_bad_image: ``"fail"`` stops at an unreadable image file naming it; ``"skip"`` leaves it out of
            its batch and counts it in ``batch["skipped"]``.
        streaming_root: a folder or object-store URL written by ``python -m datamodules.optimize --task
            detect``; the splits (same names) are then streamed with LitData and ``root`` is not read
            (:mod:`datamodules.streaming`). Target ``path`` is then relative to the dataset's root.

    Batches: ``{"image": (B, 3, S, S), "targets": [B dicts], "skipped": int}`` for fit/validate/test
    (target keys in :class:`CocoDetection`), ``{"image", "path": [B str], "orig_size": (B, 2) long,
    "skipped": int}`` for predict.
    """

    def __init__(self, root: str | None = None, train_split: str = "train2017", val_split: str = "val2017",
                 test_split: str | None = None, predict_path: str | None = None, image_size: int = 320,
                 augmentation: str = "torchvision_ssd", zoom_out_max: float | None = None, iou_crop: bool = True,
                 hflip: float = 0.5,
                 mean: tuple[float, float, float] = IMAGENET_MEAN, std: tuple[float, float, float] = IMAGENET_STD,
                 batch_size: int = 32, eval_batch_size: int | None = None, num_workers: int = 4,
                 pin_memory: bool = True, persistent_workers: bool = True, on_bad_image: OnBadImage = "fail",
                 streaming_root: str | None = None):
        super().__init__()
        check_on_bad_image(on_bad_image)
        check_augmentation(augmentation, zoom_out_max)
        self.save_hyperparameters()
        self._root = Path(root).expanduser() if root else None
        self._categories: list[dict] | None = None
        self._categories_file: Path | None = None

    streaming_layout = "coco"

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
        if self._categories is None and self.streamed is not None:
            self._categories = list(self.streamed.data["categories"])
        if self._categories is None:
            source = self.annotation_file(self.hparams.train_split)
            if not source.is_file():
                source = self.annotation_file(self.hparams.val_split)
            if not source.is_file():
                raise FileNotFoundError(
                    f"data.root={self.root} does not look like a COCO dataset: expected "
                    f"{self.annotation_file(self.hparams.train_split)} or {self.annotation_file(self.hparams.val_split)}")
            self._categories = sorted(read_annotation_json(source)["categories"], key=lambda c: c["id"])
            self._categories_file = source
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
        if self.streamed is not None:
            return "test2017" if self.streamed.has_split("test2017") else self.hparams.val_split
        return "test2017" if self.annotation_file("test2017").is_file() else self.hparams.val_split

    # -- datasets and loaders --------------------------------------------------------------------------
    def split(self, name: str, train: bool = False) -> CocoDetection:
        if self.streamed is not None:
            return self.streamed_split(name, train)
        category_ids = self.category_ids  # reads the categories' file first, so it can be named in errors
        dataset = CocoDetection(self.root / name, self.annotation_file(name), self.transform(train), category_ids,
                                on_bad_image=self.hparams.on_bad_image, category_source=self._categories_file)
        rank_zero_info(f"{name}: {len(dataset)} images, {len(dataset.coco.anns)} annotations")
        return dataset

    # -- what python -m datamodules.optimize writes -----------------------------------------------------
    def streaming_sources(self, splits: Sequence[str] | None = None) -> dict[str, CocoDetection]:
        """The splits to convert (default: train, val, and test2017 when it has annotations)."""
        h = self.hparams
        names = splits or [h.train_split, h.val_split] + ([self.test_split] if self.test_split != h.val_split else [])
        sources = {name: self.split(name) for name in names}
        for dataset in sources.values():  # a missing image stops here, named, before any conversion starts
            for index in range(len(dataset)):
                dataset.existing_image(index)
        return sources

    def streaming_info(self) -> dict:
        """What the model learns from the data, stored with the optimized dataset."""
        return {"categories": [{"id": c["id"], "name": c["name"]} for c in self.categories]}

    def test_images(self) -> Path:
        return self.root / self.test_split

