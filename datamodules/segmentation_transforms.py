"""Joint image/mask augmentation for semantic segmentation (albumentations 2.x).

Training follows the mmsegmentation/CVNets recipe: random short-side resize to
``crop_size`` times a factor in ``scale_range``, random crop (padding small images),
horizontal flip, photometric distortion, Gaussian blur and a small rotation.
Everything that creates new mask pixels (padding, rotation corners) fills them with
the ignore label, so they never count as background.

Albumentations 2 names the pad values ``fill`` (image) and ``fill_mask`` (mask). The
1.x names ``value``/``mask_value`` are ignored with only a warning, which would pad
masks with 0 = a real class; ``tests/test_segmentation_data.py`` checks the padding.

Evaluation resizes only the image (short side to ``eval_short_side``) and keeps the
mask at its original size: predictions are upsampled back and scored there.
"""
from __future__ import annotations

from typing import Sequence

import albumentations as A
import cv2
import numpy as np
from albumentations.pytorch import ToTensorV2

from backbones.pretrained import IMAGENET_MEAN, IMAGENET_STD

#: label of pixels that are not scored (VOC's object outlines, ADE20k's "other", padding)
IGNORE_INDEX = 255


def short_side_choices(crop_size: int, scale_range: Sequence[float], steps: int = 16) -> list[int]:
    """Short sides ``crop_size * s`` for ``steps`` evenly spaced ``s`` in ``scale_range`` (one drawn per image)."""
    low, high = float(scale_range[0]), float(scale_range[1])
    if not 0 < low <= high:
        raise ValueError(f"scale_range must satisfy 0 < low <= high, got {list(scale_range)}")
    return sorted({max(1, int(round(crop_size * s))) for s in np.linspace(low, high, steps)})


def train_transform(crop_size: int = 512, scale_range: Sequence[float] = (0.5, 2.0), hflip: float = 0.5,
                    photometric: float = 0.5, blur: float = 0.2, rotate_degrees: float = 10.0,
                    rotate_p: float = 0.5, mean: Sequence[float] = IMAGENET_MEAN,
                    std: Sequence[float] = IMAGENET_STD, ignore_index: int = IGNORE_INDEX) -> A.Compose:
    """``(image (H, W, 3) uint8, mask (H, W) uint8)`` -> ``image (3, crop, crop) float``, ``mask (crop, crop) uint8``."""
    steps: list[A.BasicTransform] = [
        A.SmallestMaxSize(max_size=short_side_choices(crop_size, scale_range), interpolation=cv2.INTER_LINEAR,
                          mask_interpolation=cv2.INTER_NEAREST),
        A.RandomCrop(crop_size, crop_size, pad_if_needed=True, pad_position="random",
                     border_mode=cv2.BORDER_CONSTANT, fill=0, fill_mask=ignore_index),
    ]
    if hflip > 0:
        steps.append(A.HorizontalFlip(p=hflip))
    if photometric > 0:
        # mmseg's PhotoMetricDistortion ranges: brightness +-32/255, contrast and saturation 0.5..1.5, hue +-18 deg
        steps.append(A.ColorJitter(brightness=(0.875, 1.125), contrast=(0.5, 1.5), saturation=(0.5, 1.5),
                                   hue=(-0.05, 0.05), p=photometric))
    if blur > 0:
        steps.append(A.GaussianBlur(sigma_limit=(0.1, 2.0), p=blur))
    if rotate_degrees > 0 and rotate_p > 0:
        steps.append(A.Rotate(limit=rotate_degrees, interpolation=cv2.INTER_LINEAR, mask_interpolation=cv2.INTER_NEAREST,
                              border_mode=cv2.BORDER_CONSTANT, fill=0, fill_mask=ignore_index, p=rotate_p))
    steps += [A.Normalize(mean=tuple(mean), std=tuple(std), max_pixel_value=255.0), ToTensorV2()]
    return A.Compose(steps)


def eval_transform(short_side: int | None, mean: Sequence[float] = IMAGENET_MEAN,
                   std: Sequence[float] = IMAGENET_STD) -> A.Compose:
    """Image only: ``(H, W, 3) uint8`` -> ``(3, h, w) float`` with ``min(h, w) == short_side`` (``None``: as is)."""
    steps: list[A.BasicTransform] = []
    if short_side:
        steps.append(A.SmallestMaxSize(max_size=int(short_side), interpolation=cv2.INTER_LINEAR))
    steps += [A.Normalize(mean=tuple(mean), std=tuple(std), max_pixel_value=255.0), ToTensorV2()]
    return A.Compose(steps)
