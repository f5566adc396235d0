from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from datamodules.imagefolder import ImageFolderDataModule, MixCollate, scan_split
from datamodules.images import BadImageError, collate_skipping


def make_folder(root: Path, layout: dict[str, dict[str, int]]) -> Path:
    rng = np.random.default_rng(0)
    for split, classes in layout.items():
        for name, count in classes.items():
            d = root / split / name
            d.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(d / f"{i}.png")
    return root


def test_demo_digits_are_written_in_imagefolder_layout():
    dm = ImageFolderDataModule(image_size=32, eval_resize=32, num_workers=0)
    assert dm.num_classes == 10 and dm.classes[3] == "3_three"
    counts = {s: len(scan_split(dm.root / s, dm.classes)[0]) for s in ("train", "val", "test")}
    assert sum(counts.values()) == 1797  # every scikit-learn digit, each in exactly one split
    assert counts["val"] == counts["test"] and counts["train"] > 4 * counts["val"]
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    assert batch["image"].shape == (128, 3, 32, 32) and batch["skipped"] == 0
    assert set(batch) == {"image", "target", "index", "path", "skipped"}
    # paths are relative to root, posix, and name the item's class folder
    first = batch["path"][0]
    assert first.startswith("val/") and first.split("/")[1] == dm.classes[int(batch["target"][0])]


def test_missing_root_names_the_expected_layout(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"expected .*nowhere/train/<class>/<image>"):
        ImageFolderDataModule(root=str(tmp_path / "nowhere")).num_classes


def test_validation_class_unknown_to_train_is_an_error(tmp_path):
    root = make_folder(tmp_path, {"train": {"cat": 2, "dog": 2}, "val": {"cat": 1, "cow": 1}})
    dm = ImageFolderDataModule(root=str(root), image_size=8, eval_resize=8, num_workers=0)
    with pytest.raises(ValueError, match=r"unknown to the training split: \['cow'\]"):
        dm.setup("validate")


def test_validation_missing_a_class_keeps_labels_aligned(tmp_path):
    root = make_folder(tmp_path, {"train": {"a": 1, "b": 1, "c": 1}, "val": {"c": 2}})
    samples, classes = scan_split(root / "val", ["a", "b", "c"])
    assert classes == ["a", "b", "c"] and {label for _, label in samples} == {2}


def test_empty_class_folder_is_an_error(tmp_path):
    root = make_folder(tmp_path, {"train": {"a": 1, "b": 0}})
    with pytest.raises(ValueError, match=r"train/b holds no images"):
        scan_split(root / "train")


def test_corrupt_image_is_named_or_skipped_and_counted(tmp_path):
    root = make_folder(tmp_path, {"train": {"a": 2, "b": 2}, "val": {"a": 2, "b": 2}})
    bad = root / "val" / "b" / "1.png"
    bad.write_bytes(b"not a png")
    dm = ImageFolderDataModule(root=str(root), image_size=8, eval_resize=8, num_workers=0, batch_size=4)
    dm.setup("validate")
    with pytest.raises(BadImageError, match=str(bad)):
        next(iter(dm.val_dataloader()))
    dm = ImageFolderDataModule(root=str(root), image_size=8, eval_resize=8, num_workers=0, batch_size=4,
                               on_bad_image="skip")
    dm.setup("validate")
    batch = next(iter(dm.val_dataloader()))
    assert batch["skipped"] == 1 and len(batch["target"]) == 3 and "val/b/1.png" not in batch["path"]


def test_mixing_collate_yields_soft_targets():
    items = [{"image": torch.rand(3, 8, 8), "target": i % 4, "index": i} for i in range(6)]
    batch = MixCollate(num_classes=4, mixup_alpha=0.2, cutmix_alpha=1.0)(items + [None])
    assert batch["target"].shape == (6, 4) and batch["skipped"] == 1
    torch.testing.assert_close(batch["target"].sum(-1), torch.ones(6))
    assert collate_skipping([None]) == {"skipped": 1}
    assert MixCollate(num_classes=4, mixup_alpha=0.2, cutmix_alpha=0.0)([None, None]) == {"skipped": 2}


def test_imagenet_recipe_augmentation_runs_with_bicubic_crops():
    """The paper recipe crops bicubically and applies RandAugment, whose rotations and shears
    torchvision cannot do bicubically on tensors: every op must still run."""
    import yaml

    from datamodules.imagefolder import train_transform
    from tests.conftest import REPO

    data = yaml.safe_load((REPO / "configs/classify/imagenet_mobilevitv2_200.yaml").read_text())["data"]
    assert data["interpolation"] == "bicubic" and data["rand_augment"]
    transform = train_transform(64, tuple(data["scale"]), data["hflip"], True, 9, data["random_erasing"],
                                data["mean"], data["std"], data["interpolation"])
    # a (3, H, W) uint8 tensor, as read_rgb gives
    image = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, 48, 64), dtype=np.uint8))
    torch.manual_seed(0)
    for _ in range(60):  # 2 ops of 14 per call: every op is drawn with near certainty
        assert transform(image).shape == (3, 64, 64)


def test_tensor_pipeline_equals_the_former_pil_pipeline(tmp_path):
    """Reading with read_rgb and transforming the uint8 tensor gives exactly what PIL + PILToTensor
    gave: the resize, crop and normalisation ran on tensors before too."""
    from torchvision.transforms import v2

    from datamodules.classification_transforms import eval_transform, train_transform
    from datamodules.images import read_rgb

    path = tmp_path / "x.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 52, 3), dtype=np.uint8)).save(path)
    with Image.open(path) as img:
        pil = img.convert("RGB")
    tensor = read_rgb(path)
    evaluate = eval_transform(24, 28, (0.5, 0.4, 0.3), (0.2, 0.3, 0.4), "bilinear")
    torch.testing.assert_close(evaluate(tensor), v2.Compose([v2.PILToTensor(), evaluate])(pil), rtol=0, atol=0)
    train = train_transform(24, (0.3, 1.0), 0.5, False, 9, 0.0, (0.5, 0.4, 0.3), (0.2, 0.3, 0.4), "bicubic")
    torch.manual_seed(3)
    ours = train(tensor)
    torch.manual_seed(3)
    torch.testing.assert_close(ours, v2.Compose([v2.PILToTensor(), train])(pil), rtol=0, atol=0)


def test_predict_on_a_plain_folder_or_file_does_not_touch_root(tmp_path, monkeypatch):
    import datamodules.imagefolder as imagefolder

    def no_demo(*args, **kwargs):
        raise AssertionError("predict with predict_path must not build the demo dataset")

    monkeypatch.setattr(imagefolder, "demo_root", no_demo)
    folder = tmp_path / "imgs"
    folder.mkdir()
    for name in ("b.jpg", "a.png", ".hidden.png"):
        Image.fromarray(np.full((10, 14, 3), 90, np.uint8)).save(folder / name)
    (folder / "notes.txt").write_text("not an image")
    dm = ImageFolderDataModule(predict_path=str(folder), image_size=8, eval_resize=8, num_workers=0, batch_size=4)
    dm.setup("predict")
    batch = next(iter(dm.predict_dataloader()))
    assert set(batch) == {"image", "index", "path", "skipped"}
    assert batch["path"] == [str(folder / "a.png"), str(folder / "b.jpg")] and batch["image"].shape == (2, 3, 8, 8)
    assert batch["index"].tolist() == [0, 1] and batch["skipped"] == 0

    one = ImageFolderDataModule(predict_path=str(folder / "b.jpg"), image_size=8, eval_resize=8, num_workers=0)
    one.setup("predict")
    assert next(iter(one.predict_dataloader()))["path"] == [str(folder / "b.jpg")]


def test_predict_on_a_labelled_folder_reads_its_class_folders(tmp_path):
    root = make_folder(tmp_path / "data", {"val": {"a": 1, "b": 2}, "val/.ipynb_checkpoints": {"a": 1}})
    dm = ImageFolderDataModule(predict_path=str(root / "val"), image_size=8, eval_resize=8, num_workers=0,
                               batch_size=8)
    dm.setup("predict")
    batch = next(iter(dm.predict_dataloader()))
    assert batch["path"] == [str(root / "val" / p) for p in ("a/0.png", "b/0.png", "b/1.png")]


def test_predict_without_predict_path_reads_the_test_split(tmp_path):
    root = make_folder(tmp_path / "data", {"train": {"a": 1, "b": 1}, "val": {"a": 1}, "test": {"b": 2}})
    dm = ImageFolderDataModule(root=str(root), image_size=8, eval_resize=8, num_workers=0, batch_size=4)
    dm.setup("predict")
    batch = next(iter(dm.predict_dataloader()))
    assert batch["path"] == [str(root / "test" / "b" / "0.png"), str(root / "test" / "b" / "1.png")]


def test_bad_predict_path_is_named(tmp_path):
    for path, error in ((tmp_path / "missing", FileNotFoundError), (tmp_path, FileNotFoundError)):
        dm = ImageFolderDataModule(predict_path=str(path), num_workers=0)
        with pytest.raises(error, match=str(path)):
            dm.setup("predict")
    (tmp_path / "notes.txt").write_text("x")
    dm = ImageFolderDataModule(predict_path=str(tmp_path / "notes.txt"), num_workers=0)
    with pytest.raises(ValueError, match=r"notes\.txt is not an image file"):
        dm.setup("predict")
