"""Pascal VOC detection data: ``root/Annotations/<id>.xml``, ``root/JPEGImages/<id>.jpg``,
``root/ImageSets/Main/<split>.txt``.

``root`` is the ``VOC2007`` or ``VOC2012`` folder of a VOCdevkit. The batches are those of
:mod:`datamodules.coco` (one detection contract, :mod:`datamodules.detection_common`), with one
more ground-truth key, ``gt_difficult``:

- fit / validate / test: ``{"image": (B, 3, S, S) float, "targets": [B dicts], "skipped": int}``,
  each target with ``boxes`` ((G, 4) xyxy in input pixels: the training objects), ``labels`` (G,),
  ``image_id`` (the image's position in the split list(s), an int, stable), ``path``, ``orig_size``
  ``(height, width)``, and the ground truth in original pixels: ``gt_boxes`` (N, 4) xyxy float,
  ``gt_labels`` (N,), ``gt_iscrowd`` (N,) zeros (VOC has no crowds), ``gt_area`` (N,) box areas,
  ``gt_difficult`` (N,) bool;
- predict: ``{"image", "path": [B str], "orig_size": (B, 2) long, "skipped": int}``.

Coordinates. VOC's ``bndbox`` holds 1-based pixel indices, inclusive at both ends: a box over
the first pixel column only is ``xmin = xmax = 1``. They become continuous pixel edges, 0-based:
``x1 = xmin - 1, y1 = ymin - 1, x2 = xmax, y2 = ymax`` (the devkit's width ``xmax - xmin + 1`` is
``x2 - x1``; mmdetection reads ``xmin - 1 .. xmax - 1`` inclusive and adds the 1 back in its
"legacy" IoU, which is the same). A box with ``xmax < xmin`` or ``ymax < ymin`` is an error;
``xmax == xmin`` is a legal one-pixel-wide box. Training boxes reaching outside the image are
clipped to it (boxes with no area left are dropped and counted); the evaluation ground truth is
kept as the file has it.

Difficult objects (``<difficult>1</difficult>``) are left out of training unless
``use_difficult_in_training`` and kept, flagged, in the evaluation ground truth:
:class:`tasks.metrics.voc_map.VocMeanAveragePrecision` ignores detections of them and does not count them
in recall. Label ``i`` is class ``class_names[i]`` and category id ``i + 1`` (``detections.json``).

Splits. VOC practice (SSD, mmdetection's voc0712): train on ``trainval``, evaluate on VOC2007
``test`` (its annotations are public), hence ``val_split="test"``: model selection then looks at
the test set, as those papers' numbers do; use ``val_split="val"`` (training on ``train``) for an
untouched test set. A split is a name under ``root`` (``trainval``) or ``<VOC folder>/<name>``,
the folder relative to ``root`` or absolute, and a list of them is their concatenation: VOC07+12
is ``root=/data/VOCdevkit/VOC2007``, ``train_split=[trainval, ../VOC2012/trainval]``.

Faults name their file: an XML that is not well-formed (with ParseError's line and column), an
``<object>`` without ``name`` or ``bndbox``, an unknown class name, a coordinate that is not a number,
an inverted box (with the object's index, 1-based, and the value), a ``<size>`` that disagrees
with the image; a split list naming a missing XML or JPEG (list file, line, path); an id listed
twice. Unreadable images stop with :class:`datamodules.images.BadImageError` unless
``on_bad_image="skip"``.

With no ``root`` the datamodule writes the handwritten-digit scenes of
:mod:`datamodules.demo_scenes` once into the demo cache in this layout
(:func:`write_voc_detection_layout`) and reads them with the same code.
"""
from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import Dataset

from datamodules.demo import demo_root
from datamodules.detection_common import (DetectionDataModule, check_augmentation, check_image_size, check_on_bad_image,
                                          detection_item, has_area_inside)
from datamodules.images import OnBadImage, guarded, read_rgb
from datamodules.input_spec import normalization
from datamodules.loaders import check_positive_counts, check_repeated_augmentation
from layers.machine import AUTO, NumWorkers

#: Pascal VOC's 20 object classes, in the devkit's order (label i = ``VOC_DETECTION_CLASSES[i]``)
VOC_DETECTION_CLASSES = (
    "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow", "diningtable", "dog",
    "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)

Split = str | Sequence[str]


# -- one annotation file ---------------------------------------------------------------------------------
@dataclass
class VocAnnotation:
    """One parsed ``Annotations/<id>.xml``: boxes already converted to continuous 0-based edges."""

    width: int | None  #: from ``<size>``; ``None`` when absent (or 0, as some exporters write)
    height: int | None
    boxes: np.ndarray  #: (N, 4) float32 x1, y1, x2, y2
    labels: np.ndarray  #: (N,) int64
    difficult: np.ndarray  #: (N,) bool


def _number(text: str | None, path: Path, what: str) -> float:
    try:
        value = float((text or "").strip())
    except ValueError:
        raise ValueError(f"{path}: {what} is {text!r}, not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{path}: {what} is {text!r}, not a finite number")
    return value


def _size(root: ET.Element, path: Path) -> tuple[int | None, int | None]:
    size = root.find("size")
    if size is None:
        return None, None
    dims = []
    for key in ("width", "height"):
        node = size.find(key)
        if node is None:
            return None, None
        value = _number(node.text, path, f"<size><{key}>")
        if value < 0 or value != int(value):
            raise ValueError(f"{path}: <size><{key}> is {node.text!r}, not a pixel count")
        dims.append(int(value) or None)
    return dims[0], dims[1]


def parse_voc_xml(path: Path | str, label_of: dict[str, int]) -> VocAnnotation:
    """Read one VOC annotation file; ``label_of`` maps class names to labels.

    A file that is not well-formed XML raises ``ValueError`` with ParseError's line and column; an
    ``<object>`` without ``<name>`` or ``<bndbox>`` (or one of its four coordinates), with a name not in
    ``label_of``, a coordinate that is not a finite number, ``xmax < xmin`` / ``ymax < ymin``, or a
    ``<difficult>`` other than 0/1 raises ``ValueError`` naming the file, the object (1-based) and the value."""
    path = Path(path)
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        line, column = err.position
        raise ValueError(f"{path}: not well-formed XML at line {line}, column {column} ({err}); "
                         "expected a VOC <annotation> file") from None
    if root.tag != "annotation":
        raise ValueError(f"{path}: the root element is <{root.tag}>, expected a VOC <annotation>")
    width, height = _size(root, path)
    boxes, labels, difficult = [], [], []
    objects = root.findall("object")
    for k, obj in enumerate(objects, start=1):
        where = f"object {k} of {len(objects)}"
        name_node = obj.find("name")
        name = (name_node.text or "").strip() if name_node is not None else None
        if not name:
            raise ValueError(f"{path}: {where} has no <name>")
        if name not in label_of:
            known = list(label_of)
            raise ValueError(f"{path}: {where} is named {name!r}, which is not one of the {len(known)} classes "
                             f"{known[:25]}{' ...' if len(known) > 25 else ''} (set data.class_names or "
                             "write them in root/class_names.txt)")
        bndbox = obj.find("bndbox")
        if bndbox is None:
            raise ValueError(f"{path}: {where} ({name!r}) has no <bndbox>")
        coords = {}
        for key in ("xmin", "ymin", "xmax", "ymax"):
            node = bndbox.find(key)
            if node is None:
                raise ValueError(f"{path}: {where} ({name!r}) has no <bndbox><{key}>")
            coords[key] = _number(node.text, path, f"{where} ({name!r}) <{key}>")
        for low, high in (("xmin", "xmax"), ("ymin", "ymax")):
            if coords[high] < coords[low]:
                raise ValueError(f"{path}: {where} ({name!r}) has {high} {coords[high]:g} < {low} {coords[low]:g} "
                                 "(VOC boxes are 1-based and inclusive: min <= max)")
        flag = obj.find("difficult")
        flag_text = (flag.text or "").strip() if flag is not None else ""
        if flag_text not in ("", "0", "1"):
            raise ValueError(f"{path}: {where} ({name!r}) has <difficult> {flag.text!r}, expected 0 or 1")
        # 1-based inclusive pixel indices -> continuous 0-based edges
        boxes.append([coords["xmin"] - 1, coords["ymin"] - 1, coords["xmax"], coords["ymax"]])
        labels.append(label_of[name])
        difficult.append(flag_text == "1")
    return VocAnnotation(width, height, np.array(boxes, np.float32).reshape(-1, 4), np.array(labels, np.int64),
                         np.array(difficult, bool))


# -- split lists ---------------------------------------------------------------------------------------------
def resolve_split(root: Path, split: str) -> tuple[Path, Path]:
    """``(voc folder, list file)`` of a split: ``"trainval"`` -> ``root/ImageSets/Main/trainval.txt``;
    ``"../VOC2012/trainval"`` -> ``root/../VOC2012`` and its ``ImageSets/Main/trainval.txt``."""
    folder, _, name = str(split).rpartition("/")
    if not name:
        raise ValueError(f"split {split!r} has no list name (expected e.g. 'trainval' or '../VOC2012/trainval')")
    voc = root / folder if folder else root
    return voc, voc / "ImageSets" / "Main" / f"{name}.txt"


def read_image_set(list_file: Path) -> list[tuple[int, str]]:
    """``(line number, image id)`` of each listed image. Lines are ``<id>`` (or ``<id> <flag>``, the
    per-class lists' form); blank lines are skipped; an empty list or an id listed twice is an error."""
    if not list_file.is_file():
        raise FileNotFoundError(f"split list {list_file} not found (VOC layout: root/ImageSets/Main/<split>.txt)")
    entries, seen = [], {}
    for line_no, line in enumerate(list_file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        stem = line.split()[0]
        if stem in seen:
            raise ValueError(f"{list_file} line {line_no} lists {stem!r} again (first at line {seen[stem]})")
        seen[stem] = line_no
        entries.append((line_no, stem))
    if not entries:
        raise ValueError(f"split list {list_file} lists no images")
    return entries


@dataclass(frozen=True)
class VocImage:
    stem: str
    image: Path
    annotation: Path
    list_file: Path
    line: int


def split_images(root: Path, split: Split, need_annotations: bool = True) -> list[VocImage]:
    """The images of ``split`` (a split or a list of splits, concatenated), their files checked: a
    listed id whose JPEG (or, with ``need_annotations``, XML) is missing raises ``FileNotFoundError``
    naming the list file, the line and the path; an image listed by two lists is an error."""
    splits = [split] if isinstance(split, str) else list(split)
    if not splits:
        raise ValueError("no split given")
    images, seen = [], {}
    for name in splits:
        voc, list_file = resolve_split(root, name)
        for line_no, stem in read_image_set(list_file):
            entry = VocImage(stem, voc / "JPEGImages" / f"{stem}.jpg", voc / "Annotations" / f"{stem}.xml",
                             list_file, line_no)
            for path in (entry.annotation, entry.image) if need_annotations else (entry.image,):
                if not path.is_file():
                    raise FileNotFoundError(f"{list_file} line {line_no} names {stem!r}, but {path} does not exist")
            key = entry.image.resolve()
            if key in seen:
                raise ValueError(f"{list_file} line {line_no} lists {stem!r}, already listed at {seen[key]}")
            seen[key] = f"{list_file} line {line_no}"
            images.append(entry)
    return images


# -- dataset ----------------------------------------------------------------------------------------------------
class VocDetection(Dataset):
    """One split (or several, concatenated) of a VOC-layout dataset. Items are those of
    :class:`datamodules.coco.CocoDetection`: ``(image, target)`` with the target keys of the
    module docstring, ``image_id`` being the position in the split list(s); ``None`` for an
    unreadable image under ``on_bad_image="skip"``.

    Every listed file is checked and every XML parsed here, so faults surface before training.
    """

    def __init__(self, root: Path | str, split: Split, transform, class_names: Sequence[str],
                 on_bad_image: OnBadImage = "fail", use_difficult_in_training: bool = False):
        check_on_bad_image(on_bad_image)
        self.root = Path(root)
        self.split = split
        self.transform = transform
        self.on_bad_image = on_bad_image
        self.use_difficult_in_training = use_difficult_in_training
        self.class_names = list(class_names)
        self.label_of = {name: i for i, name in enumerate(self.class_names)}
        self.images = split_images(self.root, split)
        self.image_ids = list(range(len(self.images)))
        self.annotations = [parse_voc_xml(entry.annotation, self.label_of) for entry in self.images]
        self.targets: list[dict[str, np.ndarray]] = []
        degenerate = []
        for entry, ann in zip(self.images, self.annotations):
            train = np.ones(len(ann.labels), bool) if use_difficult_in_training else ~ann.difficult
            known = bool(ann.width and ann.height)  # else the decoded image's size, in detection_item
            valid = has_area_inside(ann.boxes, ann.width if known else None, ann.height if known else None)
            degenerate += [f"{entry.stem} object {k + 1}" for k in np.flatnonzero(train & ~valid)]
            keep = train & valid
            width, height = ann.boxes[:, 2] - ann.boxes[:, 0], ann.boxes[:, 3] - ann.boxes[:, 1]
            self.targets.append({
                # training: boxes with area inside the image (detection_item clips them to it), difficult ones
                # left out unless asked for (and flagged)
                "boxes": ann.boxes[keep], "labels": ann.labels[keep], "difficult": ann.difficult[keep],
                # evaluation: every object as the file has it
                "gt_boxes": ann.boxes, "gt_labels": ann.labels, "gt_iscrowd": np.zeros(len(ann.labels), np.int64),
                "gt_area": (width * height).astype(np.float32), "gt_difficult": ann.difficult,
            })
        self.num_degenerate = len(degenerate)
        if degenerate:
            rank_zero_warn(f"{self.root} split {split}: dropped {len(degenerate)} training boxes with no area inside "
                           f"the image ({degenerate[:10]}{' ...' if len(degenerate) > 10 else ''})")

    @property
    def num_objects(self) -> int:
        return sum(len(t["gt_labels"]) for t in self.targets)

    def __len__(self) -> int:
        return len(self.images)

    def image_path(self, image_id: int) -> Path:
        return self.images[image_id].image

    def annotation(self, index: int) -> dict:
        """Sample ``index`` without its pixels: ``image_id`` (= ``index``), the XML's ``width`` and
        ``height`` (0 when it does not say), the training objects with their ``difficult`` flags and the
        ground truth (:func:`datamodules.detection_common.detection_item`)."""
        ann = self.annotations[index]
        return {"index": index, "image_id": index, "width": ann.width or 0, "height": ann.height or 0,
                **self.targets[index]}

    def __getitem__(self, index: int):
        entry = self.images[index]
        pixels = guarded(lambda: read_rgb(entry.image), entry.image, self.on_bad_image)
        if pixels is None:
            return None
        sample = {**self.annotation(index), "path": str(entry.image)}
        check_image_size(pixels, sample["width"], sample["height"], str(entry.image), str(entry.annotation))
        return detection_item(pixels, sample, self.transform, self.use_difficult_in_training)

    def stored_sample(self, index: int) -> dict:
        """What ``python -m datamodules.optimize`` stores: the JPEG's bytes as they are, its path relative
        to the VOC folder, and :meth:`annotation`."""
        entry = self.images[index]
        return {**self.annotation(index), "image": entry.image.read_bytes(),
                "path": os.path.relpath(entry.image, self.root)}


# -- demo data in the VOC layout -----------------------------------------------------------------------------
#: images per split of the demo set (the COCO demo's counts: same scenes, same images)
DEMO_SPLITS = {"train": 1600, "val": 250, "test": 250}
DEMO_VERSION = 1
#: image-id numbering per split, VOC2007-style 6-digit ids unique across splits
_DEMO_ID_OFFSET = {"train": 1, "val": 100_001, "test": 200_001}


def _voc_xml(stem: str, size: int, objects: list[tuple[str, list[int], bool]]) -> ET.ElementTree:
    root = ET.Element("annotation")
    ET.SubElement(root, "folder").text = "VOC2007"
    ET.SubElement(root, "filename").text = f"{stem}.jpg"
    size_node = ET.SubElement(root, "size")
    for key, value in (("width", size), ("height", size), ("depth", 3)):
        ET.SubElement(size_node, key).text = str(value)
    ET.SubElement(root, "segmented").text = "0"
    for name, (xmin, ymin, xmax, ymax), difficult in objects:
        obj = ET.SubElement(root, "object")
        ET.SubElement(obj, "name").text = name
        ET.SubElement(obj, "pose").text = "Unspecified"
        ET.SubElement(obj, "truncated").text = "0"
        ET.SubElement(obj, "difficult").text = str(int(difficult))
        box = ET.SubElement(obj, "bndbox")
        for key, value in zip(("xmin", "ymin", "xmax", "ymax"), (xmin, ymin, xmax, ymax)):
            ET.SubElement(box, key).text = str(value)
    tree = ET.ElementTree(root)
    ET.indent(tree)
    return tree


def write_voc_detection_layout(root: Path | str, counts: dict[str, int] | None = None, seed: int = 0,
                               size: int = 192, crowd_every: int = 40, empty_every: int = 30,
                               difficult_below: float = 0.15, jpeg_quality: int = 92) -> Path:
    """Write handwritten-digit scenes in the VOC detection layout under ``root``: ``JPEGImages/<id>.jpg``,
    ``Annotations/<id>.xml``, ``ImageSets/Main/{train,val,test,trainval}.txt`` and ``class_names.txt``
    ("zero" .. "nine").

    The scenes are the COCO demo's (:func:`datamodules.demo_scenes.write_coco_layout` with the same
    arguments draws the same images), so the two formats can be compared on one data set. Boxes are
    the masks' tight boxes written the VOC way (1-based, inclusive: ``xmin = x0 + 1, xmax = x1`` for
    the half-open pixel range ``[x0, x1)``). ``difficult=1`` marks what VOC would call hard to
    recognise: each crowd cluster (several small digits of one class under one box, which COCO
    calls a crowd) and every digit whose box is less than ``difficult_below`` x the image side high
    (about 5 % of the digits, plus the crowds, at the defaults).
    """
    from PIL import Image

    from datamodules.demo_scenes import DIGIT_NAMES, generate_scenes

    root = Path(root)
    for folder in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    counts = counts or DEMO_SPLITS
    lists: dict[str, list[str]] = {}
    for split, count in counts.items():
        stems = []
        for index, image, instances in generate_scenes(split, count, seed, size, crowd_every=crowd_every,
                                                       empty_every=empty_every):
            stem = f"{_DEMO_ID_OFFSET.get(split, 1) + index:06d}"
            Image.fromarray(image).save(root / "JPEGImages" / f"{stem}.jpg", quality=jpeg_quality)
            objects = []
            for inst in instances:
                ys, xs = np.nonzero(inst.mask)
                box = [int(xs.min()) + 1, int(ys.min()) + 1, int(xs.max()) + 1, int(ys.max()) + 1]
                small = (box[3] - box[1] + 1) < difficult_below * size
                objects.append((DIGIT_NAMES[inst.label], box, bool(inst.iscrowd or small)))
            _voc_xml(stem, size, objects).write(root / "Annotations" / f"{stem}.xml", encoding="unicode")
            stems.append(stem)
        lists[split] = stems
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(stems) + "\n")
    if "train" in lists and "val" in lists:
        (root / "ImageSets" / "Main" / "trainval.txt").write_text("\n".join(lists["train"] + lists["val"]) + "\n")
    (root / "class_names.txt").write_text("\n".join(DIGIT_NAMES) + "\n")
    return root


def build_demo(root: Path) -> None:
    write_voc_detection_layout(root, DEMO_SPLITS)


# -- class names ---------------------------------------------------------------------------------------------
def read_class_names(path: Path) -> list[str]:
    """One name per line, label i on line i; a leading ``background`` (the VOC *segmentation*
    layout's label 0) is left out, since detection has no background class."""
    names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if names and names[0] == "background":
        names = names[1:]
    if not names:
        raise ValueError(f"{path} lists no class names")
    return names


def check_class_names(names: Sequence[str], source: str) -> list[str]:
    names = [str(n) for n in names]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if not names or repeated:
        raise ValueError(f"{source}: class names must be non-empty and distinct (repeated: {repeated})")
    return names


# -- datamodule ----------------------------------------------------------------------------------------------
class VocDetectionDataModule(DetectionDataModule):
    """Object detection data in the Pascal VOC layout (or the embedded demo in it).

    Args:
        root: the ``VOC2007`` / ``VOC2012`` folder (``Annotations/``, ``JPEGImages/``, ``ImageSets/Main/``);
            ``None`` builds and uses the embedded handwritten-digit scenes.
        train_split: ``trainval`` by default; a split is a list name under ``root`` or
            ``<VOC folder>/<name>``, and a list of splits is their concatenation (VOC07+12:
            ``[trainval, ../VOC2012/trainval]`` with ``root`` the VOC2007 folder).
        val_split: ``test`` by default (VOC2007 practice: SSD and mmdetection train on trainval and
            report, and select models, on VOC2007 test; use ``val`` with ``train_split=train`` to keep
            the test set untouched).
        test_split: the split ``test`` scores; ``None`` = ``val_split``.
        predict_path: an image or a folder of images (hidden files ignored) for ``predict``; ``None`` =
            the test split's images. When given, ``predict`` does not read ``root`` at all.
        image_size, augmentation, zoom_out_max, iou_crop, hflip, weights, mean, std, batch_size, eval_batch_size, num_workers,
            pin_memory, persistent_workers, on_bad_image, repeated_augmentation: as
            :class:`datamodules.coco.CocoDataModule`.
        class_names: label i's class name; ``None`` = ``root/class_names.txt`` if present (one name a
            line, a leading ``background`` skipped), else VOC's 20 classes.
        use_difficult_in_training: train on ``difficult`` objects too (VOC practice, and the default,
            leaves them out; evaluation ignores them either way).
        streaming_root: a folder or object-store URL written by ``python -m datamodules.optimize --task detect
            --data datamodules.voc_detection.VocDetectionDataModule``; the splits are then streamed with
            LitData and ``root`` is not read (:mod:`datamodules.streaming`). A list of splits is the
            streamed split named by ``+`` (``trainval+../VOC2012/trainval``).

    The task reads ``num_classes``, ``category_ids`` (``1 .. K``: label + 1), ``category_names`` and
    ``evaluation_metric`` (``"voc"``: :class:`tasks.metrics.voc_map.VocMeanAveragePrecision`).
    """

    #: the metric the detection task scores this data with
    evaluation_metric = "voc"
    streaming_layout = "voc-detection"

    def __init__(self, root: str | None = None, train_split: str | list[str] = "trainval",
                 val_split: str | list[str] = "test", test_split: str | list[str] | None = None,
                 predict_path: str | None = None, image_size: int = 320, augmentation: str = "torchvision_ssd",
                 zoom_out_max: float | None = None, iou_crop: bool = True, hflip: float = 0.5,
                 weights: str | None = None, mean: tuple[float, float, float] | None = None,
                 std: tuple[float, float, float] | None = None,
                 batch_size: int = 32, eval_batch_size: int | None = None, num_workers: NumWorkers = AUTO,
                 pin_memory: bool = True, persistent_workers: bool = True, on_bad_image: OnBadImage = "fail",
                 class_names: list[str] | None = None, use_difficult_in_training: bool = False,
                 streaming_root: str | None = None, repeated_augmentation: int = 1):
        super().__init__()
        check_on_bad_image(on_bad_image)
        check_repeated_augmentation(repeated_augmentation)
        check_augmentation(augmentation, zoom_out_max)
        if class_names is not None:
            check_class_names(class_names, "data.class_names")
        self.save_hyperparameters()
        check_positive_counts(batch_size=batch_size, eval_batch_size=eval_batch_size)
        self.hparams.mean, self.hparams.std = normalization(weights, mean, std)
        self._root = Path(root).expanduser() if root else None
        self._class_names: list[str] | None = None

    # -- what the model needs to know about the data ---------------------------------------------------
    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = demo_root("voc-digits", build_demo, version=DEMO_VERSION)
        if not self._root.is_dir():
            raise FileNotFoundError(f"data.root={self._root} does not exist (VOC layout: the VOC2007 or VOC2012 "
                                    "folder holding Annotations/, JPEGImages/ and ImageSets/Main/)")
        return self._root

    @property
    def class_names(self) -> list[str]:
        if self._class_names is None:
            if self.streamed is not None:
                self._class_names = list(self.streamed.data["class_names"])
            elif self.hparams.class_names is not None:
                self._class_names = list(self.hparams.class_names)
            elif (self.root / "class_names.txt").is_file():
                listed = self.root / "class_names.txt"
                self._class_names = check_class_names(read_class_names(listed), str(listed))
            else:
                self._class_names = list(VOC_DETECTION_CLASSES)
        return self._class_names

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def category_ids(self) -> list[int]:
        """Label i is category id ``i + 1`` (1-based, as the VOC devkit numbers its classes)."""
        return list(range(1, self.num_classes + 1))

    @property
    def category_names(self) -> list[str]:
        return list(self.class_names)

    @property
    def test_split(self) -> Split:
        return self.hparams.test_split if self.hparams.test_split else self.hparams.val_split

    # -- datasets and loaders --------------------------------------------------------------------------
    def split(self, name: Split, train: bool = False) -> VocDetection:
        h = self.hparams
        if self.streamed is not None:
            return self.streamed_split(name, train, use_difficult=h.use_difficult_in_training)
        dataset = VocDetection(self.root, name, self.transform(train), self.class_names, on_bad_image=h.on_bad_image,
                               use_difficult_in_training=h.use_difficult_in_training)
        difficult = sum(int(t["gt_difficult"].sum()) for t in dataset.targets)
        rank_zero_info(f"{name}: {len(dataset)} images, {dataset.num_objects} objects ({difficult} difficult)")
        return dataset

    # -- what python -m datamodules.optimize writes -----------------------------------------------------
    def streaming_sources(self, splits: Sequence[str] | None = None) -> dict[str, VocDetection]:
        """The splits to convert (default: train, val and test splits; ``a+b`` converts a list of splits
        into one streamed split)."""
        from datamodules.streaming import split_key

        h = self.hparams
        names = splits or list(dict.fromkeys(split_key(s) for s in (h.train_split, h.val_split, self.test_split)))
        # difficult objects are stored with their flag: use_difficult_in_training chooses when streaming
        return {name: VocDetection(self.root, name.split("+") if "+" in name else name, None, self.class_names,
                                   use_difficult_in_training=True) for name in names}

    def streaming_info(self) -> dict:
        """What the model learns from the data, stored with the optimized dataset."""
        return {"class_names": self.class_names}

    def test_images(self) -> list[Path]:
        return [entry.image for entry in split_images(self.root, self.test_split, need_annotations=False)]
