"""The one-pass SSD augmentation and the faster classification kernels, against torchvision.

torchvision's own transforms are the reference: with the same seed the new pipelines draw the same
random parameters (the SSD crop's trials excepted), so geometry, pixels and mixing are compared
sample by sample, and the documented differences are bounded.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from datamodules.classification_transforms import FastRandAugment, MixCollate, eval_transform as classify_eval
from datamodules.classification_transforms import train_transform as classify_train
from datamodules.detection_transforms import (CVNetsPhotometricDistortion, CVNetsSSDTrainTransform,
                                              PhotometricDistortion, SSDTrainTransform, cvnets_crop_window,
                                              detection_train_transform, eval_transform, iou_crop_window, shift_hue,
                                              ssd_train_transform)
from datamodules.loaders import SeededSamples, run_seeded

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def photo(height: int = 90, width: int = 120, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def detection_target(boxes, labels, height: int = 90, width: int = 120) -> dict:
    return {"boxes": tv_tensors.BoundingBoxes(torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4), format="XYXY",
                                              canvas_size=(height, width)),
            "labels": torch.tensor(labels)}


def torchvision_ssd_chain(size: int, photometric: float, zoom_out_max: float, hflip: float) -> v2.Compose:
    """The SSD chain of torchvision transforms (no IoU crop: its trials are drawn differently)."""
    fill = {tv_tensors.Image: [round(255 * m) for m in MEAN], "others": 0}
    return v2.Compose([v2.RandomPhotometricDistort(p=photometric),
                       v2.RandomZoomOut(fill=fill, side_range=(1.0, zoom_out_max), p=0.5),
                       v2.RandomHorizontalFlip(hflip), v2.Resize((size, size), antialias=True),
                       v2.ClampBoundingBoxes(), v2.SanitizeBoundingBoxes(min_size=1.0),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


# -- detection ---------------------------------------------------------------------------------------
def test_ssd_draws_the_torchvision_chains_zoom_out_and_flip_and_keeps_its_geometry():
    """Same seed, same photometric factors, zoom-out and flip as torchvision's chain: boxes agree to
    half an output pixel (the photo lands on whole pixels), labels agree except for boxes that end at
    the 1-pixel size limit; with photometric distortion off, the pixels are the chain's without
    zoom-out and within half an output pixel's worth of gradient with it."""
    # smooth, so that a photo moved by under half an output pixel changes its pixels by little
    y, x = torch.meshgrid(torch.arange(90.0), torch.arange(120.0), indexing="ij")
    image = torch.stack([2 * x, 2.5 * y, x + y]).clamp(0, 255).to(torch.uint8)
    boxes = [[10, 20, 60, 80], [70, 30, 118, 88], [100, 5, 104, 9], [0, 0, 120, 90], [40, 40, 41, 70]]
    zoomed_out = exact = 0
    for photometric in (0.5, 0.0):
        ours = SSDTrainTransform(64, MEAN, STD, zoom_out_max=3.0, iou_crop=False, photometric=photometric)
        theirs = torchvision_ssd_chain(64, photometric, zoom_out_max=3.0, hflip=0.5)
        for seed in range(30):
            torch.manual_seed(seed)
            ref_image, ref = theirs(tv_tensors.Image(image), detection_target(boxes, [1, 2, 3, 4, 5]))
            torch.manual_seed(seed)
            out_image, out = ours(tv_tensors.Image(image), detection_target(boxes, [1, 2, 3, 4, 5]))
            ref_boxes = dict(zip(ref["labels"].tolist(), ref["boxes"]))
            out_boxes = dict(zip(out["labels"].tolist(), out["boxes"]))
            for label in set(ref_boxes) ^ set(out_boxes):  # kept by one side only: at the size limit
                box = ref_boxes.get(label, out_boxes.get(label))
                assert min(box[2] - box[0], box[3] - box[1]) < 1.6, (seed, label, box)
            for label in set(ref_boxes) & set(out_boxes):
                torch.testing.assert_close(out_boxes[label], ref_boxes[label], atol=0.5, rtol=0)
            if photometric == 0.0:
                if out["boxes"].shape == ref["boxes"].shape and torch.allclose(out["boxes"], ref["boxes"]):
                    torch.testing.assert_close(out_image, ref_image, atol=1e-6, rtol=0)  # no zoom-out
                    exact += 1
                else:
                    zoomed_out += 1  # inside the photo, away from its edge (label 4 frames the photo)
                    x0, y0, x1, y1 = (round(v) for v in ref_boxes[4].tolist())
                    inside = (out_image - ref_image)[:, y0 + 2:y1 - 2, x0 + 2:x1 - 2].abs()
                    # the photo moves by at most half an output pixel in x and in y; its steepest
                    # gradient is 2.5 grey levels per photo pixel; plus one level of rounding
                    photo_pixels = max(120 / (x1 - x0), 90 / (y1 - y0))
                    grey_levels = 0.5 * 2.5 * photo_pixels * 2 + 1
                    assert inside.max() <= grey_levels / 255 / min(STD), seed
    assert exact > 10 and zoomed_out > 10


def test_iou_crop_windows_follow_torchvision_distribution():
    """The crop's trials are drawn at once, not one by one: over the same seeds, how often there is
    no crop, the windows' area and aspect ratio and how many objects they keep match torchvision's
    RandomIoUCrop (4 standard errors)."""
    boxes = torch.tensor([[5.0, 5, 60, 50], [40, 30, 95, 75], [70, 5, 85, 20]])
    image = tv_tensors.Image(torch.zeros(3, 80, 100, dtype=torch.uint8))
    theirs, ours = [], []
    for seed in range(200):
        torch.manual_seed(seed)
        out, target = v2.RandomIoUCrop()(image, {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY",
                                                                                    canvas_size=(80, 100))})
        cropped = out.shape[-2:] != image.shape[-2:] or not torch.equal(target["boxes"], boxes)
        kept = int(((target["boxes"][:, 2:] - target["boxes"][:, :2]) > 0).all(1).sum())
        theirs.append((cropped, out.shape[-1] * out.shape[-2] / 8000, out.shape[-1] / out.shape[-2], kept))
        torch.manual_seed(seed)
        window = iou_crop_window(boxes, 100, 80)
        if window is None:
            ours.append((False, 1.0, 100 / 80, 3))
        else:
            left, top, right, bottom, inside = window
            ours.append((True, (right - left) * (bottom - top) / 8000, (right - left) / (bottom - top),
                         int(inside.sum())))
    theirs, ours = torch.tensor(theirs, dtype=torch.float64), torch.tensor(ours, dtype=torch.float64)
    for column in range(4):
        standard_error = (theirs[:, column].var() / len(theirs) * 2).sqrt()
        assert abs(theirs[:, column].mean() - ours[:, column].mean()) < 4 * standard_error, column


@pytest.mark.parametrize("hue", [-0.5, -0.05, 0.0, 0.03, 0.5])
def test_shift_hue_equals_torchvision_adjust_hue(hue):
    image = torch.rand(3, 24, 40, generator=torch.Generator().manual_seed(1))
    image[:, :4] = 0.5  # grey: no hue
    image[:, 4:8] = torch.tensor([0.8, 0.8, 0.2]).view(3, 1, 1)  # two channels tie for the maximum
    image[:, 8:12] = torch.tensor([0.2, 0.8, 0.8]).view(3, 1, 1)
    image[:, 12:16] = torch.tensor([0.8, 0.2, 0.8]).view(3, 1, 1)
    torch.testing.assert_close(shift_hue(image, hue), F.adjust_hue(image, hue), atol=1e-5, rtol=0)


def test_photometric_distortion_equals_torchvision_on_float_images():
    """Same draws in the same order (factors, contrast before or after, channel order)."""
    image = torch.rand(3, 20, 30, generator=torch.Generator().manual_seed(2))
    ours, theirs = PhotometricDistortion(p=0.5), v2.RandomPhotometricDistort(p=0.5)
    for seed in range(40):
        torch.manual_seed(seed)
        expected = theirs(image)
        torch.manual_seed(seed)
        torch.testing.assert_close(ours(image), expected, atol=1e-5, rtol=0)


def bright_squares(height: int = 120, width: int = 160):
    """Dark photo with a large (label 1) and a small (label 2) bright square."""
    pixels = torch.full((3, height, width), 30, dtype=torch.uint8)
    pixels[:, 20:80, 20:80] = 250
    pixels[:, 70:90, 110:130] = 250
    return pixels, [[20, 20, 80, 80], [110, 70, 130, 90]], [1, 2]


def test_every_box_frames_its_own_square_after_the_full_recipe():
    """Zoom-out, IoU crop, flip and photometric distortion: each kept box still frames bright pixels
    with dark ones around it, and the large square's label stays on the larger box."""
    pixels, boxes, labels = bright_squares()
    transform = ssd_train_transform(96, MEAN, STD, zoom_out_max=4.0, iou_crop=True, hflip=0.5)
    both = 0
    for seed in range(60):
        torch.manual_seed(seed)
        image, out = transform(tv_tensors.Image(pixels), detection_target(boxes, labels, 120, 160))
        assert image.shape == (3, 96, 96) and len(out["boxes"]) == len(out["labels"])
        brightness = image.mean(0)
        threshold = 0.5 * (brightness.max() + brightness.min())
        sizes = {}
        for label, box in zip(out["labels"].tolist(), out["boxes"]):
            sizes[label] = float((box[2] - box[0]) * (box[3] - box[1]))
            # pixels wholly inside the box are bright, those wholly outside it (2 around) dark
            x0, y0 = box[:2].ceil().int().tolist()
            x1, y1 = box[2:].floor().int().tolist()
            assert (brightness[y0:y1, x0:x1] > threshold).all(), (seed, label)
            x0, y0 = box[:2].floor().int().tolist()
            x1, y1 = box[2:].ceil().int().tolist()
            ring = torch.zeros(96, 96, dtype=torch.bool)
            ring[max(y0 - 2, 0):y1 + 2, max(x0 - 2, 0):x1 + 2] = True
            ring[y0:y1, x0:x1] = False
            assert (brightness[ring] < threshold).all(), (seed, label)
        if len(sizes) == 2:
            both += 1
            assert sizes[1] > sizes[2]
    assert both > 10


def test_flip_mirrors_pixels_and_boxes():
    image = photo(40, 50)
    transform = SSDTrainTransform(32, MEAN, STD, zoom_out_max=1.0, iou_crop=False, hflip=1.0, photometric=0.0)
    out_image, out = transform(tv_tensors.Image(image), detection_target([[5, 10, 20, 30]], [7], 40, 50))
    resized = F.normalize(F.to_dtype(F.resize(image, [32, 32], antialias=True), torch.float32, scale=True), MEAN, STD)
    torch.testing.assert_close(out_image, resized.flip(-1), atol=1e-6, rtol=0)
    x0, x1 = 5 * 32 / 50, 20 * 32 / 50
    torch.testing.assert_close(out["boxes"], torch.tensor([[32 - x1, 10 * 32 / 40, 32 - x0, 30 * 32 / 40]]))
    assert out["labels"].tolist() == [7]


def test_boxes_too_small_for_the_output_are_dropped_with_their_labels_as_torchvision_does():
    boxes = [[0, 0, 200, 100], [10, 10, 11, 60], [50, 50, 90, 51], [100, 20, 160, 80], [198, 98, 200, 100]]
    labels = [1, 2, 3, 4, 5]
    image = photo(100, 200)
    reference = v2.Compose([v2.Resize((50, 50), antialias=True), v2.ClampBoundingBoxes(),
                            v2.SanitizeBoundingBoxes(min_size=1.0)])
    _, expected = reference(tv_tensors.Image(image), detection_target(boxes, labels, 100, 200))
    transform = SSDTrainTransform(50, MEAN, STD, zoom_out_max=1.0, iou_crop=False, hflip=0.0)
    _, out = transform(tv_tensors.Image(image), detection_target(boxes, labels, 100, 200))
    assert out["labels"].tolist() == expected["labels"].tolist() == [1, 4]
    torch.testing.assert_close(out["boxes"], expected["boxes"])


def test_output_contract_and_normalisation():
    """Types, shapes and dtypes of torchvision's chain; a uniform photo maps to (v / 255 - mean) / std
    and the zoom-out's fill to the mean colour in 8 bits; other target keys pass through."""
    value = 200
    image = torch.full((3, 60, 80), value, dtype=torch.uint8)
    transform = SSDTrainTransform(48, MEAN, STD, zoom_out_max=4.0, iou_crop=False, hflip=0.5, photometric=0.0)
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    fill = (torch.tensor([round(255 * m) for m in MEAN]).view(3, 1, 1) / 255 - mean) / std
    photo_value = (value / 255 - mean) / std
    seen_fill = False
    for seed in range(8):
        torch.manual_seed(seed)
        target = {**detection_target([[10, 10, 50, 40]], [3], 60, 80), "image_id": 17}
        out_image, out = transform(tv_tensors.Image(image), target)
        assert isinstance(out_image, tv_tensors.Image) and out_image.dtype == torch.float32
        assert out_image.shape == (3, 48, 48)
        assert isinstance(out["boxes"], tv_tensors.BoundingBoxes) and out["boxes"].format.name == "XYXY"
        assert tuple(out["boxes"].canvas_size) == (48, 48) and out["boxes"].dtype == torch.float32
        assert out["labels"].dtype == torch.int64 and out["image_id"] == 17
        is_photo = torch.isclose(out_image, photo_value.expand_as(out_image), atol=1e-5).all(0)
        is_fill = torch.isclose(out_image, fill.expand_as(out_image), atol=1e-5).all(0)
        assert (is_photo | is_fill).all()
        seen_fill |= bool(is_fill.any())
    assert seen_fill


def test_same_seed_same_sample_under_seeded_samples():
    """All randomness comes from torch's global RNG, which SeededSamples seeds per sample: a
    replayed (index, seed) gives the same item, another seed another one."""
    pixels, boxes, labels = bright_squares()
    transform = ssd_train_transform(64, MEAN, STD)

    class Scene(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, index):
            return transform(tv_tensors.Image(pixels), detection_target(boxes, labels, 120, 160))

    samples = SeededSamples(Scene())
    first, again, other = samples[(0, 123)], samples[(0, 123)], [samples[(0, s)] for s in range(1, 9)]
    torch.testing.assert_close(first[0], again[0], rtol=0, atol=0)
    torch.testing.assert_close(first[1]["boxes"], again[1]["boxes"], rtol=0, atol=0)
    assert any(o[0].shape != first[0].shape or not torch.equal(o[0], first[0]) for o in other)


def test_images_without_objects_pass():
    transform = ssd_train_transform(32, MEAN, STD)
    for seed in range(5):
        torch.manual_seed(seed)
        out_image, out = transform(tv_tensors.Image(photo(30, 40)), detection_target(torch.zeros(0, 4), [], 30, 40))
        assert out_image.shape == (3, 32, 32) and out["boxes"].shape == (0, 4) and len(out["labels"]) == 0


def test_non_uint8_input_is_refused_naming_what_it_got():
    with pytest.raises(TypeError, match="uint8.*float32"):
        ssd_train_transform(32, MEAN, STD)(photo().float(), detection_target([[1, 1, 5, 5]], [1]))


def test_eval_transform_scales_boxes_onto_the_resized_square():
    pixels, boxes, labels = bright_squares()
    image, out = eval_transform(60, MEAN, STD)(tv_tensors.Image(pixels), detection_target(boxes, labels, 120, 160))
    assert image.shape == (3, 60, 60) and image.dtype == torch.float32
    x0, y0, x1, y1 = out["boxes"][0].tolist()
    scale = torch.tensor([60 / 160, 60 / 120, 60 / 160, 60 / 120])
    torch.testing.assert_close(out["boxes"][0], torch.tensor([20.0, 20, 80, 80]) * scale)
    brightness = image.mean(0)
    assert (brightness[round(y0) + 1:round(y1) - 1, round(x0) + 1:round(x1) - 1] > brightness.mean()).all()


# -- classification ----------------------------------------------------------------------------------
def test_fast_randaugment_ops_equal_torchvision_ops():
    """Every op of the table at both signs, on a non-square image: at most one grey level apart,
    on rounding ties only."""
    image = photo(48, 64, seed=3)
    theirs = v2.RandAugment(magnitude=9, interpolation=v2.InterpolationMode.BILINEAR)
    ours = FastRandAugment(magnitude=9, interpolation=v2.InterpolationMode.BILINEAR)
    for op, (magnitudes, signed) in theirs._AUGMENTATION_SPACE.items():
        values = magnitudes(31, 48, 64)
        magnitude = 0.0 if values is None else float(values[9])
        for sign in (1, -1) if signed else (1,):
            expected = theirs._apply_image_or_video_transform(image, op, sign * magnitude, theirs.interpolation,
                                                              theirs._fill)
            got = ours._apply_image_or_video_transform(image, op, sign * magnitude, ours.interpolation, ours._fill)
            assert got.dtype == torch.uint8 and got.shape == expected.shape
            difference = (got.int() - expected.int()).abs()
            assert difference.max() <= 1 and (difference > 0).float().mean() < 0.01, (op, sign)


def test_classification_train_transform_equals_torchvision_pipeline_for_a_seed():
    image = photo(75, 100, seed=4)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.3, 0.4)
    ours = classify_train(48, (0.08, 1.0), 0.5, True, 9, 0.25, mean, std, "bicubic")
    theirs = v2.Compose([v2.RandomResizedCrop(48, scale=(0.08, 1.0), interpolation=v2.InterpolationMode.BICUBIC,
                                              antialias=True), v2.RandomHorizontalFlip(0.5),
                         v2.RandAugment(magnitude=9, interpolation=v2.InterpolationMode.BILINEAR),
                         v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std),
                         v2.RandomErasing(p=0.25, value=0)])
    grey_level = 1 / 255 / min(std)
    for seed in range(30):
        torch.manual_seed(seed)
        expected = theirs(image)
        torch.manual_seed(seed)
        got = ours(image)
        assert got.dtype == torch.float32 and got.shape == (3, 48, 48)
        assert (got - expected).abs().max() <= 2 * grey_level + 1e-5, seed  # two ops, one level each


def test_unnormalised_recipes_get_pixels_over_255():
    image = photo(40, 40, seed=5)
    out = classify_eval(32, 32, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), "bilinear")(image)
    torch.testing.assert_close(out, F.center_crop(F.resize(image, 32, antialias=True), 32).float() / 255)


def labelled_items(count: int = 6) -> list:
    images = torch.rand(count, 3, 16, 20, generator=torch.Generator().manual_seed(6))
    return [{"image": images[i], "target": i % 3, "index": i, "path": f"{i}.jpg"} for i in range(count)]


@pytest.mark.parametrize("mixup_alpha, cutmix_alpha", [(0.2, 1.0), (0.2, 0.0), (0.0, 1.0)])
def test_mix_collate_equals_torchvision_mixup_and_cutmix(mixup_alpha, cutmix_alpha):
    choices = ([v2.MixUp(alpha=mixup_alpha, num_classes=3)] if mixup_alpha else []) + \
              ([v2.CutMix(alpha=cutmix_alpha, num_classes=3)] if cutmix_alpha else [])
    reference = v2.RandomChoice(choices)
    collate = MixCollate(3, mixup_alpha, cutmix_alpha)
    for seed in range(6):
        items = labelled_items()
        images = torch.stack([item["image"] for item in items])
        torch.manual_seed(seed)
        expected_images, expected_targets = reference(images.clone(), torch.tensor([item["target"] for item in items]))
        torch.manual_seed(seed)
        batch = collate(items[:2] + [None] + items[2:])
        torch.testing.assert_close(batch["image"], expected_images, atol=1e-6, rtol=0)
        torch.testing.assert_close(batch["target"], expected_targets, atol=1e-6, rtol=0)
        assert batch["skipped"] == 1 and batch["index"].tolist() == list(range(6))


# -- CVNets' SSD pipeline (CVNets data/transforms/image_pil.py: SSDCroping, PhotometricDistort, flip, Resize) ---------
def random_boxes(count: int, width: int, height: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    corner = rng.uniform(0, 1, (count, 2)) * [width - 10, height - 10]
    size = rng.uniform(0.05, 0.6, (count, 2)) * [width, height]
    return np.concatenate([corner, np.minimum(corner + size, [width, height])], axis=1).astype(np.float32)


@pytest.mark.parametrize("threshold", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_cvnets_crop_meets_its_drawn_iou_with_some_box_and_keeps_only_centres_inside(threshold):
    """CVNets' rules, checked with torchvision's box_iou: the window's IoU with *some* box (centre inside
    or not) reaches the drawn threshold, sides are 0.3-1x the photo's and at least 100 px, height / width is
    0.5-2, and the kept boxes are exactly those whose centre lies strictly inside."""
    from torchvision.ops import box_iou

    width, height = 400, 300
    for seed in range(25):
        # one large box makes every threshold reachable in a few picks
        boxes = np.concatenate([random_boxes(5, width, height, seed), [[20, 10, 380, 290]]]).astype(np.float32)
        random.seed(seed)
        left, top, right, bottom, inside = cvnets_crop_window(boxes, width, height, iou_thresholds=(threshold,))
        new_width, new_height = right - left, bottom - top
        assert 0.3 * width - 1 <= new_width <= width and 0.3 * height - 1 <= new_height <= height
        assert new_width >= 100 and new_height >= 100 and 0.5 <= new_height / new_width <= 2.0
        assert 0 <= left and right <= width and 0 <= top and bottom <= height
        iou = box_iou(torch.tensor([[left, top, right, bottom]], dtype=torch.float32), torch.from_numpy(boxes))[0]
        assert iou.max() >= threshold - 1e-6, (seed, iou.max())
        cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
        expected = (left < cx) & (cx < right) & (top < cy) & (cy < bottom)
        assert inside.tolist() == expected.tolist() and inside.any()


def test_cvnets_crop_zero_threshold_means_no_crop_and_windows_under_100_px_are_refused():
    """Unlike torchvision (where 1.0 means "no crop"), CVNets' 0.0 leaves the photo whole; on a photo whose
    windows cannot reach 100 px only that choice ends the search."""
    boxes = random_boxes(3, 400, 300, 0)
    random.seed(0)
    assert cvnets_crop_window(boxes, 400, 300, iou_thresholds=(0.0,)) is None
    small = random_boxes(3, 90, 90, 1)
    for seed in range(10):
        random.seed(seed)
        assert cvnets_crop_window(small, 90, 90, iou_thresholds=(0.0, 0.1, 0.5)) is None


def test_cvnets_photometric_decisions_follow_cvnets_draw():
    """CVNets draws np.random.rand(7) and compares each with p: brightness r0, contrast-before r1,
    contrast r2 (before) or r5 (after), saturation r3, hue r4, channel permutation r6."""
    distortion = CVNetsPhotometricDistortion(p=0.5)
    for seed in range(40):
        np.random.seed(seed)
        r = np.random.rand(7) < 0.5
        np.random.seed(seed)
        params = distortion.draw()
        applied = {name: params[name] is not None for name in ("brightness", "saturation", "hue", "contrast")}
        assert applied == {"brightness": r[0], "saturation": r[3], "hue": r[4], "contrast": r[2] if r[1] else r[5]}
        assert params["contrast_before"] == r[1] and (params["channels"] is not None) == r[6]
        for name in ("brightness", "contrast", "saturation", "hue"):
            if params[name] is not None:
                low, high = distortion.ranges[name]
                assert low <= params[name] <= high


def test_cvnets_pipeline_never_zooms_out_and_boxes_frame_their_squares():
    """No zoom-out: with no distortion, a photo without any fill-coloured pixel gives an output without
    one either (every output pixel comes from the photo), and each kept box frames its bright square."""
    pixels, boxes, labels = bright_squares(300, 400)
    pixels[:, 60:200, 60:200] = 250
    pixels[:, 200:240, 300:340] = 250
    boxes = [[60, 60, 200, 200], [300, 200, 340, 240]]
    transform = CVNetsSSDTrainTransform(96, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), photometric=0.0)
    cropped = 0
    for seed in range(40):
        random.seed(seed)
        np.random.seed(seed)
        image, out = transform(tv_tensors.Image(pixels), detection_target(boxes, labels, 300, 400))
        assert image.shape == (3, 96, 96)
        # the same draws on a uniform grey photo: every output pixel is that grey, none is fill
        random.seed(seed)
        np.random.seed(seed)
        grey, _ = transform(tv_tensors.Image(torch.full_like(pixels, 30)), detection_target(boxes, labels, 300, 400))
        torch.testing.assert_close(grey.as_subclass(torch.Tensor), torch.full((3, 96, 96), 30 / 255), rtol=0, atol=1e-6)
        assert (out["boxes"] >= 0).all() and (out["boxes"] <= 96).all()
        brightness = image.mean(0)
        for box in out["boxes"]:
            x0, y0 = box[:2].ceil().int().tolist()
            x1, y1 = box[2:].floor().int().tolist()
            assert (brightness[y0 + 1:y1 - 1, x0 + 1:x1 - 1] > 0.5).all(), seed
        cropped += len(out["boxes"]) < 2 or not torch.allclose(out["boxes"][0], torch.tensor([60, 60, 200, 200]) * 96
                                                               / torch.tensor([400, 300, 400, 300]))
    assert 5 < cropped < 40


def test_cvnets_flip_mirrors_pixels_and_boxes():
    pixels = photo(120, 160)
    boxes, labels = [[10, 20, 50, 100]], [3]
    kept, mirrored = (CVNetsSSDTrainTransform(40, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), iou_crop=False, hflip=p,
                                              photometric=0.0)(tv_tensors.Image(pixels), detection_target(boxes, labels))
                      for p in (0.0, 1.0))
    torch.testing.assert_close(mirrored[0].as_subclass(torch.Tensor), kept[0].as_subclass(torch.Tensor).flip(-1))
    torch.testing.assert_close(kept[1]["boxes"].as_subclass(torch.Tensor), torch.tensor([[2.5, 20 / 3, 12.5, 100 / 3]]))
    torch.testing.assert_close(mirrored[1]["boxes"].as_subclass(torch.Tensor), torch.tensor([[27.5, 20 / 3, 37.5, 100 / 3]]))


def test_cvnets_pipeline_without_boxes_resizes_the_whole_photo():
    pixels = photo(120, 160)
    transform = CVNetsSSDTrainTransform(32, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), hflip=0.0, photometric=0.0)
    image, out = transform(tv_tensors.Image(pixels), detection_target([], []))
    expected = F.resize(pixels, [32, 32], interpolation=v2.InterpolationMode.BICUBIC, antialias=True)
    torch.testing.assert_close(image.as_subclass(torch.Tensor), expected.float() / 255, rtol=0, atol=1e-6)
    assert out["boxes"].shape == (0, 4) and out["labels"].shape == (0,)


def test_cvnets_pipeline_is_reproducible_under_the_per_sample_seed():
    """Its randomness comes from Python's random, numpy and torch, all three seeded by run_seeded: a replayed
    seed gives the same sample (exact resume), other seeds other samples."""
    pixels, boxes, labels = bright_squares(300, 400)
    transform = detection_train_transform("cvnets", 64, MEAN, STD)
    sample = lambda seed: run_seeded(lambda: transform(tv_tensors.Image(pixels),  # noqa: E731
                                                       detection_target(boxes, labels, 300, 400)), seed)
    first, again = sample(7), sample(7)
    torch.testing.assert_close(first[0], again[0], rtol=0, atol=0)
    torch.testing.assert_close(first[1]["boxes"], again[1]["boxes"], rtol=0, atol=0)
    assert any(not torch.equal(sample(s)[0], first[0]) for s in range(8, 14))


def test_training_pipelines_by_name():
    assert isinstance(detection_train_transform("torchvision_ssd", 64, MEAN, STD), SSDTrainTransform)
    assert detection_train_transform("torchvision_ssd", 64, MEAN, STD).zoom_out_max == 4.0
    cvnets = detection_train_transform("cvnets", 64, MEAN, STD, zoom_out_max=1.0)
    assert isinstance(cvnets, CVNetsSSDTrainTransform)
    with pytest.raises(ValueError, match="zoom_out_max=4.0"):
        detection_train_transform("cvnets", 64, MEAN, STD, zoom_out_max=4.0)
    with pytest.raises(ValueError, match="'albumentations'"):
        detection_train_transform("albumentations", 64, MEAN, STD)
