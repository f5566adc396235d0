"""ImageNet-layout classification data: ``root/{train,val,test}/<class>/<image>``.

With no ``root`` the datamodule writes scikit-learn's handwritten digits once into
the demo cache in exactly that layout and reads them with the same code.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from PIL import Image
from torch.utils.data import Dataset, default_collate
from torchvision.transforms import v2

from datamodules.demo import demo_root
from datamodules.loaders import SplitLoaders, make_loader

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".JPEG")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def scan_split(split_dir: Path, classes: Sequence[str] | None = None) -> tuple[list[tuple[Path, int]], list[str]]:
    """List ``(image path, label)`` pairs of one split folder.

    ``classes`` (the training classes, sorted) fixes the label of each folder name, so a
    validation split missing a class never shifts the labels of the others. A class
    folder unknown to training, or with no images, is an error.
    """
    if not split_dir.is_dir():
        raise FileNotFoundError(f"expected a split folder {split_dir} holding one sub-folder per class")
    found = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
    if not found:
        raise FileNotFoundError(f"{split_dir} has no class sub-folders (ImageFolder layout: {split_dir}/<class>/<image>)")
    classes = list(found if classes is None else classes)
    index = {name: i for i, name in enumerate(classes)}
    unknown = [name for name in found if name not in index]
    if unknown:
        raise ValueError(f"{split_dir} has class folders unknown to the training split: {unknown[:10]} "
                         f"({len(unknown)} in all); the training split defines the {len(classes)} classes")
    samples = []
    for name in found:
        files = sorted(p for p in (split_dir / name).iterdir() if p.suffix in IMAGE_EXTENSIONS or
                       p.suffix.lower() in IMAGE_EXTENSIONS)
        if not files:
            raise ValueError(f"class folder {split_dir / name} holds no images (extensions {IMAGE_EXTENSIONS})")
        samples += [(f, index[name]) for f in files]
    return samples, classes


class ImageFolderDataset(Dataset):
    """Items are dicts ``{"image": (3, H, W) float, "target": int, "index": int}``.

    ``on_bad_image="skip"`` returns ``None`` for an unreadable file (logged with its path);
    the collate function drops it and counts it in ``batch["skipped"]``.
    """

    def __init__(self, samples: list[tuple[Path, int]], transform, on_bad_image: str = "fail"):
        self.samples = samples
        self.transform = transform
        self.on_bad_image = on_bad_image

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        try:
            with Image.open(path) as img:
                image = img.convert("RGB")
        except Exception as err:  # PIL raises several types for truncated/corrupt files
            if self.on_bad_image == "skip":
                log.warning("skipping unreadable image %s: %s", path, err)
                return None
            raise RuntimeError(f"cannot read image {path}: {err} "
                               "(set data.on_bad_image=skip to skip and count such files)") from err
        return {"image": self.transform(image), "target": target, "index": index}


def collate_skipping(batch: list) -> dict:
    """Collate dict items, dropping ``None`` (skipped images) and counting them."""
    kept = [item for item in batch if item is not None]
    out = default_collate(kept) if kept else {}
    out["skipped"] = len(batch) - len(kept)
    return out


class MixCollate:
    """Collate, then apply MixUp or CutMix (one chosen per batch) to images and targets.
    Targets become soft ``(B, num_classes)`` probabilities."""

    def __init__(self, num_classes: int, mixup_alpha: float, cutmix_alpha: float):
        choices = []
        if mixup_alpha > 0:
            choices.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
        if cutmix_alpha > 0:
            choices.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
        self.mix = v2.RandomChoice(choices)

    def __call__(self, batch: list) -> dict:
        out = collate_skipping(batch)
        if "image" in out:
            out["image"], out["target"] = self.mix(out["image"], out["target"])
        return out


def train_transform(image_size: int, scale: tuple[float, float], hflip: float, rand_augment: bool,
                    rand_augment_magnitude: int, random_erasing: float, mean, std, interpolation: str) -> v2.Compose:
    interp = v2.InterpolationMode(interpolation)
    steps = [v2.PILToTensor(), v2.RandomResizedCrop(image_size, scale=scale, interpolation=interp, antialias=True)]
    if hflip > 0:
        steps.append(v2.RandomHorizontalFlip(hflip))
    if rand_augment:
        # its rotations and shears run on tensors, which torchvision warps only with nearest or
        # bilinear sampling: bicubic (the recipes' crop interpolation) would fail on those ops
        steps.append(v2.RandAugment(magnitude=rand_augment_magnitude, interpolation=v2.InterpolationMode.BILINEAR))
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    if random_erasing > 0:
        steps.append(v2.RandomErasing(p=random_erasing, value=0))
    return v2.Compose(steps)


def eval_transform(image_size: int, resize_size: int, mean, std, interpolation: str) -> v2.Compose:
    """Resize the short side to ``resize_size``, then center-crop ``image_size``."""
    interp = v2.InterpolationMode(interpolation)
    return v2.Compose([v2.PILToTensor(), v2.Resize(resize_size, interpolation=interp, antialias=True),
                       v2.CenterCrop(image_size), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def build_digits_imagefolder(root: Path, size: int = 32, seed: int = 0) -> None:
    """Write scikit-learn's 1,797 handwritten digits as ``root/{train,val,test}/<digit>/*.png``
    (70/15/15, stratified, deterministic), upsampled from 8x8 to ``size`` pixels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    for digit in range(10):
        idx = rng.permutation(np.flatnonzero(digits.target == digit))
        n_val = n_test = round(0.15 * len(idx))
        splits = {"test": idx[:n_test], "val": idx[n_test:n_test + n_val], "train": idx[n_test + n_val:]}
        for split, members in splits.items():
            folder = root / split / f"{digit}_{names[digit]}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in members:
                pixels = (digits.images[i] * (255.0 / 16.0)).astype(np.uint8)
                img = Image.fromarray(255 - pixels).resize((size, size), Image.BICUBIC).convert("RGB")
                img.save(folder / f"digit_{i:04d}.png")


class ImageFolderDataModule(SplitLoaders, LightningDataModule):
    """Classification data in ImageNet/ImageFolder layout.

    Args:
        root: folder holding ``train/``, ``val/`` and optionally ``test/`` (each ``<class>/<image>``);
            ``None`` builds and uses the embedded digits demo.
        image_size: training crop and evaluation center-crop size.
        eval_resize: short side before the evaluation center crop (default ``image_size / 0.875``).
        scale: RandomResizedCrop area range. hflip: flip probability.
        rand_augment: RandAugment (2 ops, ``rand_augment_magnitude``). random_erasing: probability.
        mixup_alpha, cutmix_alpha: batch mixing (0 disables); targets become soft labels.
        mean, std: normalisation (MobileViT/CVNets checkpoints expect 0/1, i.e. none).
        on_bad_image: ``"fail"`` names the unreadable file and stops; ``"skip"`` skips and counts it.
    """

    def __init__(self, root: str | None = None, train_dir: str = "train", val_dir: str = "val",
                 test_dir: str = "test", image_size: int = 224, eval_resize: int | None = None,
                 scale: tuple[float, float] = (0.08, 1.0), hflip: float = 0.5, rand_augment: bool = False,
                 rand_augment_magnitude: int = 9, random_erasing: float = 0.0, mixup_alpha: float = 0.0,
                 cutmix_alpha: float = 0.0, mean: tuple[float, float, float] = IMAGENET_MEAN,
                 std: tuple[float, float, float] = IMAGENET_STD, interpolation: str = "bilinear",
                 batch_size: int = 128, eval_batch_size: int | None = None, num_workers: int = 4,
                 pin_memory: bool = True, persistent_workers: bool = True,
                 on_bad_image: Literal["fail", "skip"] = "fail"):
        super().__init__()
        self.save_hyperparameters()
        self._root = Path(root).expanduser() if root else None
        self._classes: list[str] | None = None

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = demo_root("digits-imagefolder", build_digits_imagefolder, version=1)
        if not (self._root / self.hparams.train_dir).is_dir():
            raise FileNotFoundError(
                f"data.root={self._root} does not look like an ImageFolder dataset: expected "
                f"{self._root / self.hparams.train_dir}/<class>/<image> and {self._root / self.hparams.val_dir}/<class>/<image>")
        return self._root

    @property
    def classes(self) -> list[str]:
        """Class folder names of the training split, sorted; label i is ``classes[i]``."""
        if self._classes is None:
            train = self.root / self.hparams.train_dir
            self._classes = sorted(d.name for d in train.iterdir() if d.is_dir())
            if not self._classes:
                raise FileNotFoundError(f"{train} has no class sub-folders")
        return self._classes

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def _dataset(self, split_dir: str, train: bool) -> ImageFolderDataset:
        h = self.hparams
        samples, _ = scan_split(self.root / split_dir, self.classes)
        if train:
            transform = train_transform(h.image_size, tuple(h.scale), h.hflip, h.rand_augment,
                                        h.rand_augment_magnitude, h.random_erasing, h.mean, h.std, h.interpolation)
        else:
            resize = h.eval_resize or int(round(h.image_size / 0.875))
            transform = eval_transform(h.image_size, resize, h.mean, h.std, h.interpolation)
        dataset = ImageFolderDataset(samples, transform, h.on_bad_image)
        dataset.root = self.root
        return dataset

    @property
    def test_dir(self) -> str:
        """The labelled test split when the layout has one, else the validation split (DESIGN.md)."""
        return self.hparams.test_dir if (self.root / self.hparams.test_dir).is_dir() else self.hparams.val_dir

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.train_set = self._dataset(self.hparams.train_dir, train=True)
        if stage in ("fit", "validate"):
            self.val_set = self._dataset(self.hparams.val_dir, train=False)
        if stage in ("test", "predict"):
            self.test_set = self.predict_set = self._dataset(self.test_dir, train=False)

    def _loader(self, dataset, train: bool):
        h = self.hparams
        collate = collate_skipping
        if train and (h.mixup_alpha > 0 or h.cutmix_alpha > 0):
            collate = MixCollate(self.num_classes, h.mixup_alpha, h.cutmix_alpha)
        batch_size = h.batch_size if train else (h.eval_batch_size or h.batch_size)
        return make_loader(dataset, batch_size=batch_size, num_workers=h.num_workers, train=train,
                           pin_memory=h.pin_memory, persistent_workers=h.persistent_workers, collate_fn=collate,
                           trainer=self.trainer if train else None)

