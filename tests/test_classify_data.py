from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from datamodules.imagefolder import ImageFolderDataModule, MixCollate, collate_skipping, scan_split


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
    with pytest.raises(RuntimeError, match=str(bad)):
        next(iter(dm.val_dataloader()))
    dm = ImageFolderDataModule(root=str(root), image_size=8, eval_resize=8, num_workers=0, batch_size=4,
                               on_bad_image="skip")
    dm.setup("validate")
    batch = next(iter(dm.val_dataloader()))
    assert batch["skipped"] == 1 and len(batch["target"]) == 3


def test_mixing_collate_yields_soft_targets():
    items = [{"image": torch.rand(3, 8, 8), "target": i % 4, "index": i} for i in range(6)]
    batch = MixCollate(num_classes=4, mixup_alpha=0.2, cutmix_alpha=1.0)(items + [None])
    assert batch["target"].shape == (6, 4) and batch["skipped"] == 1
    torch.testing.assert_close(batch["target"].sum(-1), torch.ones(6))
    assert collate_skipping([None])["skipped"] == 1


def test_imagenet_recipe_augmentation_runs_with_bicubic_crops():
    """The paper recipe crops bicubically and applies RandAugment, whose rotations and shears
    torchvision cannot do bicubically on tensors: every op must still run."""
    import yaml

    from datamodules.imagefolder import train_transform
    from tests.conftest import REPO

    data = yaml.safe_load((REPO / "configs/classify/imagenet_mobilevitv2_100.yaml").read_text())["data"]
    assert data["interpolation"] == "bicubic" and data["rand_augment"]
    transform = train_transform(64, tuple(data["scale"]), data["hflip"], True, 9, data["random_erasing"],
                                data["mean"], data["std"], data["interpolation"])
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8))
    torch.manual_seed(0)
    for _ in range(60):  # 2 ops of 14 per call: every op is drawn with near certainty
        assert transform(image).shape == (3, 64, 64)
