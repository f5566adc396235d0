"""Reading image files, once for every vision datamodule.

One decoder path (torchvision's libjpeg-turbo / libpng, PIL for the formats torchvision does
not decode), one list of image extensions, one rule for hidden files, one error that names
the file, and one lister of the images ``predict`` reads (:func:`predict_images`). 16-bit
images are scaled to 8 bits (``round(v / 257)``) instead of being clipped to white, as PIL's
``convert("RGB")`` does.

``on_bad_image`` is the same switch in every vision datamodule: ``"fail"`` stops at the first
unreadable file with :class:`BadImageError` naming it; ``"skip"`` makes the dataset return
``None`` for it, and :func:`collate_skipping` drops such items and counts them in the batch
(``batch["skipped"]``), which the task logs as ``data/skipped_images``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import torch
from torch.utils.data import default_collate

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

OnBadImage = Literal["fail", "skip"]


class BadImageError(RuntimeError):
    """An image file that cannot be decoded; the message names the file and the way out."""

    def __init__(self, path: Path | str, reason: str):
        self.path = Path(path)
        super().__init__(f"cannot read image {path}: {reason} "
                         "(set data.on_bad_image=skip to skip and count such files)")


def is_hidden(path: Path) -> bool:
    """Dot-files and dot-folders (``.ipynb_checkpoints``, ``.git``, macOS ``._x.jpg``) are never data."""
    return path.name.startswith(".")


def is_image_file(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS and not is_hidden(path) and path.is_file()


def list_images(folder: Path) -> list[Path]:
    """Image files directly inside ``folder``, sorted, hidden files left out."""
    return sorted(p for p in Path(folder).iterdir() if is_image_file(p))


def image_tree(folder: Path) -> list[Path]:
    """Image files in ``folder`` and its sub-folders, sorted; hidden files and folders left out."""
    files = list_images(folder)
    for sub in Path(folder).iterdir():
        if sub.is_dir() and not is_hidden(sub):
            files += image_tree(sub)
    return sorted(files)


def predict_images(path: Path | str, recursive: bool = False) -> list[Path]:
    """The images to predict on (``data.predict_path``): ``path`` itself if it is a file, else the
    image files in the folder ``path`` (sorted, hidden files left out), with those of its
    sub-folders if ``recursive``. A file that is not an image, a missing path, or a folder without
    images is an error naming ``data.predict_path``."""
    path = Path(path).expanduser()
    if path.is_file():
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            raise ValueError(f"data.predict_path={path} is not an image file "
                             f"(extensions {', '.join(IMAGE_EXTENSIONS)})")
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"data.predict_path={path} does not exist (give an image file or a folder of images)")
    images = image_tree(path) if recursive else list_images(path)
    if not images:
        where = "in it or its sub-folders" if recursive else "directly inside it (sub-folders are not searched)"
        raise FileNotFoundError(f"data.predict_path={path} holds no images {where} "
                                f"(extensions {', '.join(IMAGE_EXTENSIONS)})")
    return images


def _to_uint8(image: torch.Tensor) -> torch.Tensor:
    if image.dtype == torch.uint8:
        return image
    if image.dtype == torch.uint16:  # 16-bit PNG: 65535 -> 255
        return (image.to(torch.int32) * 255 + 32767).div(65535, rounding_mode="floor").to(torch.uint8)
    raise TypeError(f"unexpected decoded dtype {image.dtype}")


def _read_with_pil(path: Path) -> torch.Tensor:
    from PIL import Image

    with Image.open(path) as img:
        if img.mode in ("I;16", "I;16B", "I;16L", "I"):
            values = np.asarray(img, dtype=np.int64)
            peak = 65535 if img.mode.startswith("I;16") or values.max() > 255 else 255
            gray = np.clip(np.rint(values * (255.0 / peak)), 0, 255).astype(np.uint8)
            array = np.repeat(gray[..., None], 3, axis=2)
        else:
            array = np.asarray(img.convert("RGB"))
    return torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1)


def read_rgb(path: Path | str) -> torch.Tensor:
    """(3, H, W) uint8 RGB of an image file. Any decoding failure raises :class:`BadImageError`
    naming ``path``: a missing, empty, truncated or non-image file."""
    from torchvision.io import ImageReadMode, decode_image

    path = Path(path)
    if not path.is_file():
        raise BadImageError(path, "no such file")
    if path.stat().st_size == 0:
        raise BadImageError(path, "empty file (0 bytes)")
    try:
        return _to_uint8(decode_image(str(path), mode=ImageReadMode.RGB))
    except Exception:  # torchvision does not decode every format PIL knows (TIFF, PPM, ...)
        pass
    try:
        return _read_with_pil(path)
    except Exception as err:  # PIL raises several types for truncated or foreign files
        raise BadImageError(path, str(err) or type(err).__name__) from err


def read_rgb_array(path: Path | str) -> np.ndarray:
    """(H, W, 3) uint8 RGB, for pipelines working on numpy arrays (albumentations)."""
    return read_rgb(path).permute(1, 2, 0).numpy()


def guarded(read: Callable[[], object], path: Path | str, on_bad_image: OnBadImage):
    """Run ``read()``; an unreadable image returns ``None`` (logged with its path) under ``skip``."""
    try:
        return read()
    except BadImageError as err:
        if on_bad_image == "skip":
            log.warning("skipping %s", err)
            return None
        raise


def collate_skipping(batch: list, collate: Callable = default_collate):
    """Collate the items that are not ``None`` with ``collate`` and count the dropped ones.

    Dict batches get ``batch["skipped"]``; other batches are returned as they are, with the count
    in ``len(batch) - len(kept)`` left to the dataset's own collate. A batch whose items were all
    skipped is ``{"skipped": n}`` (tasks skip such a step)."""
    kept = [item for item in batch if item is not None]
    skipped = len(batch) - len(kept)
    if not kept:
        return {"skipped": skipped}
    out = collate(kept)
    if isinstance(out, dict):
        out["skipped"] = skipped
    return out
