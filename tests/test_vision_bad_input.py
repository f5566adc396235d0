"""Bad input to the classification and segmentation datamodules: each is a clear error naming the
file (``on_bad_image="fail"``) or a skipped, counted item (``"skip"``), never a silent wrong value.

Every case runs on a tiny layout written into ``tmp_path``."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from datamodules.imagefolder import ImageFolderDataModule, scan_split
from datamodules.images import BadImageError
from datamodules.segmentation import SegmentationDataModule, voc_palette

# no normalisation: a batch's pixel values are the decoded 8-bit values / 255
PLAIN = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}


def write_image(path: Path, value: int = 100, size: tuple[int, int] = (8, 8)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((*size, 3), value, np.uint8)).save(path)
    return path


def truncate(path: Path) -> Path:
    """Cut a written image file to half its bytes (a download or copy that stopped)."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def empty(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def imagefolder(root: Path, splits=("train", "val"), classes=("a", "b"), per_class: int = 2) -> Path:
    for split in splits:
        for name in classes:
            for i in range(per_class):
                write_image(root / split / name / f"{i}.jpg", value=40 + 10 * i)
    return root


def classify(root: Path, **kwargs) -> ImageFolderDataModule:
    settings = dict(image_size=8, eval_resize=8, num_workers=0, batch_size=4, hflip=0.0, scale=(1.0, 1.0))
    return ImageFolderDataModule(root=str(root), **{**settings, **kwargs})


def voc(root: Path, stems=("s0", "s1", "s2"), size: tuple[int, int] = (8, 8)) -> Path:
    """A VOC2012 folder whose train and val lists both name ``stems`` (masks: all background)."""
    lists = root / "ImageSets" / "Segmentation"
    lists.mkdir(parents=True, exist_ok=True)
    for stem in stems:
        write_image(root / "JPEGImages" / f"{stem}.jpg", size=size)
        mask = Image.fromarray(np.zeros(size, np.uint8))
        mask.putpalette(voc_palette().tobytes())
        (root / "SegmentationClass").mkdir(exist_ok=True)
        mask.save(root / "SegmentationClass" / f"{stem}.png")
    for split in ("train", "val"):
        (lists / f"{split}.txt").write_text("\n".join(stems) + "\n")
    return root


def segment(root: Path | None, **kwargs) -> SegmentationDataModule:
    settings = dict(crop_size=8, eval_short_side=None, num_workers=0, batch_size=3, hflip=0.0, photometric=0.0,
                    blur=0.0, rotate_p=0.0, scale_range=(1.0, 1.0))
    return SegmentationDataModule(root=None if root is None else str(root), **{**settings, **kwargs})


# -- 1. hidden folders and files are not data ------------------------------------------------------------
def test_hidden_folders_and_files_are_not_classes_or_images(tmp_path):
    root = imagefolder(tmp_path / "data")
    for split in ("train", "val"):
        write_image(root / split / ".ipynb_checkpoints" / "0-checkpoint.jpg")  # Jupyter's autosave copies
        (root / split / ".git").mkdir()
        (root / split / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        write_image(root / split / "a" / ".hidden.jpg")
        write_image(root / split / "a" / "._0.jpg")  # macOS resource fork next to 0.jpg
    dm = classify(root)
    assert dm.classes == ["a", "b"]
    samples, classes = scan_split(root / "val", dm.classes)
    assert classes == ["a", "b"] and sorted(p.relative_to(root).as_posix() for p, _ in samples) == [
        "val/a/0.jpg", "val/a/1.jpg", "val/b/0.jpg", "val/b/1.jpg"]
    dm.setup("fit")  # val's hidden folders are not "classes unknown to training"
    assert len(dm.train_set) == len(dm.val_set) == 4


# -- 2. truncated and empty JPEGs ----------------------------------------------------------------------------
@pytest.mark.parametrize("damage", [truncate, empty], ids=["truncated", "0-byte"])
def test_classification_bad_jpeg_fails_naming_it(tmp_path, damage):
    root = imagefolder(tmp_path / "data")
    bad = damage(root / "val" / "b" / "0.jpg")
    dm = classify(root)
    dm.setup("validate")
    with pytest.raises(BadImageError, match=str(bad)) as caught:
        next(iter(dm.val_dataloader()))
    assert caught.value.path == bad and "on_bad_image=skip" in str(caught.value)


@pytest.mark.parametrize("damage", [truncate, empty], ids=["truncated", "0-byte"])
def test_classification_bad_jpeg_is_skipped_and_counted(tmp_path, damage):
    root = imagefolder(tmp_path / "data")
    for split in ("train", "val"):
        damage(root / split / "b" / "0.jpg")
    dm = classify(root, on_bad_image="skip")
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        batches = list(loader)
        assert len(batches) == 1 and batches[0]["skipped"] == 1
        assert len(batches[0]["image"]) == len(batches[0]["path"]) == 3
        assert "b/0.jpg" not in {p.split("/", 1)[1] for p in batches[0]["path"]}
    # predicting skips it the same way
    predict = classify(root, on_bad_image="skip", predict_path=str(root / "val" / "b"))
    predict.setup("predict")
    batch = next(iter(predict.predict_dataloader()))
    assert batch["skipped"] == 1 and batch["path"] == [str(root / "val" / "b" / "1.jpg")]


@pytest.mark.parametrize("damage", [truncate, empty], ids=["truncated", "0-byte"])
def test_segmentation_bad_jpeg_fails_naming_it(tmp_path, damage):
    root = voc(tmp_path / "VOC2012")
    bad = damage(root / "JPEGImages" / "s1.jpg")
    dm = segment(root)
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        with pytest.raises(BadImageError, match=str(bad)):
            list(loader)


@pytest.mark.parametrize("damage", [truncate, empty], ids=["truncated", "0-byte"])
def test_segmentation_bad_jpeg_is_skipped_and_counted(tmp_path, damage):
    root = voc(tmp_path / "VOC2012")
    damage(root / "JPEGImages" / "s1.jpg")
    dm = segment(root, on_bad_image="skip")
    dm.setup("fit")
    (train,) = list(dm.train_dataloader())
    assert train["skipped"] == 1 and train["image"].shape == (2, 3, 8, 8) and train["mask"].shape == (2, 8, 8)
    # evaluation runs one image per step: the bad image's step is only the count
    val = list(dm.val_dataloader())
    assert [b["skipped"] for b in val] == [0, 1, 0] and val[1] == {"skipped": 1}
    assert [b["path"] for b in (val[0], val[2])] == [[str(root / "JPEGImages" / f"{s}.jpg")] for s in ("s0", "s2")]


def test_segmentation_unreadable_mask_fails_naming_it_or_is_skipped(tmp_path):
    root = voc(tmp_path / "VOC2012")
    bad = empty(root / "SegmentationClass" / "s2.png")
    dm = segment(root)
    dm.setup("validate")
    with pytest.raises(BadImageError, match=str(bad)):
        list(dm.val_dataloader())
    dm = segment(root, on_bad_image="skip")
    dm.setup("validate")
    assert [b["skipped"] for b in dm.val_dataloader()] == [0, 0, 1]


# -- 3. 16-bit PNGs ----------------------------------------------------------------------------------------------
def write_16bit_pngs(folder: Path) -> dict[str, int]:
    """A 16-bit grayscale and a 16-bit RGB PNG; returns the 8-bit value each must read as."""
    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8), 40000, np.uint16)).save(folder / "gray16.png")  # PIL writes mode I;16
    assert Image.open(folder / "gray16.png").mode == "I;16"
    cv2.imwrite(str(folder / "rgb16.png"), np.full((8, 8, 3), 20000, np.uint16))  # PIL cannot write 16-bit RGB
    return {"gray16.png": round(40000 / 257), "rgb16.png": round(20000 / 257)}  # 156, 78: not clipped to 255


def test_classification_reads_16bit_png_values(tmp_path):
    root = imagefolder(tmp_path / "data", classes=("a",), per_class=0)
    expected = write_16bit_pngs(root / "val" / "a")
    write_16bit_pngs(root / "train" / "a")
    dm = classify(root, **PLAIN)
    dm.setup("validate")
    batch = next(iter(dm.val_dataloader()))
    for path, image in zip(batch["path"], batch["image"]):
        value = expected[Path(path).name]
        torch.testing.assert_close(image, torch.full_like(image, value / 255))


def test_segmentation_reads_16bit_png_values(tmp_path):
    root = tmp_path / "ADEChallengeData2016"
    expected = write_16bit_pngs(root / "images" / "validation")
    (root / "annotations" / "validation").mkdir(parents=True)
    for name in expected:
        Image.fromarray(np.ones((8, 8), np.uint8)).save(root / "annotations" / "validation" / name)
    dm = segment(root, dataset="ade20k", **PLAIN)
    dm.setup("validate")
    predict = segment(None, predict_path=str(root / "images" / "validation"), **PLAIN)
    predict.setup("predict")
    for loader in (dm.val_dataloader(), predict.predict_dataloader()):
        for batch in loader:
            value = expected[Path(batch["path"][0]).name]
            torch.testing.assert_close(batch["image"], torch.full_like(batch["image"], value / 255))


# -- 4. a batch of skipped items only -----------------------------------------------------------------------------
def test_all_skipped_batch_is_only_the_count(tmp_path):
    root = imagefolder(tmp_path / "data")
    for path in (root / "val" / "b").iterdir():
        empty(path)
    dm = classify(root, on_bad_image="skip", batch_size=2)
    dm.setup("validate")
    batches = list(dm.val_dataloader())  # [a/0, a/1], [b/0, b/1]
    assert batches[0]["skipped"] == 0 and len(batches[0]["image"]) == 2
    assert batches[1] == {"skipped": 2}

    # with MixUp/CutMix the training collate mixes only what is left
    for path in (root / "train" / "b").iterdir():
        empty(path)
    for path in (root / "train" / "a").iterdir():
        truncate(path)
    dm = classify(root, on_bad_image="skip", mixup_alpha=0.2, cutmix_alpha=1.0)
    dm.setup("fit")
    assert list(dm.train_dataloader()) == [{"skipped": 4}]

    seg = voc(tmp_path / "VOC2012")
    for stem in ("s0", "s1", "s2"):
        empty(seg / "JPEGImages" / f"{stem}.jpg")
    dm = segment(seg, on_bad_image="skip")
    dm.setup("fit")
    assert list(dm.train_dataloader()) == [{"skipped": 3}]
