"""Segmentation data: the VOC-layout demo, ADE20k/VOC label encodings, augmentation padding with
the ignore label, evaluation at original size, and the bad-input errors the issue asks for."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from datamodules.demo_scenes import DIGIT_NAMES
from datamodules.segmentation import (
    IGNORE_INDEX,
    VOC_CLASSES,
    MaskFormat,
    SegmentationDataModule,
    read_mask,
    voc_palette,
    write_voc_demo,
)
from datamodules.segmentation_transforms import train_transform

DEMO_COUNTS = {"train": 6, "val": 3, "test": 3}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_voc_demo(tmp_path_factory.mktemp("voc-demo") / "VOC2012", DEMO_COUNTS)


def write_png(path, array, palette=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(np.asarray(array, np.uint8))
    if palette:
        image.putpalette(voc_palette().tobytes())
    image.save(path)


def write_jpg(path, height, width):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((height, width, 3), 128, np.uint8)).save(path)


def make_voc(root, masks: dict[str, np.ndarray], list_extra=()):
    """A VOC2012 folder whose train and val lists both name ``masks`` (+ ``list_extra``)."""
    for stem, mask in masks.items():
        write_jpg(root / "JPEGImages" / f"{stem}.jpg", *mask.shape)
        write_png(root / "SegmentationClass" / f"{stem}.png", mask, palette=True)
    lists = root / "ImageSets" / "Segmentation"
    lists.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        (lists / f"{split}.txt").write_text("\n".join([*masks, *list_extra]) + "\n")
    return root


# -- demo ----------------------------------------------------------------------------------------------
def test_demo_is_voc_layout_with_digit_classes(demo):
    for split, count in DEMO_COUNTS.items():
        stems = (demo / "ImageSets" / "Segmentation" / f"{split}.txt").read_text().split()
        assert len(stems) == count
    dm = SegmentationDataModule(root=str(demo))
    assert dm.class_names == ["background", *DIGIT_NAMES] and dm.num_classes == 11
    with Image.open(demo / "SegmentationClass" / "train_00000.png") as mask:
        assert mask.mode == "P"  # palette PNG like VOC's own masks
    stored = np.stack([read_mask(p) for p in sorted((demo / "SegmentationClass").iterdir())])
    values = set(np.unique(stored).tolist())
    assert values <= set(range(11)) | {IGNORE_INDEX}
    assert {0, IGNORE_INDEX} <= values and len(values - {0, IGNORE_INDEX}) >= 3


def test_demo_outlines_separate_digits_from_background(demo):
    mask = read_mask(demo / "SegmentationClass" / "train_00001.png")
    digits = (mask > 0) & (mask != IGNORE_INDEX)
    padded = np.pad(digits, 1)
    neighbours = [padded[1 + dy:1 + dy + mask.shape[0], 1 + dx:1 + dx + mask.shape[1]]
                  for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
    touching = np.logical_or.reduce(neighbours) & ~digits
    assert touching.any() and (mask[touching] == IGNORE_INDEX).all()


def test_demo_is_deterministic(demo, tmp_path):
    again = write_voc_demo(tmp_path / "again", {"train": 2})
    for stem in ("train_00000", "train_00001"):
        assert np.array_equal(read_mask(again / "SegmentationClass" / f"{stem}.png"),
                              read_mask(demo / "SegmentationClass" / f"{stem}.png"))


def test_augmentation_follows_torch_seed(demo):
    dm = SegmentationDataModule(root=str(demo), crop_size=48, num_workers=0)
    dm.setup("fit")

    def draw(seed):
        torch.manual_seed(seed)
        return dm.train_set[0]

    first, again, other = draw(1), draw(1), draw(2)
    assert torch.equal(first["image"], again["image"]) and torch.equal(first["mask"], again["mask"])
    assert not torch.equal(first["image"], other["image"])


def test_demo_splits_and_loaders(demo):
    dm = SegmentationDataModule(root=str(demo), crop_size=64, eval_short_side=None, batch_size=2, num_workers=0)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"image", "mask", "skipped"} and batch["skipped"] == 0
    assert batch["image"].shape == (2, 3, 64, 64) and batch["mask"].shape == (2, 64, 64)
    assert batch["mask"].dtype == torch.int64
    dm.setup("test")  # the demo's test list has masks, so test scores it (VOC's own test has none)
    assert [dm.test_set.stem(i) for i in range(len(dm.test_set))] == ["test_00000", "test_00001", "test_00002"]
    batch = next(iter(dm.test_dataloader()))
    assert set(batch) == {"image", "mask", "index", "path", "name", "skipped"}
    assert batch["image"].shape == (1, 3, 128, 128) and batch["mask"].shape == (1, 128, 128)
    assert batch["path"] == [str(demo / "JPEGImages" / "test_00000.jpg")] and batch["index"].tolist() == [0]
    assert batch["name"] == ["test_00000"]  # test writes masks/test_00000.png
    dm.setup("predict")  # no predict_path: the test split's images, without masks
    batch = next(iter(dm.predict_dataloader()))
    assert set(batch) == {"image", "orig_size", "index", "path", "name", "skipped"}
    assert batch["orig_size"].tolist() == [[128, 128]] and batch["orig_size"].dtype == torch.int64
    assert batch["path"] == [str(demo / "JPEGImages" / "test_00000.jpg")]


def test_predict_path_needs_no_root(tmp_path, monkeypatch):
    """A user predicting from a checkpoint gives only the images: no dataset folder is read or built."""
    import datamodules.segmentation as segmentation

    def no_demo(*args, **kwargs):
        raise AssertionError("predict with predict_path must not build the demo dataset")

    monkeypatch.setattr(segmentation, "demo_root", no_demo)
    folder = tmp_path / "photos"
    folder.mkdir()
    Image.fromarray(np.full((30, 20, 3), 10, np.uint8)).save(folder / "p1.jpg")
    Image.fromarray(np.full((16, 24, 3), 10, np.uint8)).save(folder / "p0.png")
    Image.fromarray(np.full((16, 24, 3), 10, np.uint8)).save(folder / "._p0.png")  # macOS droppings
    dm = SegmentationDataModule(predict_path=str(folder), eval_short_side=8, num_workers=0)
    dm.setup("predict")
    batches = list(dm.predict_dataloader())
    assert [b["path"] for b in batches] == [[str(folder / "p0.png")], [str(folder / "p1.jpg")]]
    assert [b["orig_size"].tolist() for b in batches] == [[[16, 24]], [[30, 20]]]
    assert batches[0]["image"].shape == (1, 3, 8, 12)
    # what predict writes needs only the dataset kind
    assert np.asarray(dm.encode_prediction(np.array([[0, 3]]))).tolist() == [[0, 3]]
    assert tuple(dm.palette[3]) == tuple(voc_palette()[3])
    ade = SegmentationDataModule(root=str(tmp_path / "nowhere"), dataset="ade20k", predict_path=str(folder / "p1.jpg"),
                                 num_workers=0)
    ade.setup("predict")
    assert len(ade.predict_set) == 1
    assert np.asarray(ade.encode_prediction(np.array([[0, 149]]))).tolist() == [[1, 150]]
    assert tuple(ade.palette[0]) == tuple(voc_palette()[1])  # label 0 is stored as 1


# -- augmentation ------------------------------------------------------------------------------------------------
def test_crop_padding_and_rotation_fill_with_ignore():
    image = np.full((40, 30, 3), 200, np.uint8)
    mask = np.zeros((40, 30), np.uint8)  # all background: any 255 must come from padding / rotation
    # short side 64 * 0.5 = 32, smaller than the crop: padded with ignore (mask) and 0 (image)
    pad = train_transform(crop_size=64, scale_range=(0.5, 0.5), hflip=0, photometric=0, blur=0, rotate_degrees=0,
                          mean=(0, 0, 0), std=(1, 1, 1))
    out = pad(image=image, mask=mask)
    padded = out["mask"] == IGNORE_INDEX
    resized_h, resized_w = 43, 32
    assert int((~padded).sum()) == resized_h * resized_w
    assert int(padded.sum()) == 64 * 64 - resized_h * resized_w
    assert torch.all(out["image"][:, padded] == 0)

    rotate = train_transform(crop_size=64, scale_range=(1.0, 1.0), hflip=0, photometric=0, blur=0,
                             rotate_degrees=10, rotate_p=1.0)
    big = np.zeros((64, 64), np.uint8)
    exposed = []
    for seed in range(4):  # the angle is drawn in [-10, 10] from torch's RNG; a draw near 0 exposes no corner
        torch.manual_seed(seed)
        out = rotate(image=np.full((64, 64, 3), 50, np.uint8), mask=big)
        assert set(out["mask"].unique().tolist()) <= {0, IGNORE_INDEX}
        exposed.append(int((out["mask"][[0, 0, -1, -1], [0, -1, 0, -1]] == IGNORE_INDEX).sum()))
    assert max(exposed) >= 2, exposed  # rotated corners are filled with the ignore label


# -- label encodings --------------------------------------------------------------------------------------
def test_ade20k_encoding_round_trip(tmp_path):
    stored = np.array([[0, 1, 2], [149, 150, 0]], np.uint8)
    root = tmp_path / "ADEChallengeData2016"
    for split in ("training", "validation"):
        write_jpg(root / "images" / split / "ADE_x_0001.jpg", 2, 3)
        write_png(root / "annotations" / split / "ADE_x_0001.png", stored)
    dm = SegmentationDataModule(root=str(root), dataset="ade20k", eval_short_side=None, num_workers=0)
    assert dm.num_classes == 150
    dm.setup("validate")
    item = dm.val_set[0]
    assert item["mask"].tolist() == [[IGNORE_INDEX, 0, 1], [148, 149, IGNORE_INDEX]]
    # predictions go back to 1..150 (0 stays reserved)
    written = np.asarray(dm.encode_prediction(np.array([[0, 149]])))
    assert written.tolist() == [[1, 150]]


def test_voc_encoding_writes_palette_png():
    image = MaskFormat.of("voc", len(VOC_CLASSES)).encode(np.array([[0, 20], [15, 1]]))
    assert image.mode == "P" and np.asarray(image).tolist() == [[0, 20], [15, 1]]
    assert tuple(voc_palette()[15]) == (192, 128, 128) and tuple(voc_palette()[255]) == (224, 224, 192)


def test_voc_aug_masks(tmp_path):
    root = tmp_path / "VOC2012"
    mask = np.array([[0, 5], [255, 20]], np.uint8)
    write_jpg(root / "JPEGImages" / "2008_000001.jpg", 2, 2)
    write_png(root / "SegmentationClassAug" / "2008_000001.png", mask)  # SBD masks are grayscale
    lists = root / "ImageSets" / "Segmentation"
    lists.mkdir(parents=True)
    (lists / "train_aug.txt").write_text("/JPEGImages/2008_000001.jpg /SegmentationClassAug/2008_000001.png\n")
    dm = SegmentationDataModule(root=str(root), aug_masks=True, num_workers=0)
    assert dm.num_classes == 21
    samples = dm._split_samples("train")
    assert samples[0][1].parent.name == "SegmentationClassAug"
    assert dm.mask_format.decode(read_mask(samples[0][1]), samples[0][1]).tolist() == mask.tolist()


# -- bad input --------------------------------------------------------------------------------------------
def test_mask_values_outside_classes_name_file_and_values(tmp_path):
    root = make_voc(tmp_path / "VOC2012", {"bad": np.array([[0, 21], [200, 255]], np.uint8)})
    dm = SegmentationDataModule(root=str(root), crop_size=8, num_workers=0)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"bad\.png has values \[21, 200\]"):
        dm.train_set[0]
    ade = MaskFormat(num_classes=150, offset=1, reserved=0, palette=False)
    with pytest.raises(ValueError, match=r"m\.png has values \[151, 255\]"):
        ade.decode(np.array([[0, 151, 255]], np.uint8), "m.png")


def test_size_mismatch_names_both_files(tmp_path):
    root = make_voc(tmp_path / "VOC2012", {"a": np.zeros((4, 6), np.uint8)})
    write_jpg(root / "JPEGImages" / "a.jpg", 5, 6)
    dm = SegmentationDataModule(root=str(root), num_workers=0)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"JPEGImages/a\.jpg is 6x5 but its mask .*SegmentationClass/a\.png is 6x4"):
        dm.train_set[0]


def test_split_list_naming_a_missing_file(tmp_path):
    root = make_voc(tmp_path / "VOC2012", {"a": np.zeros((4, 4), np.uint8)}, list_extra=["ghost"])
    dm = SegmentationDataModule(root=str(root), num_workers=0)
    with pytest.raises(FileNotFoundError, match=r"train\.txt line 2 names 'ghost', but .*JPEGImages/ghost\.jpg"):
        dm.setup("fit")


def test_ade20k_image_without_annotation(tmp_path):
    root = tmp_path / "ADEChallengeData2016"
    write_jpg(root / "images" / "training" / "x.jpg", 2, 2)
    (root / "annotations" / "training").mkdir(parents=True)
    dm = SegmentationDataModule(root=str(root), dataset="ade20k", num_workers=0)
    with pytest.raises(FileNotFoundError, match=r"x\.jpg has no annotation: expected .*annotations/training/x\.png"):
        dm.setup("fit")


def test_rgb_mask_is_refused(tmp_path):
    root = make_voc(tmp_path / "VOC2012", {"a": np.zeros((4, 4), np.uint8)})
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(root / "SegmentationClass" / "a.png")
    dm = SegmentationDataModule(root=str(root), num_workers=0)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"a\.png is a RGB image"):
        dm.train_set[0]


def test_eval_keeps_mask_at_original_size(demo):
    dm = SegmentationDataModule(root=str(demo), eval_short_side=64, num_workers=0)
    dm.setup("validate")
    item = dm.val_set[0]
    assert item["image"].shape == (3, 64, 64) and item["mask"].shape == (128, 128)


def test_split_list_naming_an_image_twice_is_refused(tmp_path):
    """A repeated validation entry was evaluated twice (mIoU shifted); VOC detection's lists already refused it."""
    masks = {stem: np.zeros((4, 4), np.uint8) for stem in ("a", "b", "c")}
    root = make_voc(tmp_path / "VOC2012", masks)
    val = root / "ImageSets" / "Segmentation" / "val.txt"
    val.write_text("a\n\nb\nc\nb\n")
    dm = SegmentationDataModule(root=str(root), num_workers=0)
    with pytest.raises(ValueError, match=rf"{val} line 5 lists 'b' again \(first at line 3\); each image may be "
                                         "listed once"):
        dm.setup("validate")
    # SBD's two-column form names the same image by its path
    val.write_text("a\n/JPEGImages/a.jpg /SegmentationClass/a.png\n")
    with pytest.raises(ValueError, match=r"line 2 lists 'a' again \(first at line 1\)"):
        SegmentationDataModule(root=str(root), num_workers=0).setup("validate")


def test_split_list_errors_count_blank_lines(tmp_path):
    root = make_voc(tmp_path / "VOC2012", {"a": np.zeros((4, 4), np.uint8)})
    (root / "ImageSets" / "Segmentation" / "train.txt").write_text("\na\n\nghost\n")
    with pytest.raises(FileNotFoundError, match=r"train\.txt line 4 names 'ghost'"):
        SegmentationDataModule(root=str(root), num_workers=0).setup("fit")
