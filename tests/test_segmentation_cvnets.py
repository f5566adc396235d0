"""CVNets' segmentation training augmentation (datamodules/segmentation_cvnets.py), rule by rule
against CVNets' data/transforms/image_pil.py written out here independently."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision import tv_tensors

from datamodules.segmentation import IGNORE_INDEX, SegmentationDataModule, write_voc_demo
from datamodules.segmentation_cvnets import (
    CROP_ATTEMPTS,
    ClassRatioCrop,
    CvnetsTrainTransform,
    RandomShortSideResize,
    class_ratio_crop_window,
    short_side_resize_size,
)

PLAIN = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))


def cvnets_ratio(window: np.ndarray, ignore: int | None) -> float | None:
    """CVNets' ``get_params_from_mask`` ratio: most frequent counted label / counted pixels."""
    counted = window.ravel() if ignore is None else window[window != ignore]
    if counted.size == 0:
        return None
    counts = np.bincount(counted)
    return counts.max() / counts.sum()


# -- RandomShortSizeResize ---------------------------------------------------------------------------------
@pytest.mark.parametrize("height, width, short, expected", [
    (375, 500, 256, (256, 341)),     # short side to 256, long side int(500 * 256 / 375)
    (375, 500, 768, (768, 1024)),    # 1024 exactly: the cap does not bind
    (500, 2000, 700, (256, 1024)),   # the cap binds: long side 1024, short side follows
    (1200, 900, 300, (400, 300)),    # portrait
])
def test_short_side_resize_size_follows_cvnets(height, width, short, expected):
    assert short_side_resize_size(height, width, short, 1024) == expected


def test_random_short_side_stays_in_range_and_long_side_capped():
    resize = RandomShortSideResize((256, 768), 1024)
    shorts = set()
    for seed, (h, w) in enumerate([(375, 500)] * 300 + [(480, 1900)] * 50):
        torch.manual_seed(seed)
        oh, ow = resize.make_params([tv_tensors.Image(torch.zeros(3, h, w, dtype=torch.uint8))])["size"]
        assert max(oh, ow) <= 1024
        # the size CVNets' rule gives for some short side drawn from the integers [256, 768]
        drawn = [s for s in range(256, 769) if short_side_resize_size(h, w, s, 1024) == (oh, ow)]
        assert drawn, (h, w, oh, ow)
        if (h, w) == (375, 500):  # the cap never binds here
            shorts.add(drawn[0])
        else:  # 480 x 1900: a short side above 258 hits the cap
            assert ow == 1024 or drawn[0] <= 258
    assert min(shorts) <= 262 and max(shorts) >= 762  # the whole range is drawn, ends included
    # the drawn size is applied to image and mask alike
    image, mask = resize(tv_tensors.Image(torch.zeros(3, 60, 80, dtype=torch.uint8)),
                         tv_tensors.Mask(torch.zeros(60, 80, dtype=torch.uint8)))
    assert image.shape[-2:] == mask.shape and min(mask.shape) >= 255


# -- RandomCrop with seg_class_max_ratio --------------------------------------------------------------------
def mostly_one_class(size=96, block=24):
    """Class 1 everywhere but a ``block`` x ``block`` square of class 2 in the top-left corner."""
    labels = np.ones((size, size), np.uint8)
    labels[:block, :block] = 2
    return labels


def test_crop_never_keeps_a_dominated_window_unless_retries_ran_out():
    labels = torch.from_numpy(mostly_one_class())
    balanced = ran_out = 0
    for seed in range(200):
        torch.manual_seed(seed)
        top, left, checked = class_ratio_crop_window(labels, 32, 32, 0.75)
        ratio = cvnets_ratio(labels[top:top + 32, left:left + 32].numpy(), IGNORE_INDEX)
        if ratio < 0.75:
            balanced += 1
        else:  # only when all 10 checks failed, and then the 11th window is taken unchecked
            assert checked == CROP_ATTEMPTS
            ran_out += 1
    # a uniform window is balanced with probability ~4 %; the retries must raise that a lot
    assert balanced > 40 and ran_out > 0


def test_crop_takes_the_window_drawn_after_the_tenth_failed_check():
    labels = torch.ones(50, 60, dtype=torch.uint8)  # one class: every check fails
    torch.manual_seed(7)
    top, left, checked = class_ratio_crop_window(labels, 20, 20, 0.75)
    torch.manual_seed(7)
    draws = [(int(torch.randint(0, 31, ())), int(torch.randint(0, 41, ()))) for _ in range(CROP_ATTEMPTS + 1)]
    assert checked == CROP_ATTEMPTS and (top, left) == draws[-1]


def test_crop_ratio_leaves_the_ignore_label_out_unless_told_to_count_it():
    # window: half class 1, half class 2 on its left column band, the rest ignored
    labels = torch.full((20, 20), IGNORE_INDEX, dtype=torch.uint8)
    labels[:, :2] = 1
    labels[:, 2:4] = 2
    assert class_ratio_crop_window(labels, 20, 20, 0.75)[2] == 1  # 50 % of counted pixels: taken at once
    assert class_ratio_crop_window(labels, 20, 20, 0.75, ignore_index=None)[2] == CROP_ATTEMPTS  # 80 % "255"
    labels[:, 2:4] = 1
    assert class_ratio_crop_window(labels, 20, 20, 0.75)[2] == CROP_ATTEMPTS  # one counted class: 100 %
    # a window with no counted pixel is kept as it is (CVNets `continue`s without drawing another)
    assert class_ratio_crop_window(torch.full((20, 20), IGNORE_INDEX, dtype=torch.uint8), 20, 20, 0.75)[2] == 1


def test_crop_pads_right_and_bottom_with_zero_and_the_mask_fill():
    image = torch.randint(1, 255, (3, 20, 30), dtype=torch.uint8)
    labels = torch.randint(0, 21, (20, 30), dtype=torch.uint8)
    out_image, out_mask = ClassRatioCrop(32, 0.75)(tv_tensors.Image(image), tv_tensors.Mask(labels))
    assert out_image.shape == (3, 32, 32) and out_mask.shape == (32, 32)
    assert torch.equal(out_image[:, :20, :30], image) and torch.equal(out_mask[:20, :30], labels)
    assert (out_image[:, 20:] == 0).all() and (out_image[:, :, 30:] == 0).all()
    assert (out_mask[20:] == IGNORE_INDEX).all() and (out_mask[:, 30:] == IGNORE_INDEX).all()


# -- the whole pipeline -----------------------------------------------------------------------------------
def label_scene(height=300, width=420, block=30, seed=0):
    """Labels in blocks of ``block`` pixels (0..20) and an image whose grey level is 10 x the label."""
    rng = np.random.default_rng(seed)
    grid = rng.integers(0, 21, (height // block + 1, width // block + 1))
    labels = np.kron(grid, np.ones((block, block), np.int64))[:height, :width].astype(np.uint8)
    image = np.repeat((labels.astype(np.uint8) * 10)[..., None], 3, axis=2)
    return image, labels


def uniform_neighbourhood(mask: np.ndarray, radius: int = 3) -> np.ndarray:
    """Pixels whose (2r+1)^2 neighbourhood holds one mask value (away from edges, where resampling mixes)."""
    h, w = mask.shape
    padded = np.pad(mask.astype(np.int64), radius, constant_values=-1)
    same = np.ones((h, w), bool)
    for dy in range(2 * radius + 1):
        for dx in range(2 * radius + 1):
            same &= padded[dy:dy + h, dx:dx + w] == mask
    return same


@pytest.mark.parametrize("seed", range(6))
def test_image_and_mask_stay_aligned(seed):
    image, labels = label_scene(seed=seed)  # short side 300 resized below the crop: padding in every sample
    transform = CvnetsTrainTransform(crop_size=256, short_side_range=(180, 250), max_image_side=520,
                                     seg_class_max_ratio=0.75, photometric=0.0, blur=0.0, **PLAIN)
    transform.set_random_seed(seed)
    out = transform(image=image, mask=labels)
    grey, mask = (out["image"] * 255).round().numpy(), out["mask"].numpy()
    assert out["image"].shape == (3, 256, 256) and mask.shape == (256, 256) and out["mask"].dtype == torch.uint8
    inside = uniform_neighbourhood(mask)
    labelled = inside & (mask != IGNORE_INDEX)
    assert labelled.sum() > 5000
    assert np.abs(grey[0][labelled] - 10.0 * mask[labelled]).max() <= 2
    # padding and rotated-in corners: ignore in the mask, black in the image
    filled = inside & (mask == IGNORE_INDEX)
    assert filled.any() and np.abs(grey[0][filled]).max() <= 2
    assert set(np.unique(mask)) <= set(range(21)) | {IGNORE_INDEX}


def test_rotation_fills_the_mask_with_ignore_never_background():
    image, labels = np.full((300, 300, 3), 90, np.uint8), np.full((300, 300), 7, np.uint8)
    transform = CvnetsTrainTransform(crop_size=256, short_side_range=(300, 300), max_image_side=1024,
                                     seg_class_max_ratio=1.0, hflip=0.0, photometric=0.0, blur=0.0, **PLAIN)
    for seed in range(3):
        transform.set_random_seed(seed)
        mask = transform(image=image, mask=labels)["mask"]
        assert set(mask.unique().tolist()) == {7, IGNORE_INDEX}  # rotation is always applied, as in CVNets


def test_augmentation_is_a_function_of_the_seed_and_leaves_the_global_rng_alone():
    image, labels = label_scene()
    transform = CvnetsTrainTransform(crop_size=128, **PLAIN)

    def draw(seed):
        transform.set_random_seed(seed)
        return transform(image=image, mask=labels)

    torch.manual_seed(123)
    state = torch.get_rng_state()
    first, again, other = draw(5), draw(5), draw(6)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first["image"], again["image"]) and torch.equal(first["mask"], again["mask"])
    assert not torch.equal(first["image"], other["image"])


def test_datamodule_selects_the_cvnets_pipeline(tmp_path):
    root = write_voc_demo(tmp_path / "VOC2012", {"train": 3, "val": 1})
    dm = SegmentationDataModule(root=str(root), augmentation="cvnets", crop_size=64, short_side_range=(48, 160),
                                max_image_side=200, batch_size=2, num_workers=0)
    transform = dm.train_transform()
    assert isinstance(transform, CvnetsTrainTransform)
    crop = transform.pipeline.transforms[2]
    assert isinstance(crop, ClassRatioCrop) and crop.ignore_index == IGNORE_INDEX and crop.mask_fill == IGNORE_INDEX
    ade = SegmentationDataModule(root=str(tmp_path), dataset="ade20k", augmentation="cvnets")
    assert ade.train_transform().pipeline.transforms[2].ignore_index is None  # CVNets counts every ADE20k pixel
    dm.setup("fit")

    def item(seed):
        torch.manual_seed(seed)
        return dm.train_set[0]

    first, again = item(1), item(1)
    assert torch.equal(first["image"], again["image"]) and torch.equal(first["mask"], again["mask"])
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (2, 3, 64, 64) and batch["mask"].shape == (2, 64, 64)
    assert batch["mask"].dtype == torch.int64
    with pytest.raises(ValueError, match="augmentation must be"):
        SegmentationDataModule(root=str(root), augmentation="mmseg")
