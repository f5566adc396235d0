"""Demo scenes, the COCO-layout writer and the COCO datamodule."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from torchvision import tv_tensors

from datamodules.coco import CocoDataModule, CocoDetection, eval_transform, load_coco, ssd_train_transform
from datamodules.demo_scenes import (Instance, coco_category_id, generate_scenes, make_scene, scene_seed,
                                     split_digits, write_coco_layout)

MEAN, STD = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory):
    """A tiny demo set in the COCO layout (every 4th image has a crowd, every 5th is empty)."""
    root = tmp_path_factory.mktemp("coco")
    write_coco_layout(root, {"train": 12, "val": 8}, size=96, crowd_every=4, empty_every=5)
    return root


def edit_annotations(src, dst, edit) -> None:
    """Copy the COCO set at ``src`` to ``dst`` and apply ``edit(dataset_dict)`` to its val annotations."""
    shutil.copytree(src, dst)
    path = dst / "annotations" / "instances_val2017.json"
    dataset = json.loads(path.read_text())
    edit(dataset)
    path.write_text(json.dumps(dataset))


# -- scenes ------------------------------------------------------------------------------------------
def test_scenes_are_deterministic_and_instances_are_consistent():
    a = make_scene(np.random.default_rng(scene_seed(0, "train", 3)), 96)
    b = make_scene(np.random.default_rng(scene_seed(0, "train", 3)), 96)
    c = make_scene(np.random.default_rng(scene_seed(0, "train", 4)), 96)
    assert np.array_equal(a[0], b[0]) and not np.array_equal(a[0], c[0])
    image, instances = make_scene(np.random.default_rng(1), 96, crowd=True, empty=False, max_instances=4)
    assert image.shape == (96, 96, 3) and image.dtype == np.uint8
    assert all(isinstance(i, Instance) and 0 <= i.label <= 9 and i.mask.shape == (96, 96) and i.mask.any()
               for i in instances)
    assert sum(i.iscrowd for i in instances) == 1
    union = np.sum([i.mask for i in instances], axis=0)
    assert union.max() == 1  # visible masks never overlap
    assert make_scene(np.random.default_rng(1), 96, empty=True)[1] == []


def test_splits_draw_from_disjoint_digits():
    train, val, test = (split_digits(s)[0].reshape(len(split_digits(s)[0]), -1) for s in ("train", "val", "test"))
    assert len(train) + len(val) + len(test) == 1797
    train_rows = {r.tobytes() for r in train}
    # scikit-learn's digits hold a few exact duplicates; the splits share at most those
    assert sum(r.tobytes() in train_rows for r in val) <= 2


def test_generate_scenes_marks_crowds_and_empties():
    scenes = list(generate_scenes("val", 10, size=64, crowd_every=4, empty_every=5))
    assert [i for i, _, inst in scenes if any(x.iscrowd for x in inst)] == [3, 7]
    assert {i for i, _, inst in scenes if not inst} >= {2}


# -- COCO layout --------------------------------------------------------------------------------------
def test_written_layout_reads_back_with_pycocotools(coco_root):
    from pycocotools.coco import COCO

    coco = COCO(str(coco_root / "annotations" / "instances_train2017.json"))
    assert sorted(coco.cats) == [coco_category_id(d) for d in range(10)] == list(range(10, 38, 3))
    assert coco.cats[10]["name"] == "zero" and coco.cats[37]["name"] == "nine"
    assert len(coco.imgs) == 12 and all((coco_root / "train2017" / i["file_name"]).is_file() for i in coco.imgs.values())
    anns = list(coco.anns.values())
    assert any(a["iscrowd"] for a in anns)
    assert any(not coco.getAnnIds(imgIds=i) for i in coco.imgs)  # empty images are listed
    for a in anns:
        mask = coco.annToMask(a)
        assert mask.sum() == a["area"]
        ys, xs = np.nonzero(mask)
        assert a["bbox"] == [xs.min(), ys.min(), xs.max() + 1 - xs.min(), ys.max() + 1 - ys.min()]


# -- datamodule --------------------------------------------------------------------------------------
def test_labels_are_contiguous_and_map_back_to_category_ids(coco_root):
    dm = CocoDataModule(root=str(coco_root), image_size=64, mean=MEAN, std=STD)
    assert dm.num_classes == 10 and dm.category_ids == list(range(10, 38, 3))
    assert dm.category_names[3] == "three"
    dataset = dm.split("val2017")
    coco = load_coco(coco_root / "annotations" / "instances_val2017.json")
    for k, image_id in enumerate(dataset.image_ids):
        file_cats = sorted(a["category_id"] for a in coco.imgToAnns[image_id])
        assert sorted(dm.category_ids[label] for label in dataset.annotation(k)["gt_labels"]) == file_cats


def test_prepared_index_holds_what_pycocotools_reads(coco_root):
    """Every image's ground truth from the prepared index equals pycocotools' read of the file."""
    annotation_file = coco_root / "annotations" / "instances_train2017.json"
    dataset = CocoDetection(coco_root / "train2017", annotation_file, eval_transform(96, MEAN, STD))
    coco = load_coco(annotation_file)
    assert dataset.image_ids.tolist() == sorted(coco.imgs)
    for k, image_id in enumerate(dataset.image_ids.tolist()):
        sample, anns, info = dataset.annotation(k), coco.imgToAnns[image_id], coco.imgs[image_id]
        assert (sample["width"], sample["height"]) == (info["width"], info["height"])
        assert dataset.image_path(k) == coco_root / "train2017" / info["file_name"]
        xywh = np.array([a["bbox"] for a in anns], np.float32).reshape(-1, 4)
        np.testing.assert_allclose(sample["gt_boxes"][:, :2], xywh[:, :2])
        np.testing.assert_allclose(sample["gt_boxes"][:, 2:] - sample["gt_boxes"][:, :2], xywh[:, 2:], atol=1e-4)
        assert [dataset.category_ids[label] for label in sample["gt_labels"]] == [a["category_id"] for a in anns]
        assert sample["gt_iscrowd"].tolist() == [a["iscrowd"] for a in anns]
        assert sample["gt_area"].tolist() == pytest.approx([a["area"] for a in anns])


def test_crowds_stay_out_of_training_targets_but_in_ground_truth(coco_root):
    dataset = CocoDetection(coco_root / "train2017", coco_root / "annotations" / "instances_train2017.json",
                            eval_transform(96, MEAN, STD))
    crowd_images = [i for i in range(len(dataset)) if dataset.annotation(i)["gt_iscrowd"].any()]
    empty_images = [i for i in range(len(dataset)) if len(dataset.annotation(i)["gt_boxes"]) == 0]
    assert crowd_images and empty_images and len(dataset) == 12
    image, target = dataset[crowd_images[0]]
    assert len(target["boxes"]) == len(target["gt_boxes"]) - 1 == int((target["gt_iscrowd"] == 0).sum())
    image, target = dataset[empty_images[0]]
    assert image.shape == (3, 96, 96) and target["boxes"].shape == (0, 4) and target["gt_boxes"].shape == (0, 4)


def test_boxes_are_clipped_and_degenerate_ones_dropped_and_counted(coco_root, tmp_path):
    def edit(dataset):
        anns = dataset["annotations"]
        anns[0]["bbox"] = [-10.0, -5.0, 30.0, 20.0]   # partly outside: clipped to [0, 0, 20, 15]
        anns[1]["bbox"] = [10.0, 10.0, 0.0, 5.0]      # zero width
        anns[2]["bbox"] = [200.0, 10.0, 5.0, 5.0]     # entirely right of the 96 px image
        anns[0]["iscrowd"] = anns[1]["iscrowd"] = anns[2]["iscrowd"] = 0

    edit_annotations(coco_root, tmp_path / "c", edit)
    with pytest.warns(UserWarning, match="dropped 2 boxes"):
        dataset = CocoDetection(tmp_path / "c" / "val2017", tmp_path / "c" / "annotations" / "instances_val2017.json",
                                eval_transform(96, MEAN, STD))
    assert dataset.num_degenerate == 2
    first = json.loads((tmp_path / "c" / "annotations" / "instances_val2017.json").read_text())["annotations"][0]
    _, target = dataset[dataset.image_ids.tolist().index(first["image_id"])]  # resized to its own 96 px
    assert [0.0, 0.0, 20.0, 15.0] in target["boxes"].tolist()
    # evaluation keeps the file's annotations as they are, as COCOeval does
    assert [-10.0, -5.0, 20.0, 15.0] in target["gt_boxes"].tolist()


@pytest.mark.parametrize("field, value, message", [
    ("image_id", 999_999, "annotation 1 refers to image_id 999999"),
    ("category_id", 11, "annotation 1 has category_id 11"),
])
def test_unknown_image_or_category_is_a_clear_error(coco_root, tmp_path, field, value, message):
    edit_annotations(coco_root, tmp_path / "c", lambda d: d["annotations"][0].update({field: value}))
    with pytest.raises(ValueError, match=message):
        CocoDetection(tmp_path / "c" / "val2017", tmp_path / "c" / "annotations" / "instances_val2017.json",
                      eval_transform(96, MEAN, STD))


def test_missing_image_file_names_it(coco_root, tmp_path):
    shutil.copytree(coco_root, tmp_path / "c")
    dataset = CocoDetection(tmp_path / "c" / "val2017", tmp_path / "c" / "annotations" / "instances_val2017.json",
                            eval_transform(96, MEAN, STD))
    missing = dataset.image_path(0)
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=f"{missing.name} of image_id {dataset.image_ids[0]}"):
        dataset[0]


def test_ssd_augmentation_keeps_boxes_on_their_objects():
    """A bright square on a dark image: after photometric distortion, zoom-out, IoU crop, flip and
    resize, the transformed box must still frame the bright pixels."""
    transform = ssd_train_transform(64, MEAN, STD, zoom_out_max=3.0, hflip=0.5)
    pixels = torch.zeros(3, 90, 120, dtype=torch.uint8)
    pixels[:, 30:60, 70:100] = 255
    for seed in range(12):
        torch.manual_seed(seed)
        target = {"boxes": tv_tensors.BoundingBoxes([[70, 30, 100, 60]], format="XYXY", canvas_size=(90, 120)),
                  "labels": torch.tensor([4])}
        image, out = transform(tv_tensors.Image(pixels), target)
        assert image.shape == (3, 64, 64) and out["labels"].tolist() == [4]
        x1, y1, x2, y2 = out["boxes"][0].tolist()
        # photometric distortion moves both levels, but the square stays the brightest thing
        brightness = image.mean(0)
        bright = brightness > 0.6 * brightness.max()
        ys, xs = torch.meshgrid(torch.arange(64) + 0.5, torch.arange(64) + 0.5, indexing="ij")
        near_box = (xs > x1 - 1.5) & (xs < x2 + 1.5) & (ys > y1 - 1.5) & (ys < y2 + 1.5)
        assert bright[near_box].sum() >= 0.97 * bright.sum()
        extent = [xs[bright].min() - 0.5, ys[bright].min() - 0.5, xs[bright].max() + 0.5, ys[bright].max() + 0.5]
        assert torch.allclose(torch.stack(extent), out["boxes"][0].float(), atol=1.5)


def test_without_iou_crop_every_object_stays_whole():
    """``iou_crop=False`` (the demo recipe): only photometric changes and the resize, so every
    box survives, scaled exactly; with the crop, some draws cut objects away."""
    boxes = [[5, 5, 25, 35], [60, 50, 110, 85], [90, 2, 118, 20]]
    pixels = torch.zeros(3, 90, 120, dtype=torch.uint8)
    scale = torch.tensor([64 / 120, 64 / 90, 64 / 120, 64 / 90])
    kept = {}
    for iou_crop in (False, True):
        transform = ssd_train_transform(64, MEAN, STD, zoom_out_max=1.0, iou_crop=iou_crop, hflip=0.0)
        kept[iou_crop] = []
        for seed in range(12):
            torch.manual_seed(seed)
            target = {"boxes": tv_tensors.BoundingBoxes(torch.tensor(boxes, dtype=torch.float32), format="XYXY",
                                                        canvas_size=(90, 120)),
                      "labels": torch.tensor([1, 2, 3])}
            _, out = transform(tv_tensors.Image(pixels), target)
            kept[iou_crop].append(len(out["boxes"]))
            if not iou_crop:
                assert out["labels"].tolist() == [1, 2, 3]
                assert torch.allclose(out["boxes"].float(), torch.tensor(boxes).float() * scale, atol=1e-4)
    assert min(kept[True]) < 3


def test_test_split_prefers_labelled_test2017_then_val(coco_root):
    assert CocoDataModule(root=str(coco_root)).test_split == "val2017"
    assert CocoDataModule(root=str(coco_root), test_split="train2017").test_split == "train2017"


def test_loader_collates_variable_box_counts(coco_root):
    dm = CocoDataModule(root=str(coco_root), image_size=64, batch_size=4, num_workers=0, mean=MEAN, std=STD)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"image", "targets", "skipped"} and batch["skipped"] == 0
    images, targets = batch["image"], batch["targets"]
    assert images.shape == (4, 3, 64, 64) and len(targets) == 4
    assert all(t["boxes"].shape[1] == 4 and len(t["boxes"]) == len(t["labels"]) for t in targets)
    assert all((t["boxes"] >= 0).all() and (t["boxes"] <= 64).all() for t in targets)
    assert all({"boxes", "labels", "image_id", "path", "orig_size", "gt_boxes", "gt_labels", "gt_iscrowd",
                "gt_area"} <= set(t) for t in targets)
    index_of = {image_id: k for k, image_id in enumerate(dm.train_set.image_ids.tolist())}
    assert all(t["path"] == str(dm.train_set.image_path(index_of[t["image_id"]])) for t in targets)


def test_eval_loader_yields_every_image_once_with_its_path(coco_root):
    dm = CocoDataModule(root=str(coco_root), image_size=64, batch_size=3, num_workers=0, mean=MEAN, std=STD)
    dm.setup("validate")
    batches = list(dm.val_dataloader())
    assert [len(b["targets"]) for b in batches] == [3, 3, 2] and all(b["skipped"] == 0 for b in batches)
    paths = [t["path"] for b in batches for t in b["targets"]]
    assert paths == [str(coco_root / "val2017" / f"{i:012d}.jpg") for i in dm.val_set.image_ids]
    assert all(t["orig_size"] == (96, 96) for b in batches for t in b["targets"])


def test_predict_batches_carry_paths_and_original_sizes(tmp_path):
    from PIL import Image

    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(folder / "b.jpg")
    Image.new("RGB", (20, 50), (10, 200, 10)).save(folder / "a.png")
    (folder / "._a.png").write_bytes(b"\0\5\7")  # macOS resource fork: hidden, never data
    (folder / "notes.txt").write_text("not an image")
    dm = CocoDataModule(root=str(tmp_path / "nowhere"), predict_path=str(folder), image_size=32, batch_size=4,
                        num_workers=0, mean=MEAN, std=STD)
    dm.setup("predict")
    batch = next(iter(dm.predict_dataloader()))
    assert set(batch) == {"image", "path", "orig_size", "skipped"} and batch["skipped"] == 0
    assert batch["image"].shape == (2, 3, 32, 32) and batch["image"].dtype == torch.float32
    assert batch["path"] == [str(folder / "a.png"), str(folder / "b.jpg")]
    assert batch["orig_size"].dtype == torch.long and batch["orig_size"].tolist() == [[50, 20], [30, 40]]
    # one file works as well
    dm = CocoDataModule(predict_path=str(folder / "b.jpg"), image_size=32, num_workers=0, mean=MEAN, std=STD)
    dm.setup("predict")
    assert next(iter(dm.predict_dataloader()))["path"] == [str(folder / "b.jpg")]


def test_predict_path_does_not_touch_root(tmp_path, monkeypatch):
    """Predicting from a checkpoint needs only ``--data.predict_path``: no demo build, no annotation file."""
    from PIL import Image

    import datamodules.coco as coco

    def no_demo(*args, **kwargs):
        raise AssertionError("predict with predict_path built or read the demo dataset")

    def no_annotations(*args, **kwargs):
        raise AssertionError("predict with predict_path read an annotation file")

    monkeypatch.setattr(coco, "demo_root", no_demo)
    monkeypatch.setattr(coco, "read_annotation_json", no_annotations)
    Image.new("RGB", (24, 24)).save(tmp_path / "x.jpg")
    dm = CocoDataModule(predict_path=str(tmp_path), image_size=32, num_workers=0)
    dm.setup("predict")
    assert next(iter(dm.predict_dataloader()))["image"].shape == (1, 3, 32, 32)
    with pytest.raises(FileNotFoundError, match="no images"):
        (tmp_path / "empty").mkdir()
        CocoDataModule(predict_path=str(tmp_path / "empty")).setup("predict")


def test_training_pipeline_is_chosen_by_name_and_checked_when_the_datamodule_is_built():
    from datamodules.detection_transforms import CVNetsSSDTrainTransform, SSDTrainTransform

    default = CocoDataModule(root="/nowhere").transform(train=True)
    assert isinstance(default, SSDTrainTransform) and default.zoom_out_max == 4.0  # the demo's pipeline, unchanged
    assert isinstance(CocoDataModule(root="/nowhere", augmentation="cvnets").transform(train=True),
                      CVNetsSSDTrainTransform)
    with pytest.raises(ValueError, match="'cvnet'"):
        CocoDataModule(root="/nowhere", augmentation="cvnet")
    with pytest.raises(ValueError, match="no zoom-out"):
        CocoDataModule(root="/nowhere", augmentation="cvnets", zoom_out_max=4.0)
