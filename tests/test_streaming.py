"""Datasets optimized into LitData chunks (``python -m datamodules.optimize``) and streamed back
(``--data.streaming_root``): the same samples as the folder-read dataset, the same augmentation
seeds, metrics equal to the folder-read ``test`` under 1 and 2 processes, exact mid-epoch resume,
and bad streaming roots named.

The demo datasets are converted into a temporary folder; ``local:<folder>`` makes LitData read it
as it reads an object store (manifest and chunks downloaded into its cache)."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_task
from tests.test_contract import QUIET, TINY

os.environ.setdefault("LITDATA_CACHE_DIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / "suite-litdata-cache"))

VOC_RECIPE = str(REPO / "configs" / "detect" / "demo_voc_ssdlite_mobilevitv2.yaml")
#: the VOC demo recipe's datamodule and splits, as flags (a recipe with a base: breaks 2-process CPU runs
#: in tasks/cli/suite.py, see the report)
VOC_FLAGS = ["--data", "datamodules.voc_detection.VocDetectionDataModule", "--data.train_split", "train",
             "--data.val_split", "val", "--data.test_split", "test"]


@pytest.fixture(scope="session")
def optimized(tmp_path_factory):
    """``optimized(task, *arguments)`` -> the folder the demo data of ``task`` was optimized into (cached)."""
    from datamodules.optimize import main

    done: dict[tuple, Path] = {}

    def convert(task: str, *arguments: str) -> Path:
        key = (task, *arguments)
        if key not in done:
            output = tmp_path_factory.mktemp(f"optimized-{task}")
            main(["--task", task, "--output", str(output), "--num-workers", "1", *arguments])
            done[key] = output
        return done[key]

    return convert


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "predictions" / "metrics.json").read_text())


def assert_same_metrics(one: dict, other: dict) -> None:
    assert one.keys() == other.keys()
    for key in one:  # sums over ranks or batches add in another order: equal to float32 rounding
        assert other[key] == pytest.approx(one[key], rel=1e-6, abs=1e-7), key


# -- a streamed split gives the folder-read samples ----------------------------------------------------------
def test_streamed_classification_batches_are_the_folder_batches(optimized):
    """The test split read from files and streamed from its optimized copy, read the object-store way
    (``local:``: manifest and chunks downloaded into LitData's cache): the same images, labels and
    paths, sample by sample."""
    from datamodules.imagefolder import ImageFolderDataModule

    root = optimized("classify")
    batches = {}
    for name, streaming_root in (("folder", None), ("streamed", f"local:{root}")):
        datamodule = ImageFolderDataModule(streaming_root=streaming_root, image_size=24, eval_resize=24,
                                           batch_size=300, num_workers=0)
        datamodule.setup("test")
        batch = next(iter(datamodule.test_dataloader()))
        order = batch["index"].argsort()
        batches[name] = {"image": batch["image"][order], "target": batch["target"][order],
                         "index": batch["index"][order], "path": [batch["path"][i] for i in order]}
    folder, streamed = batches["folder"], batches["streamed"]
    assert len(folder["index"]) == 269 and streamed["index"].tolist() == folder["index"].tolist()
    assert torch.equal(streamed["image"], folder["image"]) and torch.equal(streamed["target"], folder["target"])
    assert streamed["path"] == folder["path"]

    # predict without a predict_path reads the streamed test split too
    datamodule.setup("predict")
    batch = next(iter(datamodule.predict_dataloader()))
    order = batch["index"].argsort()
    assert set(batch) == {"image", "index", "path", "skipped"}
    assert torch.equal(batch["image"][order], folder["image"]) and [batch["path"][i] for i in order] == folder["path"]


def streamed_and_folder_items(datamodule_class, root: Path, split: str, **arguments):
    """``{index: item}`` of the streamed split and the folder-read split of the same datamodule settings."""
    streamed = datamodule_class(streaming_root=str(root), **arguments).split(split)
    folder = datamodule_class(**arguments).split(split)
    position = {image_id: index for index, image_id in enumerate(folder.image_ids)}
    items = {}
    for item in streamed:
        image_id = item[1]["image_id"]
        items[image_id] = (item, folder[position[image_id]])
    assert len(items) == len(folder)
    return items


@pytest.mark.parametrize("fmt", ["coco", pytest.param("voc", marks=pytest.mark.slow)])  # voc: ~14 s
def test_streamed_detection_items_are_the_folder_items(fmt, optimized):
    """Every evaluation item of the demo's validation split, streamed, equals the folder-read item: the
    resized image and every target key (boxes, labels, the ground truth COCOeval / VOC AP read)."""
    from datamodules.coco import CocoDataModule
    from datamodules.voc_detection import VocDetectionDataModule

    cls, split = {"coco": (CocoDataModule, "val2017"), "voc": (VocDetectionDataModule, "test")}[fmt]
    extra = ["--data", "datamodules.voc_detection.VocDetectionDataModule"] if fmt == "voc" else []
    root = optimized("detect", *extra, "--splits", split)
    for (image, target), (folder_image, folder_target) in streamed_and_folder_items(cls, root, split,
                                                                                   image_size=48).values():
        assert torch.equal(image, folder_image)
        assert target.keys() == folder_target.keys()
        for key, value in target.items():
            if key == "path":  # relative to the dataset root when streamed
                assert folder_target["path"].endswith("/" + value)
            elif torch.is_tensor(value):
                assert torch.equal(value, folder_target[key]), key
            else:
                assert value == folder_target[key], key


def test_streamed_segmentation_and_translation_give_the_folder_data(optimized):
    from datamodules.segmentation import SegmentationDataModule
    from datamodules.wmt import TranslationDataModule

    root = optimized("segment", "--splits", "val")
    streamed = SegmentationDataModule(streaming_root=str(root), eval_short_side=None)
    folder = SegmentationDataModule(eval_short_side=None)
    assert streamed.class_names == folder.class_names
    folder_set = folder._dataset("val")
    seen = 0
    for item in streamed._dataset("val"):
        expected = folder_set[item["index"]]
        assert torch.equal(item["image"], expected["image"]) and torch.equal(item["mask"], expected["mask"])
        assert Path(item["path"]).stem == Path(expected["path"]).stem  # test writes masks/<stem>.png
        seen += 1
    assert seen == len(folder_set)

    import numpy as np

    # translation reads the token arrays stored beside the samples: mapped in place from a folder, and
    # downloaded once into the prepared cache from a store (local: reads the folder as one)
    root = optimized("translate", "--data.vocab_size", "500")
    folder = TranslationDataModule(vocab_size=500)
    for streaming_root in (str(root), f"local:{root}"):
        streamed = TranslationDataModule(vocab_size=500, streaming_root=streaming_root)
        assert streamed.vocabulary_fingerprint == folder.vocabulary_fingerprint
        assert streamed.vocab_size == folder.vocab_size
        for split in ("train", "valid", "test"):
            a, b = streamed.dataset(split, training=split == "train"), folder.dataset(split, training=split == "train")
            assert list(a.index) == list(b.index) and list(a.num_tokens) == list(b.num_tokens)
            for i in range(len(b)):
                x, y = a[i], b[i]
                assert x[0] == y[0] and (x[1] == y[1]).all() and (x[2] == y[2]).all() and x[3:] == y[3:]
        index = streamed.dataset("train").tokens
        assert isinstance(index, np.memmap) and (str(root) in str(index.filename)) == (streaming_root == str(root))


def test_streamed_training_items_carry_the_folder_augmentation_seeds(optimized):
    """LitData deals the samples in its own shuffled order; each one is augmented exactly as the folder
    loader augments that sample in that epoch (the seed is a function of seed, epoch and index)."""
    from datamodules.imagefolder import ImageFolderDataModule
    from datamodules.loaders import SeededSamples, sample_seed

    root = optimized("classify")
    arguments = dict(image_size=24, eval_resize=24, batch_size=6, num_workers=0, rand_augment=True,
                     random_erasing=0.5)
    streamed = ImageFolderDataModule(streaming_root=str(root), **arguments)
    streamed.setup("fit")
    folder = ImageFolderDataModule(**arguments)
    folder.setup("fit")
    loader = streamed.train_dataloader()
    assert len(loader) == len(folder.train_set) // 6
    seeded = SeededSamples(folder.train_set)
    for epoch in (0, 1):
        loader.current_epoch = epoch  # what the loader takes from trainer.current_epoch
        batch = next(iter(loader))
        for k, index in enumerate(batch["index"].tolist()):
            expected = seeded[(index, sample_seed(0, epoch, index))]
            assert torch.equal(batch["image"][k], expected["image"]), (epoch, index)
            assert batch["target"][k] == expected["target"] and batch["path"][k] == expected["path"]
        order = batch["index"].tolist()
    assert order != sorted(order)  # shuffled


# -- bad streaming roots ------------------------------------------------------------------------------------
def test_bad_streaming_roots_are_named(optimized, tmp_path):
    from datamodules.coco import CocoDataModule
    from datamodules.imagefolder import ImageFolderDataModule

    root = optimized("classify")
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(FileNotFoundError, match=f"streaming_root={plain} is not an optimized dataset: no "
                                                f"{plain}/streaming.json"):
        ImageFolderDataModule(streaming_root=str(plain)).classes
    with pytest.raises(FileNotFoundError, match=f"streaming_root={tmp_path / 'absent'} does not exist"):
        ImageFolderDataModule(streaming_root=str(tmp_path / "absent")).classes
    # a dataset optimized for another task
    with pytest.raises(ValueError, match=f"streaming_root={root} holds 'imagefolder' data optimized for task "
                                         "'classify'; this datamodule reads 'coco' data"):
        CocoDataModule(streaming_root=str(root)).categories
    # a split the conversion left out
    with pytest.raises(FileNotFoundError, match=rf"streaming_root={root} has no split 'holdout' \(its splits: "
                                                r"\['test', 'train', 'val'\]\)"):
        ImageFolderDataModule(streaming_root=str(root), val_dir="holdout").setup("validate")
    # a split folder that is not LitData's
    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    (broken / "val" / "index.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"{broken / 'val'} is not an optimized split"):
        ImageFolderDataModule(streaming_root=str(broken)).setup("validate")


def test_a_corrupt_sample_or_chunk_is_named_by_split_and_index(optimized, tmp_path):
    from datamodules.imagefolder import ImageFolderDataModule
    from datamodules.images import BadImageError

    corrupt = tmp_path / "corrupt"
    shutil.copytree(optimized("classify"), corrupt)
    chunk = sorted((corrupt / "test").glob("chunk-*.bin"))[0]
    data = bytearray(chunk.read_bytes())
    first_png = data.index(b"\x89PNG")  # the first sample's image, stored as its file was
    data[first_png:first_png + 64] = bytes(64)
    chunk.write_bytes(bytes(data))

    arguments = dict(streaming_root=str(corrupt), image_size=24, eval_resize=24, batch_size=300, num_workers=0)
    datamodule = ImageFolderDataModule(**arguments)
    datamodule.setup("test")
    with pytest.raises(BadImageError, match=rf"cannot read image {corrupt / 'test'} sample 0 \(test/0_zero/digit_"):
        next(iter(datamodule.test_dataloader()))
    skipping = ImageFolderDataModule(**arguments, on_bad_image="skip")
    skipping.setup("test")
    batch = next(iter(skipping.test_dataloader()))
    assert batch["skipped"] == 1 and len(batch["index"]) == 268 and 0 not in batch["index"].tolist()

    # a chunk cut short (a partial copy): the first sample it cannot give is named by split and position
    last = sorted((corrupt / "test").glob("chunk-*.bin"))[-1]
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    with pytest.raises(RuntimeError, match=rf"{corrupt / 'test'}: sample at position \d+ cannot be read from its "
                                           rf"chunk .*{last.name}"):
        next(iter(skipping.test_dataloader()))


# -- the promises under DDP and across a kill (slow) --------------------------------------------------------
SHORT_FIT = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["classify", "detect", "voc", "segment", "translate"])
def test_streamed_test_equals_the_folder_test_under_one_and_two_processes(case, optimized, tmp_path):
    """A short fit on the streamed data, then its checkpoint scored on the test split read from files
    (1 process) and streamed (1 and 2 processes): every number of metrics.json is the same."""
    task = "detect" if case == "voc" else case
    # the conversion reads the VOC demo recipe; training gets its datamodule and splits as flags
    conversion = {"voc": ["--config", VOC_RECIPE], "translate": ["--data.vocab_size", "500"]}.get(case, [])
    recipe = VOC_FLAGS if case == "voc" else []
    root = optimized(task, *conversion)
    if case == "classify":  # read the object-store way: manifest and chunks through LitData's cache
        root = f"local:{root}"
    data = [*recipe, *TINY[task]]
    run_task(task, "fit", *data, *QUIET, *SHORT_FIT, "--data.streaming_root", str(root),
             "--trainer.default_root_dir", "fit", cwd=tmp_path)
    ckpt = str(tmp_path / "fit" / "checkpoints" / "last.ckpt")
    # batches that do not divide the split evenly between the ranks
    uneven = {"classify": ["--data.batch_size", "7"], "detect": ["--data.eval_batch_size", "5"]}.get(task, [])
    test = ["test", "--ckpt_path", ckpt, *data, *QUIET, *uneven]
    run_task(task, *test, "--trainer.default_root_dir", "folder", cwd=tmp_path)
    for devices in ("1", "2"):
        run_task(task, *test, "--data.streaming_root", str(root), "--trainer.devices", devices,
                 "--trainer.strategy", "ddp" if devices == "2" else "auto",
                 "--trainer.default_root_dir", f"streamed{devices}", cwd=tmp_path, timeout=900)
    folder = metrics(tmp_path / "folder")
    assert all(math.isfinite(v) for v in folder.values())
    assert_same_metrics(folder, metrics(tmp_path / "streamed1"))
    assert_same_metrics(folder, metrics(tmp_path / "streamed2"))


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "2"])
def test_streamed_fit_killed_mid_epoch_resumes_exactly(workers, optimized, tmp_path):
    """Killed inside the second epoch and resumed with --ckpt_path last, a streamed fit ends where the
    uninterrupted streamed fit ends: LitData's loader state replays the epoch's order past the batches
    trained, in the trainer's epoch, with the same per-sample augmentation."""
    root = optimized("classify")
    run = [*TINY["classify"], *QUIET, "--data.num_workers", workers, "--data.batch_size", "8",
           "--data.rand_augment", "true", "--model.head_dropout", "0.2", "--data.streaming_root", str(root),
           "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "5", "--trainer.limit_val_batches", "1",
           "--checkpoint.every_n_train_steps", "1"]
    run_task("classify", "fit", *run, "--trainer.default_root_dir", "straight", cwd=tmp_path)
    killed = run_task("classify", "fit", *run, "--trainer.default_root_dir", "resumed",
                      "--trainer.callbacks+=tests.callbacks.KillAtStep", "--trainer.callbacks.init_args.step", "7",
                      cwd=tmp_path, check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    interrupted = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)
    assert interrupted["global_step"] == 7 and interrupted["epoch"] == 1  # inside the second epoch
    run_task("classify", "fit", *run, "--trainer.default_root_dir", "resumed", "--ckpt_path", "last", cwd=tmp_path)

    straight = torch.load(tmp_path / "straight/checkpoints/last.ckpt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)
    assert straight["global_step"] == resumed["global_step"] == 10
    for key, value in straight["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][key]), key
    s_opt, r_opt = straight["optimizer_states"][0]["state"], resumed["optimizer_states"][0]["state"]
    for i in s_opt:
        for name, value in s_opt[i].items():
            assert torch.equal(value, r_opt[i][name]), (i, name)
    # and it really resumed mid-epoch: the killed run's checkpoint held LitData's position after 2 batches
    loader_state = interrupted["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader_state["num_samples_yielded"] == 2 * 8 and loader_state["current_epoch"] == 2


def test_a_streamed_photo_is_decoded_upright_like_the_folder_read_one(tmp_path):
    """A stored sample keeps the file's bytes, EXIF orientation included: the streamed decode turns
    it upright as the folder readers do, so both give the same pixels."""
    import numpy as np
    from PIL import Image

    from datamodules.images import read_rgb
    from datamodules.streaming import decode_rgb

    pixels = np.random.default_rng(0).integers(0, 256, (20, 36, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: viewers show it 20 wide, 36 high
    path = tmp_path / "photo.png"
    Image.fromarray(pixels).save(path, exif=exif)
    streamed = decode_rgb(path.read_bytes(), "sample 0")
    assert streamed.shape == (3, 36, 20)
    assert torch.equal(streamed, read_rgb(path))
