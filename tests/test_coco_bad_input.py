"""Faulty COCO-layout data: each fault is an error naming the file (and the id or value), or,
for unreadable images under ``on_bad_image="skip"``, a counted skip."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from datamodules.coco import CocoDataModule, CocoDetection, eval_transform, load_coco
from datamodules.images import BadImageError

MEAN, STD = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
WIDTH, HEIGHT = 40, 30
CATEGORIES = [{"id": 1, "name": "cat"}, {"id": 4, "name": "dog"}]


def write_split(root: Path, split: str, count: int = 4, categories: list[dict] = CATEGORIES) -> Path:
    """``count`` small JPEGs (WIDTH x HEIGHT) in ``root/split/`` with one box each, and their annotation file."""
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    (root / split).mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for i in range(1, count + 1):
        pixels = np.full((HEIGHT, WIDTH, 3), 40 * i, np.uint8)
        Image.fromarray(pixels).save(root / split / f"{i:04d}.jpg", quality=95)
        images.append({"id": i, "file_name": f"{i:04d}.jpg", "width": WIDTH, "height": HEIGHT})
        annotations.append({"id": 100 + i, "image_id": i, "category_id": categories[i % len(categories)]["id"],
                            "bbox": [2.0, 3.0, 10.0, 8.0], "area": 80.0, "iscrowd": 0})
    path = annotation_file(root, split)
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return path


def annotation_file(root: Path, split: str) -> Path:
    return root / "annotations" / f"instances_{split}.json"


def edit(path: Path, change) -> None:
    """Apply ``change(dataset_dict)`` to the annotation file at ``path``."""
    dataset = json.loads(path.read_text())
    change(dataset)
    path.write_text(json.dumps(dataset))


def dataset(root: Path, split: str = "val2017", **kwargs) -> CocoDetection:
    return CocoDetection(root / split, annotation_file(root, split), eval_transform(32, MEAN, STD), **kwargs)


@pytest.fixture
def root(tmp_path) -> Path:
    write_split(tmp_path, "train2017")
    write_split(tmp_path, "val2017")
    return tmp_path


# -- 1. unreadable images -------------------------------------------------------------------------
def break_images(root: Path) -> list[Path]:
    """Truncate val image 2 and empty val image 3; returns their paths."""
    truncated, empty = root / "val2017" / "0002.jpg", root / "val2017" / "0003.jpg"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])  # cut mid-scan
    empty.write_bytes(b"")
    return [truncated, empty]


def test_unreadable_images_fail_naming_the_file(root):
    truncated, empty = break_images(root)
    data = dataset(root)
    for index, path in ((1, truncated), (2, empty)):
        with pytest.raises(BadImageError, match=re.escape(str(path))):
            data[index]
    assert data[0][1]["path"] == str(root / "val2017" / "0001.jpg")


def test_unreadable_images_are_skipped_and_counted(root):
    break_images(root)
    dm = CocoDataModule(root=str(root), image_size=32, batch_size=4, num_workers=0, mean=MEAN, std=STD,
                        on_bad_image="skip")
    dm.setup("validate")
    batches = list(dm.val_dataloader())
    assert len(batches) == 1
    batch = batches[0]
    assert batch["skipped"] == 2 and batch["image"].shape == (2, 3, 32, 32)
    assert [t["image_id"] for t in batch["targets"]] == [1, 4]
    # a batch of only bad images is just the count
    dm = CocoDataModule(root=str(root), image_size=32, batch_size=1, num_workers=0, mean=MEAN, std=STD,
                        on_bad_image="skip")
    dm.setup("validate")
    assert [b["skipped"] for b in dm.val_dataloader()] == [0, 1, 1, 0]
    assert list(dm.val_dataloader())[1] == {"skipped": 1}
    # predict counts the same way
    dm = CocoDataModule(predict_path=str(root / "val2017"), image_size=32, batch_size=4, num_workers=0,
                        on_bad_image="skip")
    dm.setup("predict")
    batch = next(iter(dm.predict_dataloader()))
    assert batch["skipped"] == 2 and batch["path"] == [str(root / "val2017" / f"{i:04d}.jpg") for i in (1, 4)]


def test_sixteen_bit_png_keeps_its_values(root):
    """A 16-bit PNG at 1/2 of full scale reads as ~128/255, not as white."""
    edit(annotation_file(root, "val2017"), lambda d: d["images"][0].update(file_name="0001.png"))
    pixels = np.full((HEIGHT, WIDTH), 32768, np.uint16)
    pixels[:, : WIDTH // 2] = 8224  # 8224 / 65535 = 32 / 255
    Image.fromarray(pixels).save(root / "val2017" / "0001.png")
    assert Image.open(root / "val2017" / "0001.png").mode.startswith("I")  # really 16 bits on disk
    data = CocoDetection(root / "val2017", annotation_file(root, "val2017"),
                         eval_transform(HEIGHT, MEAN, STD))  # no resize down the middle of the image
    image, target = data[0]
    assert target["orig_size"] == (HEIGHT, WIDTH)
    values = (image * 255).round()
    assert (values[:, :, :2] - 32).abs().max() <= 1 and (values[:, :, -2:] - 128).abs().max() <= 1


# -- 2. annotation file that is not JSON ----------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "not json"])
def test_annotation_file_that_is_not_json_names_the_file(root, damage):
    path = annotation_file(root, "train2017")
    text = path.read_text()
    path.write_text(text[: len(text) // 2] if damage == "truncated" else "<html>502 Bad Gateway</html>")
    message = rf"{re.escape(str(path))} is not valid JSON .*\(line 1, column \d+\)"
    with pytest.raises(ValueError, match=message):
        load_coco(path)
    with pytest.raises(ValueError, match=message):
        CocoDataModule(root=str(root)).categories


def test_annotation_file_that_is_binary_names_the_file(root):
    path = annotation_file(root, "val2017")
    path.write_bytes(b"\xff\xfe\x00garbage\x9c")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        dataset(root)


# -- 3. / 4. boxes --------------------------------------------------------------------------------
@pytest.mark.parametrize("bbox", [[2.0, 3.0, 10.0], [1, 2, 3, 4, 5], "2 3 10 8", [1, 2, "3", 4], [[1, 2, 3, 4]]])
def test_bbox_not_four_numbers_names_file_annotation_and_value(root, bbox):
    path = annotation_file(root, "val2017")
    edit(path, lambda d: d["annotations"][1].update(bbox=bbox))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: annotation 102 has bbox {re.escape(repr(bbox))}"):
        dataset(root)


def test_annotation_without_bbox_names_file_and_annotation(root):
    path = annotation_file(root, "val2017")
    edit(path, lambda d: d["annotations"][2].pop("bbox"))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: annotation 103 has no 'bbox'.*detection needs"):
        dataset(root)


# -- 5. image size differs from the annotation file -----------------------------------------------
def test_image_size_differing_from_the_annotation_file_names_both(root):
    image = root / "val2017" / "0002.jpg"
    Image.new("RGB", (WIDTH + 8, HEIGHT)).save(image)
    data = dataset(root, on_bad_image="skip")  # not an unreadable image: skip does not hide it
    data[0]
    message = (rf"image file {re.escape(str(image))} \(image_id 2\) is {WIDTH + 8}x{HEIGHT} .* "
               rf"{re.escape(str(annotation_file(root, 'val2017')))} says {WIDTH}x{HEIGHT}")
    with pytest.raises(ValueError, match=message):
        data[1]


# -- 6. the same image id twice -------------------------------------------------------------------
def test_duplicate_image_entry_names_file_and_id(root):
    path = annotation_file(root, "val2017")
    edit(path, lambda d: d["images"].append(dict(d["images"][2], file_name="other.jpg")))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: image id 3 is listed more than once"):
        dataset(root)


# -- 7. evaluation categories the training file does not have ---------------------------------------
def test_evaluation_file_declaring_extra_categories_names_both_files(root):
    write_split(root, "val2017", categories=CATEGORIES + [{"id": 7, "name": "bird"}, {"id": 9, "name": "cow"}])
    edit(annotation_file(root, "val2017"), lambda d: d["annotations"].clear())  # declared only, never used
    dm = CocoDataModule(root=str(root), image_size=32, num_workers=0)
    message = (rf"{re.escape(str(annotation_file(root, 'val2017')))} declares category ids \[7, 9\], which "
               rf"{re.escape(str(annotation_file(root, 'train2017')))} does not have")
    with pytest.raises(ValueError, match=message):
        dm.setup("validate")
    with pytest.raises(ValueError, match=message):
        dm.setup("test")  # test falls back to the validation split


def test_evaluation_file_missing_a_training_category_is_fine(root):
    write_split(root, "val2017", categories=CATEGORIES[1:])
    dm = CocoDataModule(root=str(root), image_size=32, num_workers=0)
    dm.setup("validate")
    assert dm.val_set.category_ids == [1, 4]
    assert {int(t["labels"][0]) for _, t in (dm.val_set[i] for i in range(len(dm.val_set)))} == {1}


# -- 8. what real annotation files get wrong ---------------------------------------------------------
def test_image_without_width_or_height_names_file_and_image(root):
    path = annotation_file(root, "val2017")
    edit(path, lambda d: d["images"][1].pop("width"))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: image 2 has no 'width'; every entry of 'images'"):
        dataset(root)


def test_string_category_id_is_reported_with_its_type(root):
    path = annotation_file(root, "val2017")
    edit(path, lambda d: d["annotations"][0].update(category_id="4"))
    with pytest.raises(ValueError, match=r"annotation 101 has category_id '4' \(a str\), which is not among"):
        dataset(root)


def test_file_name_listed_under_two_image_ids_is_refused(root):
    path = annotation_file(root, "val2017")
    edit(path, lambda d: d["images"][3].update(file_name="0002.jpg"))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: file_name '0002.jpg' is listed more than once "
                                         r"in 'images' \(image ids \[2, 4\]"):
        dataset(root)


def test_negative_box_size_names_file_annotation_and_value(root):
    path = annotation_file(root, "val2017")
    edit(path, lambda d: d["annotations"][2].update(bbox=[20.0, 3.0, -10.0, 8.0]))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: annotation 103 has bbox \[20.0, 3.0, -10.0, 8.0\] "
                                         "with a negative width or height"):
        dataset(root)


def test_each_annotation_file_is_parsed_once_and_then_mapped(root, monkeypatch):
    """The categories the model links to and the training split come from one parse of the file; a
    second start parses nothing; an edited file is parsed again."""
    import datamodules.coco as coco

    parsed = []
    monkeypatch.setattr(coco, "read_annotation_json", lambda path: parsed.append(path) or json.loads(path.read_text()))
    for _ in range(2):
        dm = CocoDataModule(root=str(root), image_size=32, num_workers=0)
        assert dm.category_ids == [1, 4]
        dm.setup("fit")
    assert parsed == [annotation_file(root, "train2017"), annotation_file(root, "val2017")]
    edit(annotation_file(root, "val2017"), lambda d: d["annotations"].pop())
    dm = CocoDataModule(root=str(root), image_size=32, num_workers=0)
    dm.setup("validate")
    assert parsed[2:] == [annotation_file(root, "val2017")] and len(dm.val_set.index.ann_ids) == 3


# -- 9. values that compare false with everything, ids of the wrong type, nothing to train on ----------
@pytest.mark.parametrize("split, stage", [("train2017", "fit"), ("val2017", "validate")])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_box_names_file_annotation_and_value(root, split, stage, value):
    """A NaN box passes every size comparison: unchecked it left training uncounted and counted as a
    missed object in evaluation."""
    path = annotation_file(root, split)
    edit(path, lambda d: d["annotations"][0].update(bbox=[value, 5.0, 20.0, 20.0]))
    assert "NaN" in path.read_text() or "Infinity" in path.read_text()  # what json writes, and reads back
    dm = CocoDataModule(root=str(root), image_size=32, num_workers=0)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: annotation 101 has bbox \[{value}, 5.0, 20.0, "
                                         r"20.0\] with a value that is not a finite number; fix the box or remove"):
        dm.setup(stage)


def test_non_finite_area_names_file_annotation_and_value(root):
    path = annotation_file(root, "val2017")
    edit(path, lambda d: d["annotations"][1].update(area=float("nan")))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: annotation 102 has area nan, not a finite number"):
        dataset(root)


def test_category_ids_written_as_strings_everywhere_say_ids_are_integers(root):
    """Quoted ids in 'categories' and in every annotation agree with each other, but labels are indexed by
    id: the error names the first category and says how to write it."""
    path = annotation_file(root, "train2017")

    def quote(d):
        for category in d["categories"]:
            category["id"] = str(category["id"])
        for ann in d["annotations"]:
            ann["category_id"] = str(ann["category_id"])

    edit(path, quote)
    dm = CocoDataModule(root=str(root), image_size=32, num_workers=0)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: category 'cat' has id '1' \(a str\); COCO category "
                                         r"ids are integers.*\(write 1, without quotes\)"):
        dm.setup("fit")
    # a single quoted annotation among integer categories says the same
    write_split(root, "train2017")
    edit(path, lambda d: d["annotations"][2].update(category_id="4"))
    with pytest.raises(ValueError, match=r"annotation 103 has category_id '4' \(a str\), which is not among the "
                                         r"categories \[1, 4\]: category ids are integers \(write 4, without quotes\)"):
        CocoDataModule(root=str(root), image_size=32, num_workers=0).setup("fit")


def test_training_split_of_only_crowd_regions_is_refused(root, caplog):
    """Crowd regions never train (COCO's convention): a split of nothing else would fit on background alone."""
    path = annotation_file(root, "train2017")
    edit(path, lambda d: [ann.update(iscrowd=1) for ann in d["annotations"]])
    dm = CocoDataModule(root=str(root), image_size=32, num_workers=0)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: none of its 4 annotations is a box training can "
                                         r"use \(4 are crowd regions, iscrowd=1, .*; 0 have no area .*Mark single "
                                         r"objects iscrowd=0"):
        dm.setup("fit")
    # a split with some crowds trains on the rest, and says how many it leaves out
    edit(path, lambda d: d["annotations"][0].update(iscrowd=0))
    dm = CocoDataModule(root=str(root), image_size=32, num_workers=0)
    dm.setup("fit")
    assert dm.train_set.num_training_boxes == 1 and dm.train_set.num_crowd == 3
    assert "train2017: 4 images, 4 annotations (3 crowd regions, left out of training)" in caplog.text
    # evaluation splits of crowds only are scored as COCOeval scores them: no refusal there
    edit(annotation_file(root, "val2017"), lambda d: [ann.update(iscrowd=1) for ann in d["annotations"]])
    CocoDataModule(root=str(root), image_size=32, num_workers=0).setup("validate")
