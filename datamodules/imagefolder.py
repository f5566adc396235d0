"""ImageNet-layout classification data: ``root/{train,val,test}/<class>/<image>``.

With no ``root`` the datamodule writes scikit-learn's handwritten digits once into
the demo cache in exactly that layout and reads them with the same code.

Images are read by :func:`datamodules.images.read_rgb` (one decoder for every vision
datamodule, 16-bit PNGs scaled, errors naming the file). Batches are dicts:

- train / val / test: ``{"image": (B, 3, S, S) float, "target": (B,) int64 (or (B, K) soft
  labels under MixUp/CutMix), "index": (B,) int64, "path": list[str] (relative to ``root``,
  posix), "skipped": int}``;
- training batches with ``normalize_on_device`` (the default) leave the loader with ``"image"``
  (B, 3, S, S) uint8, plus ``"erase"`` (B, 4) and ``"mix"`` when erasing and MixUp/CutMix are on;
  the datamodule's ``on_after_batch_transfer`` turns them into the float batch above on the device
  (:func:`datamodules.classification_transforms.finish_on_device`), so a training step sees the same;
- predict: ``{"image", "index", "path": list[str] (the file as given or listed), "skipped"}``.
"""
from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2

from datamodules.demo import demo_root
from datamodules.images import (
    IMAGE_EXTENSIONS,
    OnBadImage,
    SkippedFiles,
    collate_skipping,
    entry_kind,
    guarded,
    is_regular_file,
    predict_images,
    read_rgb,
)
from datamodules.classification_transforms import MixCollate, finish_on_device, normalize, train_transform
from datamodules.input_spec import InputSpec, classification_spec, normalization
from datamodules.loaders import (SplitLoaders, StreamedSource, check_positive_counts, check_repeated_augmentation,
                                 make_loader)
from datamodules.resolution import ProgressiveResizing, VariableResolution, check_schedules, resolution_loader, \
    resolution_plan
from datamodules.prepared import StringTable, folder_signature, prepare
from layers.machine import AUTO, NumWorkers


def class_folders(split_dir: Path) -> list[str]:
    """Sorted names of the class sub-folders of a split; hidden folders (``.ipynb_checkpoints``,
    ``.git``) are tool droppings, not classes. A link that leads nowhere (broken, or a loop) is an
    error naming it: it may be a class folder whose target is gone, and that class would vanish."""
    names = []
    with os.scandir(split_dir) as entries:  # the entries' types come with the listing: no stat per folder
        for entry in entries:
            if entry.name.startswith("."):
                continue
            kind = entry_kind(entry)
            if kind == "folder":
                names.append(entry.name)
            elif kind in ("broken link", "link loop"):
                raise FileNotFoundError(f"{entry.path} in the split folder {split_dir} is a {kind} "
                                        f"(-> {os.readlink(entry.path)}): a class folder whose target is gone? "
                                        "Fix the link, or remove it")
    return sorted(names)


def _images_below(folder: Path) -> list[Path]:
    """The image files anywhere under ``folder`` (hidden entries left out), sorted; links to folders are not
    followed (a loop would never end)."""
    found = []
    for parent, folders, files in os.walk(folder):
        folders[:] = sorted(f for f in folders if not f.startswith("."))
        found += [Path(parent) / f for f in sorted(files)
                  if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS]
    return found


def _checked_classes(split_dir: Path, classes: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """(class folders found in ``split_dir``, the label order): errors for a missing split, no class
    folders, or folders unknown to the training classes."""
    if not split_dir.is_dir():
        raise FileNotFoundError(f"expected a split folder {split_dir} holding one sub-folder per class")
    found = class_folders(split_dir)
    if not found:
        raise FileNotFoundError(f"{split_dir} has no class sub-folders (ImageFolder layout: {split_dir}/<class>/<image>)")
    classes = list(found if classes is None else classes)
    known = set(classes)
    unknown = [name for name in found if name not in known]
    if unknown:
        raise ValueError(f"{split_dir} has class folders unknown to the training split: {unknown[:10]} "
                         f"({len(unknown)} in all); the training split defines the {len(classes)} classes")
    return found, classes


def _image_names(folder: Path, skipped: SkippedFiles) -> list[str]:
    """Sorted names of the image files directly in ``folder``, read from the directory entries alone
    (no ``stat`` per file: the entry's type comes with the listing). Entries left out are counted in
    ``skipped``; hidden files are not data and are not counted. The images inside a sub-folder are not read
    (the layout is ``<class>/<image>``) and are counted, so none is left out without a word (torchvision's
    ImageFolder would read them)."""
    names = []
    with os.scandir(folder) as entries:
        for entry in entries:
            name = entry.name
            if name.startswith("."):
                continue
            # the common case first, in two string tests and a type the listing already holds
            if name.lower().endswith(IMAGE_EXTENSIONS) and is_regular_file(entry):
                names.append(name)
                continue
            kind = entry_kind(entry)  # what it is instead, or why it is left out
            if kind == "image":
                names.append(name)
            elif kind == "folder":
                for image in _images_below(Path(entry.path)):
                    skipped.add("image in a sub-folder", image)
            else:
                skipped.add(kind, Path(entry.path))
    return sorted(names)


def _list_split(split_dir: Path, found: list[str], classes: list[str]) -> tuple[list[str], np.ndarray, SkippedFiles]:
    """The images of a split: (paths relative to the split folder, labels, what was left out)."""
    label_of = {name: i for i, name in enumerate(classes)}
    paths, labels = [], []
    skipped = SkippedFiles()
    for name in found:
        files = _image_names(split_dir / name, skipped)
        if not files:
            nested = _images_below(split_dir / name)
            first = nested[0].relative_to(split_dir).as_posix() if nested else ""
            where = (f"; {len(nested)} image file(s) lie in sub-folders of it ({first}{', ...' if len(nested) > 1 else ''}"
                     "): the layout is <split>/<class>/<image>") if nested else ""
            raise ValueError(f"class folder {split_dir / name} holds no images (extensions {IMAGE_EXTENSIONS}){where}")
        paths += [f"{name}/{f}" for f in files]
        labels += [label_of[name]] * len(files)
    return paths, np.asarray(labels, dtype=np.int32), skipped


def scan_split(split_dir: Path, classes: Sequence[str] | None = None) -> tuple[list[tuple[Path, int]], list[str]]:
    """List ``(image path, label)`` pairs of one split folder by reading the folder now (the direct
    read; :func:`index_split` gives the same samples from a prepared index).

    ``classes`` (the training classes, sorted) fixes the label of each folder name, so a
    validation split missing a class never shifts the labels of the others. A class
    folder unknown to training, or with no images, is an error. Hidden folders and files
    are ignored; other files, broken links and unreadable entries are counted and named once
    (:class:`datamodules.images.SkippedFiles`).
    """
    found, classes = _checked_classes(split_dir, classes)
    paths, labels, skipped = _list_split(split_dir, found, classes)
    skipped.report(split_dir)
    return [(split_dir / p, int(label)) for p, label in zip(paths, labels)], classes


class SplitIndex:
    """The samples of one split as flat arrays: ``len``, ``path(i) -> Path``, ``labels`` (N,) int32.
    Loader workers share these pages instead of copying a list of Python objects on read."""

    def __init__(self, split_dir: Path, paths: StringTable, labels: np.ndarray):
        self.split_dir, self.paths, self.labels = split_dir, paths, labels

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, index: int) -> Path:
        return self.split_dir / self.paths[index]

    def files(self) -> list[Path]:
        return [self.path(i) for i in range(len(self))]


def index_split(split_dir: Path, classes: Sequence[str] | None = None,
                prepared_dir: str | None = None) -> tuple[SplitIndex, list[str]]:
    """:func:`scan_split` through a prepared index (:mod:`datamodules.prepared`): the first start lists
    the folder and writes the index, later starts and other ranks map it. The index is rebuilt when a
    class folder's modification time changes (a file added, removed or renamed in it)."""
    found, classes = _checked_classes(split_dir, classes)

    def build():
        paths, labels, skipped = _list_split(split_dir, found, classes)
        data, offsets = StringTable.encode(paths)
        left_out = {"counts": dict(skipped.counts),
                    "examples": {reason: [str(p) for p in shown] for reason, shown in skipped.examples.items()}}
        return {"paths": data, "path_offsets": offsets, "labels": labels}, {"skipped": left_out}

    fingerprint = {"classes": classes, "extensions": IMAGE_EXTENSIONS,
                   "folders": folder_signature(split_dir / name for name in found)}
    index = prepare("imagefolder", split_dir, fingerprint, build, prepared_dir)
    skipped = SkippedFiles()  # what the listing left out, told on every start as on the first
    skipped.counts.update(index.meta["skipped"]["counts"])
    skipped.examples = {reason: [Path(p) for p in shown] for reason, shown in index.meta["skipped"]["examples"].items()}
    skipped.report(split_dir)
    return SplitIndex(split_dir, StringTable(index["paths"], index["path_offsets"]), index["labels"]), classes


def labelled_item(image: torch.Tensor, sample: dict, transform) -> dict:
    """(3, H, W) uint8 image + its ``sample`` (``index``, ``target``, ``path``) -> the dataset item.
    Shared by the folder and the streamed datasets, so both give the same items. A transform that
    returns a dict (the image and what the device applies later) gives the item its keys."""
    out = transform(image)
    fields = out if isinstance(out, dict) else {"image": out}
    return {**fields, "target": sample["target"], "index": sample["index"], "path": sample["path"]}


def streamed_labelled_item(sample: dict, where: str, transform, on_bad_image: OnBadImage) -> dict | None:
    """A sample stored by ``datamodules.optimize`` -> the item of :class:`ImageFolderDataset`."""
    from datamodules.streaming import decode_rgb

    image = guarded(lambda: decode_rgb(sample["image"], where), where, on_bad_image)
    return None if image is None else labelled_item(image, sample, transform)


def streamed_image_item(sample: dict, where: str, transform, on_bad_image: OnBadImage) -> dict | None:
    """A stored sample -> a ``predict`` item (:class:`ImageFileDataset`'s keys), its label left out."""
    item = streamed_labelled_item(sample, where, transform, on_bad_image)
    return None if item is None else {key: item[key] for key in ("image", "index", "path")}


class ImageFolderDataset(Dataset):
    """Labelled images. Items are dicts ``{"image": (3, S, S) float, "target": int, "index": int,
    "path": str}`` with ``path`` relative to ``root`` (posix), as the predictions file names it.

    ``on_bad_image="skip"`` returns ``None`` for an unreadable file (logged with its path);
    :func:`collate_skipping` drops it and counts it in ``batch["skipped"]``.
    """

    def __init__(self, samples: SplitIndex, transform, on_bad_image: OnBadImage = "fail", root: Path | None = None):
        self.samples = samples
        self.transform = transform
        self.on_bad_image = on_bad_image
        self.prefix = samples.split_dir if root is None else samples.split_dir.relative_to(root)

    def __len__(self) -> int:
        return len(self.samples)

    def relative_path(self, index: int) -> str:
        return (self.prefix / self.samples.paths[index]).as_posix()

    def __getitem__(self, index: int) -> dict | None:
        return self.item(index, self.transform)

    def item(self, index: int, transform) -> dict | None:
        """Item ``index`` with its image through ``transform`` (a resolution schedule's crop size:
        :mod:`datamodules.resolution`)."""
        path, target = self.samples.path(index), int(self.samples.labels[index])
        image = guarded(lambda: read_rgb(path), path, self.on_bad_image)
        if image is None:
            return None
        return labelled_item(image, {"index": index, "target": target, "path": self.relative_path(index)}, transform)

    def stored_sample(self, index: int) -> dict:
        """What ``python -m datamodules.optimize`` stores for sample ``index``: the file's bytes as they are."""
        return {"index": index, "image": self.samples.path(index).read_bytes(),
                "target": int(self.samples.labels[index]), "path": self.relative_path(index)}


class ImageFileDataset(Dataset):
    """Unlabelled images for ``predict``. Items are dicts ``{"image": (3, S, S) float, "index": int,
    "path": str}`` with ``path`` the file as given or listed; unreadable files as in
    :class:`ImageFolderDataset`."""

    def __init__(self, files: list[Path], transform, on_bad_image: OnBadImage = "fail"):
        self.files = files
        self.transform = transform
        self.on_bad_image = on_bad_image

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict | None:
        path = self.files[index]
        image = guarded(lambda: read_rgb(path), path, self.on_bad_image)
        if image is None:
            return None
        return {"image": self.transform(image), "index": index, "path": str(path)}


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


class ImageFolderDataModule(SplitLoaders, StreamedSource, LightningDataModule):
    """Classification data in ImageNet/ImageFolder layout.

    Args:
        root: folder holding ``train/``, ``val/`` and optionally ``test/`` (each ``<class>/<image>``);
            ``None`` builds and uses the embedded digits demo.
        image_size: training crop and evaluation center-crop size.
        eval_resize: short side before the evaluation center crop (default ``image_size / 0.875``).
        scale: RandomResizedCrop area range. hflip: flip probability.
        rand_augment: RandAugment (2 ops, ``rand_augment_magnitude``). random_erasing: probability.
        mixup_alpha, cutmix_alpha: batch mixing (0 disables); targets become soft labels.
        weights: the weights the network starts from, registered (``backbones/pretrained.py``) or a checkpoint
            file; the CLI links the model's ``weights`` or its backbone's ``pretrained`` here. Its entry, or the
            input specification the checkpoint stores, gives ``mean`` and ``std``.
        mean, std: normalisation of [0, 1] pixels; ``None`` takes the weights' (ImageNet's without weights).
            ``hparams.mean`` / ``hparams.std`` hold the values used.
        on_bad_image: ``"fail"`` names the unreadable file and stops; ``"skip"`` skips and counts it
            (``batch["skipped"]``).
        predict_path: one image file, or a folder of images for ``predict``: a plain folder or a
            labelled one (``<class>/<image>``), sub-folders included, hidden files and folders left
            out; ``root`` is then not read. Default: the test split's images.
        streaming_root: a folder or object-store URL written by ``python -m datamodules.optimize --task
            classify``; the splits (same names) are then streamed with LitData and ``root`` is not read
            (:mod:`datamodules.streaming`).
        prepared_dir: where the splits' prepared file lists are kept (:mod:`datamodules.prepared`;
            default ``$SUITE_PREPARED_DIR`` or the suite's data cache). The first start lists each
            split once; later starts and the other ranks map that list.
        repeated_augmentation: repeated augmentation (DeiT's ``RASampler``, timm's ``--aug-repeats``): each
            training image this many times an epoch, each copy under its own augmentation, the epoch still
            about the dataset's size (:class:`datamodules.loaders.RepeatedAugmentationSampler`); 1: off.
        variable_resolution: each training batch cropped at its own size with the batch size that keeps pixels
            per batch near ``image_size`` x ``image_size`` x ``batch_size`` (CVNets' variable-batch sampler,
            :class:`datamodules.resolution.VariableResolution`); evaluation stays at ``image_size``.
        progressive_resizing: training crops growing from a fraction of ``image_size`` to all of it over training
            (Composer's schedule, :class:`datamodules.resolution.ProgressiveResizing`); evaluation stays at
            ``image_size``.
        normalize_on_device: training batches leave the workers as uint8 (a quarter of float32's bytes through
            shared memory, pinning and the copy to the accelerator) and are turned to float, normalised, erased and
            mixed on the device after the transfer, with the same random draws and values (to float rounding).
            ``False``: all of it in the workers, as evaluation batches are.

    Batches: see the module docstring.
    """

    #: what ``datamodules.optimize`` converts this datamodule's data for (the manifest's task and layout)
    streaming_task, streaming_layout = "classify", "imagefolder"

    def __init__(self, root: str | None = None, train_dir: str = "train", val_dir: str = "val",
                 test_dir: str = "test", image_size: int = 224, eval_resize: int | None = None,
                 scale: tuple[float, float] = (0.08, 1.0), hflip: float = 0.5, rand_augment: bool = False,
                 rand_augment_magnitude: int = 9, random_erasing: float = 0.0, mixup_alpha: float = 0.0,
                 cutmix_alpha: float = 0.0, weights: str | None = None,
                 mean: tuple[float, float, float] | None = None, std: tuple[float, float, float] | None = None,
                 interpolation: str = "bilinear",
                 batch_size: int = 128, eval_batch_size: int | None = None, num_workers: NumWorkers = AUTO,
                 pin_memory: bool = True, persistent_workers: bool = True,
                 on_bad_image: Literal["fail", "skip"] = "fail", predict_path: str | None = None,
                 streaming_root: str | None = None, prepared_dir: str | None = None,
                 repeated_augmentation: int = 1, variable_resolution: VariableResolution | None = None,
                 progressive_resizing: ProgressiveResizing | None = None, normalize_on_device: bool = True):
        super().__init__()
        if on_bad_image not in ("fail", "skip"):
            raise ValueError(f"on_bad_image must be 'fail' or 'skip', got {on_bad_image!r}")
        check_repeated_augmentation(repeated_augmentation)
        check_schedules(variable_resolution, progressive_resizing, repeated_augmentation, streaming_root is not None)
        self.save_hyperparameters()
        check_positive_counts(batch_size=batch_size, eval_batch_size=eval_batch_size)
        self.hparams.mean, self.hparams.std = normalization(weights, mean, std)
        self._root = Path(root).expanduser() if root else None
        self._classes: list[str] | None = None
        self._streamed = None


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
        """Class folder names of the training split, sorted (hidden folders left out); label i is ``classes[i]``."""
        if self._classes is None and self.streamed is not None:
            self._classes = list(self.streamed.data["classes"])
        if self._classes is None:
            train = self.root / self.hparams.train_dir
            self._classes = class_folders(train)
            if not self._classes:
                raise FileNotFoundError(f"{train} has no class sub-folders")
        return self._classes

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_spec(self) -> InputSpec:
        """How images enter the network at evaluation (:mod:`datamodules.input_spec`); the task keeps it
        in its checkpoint."""
        return classification_spec(self.hparams)

    def _eval_transform(self) -> v2.Compose:
        return self.input_spec.eval_transform()

    def _train_transform(self, size: int | tuple[int, int]) -> v2.Compose:
        h = self.hparams
        return train_transform(size, tuple(h.scale), h.hflip, h.rand_augment, h.rand_augment_magnitude,
                               h.random_erasing, h.mean, h.std, h.interpolation, on_device=h.normalize_on_device)

    def _dataset(self, split_dir: str, train: bool) -> ImageFolderDataset:
        h = self.hparams
        if train:
            transform = self._train_transform(h.image_size)
        else:
            transform = self._eval_transform()
        if self.streamed is not None:
            item = partial(streamed_labelled_item, transform=transform, on_bad_image=h.on_bad_image)
            return self.streamed.split(split_dir, item, train=train)
        return ImageFolderDataset(self.split_index(split_dir), transform, h.on_bad_image, root=self.root)

    def split_index(self, split_dir: str) -> SplitIndex:
        """The samples of a split folder, from its prepared index (:func:`index_split`)."""
        return index_split(self.root / split_dir, self.classes, self.hparams.prepared_dir)[0]

    @property
    def test_dir(self) -> str:
        """The split ``test`` scores: ``test_dir`` when ``root`` has that folder (labelled, in the
        ``<class>/<image>`` layout), else ``val_dir`` (ARCHITECTURE.md: what ``test`` scores)."""
        if self.streamed is not None:
            return self.hparams.test_dir if self.streamed.has_split(self.hparams.test_dir) else self.hparams.val_dir
        return self.hparams.test_dir if (self.root / self.hparams.test_dir).is_dir() else self.hparams.val_dir

    def _predict_dataset(self) -> ImageFileDataset:
        h = self.hparams
        if h.predict_path:  # only the given images: root (and the demo build) stay untouched
            # a plain folder of images, or a labelled one (<class>/<image>): both are searched whole
            files = predict_images(Path(h.predict_path), recursive=True)
        elif self.streamed is not None:
            item = partial(streamed_image_item, transform=self._eval_transform(), on_bad_image=h.on_bad_image)
            return self.streamed.split(self.test_dir, item)
        else:
            files = self.split_index(self.test_dir).files()
        return ImageFileDataset(files, self._eval_transform(), h.on_bad_image)

    # -- what python -m datamodules.optimize writes -----------------------------------------------------
    def streaming_sources(self, splits: Sequence[str] | None = None) -> dict[str, ImageFolderDataset]:
        """The splits to convert (default: train, val and test when present), each with ``stored_sample``."""
        h = self.hparams
        names = list(splits or [h.train_dir, h.val_dir] + ([h.test_dir] if (self.root / h.test_dir).is_dir() else []))
        return {name: ImageFolderDataset(self.split_index(name), None, root=self.root) for name in names}

    def streaming_info(self) -> dict:
        """What the model learns from the data, stored with the optimized dataset."""
        return {"classes": self.classes}

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.train_set = self._dataset(self.hparams.train_dir, train=True)
        if stage in ("fit", "validate"):
            self.val_set = self._dataset(self.hparams.val_dir, train=False)
        if stage == "test":
            self.test_set = self._dataset(self.test_dir, train=False)
        if stage == "predict":
            self.predict_set = self._predict_dataset()

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """A training batch that left the loader as uint8 (``normalize_on_device``) is finished where it now
        lies: float, normalised, erased, mixed (:func:`finish_on_device`)."""
        if isinstance(batch, dict) and batch.get("image") is not None and batch["image"].dtype == torch.uint8:
            device = batch["image"].device
            if getattr(self, "_device_stats", (None,))[0] != device:  # made once per device, not per step
                h = self.hparams
                # the float pipeline's own rule: no Normalize step for mean 0 and std 1
                stats = (None, None) if not normalize(h.mean, h.std) else (
                    torch.as_tensor(h.mean, dtype=torch.float32, device=device).view(-1, 1, 1),
                    torch.as_tensor(h.std, dtype=torch.float32, device=device).view(-1, 1, 1))
                self._device_stats = (device, *stats)
            batch = finish_on_device(batch, *self._device_stats[1:])
        return batch

    def _loader(self, dataset, train: bool):
        h = self.hparams
        collate = collate_skipping
        if train and (h.mixup_alpha > 0 or h.cutmix_alpha > 0):
            collate = MixCollate(self.num_classes, h.mixup_alpha, h.cutmix_alpha, on_device=h.normalize_on_device)
        batch_size = h.batch_size if train else (h.eval_batch_size or h.batch_size)
        plan = resolution_plan(h, self.trainer) if train else None
        if plan is not None:
            return resolution_loader(dataset, self._train_transform, plan, base_batch=h.batch_size, collate_fn=collate,
                                     num_workers=h.num_workers, pin_memory=h.pin_memory,
                                     persistent_workers=h.persistent_workers)
        return make_loader(dataset, batch_size=batch_size, num_workers=h.num_workers, train=train,
                           pin_memory=h.pin_memory, persistent_workers=h.persistent_workers, collate_fn=collate,
                           trainer=self.trainer if train else None, repeated_augmentation=h.repeated_augmentation)
