"""COCO instance annotations as PASCAL VOC semantic masks: the extra training data of CVNets' VOC recipes.

CVNets' MobileViTv2 VOC configs (``config/segmentation/pascal_voc/*_mobilevitv2.yaml``) set
``dataset.pascal.use_coco_data: true`` and ``coco_root_dir``; ``data/datasets/segmentation/pascal_voc.py``
then appends the pairs listed in ``<coco_root_dir>/train_2017.txt`` to VOC's ``train_aug`` list (one
training set, VOC first, shuffled together). The script that wrote that preprocessed folder is not in
the CVNets repository; its mask code is ``data/datasets/segmentation/coco_segmentation.py``
(``_gen_seg_mask``, ``coco_to_pascal_mapping``), which is PyTorch-Encoding's ``COCOSegmentation``, whose
preprocessing keeps the images with more than 1000 VOC-class pixels. Here ``instances_<split>.json`` is
parsed once into a prepared index of the VOC-class instances' RLEs (pycocotools), and each mask is
painted from them when its image is read, by the same rules:

- COCO categories map to VOC labels by name (:data:`COCO_TO_VOC`; the 20 categories of CVNets'
  id list, checked against the names of COCO 2017's annotation file); every other COCO category,
  and every pixel no instance covers, is background (0);
- every instance is painted, crowd regions (``iscrowd: 1``, RLE) included, as CVNets does;
- an image is kept when more than ``min_pixels`` of its pixels get a VOC class (``None`` keeps all,
  as CVNets' own ``COCOSegmentationDataset`` does).

Layout: the COCO layout of :mod:`datamodules.coco`, ``root/annotations/instances_<split>.json`` and
``root/<split>/<file_name>``.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from lightning.pytorch.utilities import rank_zero_info
from pycocotools import mask as mask_utils
from torch.utils.data import Dataset

from datamodules.coco import read_annotation_json
from datamodules.images import OnBadImage, guarded, read_rgb_array
from datamodules.prepared import StringTable, file_signature, prepare
from datamodules.segmentation_layouts import VOC_CLASSES, MaskFormat, image_and_labels, segmentation_item

#: COCO 2017 category name -> VOC class name, for the 20 VOC classes (COCO's ids 5, 2, 16, 9, 44, 6, 3,
#: 17, 62, 21, 67, 18, 19, 4, 1, 64, 20, 63, 7, 72 in CVNets' ``coco_to_pascal_mapping``)
COCO_TO_VOC = {
    "airplane": "aeroplane", "bicycle": "bicycle", "bird": "bird", "boat": "boat", "bottle": "bottle",
    "bus": "bus", "car": "car", "cat": "cat", "chair": "chair", "cow": "cow", "dining table": "diningtable",
    "dog": "dog", "horse": "horse", "motorcycle": "motorbike", "person": "person",
    "potted plant": "pottedplant", "sheep": "sheep", "couch": "sofa", "train": "train", "tv": "tvmonitor",
}

#: the 80 category names of COCO 2017's instance annotations; a name outside them means the file is
#: not COCO's (or was renamed), and mapping it to background would silently drop its objects
COCO_CATEGORY_NAMES = frozenset({
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard",
    "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors",
    "teddy bear", "hair drier", "toothbrush",
})

#: CVNets' preprocessing (PyTorch-Encoding's) keeps images with more than this many VOC-class pixels
MIN_VOC_PIXELS = 1000


def voc_labels_of_categories(categories: list[dict], annotation_file: Path | str) -> dict[int, int]:
    """COCO category id -> VOC label (1..20; 0 for a COCO category outside VOC's classes).

    A category name that is not one of COCO's 80, a name listed twice, or a VOC class whose COCO
    category is missing is a ``ValueError`` naming the file and the value."""
    names = Counter(category.get("name") for category in categories)
    repeated = sorted(str(name) for name, count in names.items() if count > 1)
    if repeated:
        raise ValueError(f"{annotation_file}: category name(s) {repeated} are listed more than once")
    labels = {}
    for category in categories:
        name = category.get("name")
        if name not in COCO_CATEGORY_NAMES:
            raise ValueError(f"{annotation_file}: category id {category.get('id')} is named {name!r}, which is not "
                             f"a COCO 2017 category name; COCO categories are mapped to VOC classes by name")
        labels[category["id"]] = VOC_CLASSES.index(COCO_TO_VOC[name]) if name in COCO_TO_VOC else 0
    missing = sorted(set(COCO_TO_VOC) - set(names))
    if missing:
        raise ValueError(f"{annotation_file} has no category named {missing} (the COCO categories of VOC's "
                         f"{[COCO_TO_VOC[name] for name in missing]})")
    return labels


def _instance_rle(ann: dict, height: int, width: int) -> dict:
    """One instance's mask as a compressed RLE, from polygons, an uncompressed RLE (crowds) or a compressed one."""
    segmentation = ann["segmentation"]
    if isinstance(segmentation, list):
        return mask_utils.merge(mask_utils.frPyObjects(segmentation, height, width))
    if isinstance(segmentation.get("counts"), list):
        return mask_utils.frPyObjects(segmentation, height, width)
    return segmentation


def build_voc_index(annotation_file: Path) -> tuple[dict[str, np.ndarray], dict]:
    """Parse a COCO annotation file once into the VOC-class instances of each image: per image
    (sorted by id) ``image_ids``, ``widths``, ``heights``, file names, ``voc_pixels`` (pixels some
    VOC-class instance covers) and ``ann_offsets``; per VOC-class instance, in the file's order,
    ``labels`` (1..20) and its compressed RLE. Other categories are background and not kept."""
    dataset = read_annotation_json(annotation_file)
    label_of = voc_labels_of_categories(dataset.get("categories", []), annotation_file)
    images = sorted(dataset.get("images", []), key=lambda info: info["id"])
    position = {info["id"]: k for k, info in enumerate(images)}
    per_image: list[list[dict]] = [[] for _ in images]
    for ann in dataset.get("annotations", []):
        where = f"{annotation_file}: annotation {ann.get('id')}"
        if ann.get("image_id") not in position:
            raise ValueError(f"{where} refers to image_id {ann.get('image_id')}, which is not in 'images'")
        if ann.get("category_id") not in label_of:
            raise ValueError(f"{where} has category_id {ann.get('category_id')}, which is not among its "
                             f"categories {sorted(label_of)}")
        if not ann.get("segmentation"):
            raise ValueError(f"{where} has no 'segmentation' (polygons or RLE); semantic masks need one")
        if label_of[ann["category_id"]] > 0:
            per_image[position[ann["image_id"]]].append(ann)
    labels, rles, pixels = [], [], []
    for info, anns in zip(images, per_image):
        image_rles = [_instance_rle(ann, int(info["height"]), int(info["width"])) for ann in anns]
        # the union's RLE area: no mask is decoded
        pixels.append(int(mask_utils.area(mask_utils.merge(image_rles))) if image_rles else 0)
        labels += [label_of[ann["category_id"]] for ann in anns]
        # pycocotools gives bytes; a compressed RLE read from the file is already text
        rles += [rle["counts"].decode("ascii") if isinstance(rle["counts"], bytes) else rle["counts"]
                 for rle in image_rles]
    names, name_offsets = StringTable.encode(info["file_name"] for info in images)
    counts, count_offsets = StringTable.encode(rles)
    arrays = {"image_ids": np.array([info["id"] for info in images], np.int64),
              "widths": np.array([info["width"] for info in images], np.int32),
              "heights": np.array([info["height"] for info in images], np.int32),
              "file_names": names, "file_name_offsets": name_offsets,
              "voc_pixels": np.array(pixels, np.int64),
              "ann_offsets": np.concatenate([[0], np.cumsum([len(anns) for anns in per_image])]).astype(np.int64),
              "labels": np.array(labels, np.uint8), "rle_counts": counts, "rle_offsets": count_offsets}
    return arrays, {}


class CocoVocSegmentation(Dataset):
    """Training items of :class:`datamodules.segmentation.SegmentationDataset` (``mode="train"``) from one
    COCO split, masks in VOC's labels.

    Args:
        root: the COCO folder (``annotations/instances_<split>.json``, ``<split>/``).
        split: e.g. ``"train2017"``.
        transform: the joint training transform (called as in ``segmentation_item``).
        min_pixels: keep images with more than this many VOC-class pixels (``None``: every image).
        on_bad_image: ``"skip"`` returns ``None`` for an unreadable image (counted by the collate).
        prepared_dir: where the prepared index lives (:mod:`datamodules.prepared`).

    The annotation file is parsed once into a prepared index of the VOC-class instances' RLEs
    (:func:`build_voc_index`), which later starts, ranks and workers map; every annotation is checked
    then: an unknown ``image_id`` or ``category_id``, or a missing ``segmentation``, raises naming the
    file and the value. ``image_ids`` (K,) are the kept images.
    """

    def __init__(self, root: Path | str, split: str, transform, min_pixels: int | None = MIN_VOC_PIXELS,
                 on_bad_image: OnBadImage = "fail", prepared_dir: str | None = None):
        self.root, self.split = Path(root), split
        self.annotation_file = self.root / "annotations" / f"instances_{split}.json"
        if not self.annotation_file.is_file():
            raise FileNotFoundError(f"annotation file {self.annotation_file} not found (COCO layout: "
                                    "root/annotations/instances_<split>.json)")
        self.transform, self.on_bad_image = transform, on_bad_image
        fingerprint = {"file": file_signature(self.annotation_file), "coco_to_voc": COCO_TO_VOC}
        self.index = prepare("coco_voc", self.annotation_file, fingerprint,
                             lambda: build_voc_index(self.annotation_file), prepared_dir)
        self.file_names = StringTable(self.index["file_names"], self.index["file_name_offsets"])
        self.rles = StringTable(self.index["rle_counts"], self.index["rle_offsets"])
        self.mask_format = MaskFormat.of("voc", len(VOC_CLASSES))
        all_ids = self.index["image_ids"]
        self.kept = np.flatnonzero(self.index["voc_pixels"] > (min_pixels if min_pixels is not None else -1))
        self.image_ids = all_ids[self.kept]
        rank_zero_info(f"COCO {split} as VOC classes: {len(self.kept)} of {len(all_ids)} images kept "
                       f"(more than {min_pixels} VOC-class pixels)" if min_pixels is not None else
                       f"COCO {split} as VOC classes: all {len(all_ids)} images")

    def _position(self, image_id: int) -> int:
        position = int(np.searchsorted(self.index["image_ids"], image_id))
        if position == len(self.index["image_ids"]) or self.index["image_ids"][position] != image_id:
            raise KeyError(f"image_id {image_id} is not in {self.annotation_file}")
        return position

    def voc_mask(self, image_id: int) -> np.ndarray:
        """(H, W) uint8 VOC labels (0 background, 1..20) of the image, at the annotation file's size.

        Where instances overlap, the first in the file keeps its pixels. COCO gives no depth order, so
        any rule is arbitrary; this is CVNets' (``mask += (mask == 0) * m * c``), which keeps the
        training masks identical to the ones the paper trained on."""
        k = self._position(image_id)
        size = [int(self.index["heights"][k]), int(self.index["widths"][k])]
        labels = np.zeros(size, np.uint8)
        for j in range(int(self.index["ann_offsets"][k]), int(self.index["ann_offsets"][k + 1])):
            instance = mask_utils.decode({"size": size, "counts": self.rles[j].encode("ascii")})
            labels[(labels == 0) & (instance > 0)] = self.index["labels"][j]
        return labels

    def __len__(self) -> int:
        return len(self.kept)

    def image_path(self, index: int) -> Path:
        return self.root / self.split / self.file_names[int(self.kept[index])]

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(H, W, 3) uint8 image and (H, W) uint8 labels; an image of another size than the annotation
        file says is an error naming both."""
        path, image_id = self.image_path(index), int(self.image_ids[index])
        return image_and_labels(read_rgb_array(path), self.voc_mask(image_id), self.mask_format, path,
                                f"{self.annotation_file} (image_id {image_id})")

    def __getitem__(self, index: int) -> dict | None:
        path = self.image_path(index)
        loaded = guarded(lambda: self.load(index), path, self.on_bad_image)
        if loaded is None:
            return None
        return segmentation_item(*loaded, index, str(path), self.transform, "train")


__all__ = ["COCO_CATEGORY_NAMES", "COCO_TO_VOC", "CocoVocSegmentation", "MIN_VOC_PIXELS",
           "voc_labels_of_categories"]
