"""Refusals a person can read (issue 50, items 5 and 6).

On the command line a refusal is its message and exit code 1, the traceback behind ``SUITE_DEBUG=1``
(:mod:`layers.errors`); the Python API raises. Each silent or unclear case a new user met is refused
naming the file, key or value, or handled and counted, on the real task classes, datamodules and CLI:
16-bit PIL images, ``predict`` arguments, what the translation model is given, images in sub-folders of a
class folder, ``null`` batch sizes, a copy of the translation data elsewhere, a resume with another width,
an empty ``last.ckpt``, a run root that is a file or read-only.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from datamodules.input_spec import InputSpec
from tests.conftest import run_task
from tests.test_api import MEAN, STD, tiny_backbone
from tests.test_contract import QUIET, SHAPE_OVERRIDE, TINY


@pytest.fixture(scope="module")
def classifier():
    from tasks.classify import ClassificationTask

    model = ClassificationTask(tiny_backbone(), class_names=[f"class{i}" for i in range(7)])
    model.input_spec = InputSpec.center_crop(32, 36, MEAN, STD)
    return model


# -- the Python API ---------------------------------------------------------------------------------------------
def test_a_16bit_pil_image_is_scaled_as_the_same_file_is(classifier, tmp_path):
    """``predict(Image.open(f))`` of a 16-bit grey PNG clipped every pixel to 255, while ``predict(f)`` scaled
    65535 -> 255: both now give the file's pixels scaled, round(v * 255 / 65535)."""
    from tasks.engine.predictor import read_image

    values = np.linspace(0, 65535, 24 * 32).round().astype(np.uint16).reshape(24, 32)
    path = tmp_path / "depth.png"
    Image.fromarray(values).save(path)
    image = Image.open(path)
    assert image.mode.startswith("I;16")
    pixels, _ = read_image(image)
    expected = np.rint(values.astype(np.float64) * 255 / 65535).astype(np.uint8)
    for channel in pixels:
        np.testing.assert_array_equal(channel.numpy(), expected)
    np.testing.assert_array_equal(pixels.numpy(), read_image(path)[0].numpy())
    by_image, by_path = classifier.predict(image, top_k=3), classifier.predict(path, top_k=3)
    assert [name for name, _ in by_image] == [name for name, _ in by_path]
    np.testing.assert_allclose([s for _, s in by_image], [s for _, s in by_path], rtol=1e-6)


def test_predict_refuses_batch_sizes_and_top_k_below_one_naming_them(classifier):
    """``predict([a, b], batch_size=-1)`` returned ``[]``; ``top_k=-1`` raised torch's "selected index k out of
    range"; ``predict(None)`` a bare "not iterable"."""
    images = [np.zeros((8, 8, 3), np.uint8)] * 2
    for batch_size in (-1, 0, 1.5):
        with pytest.raises(ValueError, match=rf"predict: batch_size={batch_size}; give a positive number"):
            classifier.predict(images, batch_size=batch_size)
    for top_k in (-1, 0):
        with pytest.raises(ValueError, match=rf"predict: top_k={top_k}; give how many of the 7 classes"):
            classifier.predict(images, top_k=top_k)
    assert len(classifier.predict(images, batch_size=1, top_k=99)[1]) == 7  # more than there are: all of them
    with pytest.raises(TypeError, match="cannot predict on a NoneType: give a file path"):
        classifier.predict(None)


@pytest.fixture(scope="module")
def translator():
    from datamodules.wmt import TranslationDataModule
    from tasks.translate import TranslationTask

    tokenizer = TranslationDataModule(vocab_size=500).tokenizer
    torch.manual_seed(0)
    model = TranslationTask(vocab_size=tokenizer.vocab_size, dim=32, encoder_depth=1, decoder_depth=1, num_heads=2,
                            ffn_dim=64, max_positions=64, max_len_b=4, beam_size=2)
    model._tokenizer = tokenizer
    return model


@pytest.mark.parametrize("given, named", [
    (np.array(["Germany", "France"]), r"a numpy array \(2,\) of <U7: give its strings as a list"),
    (b"Germany", r"cannot translate bytes \(b'Germany'\): decode them first"),
    (None, r"None; give a string or a list of strings"),
    (3, r"cannot translate 3 \(of type int\); give a string"),
    (Path("news.en"), r"a path \(news.en\): give its lines"),
    (Image.new("RGB", (4, 4)), r"an image: the translation model translates text"),
    (["Germany", 3], r"input 1 is 3 \(of type int\); the translation model translates strings"),
])
def test_translation_predict_refuses_what_is_not_text_naming_it(translator, given, named):
    """A numpy array was translated row by row, bytes as one number per byte, ``None`` and ``3`` as the
    strings 'None' and '3'; a PIL image or a Path failed somewhere inside."""
    with pytest.raises(TypeError, match=named):
        translator.predict(given)


def test_the_same_vocabulary_trained_from_a_copy_of_the_data_elsewhere_is_the_same(translator, tmp_path):
    """A checkpoint was refused as "trained on other data" on an exact copy of its training data in another
    folder: sentencepiece records the training files' paths in the model, so the model bytes differ while the
    vocabulary is the same. The check compares what the vocabulary does; another vocabulary is still refused."""
    from datamodules.wmt import TranslationDataModule

    demo = TranslationDataModule().root
    copies = [shutil.copytree(demo, tmp_path / name, ignore=shutil.ignore_patterns("spm.*")) for name in "ab"]
    first, second = (TranslationDataModule(root=str(copy), vocab_size=200) for copy in copies)
    assert first.tokenizer.serialized() != second.tokenizer.serialized()  # the recorded paths differ
    assert first.tokenizer.sp.id_to_piece(list(range(200))) == second.tokenizer.sp.id_to_piece(list(range(200)))
    assert first.tokenizer.content_fingerprint == second.tokenizer.content_fingerprint
    model = translator
    saved, model._tokenizer = model._tokenizer, first.tokenizer
    try:
        assert not [m for m in model.data_identity_mismatches(second) if "vocabulary" in m]
        other = TranslationDataModule(root=str(copies[1]), vocab_size=300)
        assert [m for m in model.data_identity_mismatches(other) if "sentencepiece vocabulary" in m]
    finally:
        model._tokenizer = saved


def test_images_in_a_sub_folder_of_a_class_folder_are_counted_and_named(tmp_path):
    """``train/cat/more/*.png`` was left out without a word (torchvision's ImageFolder reads them). The layout
    stays ``<class>/<image>``; what it leaves out is counted and named, with how to include it."""
    from torchvision.datasets import ImageFolder

    from datamodules.imagefolder import scan_split

    for name in ("cat/a.png", "cat/more/b.png", "cat/more/deeper/c.png", "dog/d.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4)).save(tmp_path / name)
    with pytest.warns(UserWarning, match=r"left out 2 entries of .*: 2 images in sub-folders \(cat/more/b.png, "
                                         r"cat/more/deeper/c.png\).*move them up a level"):
        samples, classes = scan_split(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p, _ in samples] == ["cat/a.png", "dog/d.png"]
    assert len(ImageFolder(str(tmp_path))) == len(samples) + 2  # the two it reads and the suite names
    (tmp_path / "dog" / "d.png").rename(tmp_path / "cat" / "more" / "d.png")
    (tmp_path / "dog" / "inside").mkdir()
    (tmp_path / "cat" / "more" / "d.png").rename(tmp_path / "dog" / "inside" / "d.png")
    with pytest.raises(ValueError, match=r"class folder .*dog holds no images .*; 1 image file\(s\) lie in "
                                         r"sub-folders of it \(dog/inside/d.png\): the layout is <split>/<class>/"):
        scan_split(tmp_path)


@pytest.mark.parametrize("datamodule, key", [
    ("datamodules.imagefolder.ImageFolderDataModule", "batch_size"),
    ("datamodules.imagefolder.ImageFolderDataModule", "eval_batch_size"),
    ("datamodules.coco.CocoDataModule", "batch_size"),
    ("datamodules.segmentation.SegmentationDataModule", "batch_size"),
    ("datamodules.wmt.TranslationDataModule", "max_tokens"),
])
def test_a_null_or_negative_batch_size_is_refused_naming_the_key(datamodule, key):
    """``--data.batch_size null`` reached ``make_loader`` as a TypeError; translation's ``--data.max_tokens
    null`` likewise. ``eval_batch_size`` may be null (it follows ``batch_size``), not 0."""
    from configs.recipes import import_class

    cls = import_class(datamodule)
    bad = [0] if key.startswith("eval_") else [None, 0, -4]
    for value in bad:
        expected = rf"data.{key}={value!r}: give a positive whole number \(--data.{key} 32\)"
        with pytest.raises(ValueError, match=expected):
            cls(**{key: value})


#: the tests of the one-line refusal run without the debug switch, whatever the developer's shell sets
NO_DEBUG = {"SUITE_DEBUG": ""}


# -- the command line (each command ~15 s on an idle 2-core machine, a minute when it is shared) -------------------
@pytest.mark.slow
def test_resume_with_another_width_is_one_line_naming_the_key(demo_fit, tmp_path):
    """A resume after changing the backbone's width failed with a state-dict size-mismatch traceback that did
    not name ``model.backbone.init_args.width``. On the command line it is one line and exit 1."""
    ckpt = shutil.copy(demo_fit("classify") / "checkpoints" / "last.ckpt", tmp_path / "started.ckpt")
    proc = run_task("classify", "fit", *TINY["classify"], *QUIET, "--model.backbone.init_args.width", "0.5",
                    "--ckpt_path", str(ckpt), cwd=tmp_path, check=False, env=NO_DEBUG)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: the checkpoint's weights do not fit this model: ")
    assert "model.backbone.init_args.width: checkpoint 0.25, this run 0.5" in last_line
    assert "[raised at tasks/engine/predictor.py:" in last_line
    assert last_line.endswith("; SUITE_DEBUG=1 shows the traceback]")


def test_a_null_batch_size_on_the_command_line_is_one_line_and_exit_1(tmp_path):
    """``--data.batch_size null`` ended in a TypeError inside ``make_loader``; the refusal that replaced it would
    reach the user inside jsonargparse's "Does not validate against any of the Union subtypes" and the whole
    config. The command prints the suite's message alone, where it was raised and the debug switch."""
    proc = run_task("classify", "fit", *TINY["classify"], *QUIET, "--data.batch_size", "null", cwd=tmp_path,
                    check=False, env=NO_DEBUG)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "Union subtypes" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: data.batch_size=None: give a positive whole number (--data.batch_size 32) [raised at "
        f"datamodules/loaders.py:{refusal_line('datamodules/loaders.py', 'data.{name}={value!r}')}; SUITE_DEBUG=1 "
        "shows the traceback]")


def refusal_line(path: str, text: str) -> int:
    """The line of ``path`` that raises the refusal whose message starts with ``text``."""
    from tests.conftest import REPO

    lines = (REPO / path).read_text().splitlines()
    return next(number for number, line in enumerate(lines, start=1) if text in line)


def test_an_empty_last_checkpoint_is_named_and_the_debug_switch_shows_the_traceback(tmp_path):
    """``--ckpt_path last`` on a zero-byte ``last.ckpt`` (a copy cut short) ended in an EOFError that named the
    file only in Lightning's restore line. With ``SUITE_DEBUG=1`` the refusal keeps its traceback."""
    root = tmp_path / "runs" / "classify"
    (root / "checkpoints").mkdir(parents=True)
    (root / "checkpoints" / "last.ckpt").write_bytes(b"")
    proc = run_task("classify", "fit", *TINY["classify"], *SHAPE_OVERRIDE["classify"], *QUIET, "--ckpt_path", "last",
                    cwd=tmp_path, check=False, env={"SUITE_DEBUG": "1"})
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert f"ValueError: cannot read checkpoint {Path('runs/classify/checkpoints/last.ckpt')} (0 bytes)" in proc.stderr


@pytest.mark.slow
def test_test_into_a_run_root_that_is_a_file_or_read_only_is_named(demo_fit, tmp_path):
    """``test`` with ``--trainer.default_root_dir`` naming a file raised the config saver's bare FileExistsError;
    a read-only run root a raw OSError."""
    ckpt = demo_fit("classify") / "checkpoints" / "last.ckpt"
    (tmp_path / "results").write_text("not a folder")
    proc = run_task("classify", "test", "--ckpt_path", str(ckpt), *QUIET, "--trainer.default_root_dir", "results",
                    cwd=tmp_path, check=False, env=NO_DEBUG)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: trainer.default_root_dir=results cannot be a run folder: results is a file.")
    if os.geteuid() != 0:  # root writes anywhere: no folder is read-only to it
        (tmp_path / "shut").mkdir(mode=0o555)
        proc = run_task("classify", "test", "--ckpt_path", str(ckpt), *QUIET, "--trainer.default_root_dir",
                        "shut/run", cwd=tmp_path, check=False, env=NO_DEBUG)
        assert proc.returncode == 1 and "this user cannot write in shut (read-only)" in proc.stderr


def test_the_api_raises_what_the_command_line_prints(demo_fit, tmp_path, monkeypatch):
    """``tasks.cli.suite.main`` given its arguments (the Python API) raises the refusal itself: no
    ``last.ckpt``, and a truncated one (a copy cut short), named with its size before Lightning reads it."""
    from tasks.cli.suite import main

    monkeypatch.chdir(tmp_path)
    fit = ["fit", *TINY["classify"], *SHAPE_OVERRIDE["classify"], *QUIET, "--ckpt_path", "last"]
    with pytest.raises(FileNotFoundError, match=r"--ckpt_path last: there is no .*last.ckpt to resume from"):
        main("classify", fit)
    whole = (demo_fit("classify") / "checkpoints" / "last.ckpt").read_bytes()
    last = tmp_path / "runs" / "classify" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    last.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=rf"cannot read checkpoint {last.relative_to(tmp_path)} \({len(whole) // 2} "
                                         r"bytes\): .*Is it truncated"):
        main("classify", fit)
