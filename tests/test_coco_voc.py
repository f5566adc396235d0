"""COCO instances rasterised to VOC's classes (datamodules/coco_voc.py) and mixed into VOC training
as CVNets does: masks against pycocotools' annToMask, the mapping against CVNets' id list."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

from datamodules.coco_voc import CocoVocSegmentation, voc_labels_of_categories
from datamodules.segmentation import IGNORE_INDEX, VOC_CLASSES, SegmentationDataModule

#: COCO 2017 ids and names of the categories the test file declares (VOC's 20 and one other)
COCO_CATEGORIES = {1: "person", 2: "bicycle", 3: "car", 4: "motorcycle", 5: "airplane", 6: "bus", 7: "train",
                   8: "truck", 9: "boat", 16: "bird", 17: "cat", 18: "dog", 19: "horse", 20: "sheep", 21: "cow",
                   44: "bottle", 62: "chair", 63: "couch", 64: "potted plant", 67: "dining table", 72: "tv"}
#: CVNets' coco_to_pascal_mapping: position = VOC label, value = COCO category id
CVNETS_COCO_TO_PASCAL = [0, 5, 2, 16, 9, 44, 6, 3, 17, 62, 21, 67, 18, 19, 4, 1, 64, 20, 63, 7, 72]


def rect_polygon(x0, y0, x1, y1):
    return [[x0, y0, x1, y0, x1, y1, x0, y1]]


def uncompressed_rle(binary: np.ndarray) -> dict:
    """COCO's crowd format: column-major run lengths starting with a run of zeros."""
    flat = binary.flatten(order="F").astype(np.int64)
    change = np.flatnonzero(np.diff(np.concatenate([[0], flat, [1 - flat[-1]]])))
    counts = np.diff(np.concatenate([[0], change])).tolist()
    return {"size": list(binary.shape), "counts": counts}


def write_coco(root, annotations, images, categories=None):
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    (root / "train2017").mkdir(parents=True, exist_ok=True)
    for info in images:
        Image.fromarray(np.full((info["height"], info["width"], 3), 100, np.uint8)).save(
            root / "train2017" / info["file_name"])
    cats = categories if categories is not None else [{"id": i, "name": n} for i, n in COCO_CATEGORIES.items()]
    path = root / "annotations" / "instances_train2017.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": cats}))
    return path


@pytest.fixture
def tiny_coco(tmp_path):
    """Image 1 (40 x 50): person polygon, dog RLE over it, crowd car RLE, truck polygon over the dog;
    image 2: a 3 x 3 cat; image 3: only a truck."""
    dog = np.zeros((40, 50), np.uint8)
    dog[10:30, 20:45] = 1
    crowd = np.zeros((40, 50), np.uint8)
    crowd[32:38, 0:50] = 1
    dog_rle = mask_utils.encode(np.asfortranarray(dog))
    dog_rle["counts"] = dog_rle["counts"].decode()
    annotations = [
        {"id": 1, "image_id": 1, "category_id": 1, "iscrowd": 0, "segmentation": rect_polygon(5, 5, 25, 25)},
        {"id": 2, "image_id": 1, "category_id": 8, "iscrowd": 0, "segmentation": rect_polygon(30, 0, 49, 20)},
        {"id": 3, "image_id": 1, "category_id": 18, "iscrowd": 0, "segmentation": dog_rle},
        {"id": 4, "image_id": 1, "category_id": 3, "iscrowd": 1, "segmentation": uncompressed_rle(crowd)},
        {"id": 5, "image_id": 2, "category_id": 17, "iscrowd": 0, "segmentation": rect_polygon(2, 2, 5, 5)},
        {"id": 6, "image_id": 3, "category_id": 8, "iscrowd": 0, "segmentation": rect_polygon(0, 0, 20, 20)},
    ]
    for ann in annotations:
        ann["bbox"], ann["area"] = [0, 0, 1, 1], 1.0
    images = [{"id": i, "file_name": f"{i:012d}.jpg", "height": h, "width": w}
              for i, (h, w) in {1: (40, 50), 2: (30, 30), 3: (30, 30)}.items()]
    path = write_coco(tmp_path / "coco", annotations, images)
    return tmp_path / "coco", path, {"dog": dog, "crowd": crowd}


def painted_by_hand(annotation_file, image_id):
    """annToMask of each VOC-class instance, in the file's order; a pixel keeps the first class painted."""
    coco = COCO(str(annotation_file))
    info = coco.imgs[image_id]
    out = np.zeros((info["height"], info["width"]), np.uint8)
    for ann in coco.loadAnns(coco.getAnnIds(imgIds=image_id)):
        if ann["category_id"] not in CVNETS_COCO_TO_PASCAL:
            continue
        binary = coco.annToMask(ann)
        for y, x in zip(*np.nonzero(binary)):
            if out[y, x] == 0:
                out[y, x] = CVNETS_COCO_TO_PASCAL.index(ann["category_id"])
    return out


def test_categories_map_to_voc_by_name_as_cvnets_ids_do():
    labels = voc_labels_of_categories([{"id": i, "name": n} for i, n in COCO_CATEGORIES.items()], "x.json")
    for voc_label, coco_id in enumerate(CVNETS_COCO_TO_PASCAL[1:], start=1):
        assert labels[coco_id] == voc_label
    assert labels[8] == 0  # truck: not a VOC class, background
    expected = {"airplane": "aeroplane", "motorcycle": "motorbike", "couch": "sofa", "dining table": "diningtable",
                "potted plant": "pottedplant", "tv": "tvmonitor", "person": "person", "cow": "cow"}
    ids = {n: i for i, n in COCO_CATEGORIES.items()}
    for coco_name, voc_name in expected.items():
        assert VOC_CLASSES[labels[ids[coco_name]]] == voc_name


def test_masks_match_annToMask_painted_first_instance_first(tiny_coco):
    root, annotation_file, parts = tiny_coco
    data = CocoVocSegmentation(root, "train2017", transform=None, min_pixels=None)
    mask = data.voc_mask(1)
    assert np.array_equal(mask, painted_by_hand(annotation_file, 1))
    person, dog, car = VOC_CLASSES.index("person"), VOC_CLASSES.index("dog"), VOC_CLASSES.index("car")
    assert mask[10, 20] == person  # the polygon comes first in the file: it keeps the overlap with the dog
    assert mask[15, 40] == dog  # the truck polygon over the dog paints nothing and blocks nothing
    assert np.array_equal(mask == car, parts["crowd"] == 1)  # crowd regions are painted, as CVNets does
    person_polygon = COCO(str(annotation_file)).annToMask({"image_id": 1, "segmentation": rect_polygon(5, 5, 25, 25)})
    assert np.array_equal(mask == person, person_polygon == 1)
    assert np.array_equal(mask == dog, (parts["dog"] == 1) & (person_polygon == 0))  # the RLE, less the overlap
    assert not mask[0:5, 0:5].any()  # nothing covers the corner: background


def test_images_with_few_voc_pixels_are_left_out(tiny_coco):
    root, annotation_file, _ = tiny_coco
    counts = {i: int((painted_by_hand(annotation_file, i) > 0).sum()) for i in (1, 2, 3)}
    assert counts[3] == 0 and 0 < counts[2] < counts[1]
    for min_pixels, kept in [(None, [1, 2, 3]), (0, [1, 2]), (counts[2], [1]), (counts[1], [])]:
        data = CocoVocSegmentation(root, "train2017", None, min_pixels=min_pixels)
        assert data.image_ids.tolist() == kept


def test_unknown_names_and_missing_categories_fail_naming_file_and_value(tmp_path, tiny_coco):
    renamed = [{"id": i, "name": "aeroplane" if n == "airplane" else n} for i, n in COCO_CATEGORIES.items()]
    with pytest.raises(ValueError, match=r"bad\.json.*'aeroplane'.*not a COCO"):
        voc_labels_of_categories(renamed, "bad.json")
    without_tv = [{"id": i, "name": n} for i, n in COCO_CATEGORIES.items() if n != "tv"]
    with pytest.raises(ValueError, match=r"bad\.json has no category named \['tv'\].*tvmonitor"):
        voc_labels_of_categories(without_tv, "bad.json")
    root, annotation_file, _ = tiny_coco
    content = json.loads(annotation_file.read_text())
    content["annotations"][0]["category_id"] = 99
    annotation_file.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"instances_train2017\.json: annotation 1 has category_id 99"):
        CocoVocSegmentation(root, "train2017", None)


def test_image_of_another_size_than_its_annotation_fails_naming_both(tiny_coco):
    root, annotation_file, _ = tiny_coco
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(root / "train2017" / "000000000001.jpg")
    data = CocoVocSegmentation(root, "train2017", None, min_pixels=None)
    with pytest.raises(ValueError, match=r"000000000001\.jpg is 20x20.*instances_train2017\.json \(image_id 1\)"):
        data.load(0)


def make_voc_train(root, stems):
    for stem in stems:
        (root / "JPEGImages").mkdir(parents=True, exist_ok=True)
        (root / "SegmentationClass").mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(len(stem))
        Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(root / "JPEGImages" / f"{stem}.jpg")
        Image.fromarray(rng.integers(0, 21, (40, 40), dtype=np.uint8)).save(root / "SegmentationClass" / f"{stem}.png")
    (root / "ImageSets" / "Segmentation").mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(stems) + "\n")
    return root


@pytest.mark.parametrize("augmentation", ["default", "cvnets"])
def test_voc_training_split_appends_coco_and_keeps_voc_items(tmp_path, tiny_coco, augmentation):
    coco_root = tiny_coco[0]
    voc = make_voc_train(tmp_path / "VOC2012", ["a", "b", "c"])
    settings = dict(root=str(voc), augmentation=augmentation, crop_size=32, short_side_range=(32, 48),
                    num_workers=0)
    alone = SegmentationDataModule(**settings)
    mixed = SegmentationDataModule(**settings, coco_root=str(coco_root), coco_min_pixels=0)
    alone.setup("fit")
    mixed.setup("fit")
    assert len(mixed.train_set) == 3 + 2  # images 1 and 2 of the COCO file have VOC pixels
    for index in range(3):
        torch.manual_seed(index)
        expected = alone.train_set[index]
        torch.manual_seed(index)
        got = mixed.train_set[index]
        assert torch.equal(got["image"], expected["image"]) and torch.equal(got["mask"], expected["mask"])
    coco_item = mixed.train_set[3]
    assert coco_item["image"].shape == (3, 32, 32)
    assert set(coco_item["mask"].unique().tolist()) <= {0, VOC_CLASSES.index("person"), VOC_CLASSES.index("dog"),
                                                       VOC_CLASSES.index("car"), IGNORE_INDEX}
    assert len(mixed.val_set) == 3  # validation stays VOC's
    batch = next(iter(mixed.train_dataloader()))  # the loader's seeded sampler reads the mixed set
    assert batch["image"].shape == (5, 3, 32, 32) and batch["skipped"] == 0


def test_coco_root_needs_voc(tmp_path):
    with pytest.raises(ValueError, match="coco_root.*dataset='voc'"):
        SegmentationDataModule(root=str(tmp_path), dataset="ade20k", coco_root=str(tmp_path))
