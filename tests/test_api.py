"""The Python API (:mod:`tasks.engine.predictor`): ``model.predict(inputs)`` gives what `predict` writes, on the same inputs.

Default cells build a tiny untrained model of each task in Python and run Lightning's own ``predict``
(the CLI's datamodule and ``predict_step``) beside ``model.predict``: the same classes and scores, boxes,
masks and translations, and the input specification carried through a checkpoint. The ``slow`` cell
fits each task's demo recipe for a few steps with the CLI and compares ``tasks.load(ckpt).predict`` with
the CLI's ``predict`` files.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from datamodules.input_spec import InputSpec
from tests.conftest import run_task

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
ORIENTATION = 0x0112


def photos(folder: Path) -> list[Path]:
    """Three images of different sizes: a PNG, a JPEG and a JPEG stored sideways with EXIF orientation 6."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for name, (height, width) in (("a.png", (40, 56)), ("b.jpg", (64, 48)), ("c.jpg", (36, 60))):
        pixels = (rng.random((height, width, 3)) * 255).astype(np.uint8)
        exif = Image.Exif()
        if name == "c.jpg":
            exif[ORIENTATION] = 6  # viewers turn it upright: 36 wide, 60 high
        Image.fromarray(pixels).save(folder / name, exif=exif)
        paths.append(folder / name)
    return paths


def lightning_predict(model, datamodule, root: Path) -> Path:
    """Lightning's ``predict`` of ``model`` on ``datamodule`` (the CLI's loop, hooks and writers); where it wrote."""
    from lightning.pytorch import Trainer

    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu",
                      default_root_dir=root)
    from tasks.outputs.common import predict_dir

    trainer.predict(model, datamodule=datamodule)
    return predict_dir(trainer)


def saved_and_loaded(model, path: Path, **rebuild):
    """``model`` written as a checkpoint and loaded back (``rebuild``: modules a Python-built model cannot save)."""
    from lightning.pytorch import Trainer

    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
    trainer.strategy.connect(model)
    trainer.save_checkpoint(path)
    return type(model).load_from_checkpoint(path, weights_only=True, **rebuild)


def tiny_backbone():
    from backbones import MobileViTv2

    torch.manual_seed(0)
    return MobileViTv2(width=0.25)


def test_input_spec_is_stated_by_the_datamodules_and_round_trips():
    from datamodules.coco import CocoDataModule
    from datamodules.segmentation import SegmentationDataModule

    detection = CocoDataModule(image_size=96, mean=MEAN, std=STD)
    assert detection.input_spec == InputSpec("square", 96, None, MEAN, STD)
    segmentation = SegmentationDataModule(crop_size=64, eval_short_side=48, mean=MEAN, std=STD)
    assert segmentation.input_spec == InputSpec("short_side", 64, 48, MEAN, STD)
    classification = InputSpec.center_crop(32, None, MEAN, STD)
    assert classification.resize_size == 37  # 32 / 0.875, the datamodule's default
    for spec in (detection.input_spec, segmentation.input_spec, classification):
        assert InputSpec.from_dict(spec.to_dict()) == spec
        assert all(isinstance(v, (str, int, list, type(None))) for v in spec.to_dict().values())


def test_classification_predict_matches_lightning_predict(tmp_path):
    from datamodules.imagefolder import ImageFolderDataModule
    from tasks.classify import ClassificationTask

    paths = photos(tmp_path / "images")
    model = ClassificationTask(tiny_backbone(), class_names=[f"class{i}" for i in range(7)])
    data = ImageFolderDataModule(predict_path=str(tmp_path / "images"), image_size=32, eval_resize=40, mean=MEAN,
                                 std=STD, batch_size=2, num_workers=0, pin_memory=False, persistent_workers=False)
    out = lightning_predict(model, data, tmp_path)
    assert model.input_spec == InputSpec("center_crop", 32, 40, MEAN, STD)  # taken from the datamodule
    rows = {Path(r["image"]).name: r for r in csv.DictReader(open(out / "predictions.csv"))}
    results = model.predict([str(p) for p in paths])
    assert len(results) == 3 and all(len(top) == 5 for top in results)
    for path, top in zip(paths, results):
        expected = [(name, float(score)) for name, score in (pair.split(":") for pair in rows[path.name]["top5"].split())]
        assert [name for name, _ in top] == [name for name, _ in expected]
        np.testing.assert_allclose([s for _, s in top], [s for _, s in expected], atol=1e-4)
    # one input gives one result; an array, a PIL image and a path are the same image
    upright = np.asarray(Image.open(paths[0]).convert("RGB"))
    for one in (paths[0], upright, Image.open(paths[0])):
        assert [name for name, _ in model.predict(one, top_k=2)] == [name for name, _ in results[0][:2]]
    # the checkpoint carries the input specification
    loaded = saved_and_loaded(model, tmp_path / "model.ckpt", backbone=tiny_backbone())
    assert loaded.input_spec == model.input_spec
    assert torch.load(tmp_path / "model.ckpt", weights_only=True)["input_spec"]["image_size"] == 32


def test_detection_predict_matches_lightning_predict_in_original_pixels(tmp_path):
    from datamodules.coco import CocoDataModule
    from tasks.detect import DetectionTask

    paths = photos(tmp_path / "images")
    model = DetectionTask(tiny_backbone(), num_classes=3, category_ids=[2, 5, 9], category_names=["x", "y", "z"],
                          display_score_threshold=0.0)
    data = CocoDataModule(predict_path=str(tmp_path / "images"), image_size=64, mean=MEAN, std=STD,
                          eval_batch_size=2, num_workers=0, pin_memory=False, persistent_workers=False)
    out = lightning_predict(model, data, tmp_path)
    results = model.predict(paths)
    for path, detections in zip(paths, results):
        written = json.loads((out / f"{path.stem}.json").read_text())
        assert detections, "an untrained head with threshold 0 keeps detections"
        assert len(detections) == len(written["detections"])
        # an untrained head scores many boxes alike: compare in box order, not score order
        in_box_order = sorted(detections, key=lambda d: [round(v, 2) for v in d["box"]])
        expected_order = sorted(written["detections"], key=lambda d: [round(d["bbox"][0], 2), round(d["bbox"][1], 2),
                                                                       round(d["bbox"][0] + d["bbox"][2], 2),
                                                                       round(d["bbox"][1] + d["bbox"][3], 2)])
        for got, expected in zip(in_box_order, expected_order):
            x, y, w, h = expected["bbox"]
            np.testing.assert_allclose(got["box"], [x, y, x + w, y + h], atol=1e-3)
            assert got["category_id"] == expected["category_id"]
            assert got["category_name"] == expected["category_name"]
            assert got["score"] == pytest.approx(expected["score"], abs=1e-5)
        # boxes in the upright original image's pixels: the EXIF-turned c.jpg is 36 wide, 60 high
        boxes = np.array([d["box"] for d in detections])
        assert boxes.min() >= -1e-3 and (boxes[:, [0, 2]] <= written["width"] + 1e-3).all()
        assert (boxes[:, [1, 3]] <= written["height"] + 1e-3).all()
    assert [json.loads((out / "c.json").read_text())[k] for k in ("width", "height")] == [36, 60]
    assert model.predict(paths[0], score_threshold=1.1) == []


def test_segmentation_predict_matches_lightning_predict_at_the_original_size(tmp_path):
    from datamodules.segmentation import SegmentationDataModule
    from tasks.segment import SegmentationTask

    paths = photos(tmp_path / "images")
    model = SegmentationTask(tiny_backbone(), class_names=[f"class{i}" for i in range(5)])
    data = SegmentationDataModule(predict_path=str(tmp_path / "images"), crop_size=64, eval_short_side=32, mean=MEAN,
                                  std=STD, num_workers=0, pin_memory=False, persistent_workers=False)
    out = lightning_predict(model, data, tmp_path)
    results = model.predict(paths)
    for path, labels in zip(paths, results):
        written = np.asarray(Image.open(out / "masks" / f"{path.stem}.png"))  # VOC encoding: label = palette index
        assert labels.dtype == np.uint8 and labels.shape == written.shape
        np.testing.assert_array_equal(labels, written)
    assert results[2].shape == (60, 36)  # upright


def test_translation_predict_matches_lightning_predict(tmp_path):
    from datamodules.wmt import TranslationDataModule
    from tasks.translate import TranslationTask

    tokenizer = TranslationDataModule(vocab_size=500).tokenizer
    torch.manual_seed(0)
    model = TranslationTask(vocab_size=tokenizer.vocab_size, dim=32, encoder_depth=1, decoder_depth=1, num_heads=2,
                            ffn_dim=64, max_positions=64, max_len_b=4, beam_size=2,
                            predict_output=str(tmp_path / "out.de"))
    model._tokenizer = tokenizer
    sources = ["Germany", "The house is small.", "France and the United Kingdom"]
    (tmp_path / "in.en").write_text("\n".join(sources) + "\n", encoding="utf-8")
    lightning_predict(model, TranslationDataModule(predict_path=str(tmp_path / "in.en")), tmp_path)
    expected = (tmp_path / "out.de").read_text(encoding="utf-8").splitlines()
    assert model.predict(sources) == expected
    assert model.predict(sources[1]) == expected[1]


def test_load_picks_the_task_class_from_the_checkpoint(tmp_path):
    import tasks
    from tasks.detect import DetectionTask

    model = DetectionTask(tiny_backbone(), num_classes=2)
    model.input_spec = InputSpec.square(64, MEAN, STD)
    saved_and_loaded(model, tmp_path / "model.ckpt", backbone=tiny_backbone())
    with pytest.raises(Exception, match="backbone"):  # a Python-built model's backbone is not in its checkpoint
        tasks.load(tmp_path / "model.ckpt")


def test_a_model_without_input_specification_says_how_to_get_one():
    from tasks.classify import ClassificationTask

    model = ClassificationTask(tiny_backbone(), class_names=["a", "b"])
    with pytest.raises(RuntimeError, match="no input specification"):
        model.predict(np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(ValueError, match=r"\(H, W, 3\) uint8"):
        model.input_spec = InputSpec.center_crop(8, 8, MEAN, STD)
        model.predict(np.zeros((8, 8, 3), np.float32))


# -- slow: the CLI's own predict on a fitted checkpoint ----------------------------------------------------------
FIT = {
    "classify": ["--model.backbone.init_args.width", "0.25", "--data.image_size", "32", "--data.eval_resize", "36",
                 "--data.batch_size", "16", "--data.num_workers", "0", "--model.scheduler.init_args.warmup_steps", "2"],
    "detect": ["--data.image_size", "64", "--data.batch_size", "4", "--data.eval_batch_size", "4",
               "--data.num_workers", "0", "--model.display_score_threshold", "0.05"],
    "segment": ["--data.crop_size", "64", "--data.eval_short_side", "48", "--data.batch_size", "4",
                "--data.num_workers", "0"],
    "translate": ["--model.encoder_depth", "1", "--model.decoder_depth", "1", "--model.num_heads", "2",
                  "--model.dim", "32", "--model.ffn_dim", "64", "--model.max_len_b", "4", "--model.beam_size", "2",
                  "--data.vocab_size", "500", "--data.max_tokens", "512", "--data.eval_max_tokens", "4096"],
}
QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
         "--trainer.num_sanity_val_steps", "0", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3",
         "--trainer.limit_val_batches", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["classify", "detect", "segment", "translate"])
def test_loaded_checkpoint_predicts_what_the_cli_writes(task, tmp_path):
    import tasks

    run_task(task, "fit", *FIT[task], *QUIET, cwd=tmp_path)
    ckpt = tmp_path / "runs" / task / "checkpoints" / "last.ckpt"
    model = tasks.load(ckpt)
    assert type(model).__name__ == torch.load(ckpt, weights_only=True)["suite_task"].rsplit(".", 1)[1]
    data = [arg for i, arg in enumerate(FIT[task]) if arg.startswith("--data.") or FIT[task][i - 1].startswith("--data.")]
    out = tmp_path / "runs" / task / "predictions" / "predict"
    quiet = QUIET[:6]
    if task == "translate":
        sources = ["Germany", "The house is small.", "France and the United Kingdom"]
        (tmp_path / "in.en").write_text("\n".join(sources) + "\n", encoding="utf-8")
        run_task(task, "predict", "--ckpt_path", str(ckpt), "--data.predict_path", str(tmp_path / "in.en"),
                 "--model.predict_output", str(tmp_path / "out.de"), *quiet, cwd=tmp_path)
        assert model.predict(sources) == (tmp_path / "out.de").read_text(encoding="utf-8").splitlines()
        return
    paths = photos(tmp_path / "images")
    run_task(task, "predict", "--ckpt_path", str(ckpt), *data, "--data.predict_path", str(tmp_path / "images"),
             *quiet, cwd=tmp_path)
    results = model.predict(paths)
    for path, result in zip(paths, results):
        if task == "classify":
            row = {Path(r["image"]).name: r for r in csv.DictReader(open(out / "predictions.csv"))}[path.name]
            assert [name for name, _ in result] == [pair.split(":")[0] for pair in row["top5"].split()]
            assert result[0][1] == pytest.approx(float(row["score"]), abs=1e-5)
        elif task == "detect":
            written = json.loads((out / f"{path.stem}.json").read_text())["detections"]
            assert [d["category_id"] for d in result] == [d["category_id"] for d in written]
            boxes = [[x, y, x + w, y + h] for x, y, w, h in (d["bbox"] for d in written)]
            np.testing.assert_allclose([d["box"] for d in result], np.reshape(boxes, (-1, 4)), atol=1e-3)
        else:
            np.testing.assert_array_equal(result, np.asarray(Image.open(out / "masks" / f"{path.stem}.png")))
