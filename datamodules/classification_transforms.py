"""Classification augmentation on uint8 tensors, with torchvision's random draws and cheaper kernels.

The pipelines are torchvision's (``RandomResizedCrop``, flip, ``RandAugment``, ``ToDtype``,
``Normalize``, ``RandomErasing``; MixUp / CutMix on the batch) and draw the same random numbers in
the same order, so a seed gives the same augmentation. What changes is the cost of the slow steps:

- :class:`FastRandAugment` runs 10 of RandAugment's 14 ops with cheaper kernels on (3, H, W)
  uint8 images: integer translations by slicing instead of a sampling grid, shear and rotation
  through a sampling grid built by broadcasting instead of a batched matrix product, the sharpness
  blur by separable box sums instead of a grouped convolution, Solarize by an XOR, and float to
  uint8 through int32 (several times faster on CPU than the direct conversion). The result equals
  torchvision's, up to one grey level where a rounding tie falls differently (warps, sharpness blur).
- :class:`MixCollate` mixes the freshly collated batch in place (MixUp walks the batch backwards
  so it needs no rolled copy; CutMix copies only the pasted patch), instead of allocating two
  more batch-sized tensors per call.

Training batches can leave the loader as uint8 (``on_device=True``): a quarter of float32's bytes
through the workers' shared memory, pinning and the host-to-device copy. The loader then makes
every random draw as before (crop, flip, RandAugment, the erasing box, MixUp's ``lam`` or CutMix's
box, in the same order) but applies none of the float steps; :func:`finish_on_device` applies them
on the device, in the pipeline's order: to float, normalise, erase, mix. The result equals the
float pipeline's, to float rounding.

Contract (as :mod:`datamodules.imagefolder`): ``train_transform(...)`` and ``eval_transform(...)``
map a (3, H, W) uint8 tensor to a (3, S, S) float normalised one (``on_device``: the uint8 crop, with
the erasing box under ``"erase"`` when erasing is on); ``MixCollate(...)`` maps dataset items to a
batch dict with soft ``target`` (B, num_classes) (``on_device``: the mix to apply under ``"mix"``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as nnf
from torchvision import tv_tensors
from torchvision.transforms import v2

from datamodules.images import collate_skipping


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """Float values in [0, 255] to uint8, truncating as ``.to(torch.uint8)`` does; through int32,
    which CPU kernels convert several times faster than float to uint8."""
    return pixels.to(torch.int32).to(torch.uint8)


def inverse_affine(centre: tuple[float, float], angle: float, shear: tuple[float, float]) -> list[float]:
    """The inverse (output pixel -> source pixel) of a rotation by ``angle`` degrees and a shear by
    ``shear`` degrees (x, y) about ``centre`` (in coordinates centred on the image), as a 2x3 row-major
    matrix: torchvision's ``affine`` with no translation and scale 1, computed in its order of float
    operations so the warps stay bit-identical to its own."""
    rot, shear_x, shear_y = math.radians(angle), math.radians(shear[0]), math.radians(shear[1])
    cx, cy = centre
    # rotation after shear: [[a, b], [c, d]], of determinant 1, so its inverse is [[d, -b], [-c, a]]
    a = math.cos(rot - shear_y) / math.cos(shear_y)
    b = -math.cos(rot - shear_y) * math.tan(shear_x) / math.cos(shear_y) - math.sin(rot)
    c = math.sin(rot - shear_y) / math.cos(shear_y)
    d = -math.sin(rot - shear_y) * math.tan(shear_x) / math.cos(shear_y) + math.cos(rot)
    matrix = [d, -b, 0.0, -c, a, 0.0]
    # about the centre: move it to the origin, map, move it back
    matrix[2] += matrix[0] * (-cx) + matrix[1] * (-cy)
    matrix[5] += matrix[3] * (-cx) + matrix[4] * (-cy)
    matrix[2] += cx
    matrix[5] += cy
    return matrix


def sample_affine(image: torch.Tensor, inverse: list[float]) -> torch.Tensor:
    """(3, H, W) uint8 warped by the inverse affine map ``inverse`` (2x3, row-major, pixel coordinates
    centred on the image), bilinear, zeros outside: torchvision's tensor ``affine`` / ``rotate`` with
    ``fill=None``, its sampling grid built by broadcasting."""
    height, width = image.shape[-2:]
    # the source of each output pixel, in grid_sample's units (-1 to 1 across the image)
    to_unit = torch.tensor([2.0 / width, 2.0 / height])
    per_x, per_y, offset = (torch.tensor(inverse[i::3]) * to_unit for i in range(3))
    x = (torch.arange(width, dtype=torch.float32) - (width * 0.5 - 0.5)).view(1, width, 1)
    y = (torch.arange(height, dtype=torch.float32) - (height * 0.5 - 0.5)).view(height, 1, 1)
    grid = (x * per_x + offset) + y * per_y  # (H, W, 2)
    warped = nnf.grid_sample(image.float().unsqueeze(0), grid.unsqueeze(0), mode="bilinear", padding_mode="zeros",
                             align_corners=False)
    return to_uint8(warped.squeeze(0).round_())


def translate(image: torch.Tensor, dx: int, dy: int) -> torch.Tensor:
    """(3, H, W) shifted by whole pixels ``dx`` right and ``dy`` down, zeros where nothing comes in."""
    height, width = image.shape[-2:]
    out = torch.zeros_like(image)
    if abs(dx) < width and abs(dy) < height:
        out[..., max(dy, 0):height + min(dy, 0), max(dx, 0):width + min(dx, 0)] = \
            image[..., max(-dy, 0):height + min(-dy, 0), max(-dx, 0):width + min(-dx, 0)]
    return out


def sharpen(image: torch.Tensor, factor: float) -> torch.Tensor:
    """torchvision's ``adjust_sharpness`` on (3, H, W) uint8: blend with the 3x3 smoothing
    (1 around, 5 in the middle, / 13; border pixels kept), the box sum done separably."""
    if image.shape[-1] <= 2 or image.shape[-2] <= 2:
        return image
    pixels = image.float()
    rows = pixels[:, :-2] + pixels[:, 1:-1] + pixels[:, 2:]
    box = rows[:, :, :-2] + rows[:, :, 1:-1] + rows[:, :, 2:]
    inner = pixels[:, 1:-1, 1:-1]
    blurred = box.add_(inner, alpha=4.0).div_(13.0).round_()
    inner.add_(blurred.sub_(inner), alpha=1.0 - factor)
    return to_uint8(pixels.clamp_(0, 255))


def grey(image: torch.Tensor) -> torch.Tensor:
    """(3, H, W) uint8 -> (H, W) float luma, floored, as torchvision's colour ops compute it."""
    red, green, blue = image.unbind(0)
    return red.mul(0.2989).add_(green, alpha=0.587).add_(blue, alpha=0.114).floor_()


def blend(image: torch.Tensor, other: torch.Tensor | float, ratio: float) -> torch.Tensor:
    """torchvision's uint8 blend ``ratio * image + (1 - ratio) * other``, clamped and truncated."""
    return to_uint8(image.mul(ratio).add_(other, alpha=1.0 - ratio).clamp_(0, 255))


class FastRandAugment(v2.RandAugment):
    """``torchvision.transforms.v2.RandAugment`` (same op table, magnitudes and random draws) with
    the slow ops on (3, H, W) uint8 images computed by the kernels above; anything else (other
    dtypes, batches, a ``fill`` colour) goes to torchvision's own kernels."""

    #: ops computed here; the geometric ones only with bilinear sampling and no fill colour, as configured
    FAST_OPS = ("TranslateX", "TranslateY", "ShearX", "ShearY", "Rotate", "Sharpness", "Solarize", "Brightness",
                "Color", "Contrast")

    # RandAugment's one per-op method; no public hook exists (listed in layers/compat.py, tested on upgrades)
    def _apply_image_or_video_transform(self, image, transform_id, magnitude, interpolation, fill):
        warps = transform_id in ("ShearX", "ShearY", "Rotate")
        fast = (transform_id in self.FAST_OPS and image.dtype == torch.uint8 and image.ndim == 3
                and not (warps and v2.InterpolationMode(interpolation) != v2.InterpolationMode.BILINEAR)
                and all(value is None for value in fill.values()))
        if not fast:
            return super()._apply_image_or_video_transform(image, transform_id, magnitude, interpolation, fill)
        pixels = image.as_subclass(torch.Tensor)
        height, width = pixels.shape[-2:]
        if transform_id == "TranslateX":
            out = translate(pixels, int(magnitude), 0)
        elif transform_id == "TranslateY":
            out = translate(pixels, 0, int(magnitude))
        elif transform_id == "Sharpness":
            out = sharpen(pixels, 1.0 + magnitude)
        elif transform_id == "Brightness":
            out = to_uint8(pixels.mul(1.0 + magnitude).clamp_(0, 255))
        elif transform_id == "Color":
            out = blend(pixels, grey(pixels), 1.0 + magnitude)
        elif transform_id == "Contrast":
            out = blend(pixels, grey(pixels).mean(), 1.0 + magnitude)
        elif transform_id == "Solarize":  # invert the pixels at or above the threshold: XOR with 255
            out = pixels ^ (pixels >= 255.0 * magnitude).to(torch.uint8).mul_(255)
        elif transform_id == "Rotate":
            out = sample_affine(pixels, inverse_affine((0.0, 0.0), -magnitude, (0.0, 0.0)))
        else:  # ShearX / ShearY about the top-left corner, as torchvision's RandAugment shears
            angle = math.degrees(math.atan(magnitude))
            shear = [angle, 0.0] if transform_id == "ShearX" else [0.0, angle]
            out = sample_affine(pixels, inverse_affine((-0.5 * width, -0.5 * height), 0.0, shear))
        return tv_tensors.wrap(out, like=image) if isinstance(image, tv_tensors.TVTensor) else out


def normalize(mean, std) -> list[v2.Transform]:
    """``[v2.Normalize(mean, std)]``, or nothing for mean 0 and std 1 (the CVNets recipes' unnormalised
    input), where it would only copy the image."""
    return [] if all(m == 0 for m in mean) and all(s == 1 for s in std) else [v2.Normalize(mean, std)]


def train_transform(image_size: int, scale: tuple[float, float], hflip: float, rand_augment: bool,
                    rand_augment_magnitude: int, random_erasing: float, mean, std, interpolation: str,
                    on_device: bool = False) -> v2.Compose:
    """(3, H, W) uint8 -> (3, image_size, image_size) float, normalised; with ``on_device``, the uint8
    crop (a dict ``{"image", "erase"}`` when ``random_erasing`` > 0), finished by :func:`finish_on_device`."""
    interp = v2.InterpolationMode(interpolation)
    steps = [v2.RandomResizedCrop(image_size, scale=scale, interpolation=interp, antialias=True)]
    if hflip > 0:
        steps.append(v2.RandomHorizontalFlip(hflip))
    if rand_augment:
        # its rotations and shears run on tensors, which torchvision warps only with nearest or
        # bilinear sampling: bicubic (the recipes' crop interpolation) would fail on those ops
        steps.append(FastRandAugment(magnitude=rand_augment_magnitude, interpolation=v2.InterpolationMode.BILINEAR))
    if on_device:
        return v2.Compose(steps + ([DeferredErasing(p=random_erasing)] if random_erasing > 0 else []))
    steps += [v2.ToDtype(torch.float32, scale=True), *normalize(mean, std)]
    if random_erasing > 0:
        steps.append(v2.RandomErasing(p=random_erasing, value=0))
    return v2.Compose(steps)


class DeferredErasing(v2.RandomErasing):
    """``v2.RandomErasing(p, value=0)``'s random draws, without the erasing: (3, H, W) -> ``{"image": the
    same image, "erase": (4,) int64 top, left, height, width}`` (all 0: nothing erased), for
    :func:`finish_on_device` to erase after normalising, as the float pipeline erases."""

    def __init__(self, p: float):
        super().__init__(p=p, value=0)

    def forward(self, image: torch.Tensor) -> dict:
        box = torch.zeros(4, dtype=torch.int64)
        if torch.rand(1) < self.p:  # the draw order of torchvision's _RandomApplyTransform.forward
            params = self.make_params([image])
            if params["v"] is not None:  # no box fitted in ten tries: torchvision erases nothing
                box = torch.tensor([params["i"], params["j"], params["h"], params["w"]])
        return {"image": image, "erase": box}


def finish_on_device(batch: dict, mean: torch.Tensor, std: torch.Tensor) -> dict:
    """The float half of the training pipeline, on a batch where it lies (the accelerator): ``batch["image"]``
    (B, 3, S, S) uint8 becomes float32 scaled to [0, 1] and normalised by ``mean`` / ``std`` ((3, 1, 1),
    on the batch's device; ``None`` for the unnormalised recipes), then the erasing boxes (``"erase"``, (B, 4))
    are zeroed and the batch's MixUp / CutMix (``"mix"``) applied. Reads nothing back from the device."""
    images = batch["image"].to(torch.float32).mul_(1.0 / 255)  # v2.ToDtype(float32, scale=True)'s arithmetic
    if mean is not None:
        images.sub_(mean).div_(std)  # v2.Normalize's
    erase = batch.pop("erase", None)
    if erase is not None:
        top, left, height, width = (erase[:, k].view(-1, 1, 1, 1) for k in range(4))
        rows = torch.arange(images.shape[-2], device=images.device).view(1, 1, -1, 1)
        cols = torch.arange(images.shape[-1], device=images.device).view(1, 1, 1, -1)
        inside = (rows >= top) & (rows < top + height) & (cols >= left) & (cols < left + width)
        images.masked_fill_(inside, 0.0)
    mix = batch.pop("mix", None)
    if mix is not None and mix[0] == "mixup":
        lam = mix[1]
        rolled = images.roll(1, 0)
        images.mul_(lam).add_(rolled, alpha=1.0 - lam)
    elif mix is not None:  # ("cutmix", x1, y1, x2, y2): image i takes image i-1's patch
        x1, y1, x2, y2 = mix[1:]
        images[..., y1:y2, x1:x2] = images[..., y1:y2, x1:x2].roll(1, 0)
    batch["image"] = images
    return batch


def eval_transform(image_size: int, resize_size: int, mean, std, interpolation: str) -> v2.Compose:
    """(3, H, W) uint8 -> (3, image_size, image_size) float: resize the short side to
    ``resize_size``, center-crop ``image_size``, normalise."""
    interp = v2.InterpolationMode(interpolation)
    return v2.Compose([v2.Resize(resize_size, interpolation=interp, antialias=True),
                       v2.CenterCrop(image_size), v2.ToDtype(torch.float32, scale=True), *normalize(mean, std)])


class InPlaceMixUp(v2.MixUp):
    """``v2.MixUp`` (same draw of ``lam``) writing into the batch it is given: image i becomes
    ``lam * image_i + (1 - lam) * image_{i-1}``, computed from the last image down."""

    def transform(self, inpt, params):
        if inpt is params["labels"]:
            return super().transform(inpt, params)
        self._check_image_or_video(inpt, batch_size=params["batch_size"])
        lam = params["lam"]
        last = inpt[-1].clone()
        for i in range(len(inpt) - 1, 0, -1):
            inpt[i].mul_(lam).add_(inpt[i - 1], alpha=1.0 - lam)
        inpt[0].mul_(lam).add_(last, alpha=1.0 - lam)
        return inpt


class InPlaceCutMix(v2.CutMix):
    """``v2.CutMix`` (same box) writing into the batch it is given: only the patch is copied."""

    def transform(self, inpt, params):
        if inpt is params["labels"]:
            return super().transform(inpt, params)
        self._check_image_or_video(inpt, batch_size=params["batch_size"])
        x1, y1, x2, y2 = params["box"]
        inpt[..., y1:y2, x1:x2] = inpt[..., y1:y2, x1:x2].roll(1, 0)
        return inpt


class DeferredMix:
    """Records the MixUp / CutMix it is asked to apply to a batch's images instead of applying it (the
    labels are mixed as usual): ``("mixup", lam)`` or ``("cutmix", x1, y1, x2, y2)`` in :attr:`recorded`."""

    def __init__(self):
        self.recorded = None


class RecordsImageMix:
    """Mixed into ``v2.MixUp`` / ``v2.CutMix``: the labels are mixed, the images left, the draw recorded in
    ``record`` (a :class:`DeferredMix`)."""

    record: DeferredMix

    def transform(self, inpt, params):
        if inpt is params["labels"]:
            return super().transform(inpt, params)
        self.record.recorded = ("cutmix", *(int(v) for v in params["box"])) if "box" in params else \
            ("mixup", params["lam"])
        return inpt


class RecordedMixUp(RecordsImageMix, v2.MixUp):
    pass


class RecordedCutMix(RecordsImageMix, v2.CutMix):
    pass


class MixCollate:
    """Collate (dropping and counting skipped images), then apply MixUp or CutMix (one chosen
    per batch) to images and targets. Targets become soft ``(B, num_classes)`` probabilities.
    With ``on_device`` the images are left as they are and ``batch["mix"]`` says what
    :func:`finish_on_device` applies (host values: reading them costs the device nothing)."""

    def __init__(self, num_classes: int, mixup_alpha: float, cutmix_alpha: float, on_device: bool = False):
        self.deferred = DeferredMix() if on_device else None
        choices = []
        if mixup_alpha > 0:
            choices.append((RecordedMixUp if on_device else InPlaceMixUp)(alpha=mixup_alpha, num_classes=num_classes))
        if cutmix_alpha > 0:
            choices.append((RecordedCutMix if on_device else InPlaceCutMix)(alpha=cutmix_alpha, num_classes=num_classes))
        for choice in choices:
            choice.record = self.deferred
        self.mix = v2.RandomChoice(choices)

    def __call__(self, batch: list) -> dict:
        out = collate_skipping(batch)
        if "image" in out:  # an all-skipped batch is only {"skipped": n}
            out["image"], out["target"] = self.mix(out["image"], out["target"])
            if self.deferred is not None:
                out["mix"] = self.deferred.recorded
        return out
