"""Bad input to the classification and segmentation datamodules: each is a clear error naming the
file (``on_bad_image="fail"``) or a skipped, counted item (``"skip"``), never a silent wrong value.
Real photo folders too: EXIF-rotated photos read upright by every reader, files a listing leaves out
counted and named, two images with one stem written to two outputs, and a dataset folder of the
other layout named as such.

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


# -- 5. EXIF orientation: every reader gives the upright image ------------------------------------------------
def quadrants(height: int = 16, width: int = 24) -> np.ndarray:
    """Four flat colours, one a quadrant, so a wrong turn or flip changes what lands where."""
    image = np.zeros((height, width, 3), np.uint8)
    for k, colour in enumerate([(250, 0, 0), (0, 250, 0), (0, 0, 250), (250, 250, 0)]):
        rows, cols = divmod(k, 2)
        image[rows * height // 2:(rows + 1) * height // 2, cols * width // 2:(cols + 1) * width // 2] = colour
    return image


def write_oriented(path: Path, orientation: int = 6, stored: np.ndarray | None = None) -> Path:
    """Save ``stored`` (default :func:`quadrants`, 24 wide, 16 high) with the EXIF orientation tag, as a
    phone stores a portrait photo (orientation 6: turn 90 degrees clockwise to view)."""
    from datamodules.images import ORIENTATION

    path.parent.mkdir(parents=True, exist_ok=True)
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    extra = {"quality": 95} if path.suffix == ".jpg" else {"lossless": True} if path.suffix == ".webp" else {}
    Image.fromarray(quadrants() if stored is None else stored).save(path, exif=exif, **extra)
    return path


def upright(path: Path) -> np.ndarray:
    """What viewers show: PIL's own EXIF transpose."""
    from PIL import ImageOps

    with Image.open(path) as img:
        return np.asarray(ImageOps.exif_transpose(img).convert("RGB"))


@pytest.mark.parametrize("suffix", [".jpg", ".png", ".webp", ".tif"])
def test_read_rgb_and_stored_bytes_are_upright(tmp_path, suffix):
    from datamodules.images import decode_rgb_bytes, exif_orientation, read_rgb

    for orientation in range(1, 9):
        path = write_oriented(tmp_path / f"o{orientation}{suffix}", orientation)
        expected = upright(path)
        assert expected.shape[:2] == ((24, 16) if orientation >= 5 else (16, 24))
        for pixels in (read_rgb(path), decode_rgb_bytes(path.read_bytes(), str(path))):
            got = pixels.permute(1, 2, 0).numpy()
            assert got.shape == expected.shape, (suffix, orientation)
            assert np.abs(got.astype(int) - expected).max() <= 12, (suffix, orientation)  # JPEG: decoders differ a little
        assert exif_orientation(path) == exif_orientation(path.read_bytes()) == orientation


def test_segmentation_reads_exif_photos_upright(tmp_path):
    folder = tmp_path / "photos"
    write_oriented(folder / "portrait.jpg")  # stored 24x16, viewed 16x24
    dm = segment(None, predict_path=str(folder), **PLAIN)
    dm.setup("predict")
    batch = next(iter(dm.predict_dataloader()))
    assert batch["orig_size"].tolist() == [[24, 16]] and batch["image"].shape == (1, 3, 24, 16)
    assert np.abs(batch["image"][0].permute(1, 2, 0).numpy() * 255 - upright(folder / "portrait.jpg")).max() < 13

    # a mask drawn on the upright photo fits; one drawn on the stored pixels is named as such
    root = voc(tmp_path / "VOC2012", stems=("s0",))
    write_oriented(root / "JPEGImages" / "s0.jpg")
    mask = Image.fromarray(np.zeros((24, 16), np.uint8))
    mask.putpalette(voc_palette().tobytes())
    mask.save(root / "SegmentationClass" / "s0.png")
    dm = segment(root)
    dm.setup("validate")
    assert dm.val_set[0]["mask"].shape == (24, 16)
    mask.transpose(Image.Transpose.TRANSPOSE).save(root / "SegmentationClass" / "s0.png")  # 24 wide, 16 high
    with pytest.raises(ValueError, match=r"s0\.jpg is 16x24 but its mask .*s0\.png is 24x16.*EXIF orientation 6"):
        dm.val_set[0]


def test_detection_size_check_names_exif_orientation(tmp_path):
    from datamodules.detection_common import ImageFiles, check_image_size, eval_transform
    from datamodules.images import read_rgb

    photo = write_oriented(tmp_path / "photos" / "portrait.jpg")
    (item, info), = ImageFiles(photo.parent, eval_transform(8, (0.0,) * 3, (1.0,) * 3))
    assert info["orig_size"] == (24, 16)  # (height, width) of the upright photo: boxes are scaled to it
    pixels = read_rgb(photo)
    check_image_size(pixels, 16, 24, str(photo), "ann.xml")  # annotated upright: fine
    for encoded in (None, photo.read_bytes()):  # the file, or a streamed sample's bytes
        with pytest.raises(ValueError, match=r"portrait\.jpg is 16x24 .* ann\.xml says 24x16: the file carries EXIF "
                                             r"orientation 6"):
            check_image_size(pixels, 24, 16, str(photo), "ann.xml", encoded)
    with pytest.raises(ValueError, match=r"says 20x20$"):  # another size is no EXIF matter
        check_image_size(pixels, 20, 20, str(photo), "ann.xml")


# -- 6. what a folder listing leaves out is counted and named once ---------------------------------------------
def test_listings_count_what_they_leave_out(tmp_path):
    from datamodules.images import SkippedFiles, image_tree, list_images, predict_images

    folder = tmp_path / "photos"
    write_image(folder / "a.jpg")
    write_image(folder / "sub" / "b.png")
    (folder / "anim.gif").write_bytes(b"GIF89a")
    (folder / "phone.heic").write_bytes(b"\x00")
    (folder / "gone.jpg").symlink_to(tmp_path / "missing.jpg")
    write_image(folder / ".hidden.jpg")  # never data, not counted
    with pytest.warns(UserWarning) as caught:
        assert predict_images(folder) == [folder / "a.jpg"]
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(f"left out 3 entries of {folder} that are not read as images: "
                              "2 files of other types (anim.gif, phone.heic); 1 broken link (gone.jpg)")
    with pytest.warns(UserWarning, match=r"left out 3 entries"):
        assert image_tree(folder) == [folder / "a.jpg", folder / "sub" / "b.png"]

    # several folders as one listing (class folders): one report with the total
    skipped = SkippedFiles()
    for name in ("cats", "dogs"):
        write_image(tmp_path / name / "0.jpg")
        (tmp_path / name / "clip.gif").write_bytes(b"GIF89a")
        list_images(tmp_path / name, skipped)
    assert skipped.total == 2
    assert "2 files of other types (cats/clip.gif, dogs/clip.gif)" in skipped.describe(tmp_path)
    with pytest.warns(UserWarning, match="left out 2 entries"):
        skipped.report(tmp_path)

    # a folder holding only such files says what it holds instead
    only = tmp_path / "only"
    only.mkdir()
    (only / "anim.gif").write_bytes(b"GIF89a")
    with pytest.raises(FileNotFoundError, match=r"holds no images .*1 file of another type \(anim\.gif\)"):
        predict_images(only)


# -- 7. two images with one stem get two outputs -----------------------------------------------------------------
def test_output_names_keep_the_extension_only_where_stems_clash():
    from datamodules.images import output_names

    names = output_names(["/d/photo.jpg", "/d/photo.png", "/d/cat.jpg", "/d/x/dog.jpg", "/d/y/DOG.png"])
    assert names == {"/d/photo.jpg": "photo.jpg", "/d/photo.png": "photo.png", "/d/cat.jpg": "cat",
                     "/d/x/dog.jpg": "x/dog.jpg", "/d/y/DOG.png": "y/DOG.png"}
    # a stem that equals another image's file name does not take its output
    assert output_names(["photo.jpg", "photo.png", "photo.jpg.jpeg"]) == {
        "photo.jpg": "photo.jpg", "photo.png": "photo.png", "photo.jpg.jpeg": "photo.jpg.jpeg"}


def test_segmentation_predict_writes_one_mask_per_image(tmp_path):
    from types import SimpleNamespace

    from tasks.outputs.segmentation import PredictMasks
    from tasks.segment import SegmentationTask

    folder = tmp_path / "photos"
    write_image(folder / "photo.jpg", size=(8, 10))
    write_image(folder / "photo.png", size=(6, 4))
    write_oriented(folder / "portrait.jpg")
    dm = segment(None, predict_path=str(folder), **PLAIN)
    dm.setup("predict")
    batches = list(dm.predict_dataloader())
    assert [b["name"] for b in batches] == [["photo.jpg"], ["photo.png"], ["portrait"]]

    class PredictsClass1:  # the task's predict_step, with a model that predicts class 1 everywhere
        label_dtype = torch.uint8

        def __call__(self, images):
            return {"out": torch.stack([torch.zeros_like(images[:, 0]), torch.ones_like(images[:, 0])], dim=1)}

    writer, trainer = PredictMasks(), SimpleNamespace(datamodule=dm, default_root_dir=tmp_path / "run")
    for k, batch in enumerate(batches):
        labels = SegmentationTask.predict_step(PredictsClass1(), batch, k)
        writer.write_on_batch_end(trainer, None, labels, None, batch, k, 0)
    out = tmp_path / "run" / "predictions" / "predict"
    sizes = {p.name: Image.open(p).size for p in (out / "masks").iterdir()}
    assert sizes == {"photo.jpg.png": (10, 8), "photo.png.png": (4, 6), "portrait.png": (16, 24)}  # upright
    assert sorted(p.name for p in (out / "overlays").iterdir()) == [
        "photo.jpg.jpg", "photo.png.jpg", "portrait.jpg"]


def test_segmentation_layout_of_the_other_dataset_is_named(tmp_path):
    ade = tmp_path / "ADEChallengeData2016"
    for split in ("training", "validation"):
        write_image(ade / "images" / split / "a.jpg")
        (ade / "annotations" / split).mkdir(parents=True)
        Image.fromarray(np.ones((8, 8), np.uint8)).save(ade / "annotations" / split / "a.png")
    with pytest.raises(FileNotFoundError, match=r"looks like ADE20k .*: pass --data\.dataset ade20k"):
        segment(ade).setup("fit")  # the default dataset is voc
    segment(ade, dataset="ade20k").setup("fit")

    root = voc(tmp_path / "VOCdevkit" / "VOC2012")
    with pytest.raises(FileNotFoundError, match=r"looks like PASCAL VOC .*: pass --data\.dataset voc"):
        segment(root, dataset="ade20k").setup("fit")
    with pytest.raises(FileNotFoundError, match=r"data\.root should be the VOC2012 folder itself: --data\.root "
                                                 f"{tmp_path / 'VOCdevkit' / 'VOC2012'}"):
        segment(tmp_path / "VOCdevkit").setup("fit")


# -- 9. symbolic-link loops in a class folder or a split folder -------------------------------------------------
@pytest.mark.parametrize("on_bad_image", ["fail", "skip"])
def test_link_loops_in_a_class_folder_are_left_out_counted_and_named(tmp_path, on_bad_image):
    """A link loop made the lister's bare ``OSError: Too many levels of symbolic links`` stop every run."""
    root = imagefolder(tmp_path / "data")
    (root / "train" / "a" / "loop.jpg").symlink_to("loop.jpg")  # named like an image: the lister's fast path
    (root / "train" / "b" / "ping").symlink_to("pong")
    (root / "train" / "b" / "pong").symlink_to("ping")
    dm = classify(root, on_bad_image=on_bad_image)
    with pytest.warns(UserWarning) as caught:
        dm.setup("fit")
    assert len(dm.train_set) == 4 and len(next(iter(dm.train_dataloader()))["image"]) == 4
    (message,) = [str(w.message) for w in caught if "left out" in str(w.message)]
    assert message.startswith(f"left out 3 entries of {root / 'train'} that are not read as images: 3 link loops (")
    assert all(name in message for name in ("a/loop.jpg", "b/ping", "b/pong"))


def test_link_loop_or_broken_link_in_a_split_folder_is_named(tmp_path):
    """In the split folder a dead link may be a class whose folder is gone: that class would vanish."""
    root = imagefolder(tmp_path / "data")
    loop = root / "val" / "c"
    loop.symlink_to("c")
    with pytest.raises(FileNotFoundError, match=rf"{loop} in the split folder {root / 'val'} is a link loop \(-> c\): "
                                                "a class folder whose target is gone"):
        classify(root).setup("validate")
    loop.unlink()
    gone = root / "val" / "c"
    gone.symlink_to(tmp_path / "elsewhere" / "c")
    with pytest.raises(FileNotFoundError, match=rf"{gone} in the split folder .* is a broken link"):
        classify(root).setup("validate")


# -- 10. decompression bombs: more pixels than PIL's limit are refused before decoding ------------------------
def png_header(width: int, height: int) -> bytes:
    """The start of a PNG declaring ``width`` x ``height`` 8-bit gray pixels (its pixel data cut off)."""
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))


def test_a_png_declaring_twenty_thousand_squared_pixels_names_the_file_and_the_limit(tmp_path):
    """The issue's 388 KB PNG of 20000x20000 pixels (3 GB decoded) is refused from its header at PIL's default limit."""
    from datamodules.images import read_rgb

    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_header(20000, 20000) + bytes(1000))
    with pytest.raises(BadImageError, match=rf"cannot read image {bomb}: it is 20000x20000 = 400,000,000 pixels "
                                            r"\(1.1 GiB decoded\), over the limit of 178,956,970 pixels \(twice "
                                            r"PIL.Image.MAX_IMAGE_PIXELS"):
        read_rgb(bomb)


@pytest.mark.parametrize("suffix", [".png", ".jpg", ".webp"])
@pytest.mark.parametrize("on_bad_image", ["fail", "skip"])
def test_images_over_the_pixel_limit_fail_naming_file_and_limit_or_are_skipped_and_counted(tmp_path, monkeypatch,
                                                                                          suffix, on_bad_image):
    """A real image over a lowered limit goes through the datamodule's reader: an error naming it and the
    limit, or under ``skip`` a counted skip; images under the limit are read as any other."""
    import PIL.Image

    root = imagefolder(tmp_path / "data")
    big = write_image((root / "val" / "b" / "big").with_suffix(suffix), size=(40, 50))
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 900)  # limit 1,800 pixels: 8x8 passes, 50x40 does not
    dm = classify(root, on_bad_image=on_bad_image)
    dm.setup("validate")
    if on_bad_image == "fail":
        with pytest.raises(BadImageError, match=rf"{big}: it is 50x40 = 2,000 pixels .*over the limit of 1,800 pixels"):
            list(dm.val_dataloader())
        return
    batches = list(dm.val_dataloader())  # [a/0, a/1, b/0, b/1], [b/big]: the second is only its count
    assert [b["skipped"] for b in batches] == [0, 1] and batches[1] == {"skipped": 1}
    assert len(batches[0]["image"]) == 4
