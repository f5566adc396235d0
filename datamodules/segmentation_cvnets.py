"""CVNets' segmentation training augmentation, as the MobileViTv2 paper's VOC and ADE20k rows train.

Source: apple/ml-cvnets ``data/datasets/segmentation/base_segmentation.py`` (``_training_transforms``,
the order) and ``data/transforms/image_pil.py`` (each transform), with the ``image_augmentation``
section of ``config/segmentation/{pascal_voc,ade20k}/{deeplabv3,pspnet}_mobilevitv2.yaml``:

1. ``RandomShortSizeResize``: short side drawn uniformly from the integers ``[256, 768]``, the scale
   capped so the long side is at most ``max_img_dim = 1024``; sizes truncated to int; bicubic for
   the image, nearest for the mask.
2. ``RandomHorizontalFlip``, p = 0.5.
3. ``RandomCrop`` 512 x 512 with ``pad_if_needed`` (pad right/bottom, image with 0, mask with the
   fill) and ``seg_class_max_ratio = 0.75``: :func:`class_ratio_crop_window`.
4. ``RandomGaussianBlur`` (enabled by the config key ``random_gaussian_noise``; CVNets adds no noise):
   p = 0.5, PIL ``GaussianBlur(radius=U(0, 1))``, the radius being the Gaussian's standard deviation.
5. ``PhotometricDistort``: brightness [0.875, 1.125], contrast [0.5, 1.5] before or after the colour
   changes, saturation [0.5, 1.5], hue [-0.05, 0.05], channel permutation, each with p = 0.5; this is
   exactly ``torchvision.transforms.v2.RandomPhotometricDistort``.
6. ``RandomRotate``: always applied, angle U(-10, 10) degrees, bilinear image filled with 0, nearest
   mask filled with the mask fill.
7. ``ToTensor``: pixels / 255 (CVNets does not normalise; pass mean 0, std 1 for that).

CVNets' mask fill is the value meaning "not scored" in its encoding (VOC 255, ADE20k 0 = "other",
which its loss ignores after the shift by one). Here masks are decoded to "labels 0..K-1, 255
ignored" before augmentation, so the fill is :data:`IGNORE_INDEX` for both datasets.

Randomness comes from torch only, under the seed given to :meth:`CvnetsTrainTransform.set_random_seed`
(the datamodule draws it per sample from the loader's per-sample RNG), so a sample's augmentation
is a function of its seed and resumed runs repeat it exactly.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from backbones.pretrained import IMAGENET_MEAN, IMAGENET_STD
from datamodules.segmentation_transforms import IGNORE_INDEX

#: windows ``RandomCrop.get_params_from_mask`` checks before it takes the next one unchecked
#: (``self.num_repeats = 10`` in CVNets' image_pil.py)
CROP_ATTEMPTS = 10


def short_side_resize_size(height: int, width: int, short_side: int, max_side: int) -> tuple[int, int]:
    """``(new_height, new_width)``: short side scaled to ``short_side`` unless that makes the long side
    exceed ``max_side``, then the long side to ``max_side``; truncated to int as CVNets does."""
    scale = min(short_side / min(height, width), max_side / max(height, width))
    return int(height * scale), int(width * scale)


def random_window(height: int, width: int, crop_h: int, crop_w: int) -> tuple[int, int]:
    """Top-left corner of a uniformly drawn ``crop_h`` x ``crop_w`` window (both ends inclusive)."""
    top = int(torch.randint(0, max(0, height - crop_h) + 1, ()))
    left = int(torch.randint(0, max(0, width - crop_w) + 1, ()))
    return top, left


def dominant_class_ratio(window: torch.Tensor, ignore_index: int | None) -> float | None:
    """Share of the most frequent label among the window's counted pixels (``ignore_index`` is not
    counted; ``None`` counts every value); ``None`` when no pixel is counted."""
    _, counts = torch.unique(window, return_counts=True) if ignore_index is None else \
        torch.unique(window[window != ignore_index], return_counts=True)
    if counts.numel() == 0:
        return None
    return float(counts.max()) / float(counts.sum())


def class_ratio_crop_window(labels: torch.Tensor, crop_h: int, crop_w: int, max_ratio: float,
                            ignore_index: int | None = IGNORE_INDEX,
                            attempts: int = CROP_ATTEMPTS) -> tuple[int, int, int]:
    """CVNets' ``RandomCrop`` with ``seg_class_max_ratio``: ``(top, left, windows_checked)``.

    ``labels`` is (H, W) with H >= ``crop_h`` and W >= ``crop_w`` (padded already). A window is drawn
    and checked up to ``attempts`` times: it is taken when its most frequent counted label covers
    strictly less than ``max_ratio`` of its counted pixels; a window with no counted pixel is taken as
    it is (CVNets ``continue``s without drawing a new one, so it keeps it). When every check fails,
    the window drawn after the last check is taken unchecked. ``ignore_index`` is the label left out
    of the counts (CVNets passes 255; on ADE20k, whose raw masks hold no 255, it counts every pixel,
    "other" and padding included: pass ``None`` for that)."""
    height, width = labels.shape[-2:]
    top, left = random_window(height, width, crop_h, crop_w)
    if max_ratio >= 1.0:  # CVNets checks only ratios below 1
        return top, left, 0
    for attempt in range(1, attempts + 1):
        ratio = dominant_class_ratio(labels[..., top:top + crop_h, left:left + crop_w], ignore_index)
        if ratio is None or ratio < max_ratio:
            return top, left, attempt
        top, left = random_window(height, width, crop_h, crop_w)
    return top, left, attempts


class RandomShortSideResize(v2.Transform):
    """Short side uniform in the integers ``short_side_range``, long side at most ``max_side``; bicubic
    (antialiased, as PIL resizes) for images, pixel-centre nearest (PIL's NEAREST) for masks."""

    def __init__(self, short_side_range: Sequence[int] = (256, 768), max_side: int = 1024):
        super().__init__()
        low, high = int(short_side_range[0]), int(short_side_range[1])
        if not 0 < low <= high:
            raise ValueError(f"short_side_range must satisfy 0 < min <= max, got {list(short_side_range)}")
        self.short_side_range, self.max_side = (low, high), int(max_side)

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        height, width = v2.query_size(flat_inputs)
        short_side = int(torch.randint(self.short_side_range[0], self.short_side_range[1] + 1, ()))
        return {"size": list(short_side_resize_size(height, width, short_side, self.max_side))}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        if isinstance(inpt, tv_tensors.Mask):
            return F.resize(inpt, params["size"], interpolation=v2.InterpolationMode.NEAREST_EXACT)
        return F.resize(inpt, params["size"], interpolation=v2.InterpolationMode.BICUBIC, antialias=True)


class ClassRatioCrop(v2.Transform):
    """Pad to at least ``size`` on the right and bottom (image with 0, mask with ``mask_fill``), then crop
    the window of :func:`class_ratio_crop_window`. Expects exactly one :class:`tv_tensors.Mask`."""

    def __init__(self, size: int, max_ratio: float = 0.75, ignore_index: int | None = IGNORE_INDEX,
                 mask_fill: int = IGNORE_INDEX, attempts: int = CROP_ATTEMPTS):
        super().__init__()
        self.size, self.max_ratio, self.ignore_index = int(size), float(max_ratio), ignore_index
        self.mask_fill, self.attempts = int(mask_fill), int(attempts)

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        height, width = v2.query_size(flat_inputs)
        masks = [inpt for inpt in flat_inputs if isinstance(inpt, tv_tensors.Mask)]
        if len(masks) != 1:
            raise ValueError(f"ClassRatioCrop needs exactly one tv_tensors.Mask, got {len(masks)}")
        padding = [0, 0, max(0, self.size - width), max(0, self.size - height)]  # left, top, right, bottom
        labels = F.pad(masks[0], padding, fill=self.mask_fill).as_subclass(torch.Tensor)
        top, left, _ = class_ratio_crop_window(labels, self.size, self.size, self.max_ratio, self.ignore_index,
                                               self.attempts)
        return {"padding": padding, "top": top, "left": left}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        fill = self.mask_fill if isinstance(inpt, tv_tensors.Mask) else 0
        padded = F.pad(inpt, params["padding"], fill=fill)
        return F.crop(padded, params["top"], params["left"], self.size, self.size)


class CvnetsTrainTransform:
    """``image=(H, W, 3) uint8, mask=(H, W) uint8`` -> ``{"image": (3, c, c) float, "mask": (c, c) uint8}``.

    Called like an albumentations pipeline (keyword ``image``/``mask``, ``set_random_seed``), so
    :func:`datamodules.segmentation.segmentation_item` treats both pipelines alike. Defaults are
    CVNets' MobileViTv2 values (module docstring); ``ratio_ignore_index`` is the label the crop's
    class ratio leaves out (255 on VOC, ``None`` on ADE20k, see :func:`class_ratio_crop_window`).
    """

    def __init__(self, crop_size: int = 512, short_side_range: Sequence[int] = (256, 768), max_image_side: int = 1024,
                 seg_class_max_ratio: float = 0.75, hflip: float = 0.5, blur: float = 0.5, max_blur_sigma: float = 1.0,
                 photometric: float = 0.5, rotate_degrees: float = 10.0, rotate_p: float = 1.0,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 mask_fill: int = IGNORE_INDEX, ratio_ignore_index: int | None = IGNORE_INDEX):
        steps: list[v2.Transform] = [
            RandomShortSideResize(short_side_range, max_image_side),
            v2.RandomHorizontalFlip(p=hflip),
            ClassRatioCrop(crop_size, seg_class_max_ratio, ratio_ignore_index, mask_fill),
        ]
        if blur > 0:
            # PIL's blur has no kernel size: 3 standard deviations each side covers it; sigma > 0 is
            # torchvision's requirement, and a sigma of 1e-3 leaves the image as PIL's radius 0 does
            kernel = 2 * int(np.ceil(3 * max_blur_sigma)) + 1
            steps.append(v2.RandomApply([v2.GaussianBlur(kernel, sigma=(1e-3, max_blur_sigma))], p=blur))
        if photometric > 0:
            steps.append(v2.RandomPhotometricDistort(brightness=(0.875, 1.125), contrast=(0.5, 1.5),
                                                     saturation=(0.5, 1.5), hue=(-0.05, 0.05), p=photometric))
        if rotate_degrees > 0 and rotate_p > 0:
            rotate = v2.RandomRotation(rotate_degrees, interpolation=v2.InterpolationMode.BILINEAR,
                                       fill={tv_tensors.Image: 0, tv_tensors.Mask: mask_fill})
            steps.append(rotate if rotate_p >= 1 else v2.RandomApply([rotate], p=rotate_p))
        # a plain dtype converts images only: masks keep their labels
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=list(mean), std=list(std))]
        self.pipeline = v2.Compose(steps)
        self.seed: int | None = None

    def set_random_seed(self, seed: int) -> None:
        """The next call draws from a torch generator seeded with ``seed`` (the caller's RNG is left alone)."""
        self.seed = int(seed)

    def __call__(self, *, image: np.ndarray, mask: np.ndarray) -> dict[str, torch.Tensor]:
        inputs = (tv_tensors.Image(torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)),
                  tv_tensors.Mask(torch.from_numpy(np.ascontiguousarray(mask))))
        if self.seed is None:
            out_image, out_mask = self.pipeline(*inputs)
        else:
            with torch.random.fork_rng(devices=[]):
                # the CPU generator only, as loaders.run_seeded: torch.manual_seed would also queue a lazy
                # seeding of every accelerator backend (a recorded stack trace per sample) for no draw
                torch.default_generator.manual_seed(self.seed)
                out_image, out_mask = self.pipeline(*inputs)
        return {"image": out_image.as_subclass(torch.Tensor), "mask": out_mask.as_subclass(torch.Tensor)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.pipeline})"


__all__ = ["CROP_ATTEMPTS", "ClassRatioCrop", "CvnetsTrainTransform", "RandomShortSideResize",
           "class_ratio_crop_window", "dominant_class_ratio", "short_side_resize_size"]
