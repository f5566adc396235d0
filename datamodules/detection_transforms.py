"""SSD training augmentation in one pass over the pixels, and the evaluation resize.

Two training pipelines, chosen by name with :func:`detection_train_transform` (the datamodules'
``augmentation`` argument):

- ``"torchvision_ssd"`` (:class:`SSDTrainTransform`): torchvision's SSD preset, zoom-out included
  (described below);
- ``"cvnets"`` (:class:`CVNetsSSDTrainTransform`): the one CVNets trains SSDLite-MobileViT(v2) with
  (``data/datasets/detection/coco_ssd.py``: SSDCroping, PhotometricDistort, RandomHorizontalFlip,
  Resize), with CVNets' crop rules and no zoom-out.

:func:`ssd_train_transform` draws the SSD recipe's random parameters as torchvision's
``RandomPhotometricDistort -> RandomZoomOut -> RandomIoUCrop -> RandomHorizontalFlip -> Resize``
chain does (same ranges, probabilities and order, from torch's global RNG), but works out the
geometry on the boxes first and touches the pixels once: the part of the photo that the crop keeps
is cut out and resized straight to its place in the ``S x S`` output, the photometric distortion
runs on that small piece in float (not on the full-size photo in uint8), and the zoom-out's fill is
painted only where the piece does not reach. The zoom-out canvas (up to 16x the photo's pixels) is
never built.

Against the torchvision chain:

- the IoU crop's trial windows are drawn all at once (same distribution, other random numbers);
  without IoU crop a seed draws the chain's photometric factors, zoom-out and flip, one for one;
- without zoom-out the geometry is the chain's: the crop's photo pixels resized to the output;
- with zoom-out the photo's piece lands on whole output pixels (its edges move by at most half an
  output pixel, boxes move with it), and its border is not blended with the fill by the resize;
- contrast pivots on the mean grey of the kept piece instead of the whole photo (the order of
  CVNets' SSD recipe, which distorts the crop); brightness, saturation, hue and the channel swap
  act per pixel and commute with the resize up to rounding; no 8-bit truncation between the
  photometric steps (torchvision truncates after each on uint8).

Items: ``(image (3, H, W) uint8, {"boxes": (G, 4), "labels": (G,), ...})`` -> ``(image (3, S, S)
float normalised, {"boxes": BoundingBoxes (G', 4) xyxy in output pixels, "labels": (G',), ...})``, other
target keys passed through. The input boxes lie on the photo (:func:`datamodules.detection_common.detection_item`
clips them) and are a plain xyxy tensor or ``BoundingBoxes``; inputs may be plain tensors or tv_tensors, and
the outputs are tv_tensors, made once, at the end. Boxes whose centre falls outside the crop, or that keep
less than 1 output pixel of width, height or area, are dropped with their labels.
"""
from __future__ import annotations

import random
from typing import Sequence

import numpy as np
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

#: HSV -> RGB: channel c takes value - chroma * clamp(min(k, 4 - k), 0, 1) with k = (offset_c + hue * 6) mod 6
_HUE_OFFSETS = torch.tensor([5.0, 3.0, 1.0]).view(3, 1, 1)


def shift_hue(image: torch.Tensor, hue: float) -> torch.Tensor:
    """Rotate the HSV hue of a (3, H, W) float RGB image in [0, 1] by ``hue`` turns (-0.5..0.5),
    keeping value and saturation: ``torchvision``'s ``adjust_hue`` in a few element-wise passes
    (no HSV image, no sorting of channels), equal to it within 1e-5."""
    red, green, blue = image
    value = image.amax(0)
    chroma = value - image.amin(0)
    is_red = red == value
    is_green = (green == value) & ~is_red
    is_blue = ~(is_red | is_green)
    # hue in sixths of a turn times chroma: red at 0, green at 2, blue at 4
    hue_chroma = (is_red * (green - blue) + is_green * (blue - red + 2 * chroma)
                  + is_blue * (red - green + 4 * chroma))
    sixths = _HUE_OFFSETS + (hue_chroma / chroma.clamp(min=1e-12) + 6 * hue)
    sixths -= 6 * torch.floor(sixths / 6)
    return value - chroma * torch.minimum(sixths, 4 - sixths).clamp_(0, 1)


class PhotometricDistortion:
    """torchvision's ``RandomPhotometricDistort`` for (3, H, W) float images in [0, 1]: each of
    brightness, contrast, saturation and hue changes with probability ``p`` (factors drawn as there,
    in the same order), contrast before or after saturation and hue, then a random channel order with
    probability ``p``. :meth:`draw` takes the random values, :meth:`apply` uses them."""

    def __init__(self, p: float = 0.5, brightness: tuple[float, float] = (0.875, 1.125),
                 contrast: tuple[float, float] = (0.5, 1.5), saturation: tuple[float, float] = (0.5, 1.5),
                 hue: tuple[float, float] = (-0.05, 0.05)):
        self.p = p
        self.ranges = {"brightness": brightness, "contrast": contrast, "saturation": saturation, "hue": hue}

    def draw(self) -> dict:
        params = {name: float(torch.empty(1).uniform_(low, high)) if torch.rand(1) < self.p else None
                  for name, (low, high) in self.ranges.items()}
        params["contrast_before"] = bool(torch.rand(()) < 0.5)
        params["channels"] = torch.randperm(3) if torch.rand(1) < self.p else None
        return params

    @staticmethod
    def apply(image: torch.Tensor, params: dict) -> torch.Tensor:
        if params["brightness"] is not None:
            image = F.adjust_brightness(image, params["brightness"])
        if params["contrast"] is not None and params["contrast_before"]:
            image = F.adjust_contrast(image, params["contrast"])
        if params["saturation"] is not None:
            image = F.adjust_saturation(image, params["saturation"])
        if params["hue"] is not None:
            image = shift_hue(image, params["hue"])
        if params["contrast"] is not None and not params["contrast_before"]:
            image = F.adjust_contrast(image, params["contrast"])
        if params["channels"] is not None:
            image = image[params["channels"]]
        return image

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return self.apply(image, self.draw())


def zoom_out_placement(width: int, height: int, zoom_out_max: float, p: float = 0.5) -> tuple[int, int, int, int]:
    """``(canvas width, canvas height, left, top)``: torchvision's ``RandomZoomOut`` draws (with
    probability ``p`` a canvas ``r`` in [1, ``zoom_out_max``] times the photo's size, the photo at a
    random place in it); without zoom-out the canvas is the photo."""
    if zoom_out_max <= 1 or torch.rand(1) >= p:
        return width, height, 0, 0
    ratio = 1.0 + torch.rand(1) * (zoom_out_max - 1.0)
    canvas_width, canvas_height = int(width * ratio), int(height * ratio)
    where = torch.rand(2)
    return canvas_width, canvas_height, int((canvas_width - width) * where[0]), int((canvas_height - height) * where[1])


def iou_crop_window(boxes: torch.Tensor, width: int, height: int, min_scale: float = 0.3, max_scale: float = 1.0,
                    min_aspect_ratio: float = 0.5, max_aspect_ratio: float = 2.0,
                    options: Sequence[float] = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0),
                    trials: int = 40) -> tuple[int, int, int, int, torch.Tensor] | None:
    """The SSD crop as torchvision's ``RandomIoUCrop`` samples it: pick a minimum IoU among
    ``options`` (1.0: no crop, ``None`` returned), try ``trials`` windows of 0.3-1x the canvas's
    sides, and keep the first whose aspect ratio is 0.5-2, that holds a box centre and that overlaps
    such a box by that IoU; none: pick again. The trials of one pick are drawn at once (same
    distribution as torchvision's one-by-one loop, other draws from the RNG), which makes the
    search cheap when small objects make most windows fail.

    ``boxes`` (G, 4) xyxy on the ``width x height`` canvas, G >= 1. Returns ``(left, top, right,
    bottom, centre_inside (G,) bool)``."""
    centre_x = 0.5 * (boxes[:, 0] + boxes[:, 2])
    centre_y = 0.5 * (boxes[:, 1] + boxes[:, 3])
    box_area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    while True:
        min_iou = options[int(torch.randint(low=0, high=len(options), size=(1,)))]
        if min_iou >= 1.0:
            return None
        scale = min_scale + (max_scale - min_scale) * torch.rand(trials, 2)
        sizes = (torch.tensor([width, height]) * scale).floor()
        lefttop = ((torch.tensor([width, height]) - sizes) * torch.rand(trials, 2)).floor()
        windows = torch.cat([lefttop, lefttop + sizes], dim=1)  # (trials, 4)
        aspect = sizes[:, 0] / sizes[:, 1]
        valid = (min_aspect_ratio <= aspect) & (aspect <= max_aspect_ratio) & (sizes > 0).all(1)
        inside = ((windows[:, :1] < centre_x) & (centre_x < windows[:, 2:3])
                  & (windows[:, 1:2] < centre_y) & (centre_y < windows[:, 3:]))  # (trials, G)
        corner_low = torch.maximum(windows[:, None, :2], boxes[None, :, :2])
        corner_high = torch.minimum(windows[:, None, 2:], boxes[None, :, 2:])
        overlap = (corner_high - corner_low).clamp(min=0).prod(-1)
        iou = overlap / (sizes.prod(1, keepdim=True) + box_area - overlap)
        valid &= (iou.masked_fill(~inside, -1.0).amax(1) >= min_iou) & inside.any(1)
        if valid.any():
            first = int(valid.nonzero()[0])
            left, top, right, bottom = (int(v) for v in windows[first])
            return left, top, right, bottom, inside[first]


def xyxy_boxes(boxes: torch.Tensor) -> torch.Tensor:
    """(G, 4) boxes as a plain xyxy tensor: a plain tensor is taken as xyxy, ``BoundingBoxes`` of any format converted."""
    if isinstance(boxes, tv_tensors.BoundingBoxes) and boxes.format != tv_tensors.BoundingBoxFormat.XYXY:
        boxes = F.convert_bounding_box_format(boxes, new_format=tv_tensors.BoundingBoxFormat.XYXY)
    return boxes.as_subclass(torch.Tensor)


def plain_inputs(image: torch.Tensor, target: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A training sample's (3, H, W) uint8 pixels and (G, 4) xyxy boxes (:func:`xyxy_boxes`) as plain tensors;
    any other image is refused naming its shape and dtype."""
    if image.dtype != torch.uint8 or image.ndim != 3:
        raise TypeError(f"SSD augmentation expects a (3, H, W) uint8 image, got {tuple(image.shape)} {image.dtype}")
    return image.as_subclass(torch.Tensor), xyxy_boxes(target["boxes"])


class SSDTrainTransform:
    """The SSD recipe (photometric distortion, zoom-out, IoU crop, flip, resize to ``image_size``
    squared, normalise) on ``(image, target)``; see the module docstring for the contract and for
    how it compares with torchvision's chain.

    Args:
        zoom_out_max: largest zoom-out (canvas side / photo side, applied to half the images); 1: none.
        iou_crop: the SSD crop. hflip: flip probability.
        photometric: probability of each photometric change (0: no distortion).
        min_size: boxes narrower or lower than this in output pixels (or with less area) are dropped.
    """

    def __init__(self, image_size: int, mean: Sequence[float], std: Sequence[float], zoom_out_max: float = 4.0,
                 iou_crop: bool = True, hflip: float = 0.5, photometric: float = 0.5, min_size: float = 1.0):
        self.size = image_size
        self.mean, self.std = list(mean), list(std)
        self.zoom_out_max, self.iou_crop, self.hflip, self.min_size = zoom_out_max, iou_crop, hflip, min_size
        self.photometric = PhotometricDistortion(p=photometric)
        # the zoom-out fill is the mean colour in 8 bits, as torchvision's chain pads the uint8 photo
        fill = torch.tensor([round(255 * m) for m in mean], dtype=torch.uint8).view(3, 1, 1)
        self.fill = self.normalise(fill)

    def normalise(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 or float in [0, 1] -> float normalised, with torchvision's arithmetic (mean 0 and
        std 1, the CVNets recipes' unnormalised input, leave it as it is)."""
        image = F.to_dtype(image, torch.float32, scale=True)
        if all(m == 0 for m in self.mean) and all(s == 1 for s in self.std):
            return image
        return F.normalize(image, self.mean, self.std)

    def __call__(self, image: torch.Tensor, target: dict) -> tuple[tv_tensors.Image, dict]:
        pixels, boxes = plain_inputs(image, target)
        height, width = pixels.shape[-2:]
        boxes = boxes.float()  # on the photo (clipped by detection_item): a window holding a centre holds photo pixels
        labels = target["labels"]
        colour = self.photometric.draw()

        # geometry on the boxes: the canvas the photo sits in, the window of it that is kept
        canvas_width, canvas_height, left, top = zoom_out_placement(width, height, self.zoom_out_max)
        boxes = boxes + torch.tensor([left, top, left, top], dtype=boxes.dtype)
        window, inside = (0, 0, canvas_width, canvas_height), None
        if self.iou_crop and len(boxes):
            crop = iou_crop_window(boxes, canvas_width, canvas_height)
            if crop is not None:
                window, inside = crop[:4], crop[4]
        flip = self.hflip > 0 and bool(torch.rand(1) < self.hflip)

        # the photo's part of the window, in photo pixels, and the output pixels it covers
        wx0, wy0, wx1, wy1 = window
        px0, py0 = max(wx0, left), max(wy0, top)
        px1, py1 = min(wx1, left + width), min(wy1, top + height)
        scale_x, scale_y = self.size / (wx1 - wx0), self.size / (wy1 - wy0)
        ox0 = min(round((px0 - wx0) * scale_x), self.size - 1)  # a sliver of photo still gets a pixel
        oy0 = min(round((py0 - wy0) * scale_y), self.size - 1)
        ox1, oy1 = max(ox0 + 1, round((px1 - wx0) * scale_x)), max(oy0 + 1, round((py1 - wy0) * scale_y))
        piece = pixels[:, py0 - top:py1 - top, px0 - left:px1 - left]
        piece = F.resize(piece, [oy1 - oy0, ox1 - ox0], antialias=True)
        piece = self.normalise(self.photometric.apply(F.to_dtype(piece, torch.float32, scale=True), colour))
        if flip:
            piece = piece.flip(-1)
            ox0, ox1 = self.size - ox1, self.size - ox0
        if (ox0, oy0, ox1, oy1) == (0, 0, self.size, self.size):
            out = piece
        else:
            out = self.fill.expand(3, self.size, self.size).clone()
            out[:, oy0:oy1, ox0:ox1] = piece

        # boxes follow the piece's own mapping, so they sit on the pixels whatever the rounding
        gain_x, gain_y = (ox1 - ox0) / (px1 - px0), (oy1 - oy0) / (py1 - py0)
        if flip:
            boxes = boxes[:, [2, 1, 0, 3]]
            gain_x, ox0 = -gain_x, ox1
        mapped = torch.stack([ox0 + (boxes[:, 0] - px0) * gain_x, oy0 + (boxes[:, 1] - py0) * gain_y,
                              ox0 + (boxes[:, 2] - px0) * gain_x, oy0 + (boxes[:, 3] - py0) * gain_y], dim=1)
        mapped = mapped.clamp_(0, self.size)
        sides = mapped[:, 2:] - mapped[:, :2]
        keep = (sides >= self.min_size).all(1) & (sides.prod(1) >= self.min_size)
        if inside is not None:
            keep &= inside
        out_target = dict(target)
        out_target["boxes"] = tv_tensors.BoundingBoxes(mapped[keep].to(target["boxes"].dtype), format="XYXY",
                                                       canvas_size=(self.size, self.size))
        out_target["labels"] = labels[keep]
        return tv_tensors.Image(out), out_target


def ssd_train_transform(image_size: int, mean: Sequence[float], std: Sequence[float],
                        zoom_out_max: float = 4.0, iou_crop: bool = True, hflip: float = 0.5) -> SSDTrainTransform:
    """The SSD recipe's augmentation (Liu et al. 2016, sec. 2.2 / torchvision's SSD preset), one pass."""
    return SSDTrainTransform(image_size, mean, std, zoom_out_max=zoom_out_max, iou_crop=iou_crop, hflip=hflip)


class CVNetsPhotometricDistortion(PhotometricDistortion):
    """CVNets' ``PhotometricDistort`` (``data/transforms/image_pil.py``): seven uniform numbers from
    numpy decide, each against ``p``, brightness, contrast-before-saturation, contrast (before), saturation,
    hue, contrast (after, only when not before) and a channel permutation (``np.random.permutation``);
    each factor is drawn as torchvision's ``ColorJitter`` draws it. Same ranges as torchvision's
    (``image_pil.py`` defaults: brightness 0.875-1.125, contrast and saturation 0.5-1.5, hue -0.05-0.05,
    p 0.5). Contrast before / after and its probability: ``r1 < p`` then ``r2 < p`` (or ``r5 < p``)."""

    def draw(self) -> dict:
        decide = np.random.rand(7) < self.p
        def factor(name: str, apply: bool) -> float | None:
            low, high = self.ranges[name]
            return float(torch.empty(1).uniform_(low, high)) if apply else None
        contrast_before = bool(decide[1])
        params = {"brightness": factor("brightness", decide[0]),
                  "contrast_before": contrast_before,
                  "saturation": factor("saturation", decide[3]),
                  "hue": factor("hue", decide[4]),
                  "contrast": factor("contrast", decide[2] if contrast_before else decide[5])}
        params["channels"] = torch.from_numpy(np.random.permutation(3)) if decide[6] else None
        return params


#: CVNets' SSDCroping defaults (``data/transforms/image_pil.py``, ``--image-augmentation.ssd-crop.*``)
CVNETS_IOU_THRESHOLDS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)


def cvnets_crop_window(boxes: np.ndarray, width: int, height: int,
                       iou_thresholds: Sequence[float] = CVNETS_IOU_THRESHOLDS, trials: int = 40,
                       min_aspect_ratio: float = 0.5, max_aspect_ratio: float = 2.0,
                       min_side: int = 100) -> tuple[int, int, int, int, np.ndarray] | None:
    """The crop of CVNets' ``SSDCroping``, drawn from Python's ``random`` in CVNets' order.

    Pick a minimum IoU among ``iou_thresholds``: ``0.0`` means no crop (``None``); otherwise try
    ``trials`` windows with sides ``int(uniform(0.3, 1) x`` the photo's), height / width within
    ``[min_aspect_ratio, max_aspect_ratio]``, top-left ``int(uniform(0, room))``; a window is taken
    when its largest IoU with *any* box reaches the threshold, at least one box centre lies strictly
    inside it, and both sides are at least ``min_side`` pixels. No window in ``trials``: pick again
    (so ``1.0`` almost always means "pick again"). Differs from torchvision's ``RandomIoUCrop``, where
    ``1.0`` means no crop, ``0.0`` any crop, the IoU counts only boxes with their centre inside, the
    aspect ratio is width / height, and windows have no minimum side.

    ``boxes`` (G, 4) xyxy on the ``width x height`` photo, G >= 1. Returns ``(left, top, right,
    bottom, centre_inside (G,) bool)``."""
    centres = 0.5 * (boxes[:, :2] + boxes[:, 2:])
    box_area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    while True:
        min_iou = random.choice(iou_thresholds)
        if min_iou == 0.0:
            return None
        for _ in range(trials):
            new_width = int(random.uniform(0.3 * width, width))
            new_height = int(random.uniform(0.3 * height, height))
            if new_width == 0 or not min_aspect_ratio <= new_height / new_width <= max_aspect_ratio:
                continue
            left = int(random.uniform(0, width - new_width))
            top = int(random.uniform(0, height - new_height))
            window = np.array([left, top, left + new_width, top + new_height])
            sides = (np.minimum(boxes[:, 2:], window[2:]) - np.maximum(boxes[:, :2], window[:2])).clip(min=0)
            overlap = sides[:, 0] * sides[:, 1]
            iou = overlap / (box_area + new_width * new_height - overlap)
            if iou.max() < min_iou:
                continue
            inside = ((window[:2] < centres) & (centres < window[2:])).all(1)
            if not inside.any() or new_width < min_side or new_height < min_side:
                continue
            return left, top, left + new_width, top + new_height, inside


class CVNetsSSDTrainTransform:
    """CVNets' SSD training pipeline (``coco_ssd.py::_training_transforms``): SSD crop
    (:func:`cvnets_crop_window`), photometric distortion (:class:`CVNetsPhotometricDistortion`),
    horizontal flip (``random.random() <= hflip``), resize to ``image_size`` squared
    (``interpolation``; CVNets' ``ssd_coco`` configs: bicubic), ``[0, 1]`` float, normalise. No
    zoom-out: the output shows only photo pixels.

    Boxes as CVNets keeps them: after a crop only those whose centre lies strictly inside, clipped
    to the window; no size filter. Without boxes there is no crop (CVNets' guard).

    One pass over the pixels: the window is cut from the photo and resized once; the distortion
    runs on the resized ``S x S`` float image (CVNets distorts the full-resolution crop in 8 bits:
    brightness, saturation, hue and the channel order act per pixel and commute with the resize up
    to rounding, contrast pivots on the mean grey, which the resize keeps up to resampling); the flip
    mirrors the output (the same as mirroring before the resize).

    Items: as :class:`SSDTrainTransform`'s (see the module docstring).
    """

    def __init__(self, image_size: int, mean: Sequence[float], std: Sequence[float], iou_crop: bool = True,
                 hflip: float = 0.5, photometric: float = 0.5, interpolation: str = "bicubic",
                 iou_thresholds: Sequence[float] = CVNETS_IOU_THRESHOLDS, trials: int = 40,
                 min_aspect_ratio: float = 0.5, max_aspect_ratio: float = 2.0, min_crop_side: int = 100):
        self.size = image_size
        self.mean, self.std = list(mean), list(std)
        self.iou_crop, self.hflip = iou_crop, hflip
        self.interpolation = v2.InterpolationMode(interpolation)
        self.photometric = CVNetsPhotometricDistortion(p=photometric)
        self.crop = {"iou_thresholds": tuple(iou_thresholds), "trials": trials, "min_aspect_ratio": min_aspect_ratio,
                     "max_aspect_ratio": max_aspect_ratio, "min_side": min_crop_side}

    normalise = SSDTrainTransform.normalise

    def __call__(self, image: torch.Tensor, target: dict) -> tuple[tv_tensors.Image, dict]:
        pixels, boxes = plain_inputs(image, target)
        height, width = pixels.shape[-2:]
        boxes = boxes.float()
        labels = target["labels"]

        left, top, right, bottom = 0, 0, width, height
        if self.iou_crop and len(boxes):
            crop = cvnets_crop_window(boxes.numpy(), width, height, **self.crop)
            if crop is not None:
                left, top, right, bottom, inside = crop
                keep = torch.from_numpy(inside)
                boxes, labels = boxes[keep], labels[keep]
                boxes = torch.maximum(torch.minimum(boxes, torch.tensor([right, bottom] * 2, dtype=boxes.dtype)),
                                      torch.tensor([left, top] * 2, dtype=boxes.dtype))
        colour = self.photometric.draw()
        flip = self.hflip > 0 and random.random() <= self.hflip  # CVNets: random.random() <= p

        piece = F.resize(pixels[:, top:bottom, left:right], [self.size, self.size],
                         interpolation=self.interpolation, antialias=True)
        out = self.photometric.apply(F.to_dtype(piece, torch.float32, scale=True), colour)
        scale = torch.tensor([self.size / (right - left), self.size / (bottom - top)] * 2)
        boxes = ((boxes - torch.tensor([left, top] * 2, dtype=boxes.dtype)) * scale).clamp_(0, self.size)  # float rounding
        if flip:
            out = out.flip(-1)
            boxes = torch.stack([self.size - boxes[:, 2], boxes[:, 1], self.size - boxes[:, 0], boxes[:, 3]], dim=1)
        out_target = dict(target)
        out_target["boxes"] = tv_tensors.BoundingBoxes(boxes.to(target["boxes"].dtype), format="XYXY",
                                                       canvas_size=(self.size, self.size))
        out_target["labels"] = labels
        return tv_tensors.Image(self.normalise(out)), out_target


#: the training pipelines a detection datamodule offers (its ``augmentation`` argument)
AUGMENTATIONS = ("torchvision_ssd", "cvnets")


def detection_train_transform(augmentation: str, image_size: int, mean: Sequence[float], std: Sequence[float],
                              zoom_out_max: float | None = None, iou_crop: bool = True, hflip: float = 0.5):
    """The training pipeline named ``augmentation`` (:data:`AUGMENTATIONS`). ``zoom_out_max``
    ``None`` is the pipeline's own: 4 for ``torchvision_ssd``, none for ``cvnets``, which has no
    zoom-out and refuses one."""
    if augmentation == "torchvision_ssd":
        return ssd_train_transform(image_size, mean, std, 4.0 if zoom_out_max is None else zoom_out_max, iou_crop, hflip)
    if augmentation == "cvnets":
        if zoom_out_max not in (None, 1, 1.0):
            raise ValueError(f"data.zoom_out_max={zoom_out_max}: CVNets' SSD pipeline (data.augmentation=cvnets) has "
                             "no zoom-out; leave zoom_out_max unset (or 1) or use data.augmentation=torchvision_ssd")
        return CVNetsSSDTrainTransform(image_size, mean, std, iou_crop=iou_crop, hflip=hflip)
    raise ValueError(f"data.augmentation={augmentation!r} is not a detection training pipeline; "
                     f"choose one of {', '.join(AUGMENTATIONS)}")


class SquareResize:
    """The evaluation input of SSD: the whole image resized to ``size`` x ``size`` (the aspect ratio is not kept),
    scaled to [0, 1] and normalised; boxes, when given, follow it. torchvision's ``Resize((size, size),
    antialias=True) -> ClampBoundingBoxes -> ToDtype(float32, scale=True) -> Normalize`` chain, computed with its
    functional kernels on plain tensors (equal to the chain bit for bit).

    ``(image (3, H, W) uint8)`` -> ``Image (3, S, S)``; ``(image, {"boxes": (G, 4) xyxy, ...})`` -> ``(Image,
    {"boxes": BoundingBoxes (G, 4) xyxy in output pixels, ...})``, other target keys passed through."""

    def __init__(self, size: int, mean: Sequence[float], std: Sequence[float]):
        self.size = size
        self.mean, self.std = list(mean), list(std)

    def __call__(self, image: torch.Tensor, target: dict | None = None):
        pixels = image.as_subclass(torch.Tensor)
        out = F.resize(pixels, [self.size, self.size], antialias=True)
        out = tv_tensors.Image(F.normalize(F.to_dtype(out, torch.float32, scale=True), self.mean, self.std))
        if target is None:
            return out
        boxes, canvas = F.resize_bounding_boxes(xyxy_boxes(target["boxes"]), canvas_size=tuple(pixels.shape[-2:]),
                                                size=[self.size, self.size])
        # the float scale can carry an edge on the image's border a hair past the square's
        boxes = F.clamp_bounding_boxes(boxes, format=tv_tensors.BoundingBoxFormat.XYXY, canvas_size=canvas,
                                       clamping_mode="soft")
        return out, {**target, "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=canvas)}


def eval_transform(image_size: int, mean: Sequence[float], std: Sequence[float]) -> SquareResize:
    """Resize to the square model input (SSD does not keep the aspect ratio)."""
    return SquareResize(image_size, mean, std)
