"""COCO-layout detection data: ``root/annotations/instances_{split}.json`` + ``root/{split}/*.jpg``.

Each annotation file is parsed once into a prepared index of flat arrays (:class:`CocoIndex`), which
later starts, ranks and loader workers memory-map. Category ids (COCO's run 1..90 with gaps) map to
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
that is not JSON, a ``bbox`` that is not 4 numbers or is missing, an image id or file name listed
twice, an image entry without ``width``/``height``, a box of negative size, a box or area that is not a
finite number (NaN, infinity), a category id that is not an integer, an image whose pixel size differs
from the annotation file's, a validation/test file declaring categories the training file does not
have, a training split with no box to train on (all crowd regions, say). Unreadable image files (truncated, empty, not an
image) stop with :class:`datamodules.images.BadImageError` unless ``on_bad_image="skip"``.
"""
from __future__ import annotations

import contextlib
import io
import json
from collections import Counter
import math
from numbers import Integral, Real
from pathlib import Path
from typing import Sequence

import numpy as np
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import Dataset

from datamodules.demo import demo_root
# shared with the VOC datamodule, and importable from here
from datamodules.detection_common import (DetectionDataModule, ImageFiles,  # noqa: F401
                                          check_augmentation, check_image_size, check_on_bad_image, collate_detection,
                                          collate_images, detection_item, eval_transform, has_area_inside,
                                          ssd_train_transform, stack_detection, stack_images)
from datamodules.images import OnBadImage, guarded, read_rgb
from datamodules.input_spec import normalization
from datamodules.loaders import check_positive_counts, check_repeated_augmentation
from datamodules.prepared import StringTable, file_signature, prepare
from layers.machine import AUTO, NumWorkers

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


def is_integer(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _named(value) -> str:
    """A value as an error message shows it: its repr, and its type when the repr hides it (``'3'``)."""
    return f"{value!r} (a {type(value).__name__})" if not is_number(value) else repr(value)


def _check_images(images: list, annotation_file: Path) -> None:
    """Every image entry has an id, a file name and a size; ids and file names are unique."""
    for info in images:
        missing = [key for key in ("id", "file_name", "width", "height") if key not in info]
        if missing:
            raise ValueError(f"{annotation_file}: image {info.get('id', info.get('file_name'))!r} has no "
                             f"{' / '.join(repr(k) for k in missing)}; every entry of 'images' needs id, file_name, "
                             "width and height (the pixel size boxes are clipped to and checked against)")
        if not (is_number(info["width"]) and is_number(info["height"]) and is_number(info["id"])):
            raise ValueError(f"{annotation_file}: image {_named(info['id'])} has width {_named(info['width'])} and "
                             f"height {_named(info['height'])}; id, width and height must be numbers")
    # pycocotools keys images by id, so a second entry would silently replace the first
    for key, what in (("id", "image id"), ("file_name", "file_name")):
        counts = Counter(info[key] for info in images)
        repeated = [value for value, n in counts.items() if n > 1]
        if repeated:
            owners = [info["id"] for info in images if info[key] == repeated[0]]
            raise ValueError(f"{annotation_file}: {what} {repeated[0]!r} is listed more than once in 'images' "
                             f"(image ids {owners[:5]}; all repeated: {repeated[:10]}"
                             f"{' ...' if len(repeated) > 10 else ''}); an image would be trained on twice "
                             "with conflicting boxes")


def _check_categories(categories: list, annotation_file: Path) -> None:
    """Every category has an integer id: labels are indexed by it, and a string id cannot equal an annotation's."""
    for category in categories:
        if not is_integer(category.get("id")):
            raise ValueError(f"{annotation_file}: category {category.get('name')!r} has id {_named(category.get('id'))}; "
                             "COCO category ids are integers, in 'categories' and in every annotation's category_id "
                             f"(write {_as_integer_hint(category.get('id'))}, without quotes)")


def _as_integer_hint(value) -> str:
    """How ``value`` would be written as an integer id, for an error message (``'3'`` -> ``3``)."""
    text = str(value).strip()
    return text if text.lstrip("-").isdigit() else "a whole number such as 1"


def _check_annotation(ann: dict, annotation_file: Path, images: dict, categories: set) -> None:
    where = f"{annotation_file}: annotation {ann.get('id')}"
    if ann.get("image_id") not in images:
        raise ValueError(f"{where} refers to image_id {_named(ann.get('image_id'))}, which is not in 'images'")
    category_id = ann.get("category_id")
    if category_id not in categories or not is_integer(category_id):
        hint = (f": category ids are integers (write {_as_integer_hint(category_id)}, without quotes)"
                if not is_integer(category_id) else "")
        raise ValueError(f"{where} has category_id {_named(category_id)}, which is not among the "
                         f"categories {sorted(categories)}{hint}")
    if "bbox" not in ann:
        raise ValueError(f"{where} has no 'bbox' (segmentation only?); detection needs a box for every annotation")
    bbox = ann["bbox"]
    if not (isinstance(bbox, (list, tuple)) and len(bbox) == 4 and all(is_number(v) for v in bbox)):
        raise ValueError(f"{where} has bbox {bbox!r}; expected 4 numbers [x, y, width, height]")
    if not all(math.isfinite(v) for v in bbox):
        # NaN compares false with everything: it would pass every size check and vanish from training unseen
        raise ValueError(f"{where} has bbox {bbox!r} with a value that is not a finite number; fix the box or "
                         "remove the annotation")
    if bbox[2] < 0 or bbox[3] < 0:
        raise ValueError(f"{where} has bbox {bbox!r} with a negative width or height; COCO boxes are "
                         "[x, y, width, height] with width, height >= 0 (x2, y2 written in place of width, height?)")
    area = ann.get("area")
    if is_number(area) and not math.isfinite(area):
        raise ValueError(f"{where} has area {area!r}, not a finite number (COCOeval sizes objects by it); fix it "
                         "or leave 'area' out to use the box's")


def build_coco_index(annotation_file: Path) -> tuple[dict[str, np.ndarray], dict]:
    """Parse a COCO annotation file once into flat arrays (see :class:`CocoIndex`), checking every
    image and annotation; errors name the file and the id or value."""
    dataset = read_annotation_json(annotation_file)
    images, annotations = dataset.get("images", []), dataset.get("annotations", [])
    _check_categories(dataset.get("categories", []), annotation_file)
    categories = sorted(({"id": c["id"], "name": c.get("name", str(c["id"]))} for c in dataset.get("categories", [])),
                        key=lambda c: c["id"])
    _check_images(images, annotation_file)
    images = sorted(images, key=lambda info: info["id"])
    position = {info["id"]: k for k, info in enumerate(images)}
    category_set = {c["id"] for c in categories}
    for ann in annotations:
        _check_annotation(ann, annotation_file, position, category_set)
    # annotations grouped by image in id order, each image's in file order
    owner = np.array([position[a["image_id"]] for a in annotations], np.int64)
    order = np.argsort(owner, kind="stable")
    annotations = [annotations[k] for k in order]
    xywh = np.array([a["bbox"] for a in annotations], np.float64).reshape(-1, 4)
    names, name_offsets = StringTable.encode(info["file_name"] for info in images)
    arrays = {
        "image_ids": np.array([info["id"] for info in images], np.int64),
        "widths": np.array([info["width"] for info in images], np.int32),
        "heights": np.array([info["height"] for info in images], np.int32),
        "file_names": names, "file_name_offsets": name_offsets,
        "ann_offsets": np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=len(images)))]).astype(np.int64),
        "ann_ids": np.array([a.get("id", -1) for a in annotations], np.int64),
        "boxes": np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1).astype(np.float32),
        "category_ids": np.array([a["category_id"] for a in annotations], np.int64),
        "iscrowd": np.array([int(a.get("iscrowd", 0)) for a in annotations], np.uint8),
        # COCOeval sizes objects by the annotation's area (the mask's), not the box's
        "areas": np.array([float(a.get("area", 0.0)) or (a["bbox"][2] * a["bbox"][3]) for a in annotations],
                          np.float32),
    }
    return arrays, {"categories": categories}


class CocoIndex:
    """A COCO annotation file as flat arrays, parsed once and then memory-mapped
    (:mod:`datamodules.prepared`): per image ``image_ids``, ``widths``, ``heights``, file names and
    ``ann_offsets`` (image i owns annotations ``ann_offsets[i]:ann_offsets[i + 1]``); per annotation
    ``boxes`` (M, 4) xyxy as written, ``category_ids``, ``iscrowd``, ``areas``, ``ann_ids``. Polygons
    and masks are not kept: detection trains and evaluates on boxes."""

    def __init__(self, annotation_file: Path, prepared_dir: str | None = None):
        annotation_file = Path(annotation_file)
        if not annotation_file.is_file():
            raise FileNotFoundError(f"annotation file {annotation_file} not found (COCO layout: "
                                    "root/annotations/instances_<split>.json)")
        index = prepare("coco", annotation_file, {"file": file_signature(annotation_file)},
                        lambda: build_coco_index(annotation_file), prepared_dir)
        self.annotation_file = annotation_file
        self.categories: list[dict] = index.meta["categories"]
        for name in index:
            setattr(self, name, index[name])
        self.file_names = StringTable(index["file_names"], index["file_name_offsets"])

    def __len__(self) -> int:
        return len(self.image_ids)

    def objects(self, index: int) -> slice:
        return slice(int(self.ann_offsets[index]), int(self.ann_offsets[index + 1]))


class CocoDetection(Dataset):
    """One split of a COCO-layout dataset.

    Items are ``(image, target)``: ``image`` a (3, S, S) float tensor, normalised; ``target`` a dict
    with ``boxes`` ((G, 4) ``x1, y1, x2, y2`` in input pixels, crowds excluded), ``labels`` ((G,)
    contiguous), ``image_id``, ``path`` (the image file, str), ``orig_size`` ``(height, width)`` and, for
    evaluation, the untransformed ground truth in original pixels: ``gt_boxes`` (N, 4) xyxy,
    ``gt_labels`` (N,), ``gt_iscrowd`` (N,), ``gt_area`` (N,). Under ``on_bad_image="skip"`` an unreadable
    image file gives ``None`` (dropped and counted by :func:`collate_detection`).

    The annotation file is read through its prepared :class:`CocoIndex` (parsed once, then mapped by
    every start, rank and worker). Training boxes reaching outside the image are clipped to it
    (by :func:`detection_item`); boxes with no area inside it are dropped and counted (:attr:`num_degenerate`, logged once). The
    evaluation ground truth keeps every annotation as the file has it, so mAP is COCOeval's on that
    file. An annotation naming an unknown image or category, a ``bbox`` missing, not 4 numbers or of
    negative size, an image id or file name listed twice, an image without ``width``/``height``, or
    (with ``category_ids`` given) a declared category outside ``category_ids`` raises an error naming
    the file and the id or value; ``category_source`` is the file ``category_ids`` came from, named in
    that last error. An image whose decoded size differs from the file's ``width``/``height`` raises
    when it is read.
    """

    def __init__(self, image_dir: Path, annotation_file: Path, transform, category_ids: Sequence[int] | None = None,
                 on_bad_image: OnBadImage = "fail", category_source: Path | str | None = None,
                 prepared_dir: str | None = None):
        check_on_bad_image(on_bad_image)
        self.image_dir = Path(image_dir)
        self.annotation_file = Path(annotation_file)
        self.transform = transform
        self.on_bad_image = on_bad_image
        self.index = CocoIndex(self.annotation_file, prepared_dir)
        file_categories = [c["id"] for c in self.index.categories]
        if category_ids is not None:
            self._check_declared_categories(file_categories, category_ids, category_source)
        self.category_ids = list(category_ids) if category_ids is not None else file_categories
        self.image_ids = self.index.image_ids
        # category id -> contiguous label, as an array so workers share it
        self.label_of = np.full(max(self.category_ids, default=0) + 1, -1, np.int64)
        self.label_of[self.category_ids] = np.arange(len(self.category_ids))
        empty = self._empty_boxes()
        crowd = self.index.iscrowd.astype(bool)
        self.num_degenerate = int((empty & ~crowd).sum())
        self.num_crowd = int(crowd.sum())
        #: (M,) bool: the boxes training sees, neither crowd regions nor boxes with no area inside their image
        self.trains_on = ~empty & ~crowd
        self.num_training_boxes = int(self.trains_on.sum())

    def _check_declared_categories(self, file_categories: list[int], category_ids: Sequence[int],
                                   category_source: Path | str | None) -> None:
        # a category declared here but absent from training would be ignored by the metric without a word
        extra = sorted(set(file_categories) - set(category_ids))
        if extra:
            source = category_source if category_source is not None else "the given category_ids"
            raise ValueError(f"{self.annotation_file} declares category ids {extra}, which {source} does not have "
                             f"(its categories: {list(category_ids)}); the model cannot predict them")

    def _empty_boxes(self) -> np.ndarray:
        """(M,) bool: the annotations whose box has no area inside its image; those that are not crowds
        (crowds never train) are dropped from training, with a warning naming them."""
        index = self.index
        per_object = np.repeat(np.arange(len(index)), np.diff(index.ann_offsets))
        empty = ~has_area_inside(index.boxes, index.widths[per_object], index.heights[per_object])
        ids = index.ann_ids[empty & (index.iscrowd == 0)]
        if len(ids):
            rank_zero_warn(f"{self.annotation_file}: dropped {len(ids)} boxes with no area inside the image "
                           f"(annotation ids {ids[:10].tolist()}{' ...' if len(ids) > 10 else ''})")
        return empty

    def __len__(self) -> int:
        return len(self.image_ids)

    def image_path(self, index: int) -> Path:
        return self.image_dir / self.index.file_names[index]

    def existing_image(self, index: int) -> Path:
        path = self.image_path(index)
        if not path.is_file():
            raise FileNotFoundError(f"image file {path} of image_id {self.image_ids[index]} ({self.annotation_file}) "
                                    "not found")
        return path

    def annotation(self, index: int) -> dict:
        """Sample ``index`` without its pixels: ``image_id``, the annotation file's ``width`` and
        ``height``, the training objects (crowds and boxes with no area inside the image left out;
        :func:`detection_item` clips the rest to the image) and the ground truth as written."""
        objects = self.index.objects(index)
        gt_boxes = np.array(self.index.boxes[objects])
        labels = self.label_of[self.index.category_ids[objects]]
        train = self.trains_on[objects]
        # training boxes are float64, the ground truth (and VOC's boxes) float32: changing either changes batches
        return {"index": index, "image_id": int(self.image_ids[index]), "width": int(self.index.widths[index]),
                "height": int(self.index.heights[index]), "boxes": gt_boxes[train].astype(np.float64),
                "labels": labels[train], "gt_boxes": gt_boxes, "gt_labels": labels,
                "gt_iscrowd": self.index.iscrowd[objects].astype(np.int64), "gt_area": np.array(self.index.areas[objects])}

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
                "path": f"{self.image_dir.name}/{self.index.file_names[index]}"}


def refuse_training_without_boxes(dataset: CocoDetection) -> None:
    """A training split that gives the model no box at all would fit on background alone, without a word."""
    if dataset.num_training_boxes:
        return
    total = len(dataset.index.ann_ids)
    if not total:
        raise ValueError(f"{dataset.annotation_file} has no annotations: the training split has no box to learn "
                         "from. Point --data.train_split at an annotated split")
    raise ValueError(
        f"{dataset.annotation_file}: none of its {total} annotations is a box training can use "
        f"({dataset.num_crowd} are crowd regions, iscrowd=1, which training leaves out as COCO does; "
        f"{dataset.num_degenerate} have no area inside their image). Mark single objects iscrowd=0, or point "
        "--data.train_split at an annotated split")


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
        weights: the weights the network starts from, registered (``backbones/pretrained.py``) or a checkpoint
            file; the CLI links the model's ``weights`` or its backbone's ``pretrained`` here. Its entry, or the
            input specification the checkpoint stores, gives ``mean`` and ``std``.
        mean, std: normalisation of [0, 1] pixels; ``None`` takes the weights' (ImageNet's without weights).
            ``hparams.mean`` / ``hparams.std`` hold the values used.
        on_bad_image: ``"fail"`` stops at an unreadable image file naming it; ``"skip"`` leaves it out of
            its batch and counts it in ``batch["skipped"]``.
        streaming_root: a folder or object-store URL written by ``python -m datamodules.optimize --task
            detect``; the splits (same names) are then streamed with LitData and ``root`` is not read
            (:mod:`datamodules.streaming`). Target ``path`` is then relative to the dataset's root.
        prepared_dir: where the annotation files' prepared indexes are kept (:mod:`datamodules.prepared`;
            default ``$SUITE_PREPARED_DIR`` or the suite's data cache): the first start parses each file
            once, later starts and the other ranks map its boxes, labels and sizes.
        repeated_augmentation: repeated augmentation (DeiT's ``RASampler``, timm's ``--aug-repeats``): each
            training image this many times an epoch, each copy under its own augmentation, the epoch still
            about the dataset's size (:class:`datamodules.loaders.RepeatedAugmentationSampler`); 1: off.

    Batches: ``{"image": (B, 3, S, S), "targets": [B dicts], "skipped": int}`` for fit/validate/test
    (target keys in :class:`CocoDetection`), ``{"image", "path": [B str], "orig_size": (B, 2) long,
    "skipped": int}`` for predict.
    """

    def __init__(self, root: str | None = None, train_split: str = "train2017", val_split: str = "val2017",
                 test_split: str | None = None, predict_path: str | None = None, image_size: int = 320,
                 augmentation: str = "torchvision_ssd", zoom_out_max: float | None = None, iou_crop: bool = True,
                 hflip: float = 0.5,
                 weights: str | None = None, mean: tuple[float, float, float] | None = None,
                 std: tuple[float, float, float] | None = None,
                 batch_size: int = 32, eval_batch_size: int | None = None, num_workers: NumWorkers = AUTO,
                 pin_memory: bool = True, persistent_workers: bool = True, on_bad_image: OnBadImage = "fail",
                 streaming_root: str | None = None, prepared_dir: str | None = None,
                 repeated_augmentation: int = 1):
        super().__init__()
        check_on_bad_image(on_bad_image)
        check_repeated_augmentation(repeated_augmentation)
        check_augmentation(augmentation, zoom_out_max)
        self.save_hyperparameters()
        check_positive_counts(batch_size=batch_size, eval_batch_size=eval_batch_size)
        self.hparams.mean, self.hparams.std = normalization(weights, mean, std)
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
            # the training split's prepared index: this start's only parse of the file, if any
            self._categories = CocoIndex(source, self.hparams.prepared_dir).categories
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
                                on_bad_image=self.hparams.on_bad_image, category_source=self._categories_file,
                                prepared_dir=self.hparams.prepared_dir)
        crowd = f" ({dataset.num_crowd} crowd regions, left out of training)" if dataset.num_crowd else ""
        rank_zero_info(f"{name}: {len(dataset)} images, {len(dataset.index.ann_ids)} annotations{crowd}")
        if train:
            refuse_training_without_boxes(dataset)
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

