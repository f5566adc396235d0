"""ONNX export of every task, checked against PyTorch with ONNX Runtime on the demo test data.

Each check fits a few steps of the task's demo recipe through the CLI (weights and BatchNorm
statistics away from their initial values), exports the checkpoint with
``python -m tasks.<task> export`` and compares ONNX Runtime's outputs with the checkpoint's
PyTorch model on the demo test split. Classification runs in the default suite; the other
tasks, the fixed-size ViT and CoreML carry the ``slow`` marker (each export takes ~20-40 s).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import run_task

QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
         "--trainer.num_sanity_val_steps", "0", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3",
         "--trainer.limit_val_batches", "1"]
FIT = {
    "classify": ["--model.backbone.init_args.width", "0.25", "--data.image_size", "64", "--data.eval_resize", "64",
                 "--data.batch_size", "16", "--data.num_workers", "0", "--model.scheduler.init_args.warmup_steps", "2"],
    "detect": ["--data.image_size", "64", "--data.batch_size", "4", "--data.eval_batch_size", "4",
               "--data.num_workers", "0"],
    "segment": ["--data.crop_size", "64", "--data.batch_size", "4", "--data.num_workers", "0"],
    "translate": ["--model.encoder_depth", "1", "--model.decoder_depth", "2", "--model.dim", "64", "--model.ffn_dim",
                  "128", "--model.num_heads", "2", "--model.beam_size", "3", "--data.vocab_size", "500",
                  "--data.max_tokens", "512", "--data.eval_max_tokens", "4096"],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(task, *args)`` -> ``last.ckpt`` of a 3-step fit of the task's demo recipe with ``args``
    (default :data:`FIT`), cached per module."""
    made: dict[tuple, Path] = {}

    def fit(task: str, *args: str) -> Path:
        key = (task, *args)
        if key not in made:
            cwd = tmp_path_factory.mktemp(f"fit-{task}")
            run_task(task, "fit", *(args or FIT[task]), *QUIET, cwd=cwd)
            made[key] = cwd / "runs" / task / "checkpoints" / "last.ckpt"
        return made[key]

    return fit


def export(task: str, *args: str, capsys) -> str:
    """Run ``python -m tasks.<task> export *args`` in this process; its standard output."""
    import importlib

    importlib.import_module(f"tasks.{task}").main(["export", *args])
    return capsys.readouterr().out


@pytest.mark.slow  # ~26 s, like the other tasks' export cells
def test_classification_export_matches_pytorch_on_demo_test_images(checkpoint, capsys):
    from datamodules.imagefolder import ImageFolderDataModule
    from tasks.classify import ClassificationTask
    from tasks.export.onnx import graph_shapes, ort_session, read_metadata

    ckpt = checkpoint("classify")
    out = export("classify", "--ckpt_path", str(ckpt), "--probabilities", "true", capsys=capsys)
    path = ckpt.with_suffix(".onnx")  # the default: next to the checkpoint
    assert f"exported:  {path.resolve()}" in out and "parity:" in out and "FAILED" not in out, out
    session = ort_session(path)
    model = ClassificationTask.load_from_checkpoint(ckpt, weights_only=True).eval()
    meta = read_metadata(session)
    assert meta["class_names"] == model.class_names and meta["image_size"] == [64, 64]
    assert meta["size_multiple"] == 64 and meta["mean"] == [0.485, 0.456, 0.406]
    assert graph_shapes(session) == {"images": ["batch", 3, "height", "width"], "logits": ["batch", 10],
                                     "probabilities": ["batch", 10]}

    data = ImageFolderDataModule(root=None, image_size=64, eval_resize=64, batch_size=50, num_workers=0)
    data.setup("test")
    images = torch.cat([batch["image"] for batch in data.test_dataloader()])
    # a dynamic batch and, MobileViTv2 at stride 32, any multiple of 64: the demo images at 64 and 128 px
    for batch in (images, torch.nn.functional.interpolate(images[:7], size=(128, 128), mode="bilinear")):
        with torch.no_grad():
            logits = model(batch)
        got_logits, got_probabilities = session.run(None, {"images": batch.numpy()})
        np.testing.assert_allclose(got_logits, logits.numpy(), rtol=0, atol=1e-4)
        np.testing.assert_allclose(got_probabilities, logits.softmax(-1).numpy(), rtol=0, atol=1e-4)
    assert len(images) > 100  # the whole demo test split


def test_export_refuses_a_checkpoint_of_another_task(tmp_path, capsys):
    ckpt = tmp_path / "detector.ckpt"
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6.0", "suite_task": "tasks.detect.DetectionTask",
                "hyper_parameters": {"num_classes": 3}}, ckpt)
    with pytest.raises(ValueError, match=r"detector.ckpt is a checkpoint of tasks.detect.DetectionTask, not of "
                                         r"tasks.classify.ClassificationTask: use it with `python -m tasks.detect`"):
        export("classify", "--ckpt_path", str(ckpt), capsys=capsys)


def test_export_without_the_extra_names_it_and_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # what a missing package looks like to import
    with pytest.raises(ImportError, match=r"onnxruntime is not installed\. Install the extra: pip install -e '\.\[export\]'"):
        export("classify", "--ckpt_path", "any.ckpt", capsys=capsys)


def test_export_refuses_an_unsupported_opset(capsys):
    with pytest.raises(ValueError, match=r"--opset 11 is not supported: the exporter writes ONNX opsets 18 to 23"):
        export("classify", "--ckpt_path", "any.ckpt", "--opset", "11", capsys=capsys)


def test_export_refuses_a_data_option_the_checkpoint_does_not_have(demo_fit, tmp_path, capsys):
    import shutil

    # a copy of the session's shared classification checkpoint: an export that went ahead would write beside it
    ckpt = shutil.copy(demo_fit("classify") / "checkpoints" / "last.ckpt", tmp_path / "last.ckpt")
    with pytest.raises(ValueError, match=r"--data.imagesize is not a data option of this checkpoint's datamodule "
                                         r"\(datamodules.imagefolder.ImageFolderDataModule: .*image_size"):
        export("classify", "--ckpt_path", str(ckpt), "--data.imagesize", "64", capsys=capsys)


# -- slow: one export each ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_detection_export_matches_pytorch_on_demo_test_images(checkpoint, capsys):
    from datamodules.coco import CocoDataModule
    from tasks.detect import DetectionTask
    from tasks.export.detection import match_detections
    from tasks.export.onnx import graph_shapes, ort_session, read_metadata

    ckpt = checkpoint("detect")
    output = ckpt.parent / "exported" / "detector.onnx"
    out = export("detect", "--ckpt_path", str(ckpt), "--output", str(output), "--opset", "20", capsys=capsys)
    assert f"exported:  {output.resolve()}" in out and "FAILED" not in out, out
    session = ort_session(output)
    model = DetectionTask.load_from_checkpoint(ckpt, weights_only=True).eval()
    meta = read_metadata(session)
    assert meta["category_ids"] == model.category_ids and meta["category_names"] == model.category_names
    assert meta["score_threshold"] == model.head.score_threshold and meta["image_size"] == [64, 64]
    assert graph_shapes(session)["images"] == ["batch", 3, 64, 64]  # anchors are constants: one size
    assert graph_shapes(session)["boxes"] == ["batch", model.head.detections_per_image, 4]

    data = CocoDataModule(root=None, image_size=64, eval_batch_size=25, num_workers=0)
    data.setup("test")
    compared = 0
    for batch in data.test_dataloader():
        images = batch["image"]
        with torch.no_grad():
            expected = model.detect(images)
        boxes, scores, labels, counts = session.run(None, {"images": images.numpy()})
        for i, det in enumerate(expected):
            n = int(counts[i])
            assert n == len(det["boxes"]) > 0
            # the same detections (label, box within 1e-3, score within 1e-4), in the same order up to
            # swaps among scores within 1e-4 (barely trained, many scores tie to float precision)
            assert match_detections(det, boxes[i, :n], scores[i, :n], labels[i, :n],
                                    model.head.detections_per_image)[0] == 0
            assert (labels[i, n:] == -1).all() and (scores[i, n:] == 0).all()  # the padding
            compared += n
        # and where the scores do not tie, the same order: most rows are exactly PyTorch's
        assert (labels[0, : counts[0]] == expected[0]["labels"].numpy()).mean() > 0.9
    assert compared > 1000


@pytest.mark.slow
def test_segmentation_export_matches_pytorch_on_demo_test_images(checkpoint, capsys):
    from datamodules.segmentation import SegmentationDataModule
    from tasks.export.onnx import graph_shapes, ort_session
    from tasks.export.segmentation import label_disagreements
    from tasks.segment import SegmentationTask

    ckpt = checkpoint("segment")
    out = export("segment", "--ckpt_path", str(ckpt), "--logits", "true", capsys=capsys)
    assert "any multiples of 8" in out and "FAILED" not in out, out  # the demo ConvMixer: 8 px patches
    session = ort_session(ckpt.with_suffix(".onnx"))
    assert graph_shapes(session)["labels"] == ["batch", "height", "width"]
    model = SegmentationTask.load_from_checkpoint(ckpt, weights_only=True).eval()

    data = SegmentationDataModule(root=None, dataset="voc", eval_short_side=None, num_workers=0)
    data.setup("test")
    pixels = 0
    for batch in data.test_dataloader():  # one image per batch, at its own (128 px) size
        images = batch["image"]
        with torch.no_grad():
            logits = model(images)["out"]
        labels, got_logits = session.run(None, {"images": images.numpy()})
        assert labels.shape == tuple(logits.argmax(1).shape)
        np.testing.assert_allclose(got_logits, logits.numpy(), rtol=0, atol=1e-4)
        # the class map is PyTorch's wherever the best two classes are not within float noise
        assert label_disagreements(logits, torch.from_numpy(labels)) == 0
        assert (labels == logits.argmax(1).numpy()).mean() > 0.999
        pixels += labels.size
    assert pixels >= 50 * 128 * 128


@pytest.mark.slow
def test_translation_export_gives_the_same_hypotheses_on_the_demo_test_set(checkpoint, capsys, demo_cache, tmp_path):
    from tasks.export.translation import OnnxTranslator
    from tasks.translate import TranslationTask

    ckpt = checkpoint("translate")
    out = export("translate", "--ckpt_path", str(ckpt), capsys=capsys)
    assert "FAILED" not in out, out
    encoder = ckpt.with_name("last.encoder.onnx")
    assert encoder.is_file() and ckpt.with_name("last.decoder_step.onnx").is_file()
    assert ckpt.with_name("last.spm.model").is_file()
    model = TranslationTask.load_from_checkpoint(ckpt, weights_only=True).eval()
    translator = OnnxTranslator(encoder)

    corpus = sorted(demo_cache.glob("translate-en-de-v*"))[-1]
    sources = (corpus / "test.en").read_text(encoding="utf-8").splitlines()
    assert len(sources) > 300
    for beam in (1, 3):
        for start in range(0, len(sources), 64):
            src = model.encode_sources(sources[start:start + 64])
            assert torch.equal(translator.encode(sources[start:start + 64]), src)  # the same tokenizer
            expected = model.translate(src, beam_size=beam)
            got = translator.translate_ids(src, beam_size=beam)
            assert torch.equal(got.tokens, expected.tokens), f"beam {beam}, sentences {start}..{start + 63}"
            torch.testing.assert_close(got.normalized, expected.normalized, rtol=0, atol=1e-4)

    # the runner's command line: text in, text out
    (tmp_path / "in.en").write_text("\n".join(sources[:5]) + "\n", encoding="utf-8")
    proc = __import__("subprocess").run(
        [sys.executable, "-m", "tasks.export.translation", str(encoder), "--input", str(tmp_path / "in.en")],
        capture_output=True, text=True, cwd=tmp_path, env=__import__("tests.conftest").conftest.clean_env())
    assert proc.returncode == 0, proc.stderr
    expected_text = model.tokenizer.decode(model.translate(model.encode_sources(sources[:5])).tokens.tolist())
    assert proc.stdout.splitlines() == expected_text


@pytest.mark.slow
def test_vit_exports_at_its_one_size_and_refuses_another(checkpoint, capsys):
    from tasks.export.onnx import graph_shapes, ort_session

    vit = ["--model.backbone", "backbones.ViT", "--model.backbone.size", "tiny", "--model.backbone.patch_size", "16",
           "--model.backbone.img_size", "64", *FIT["classify"][2:]]  # the classification arguments but the width
    ckpt = checkpoint("classify", *vit)
    with pytest.raises(ValueError, match=r"ViT cannot take 96x96 images: .*img_size=\(64, 64\).* Export at a size it "
                                         r"takes: the checkpoint was trained at 64x64"):
        export("classify", "--ckpt_path", str(ckpt), "--data.image_size", "96", capsys=capsys)
    out = export("classify", "--ckpt_path", str(ckpt), capsys=capsys)
    assert "input size fixed at 64x64 (ViT's position embeddings are built for one grid)" in out, out
    assert "FAILED" not in out
    assert graph_shapes(ort_session(ckpt.with_suffix(".onnx")))["images"] == ["batch", 3, 64, 64]


def test_convmixer_graphs_take_any_multiple_of_their_deepest_stride():
    """ConvMixer holds only convolutions and poolings: its graph's sides may be any multiple of the
    patch size, or of the largest pyramid stride when it builds a pyramid (the slow segmentation check
    runs such a graph, exported at 64 px, on the 128 px demo images)."""
    from backbones.convmixer import ConvMixer

    assert ConvMixer(dim=16, depth=1, kernel_size=3, patch_size=8).size_multiple == 8
    assert ConvMixer(dim=16, depth=1, kernel_size=3, patch_size=8, pyramid_strides=(8, 16, 32)).size_multiple == 32
