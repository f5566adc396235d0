"""The tables and pictures of `test` and validation reach every logger of the run (tasks/outputs/media.py).

The real tasks run with several loggers at once (``--trainer.logger`` a list): wandb (offline), TensorBoard
and CSV get the same validation images and test tables; each is read back from what the logger wrote
(wandb's run files, TensorBoard's event file, the CSV logger's folder). Segmentation's overlays through
TensorBoard run in the slow suite. MLflow is checked when it is
installed (it is no dependency of the suite).
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tasks.outputs.media import (AllSinks, Boxes, CsvSink, Mask, MlflowSink, TensorBoardSink, WandbSink, drawn,
                                 markdown_table, media_sink)

def loggers(*names: str) -> list[str]:
    """``--trainer.logger`` naming several of Lightning's loggers, each in its own folder under the run root."""
    known = {"wandb": {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"offline": True}},
             "tensorboard": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"name": "tb"}},
             "csv": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"name": "csv"}}}
    return ["--trainer.logger", json.dumps([known[name] for name in names])]


def events(folder: Path):
    """TensorBoard's view of the one event file under ``folder``, every event kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list(folder.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    accumulator = EventAccumulator(str(files[0]), size_guidance={"images": 0, "tensors": 0, "scalars": 0})
    accumulator.Reload()
    return accumulator


def text(accumulator, tag: str) -> str:
    """The last text logged under ``tag`` (``add_text`` stores it under ``<tag>/text_summary``)."""
    return accumulator.Tensors(f"{tag}/text_summary")[-1].tensor_proto.string_val[0].decode()


def markdown_rows(table: str) -> list[list[str]]:
    """The body rows of a markdown table written by :func:`markdown_table` (no ``|`` in its cells)."""
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


@pytest.mark.filterwarnings("ignore")
def test_classification_media_reach_wandb_tensorboard_and_csv(classify_run):
    """The session's shared classification run (conftest's ``classify_run``): a fit of 4 steps with one
    validation of 2 batches of 16, and a test of 3 batches, logging to wandb, TensorBoard and CSV at once."""
    pytest.importorskip("tensorboard")
    root = classify_run.root
    predictions = root / "predictions"
    per_class = read_csv(predictions / "per_class.csv")
    worst = read_csv(predictions / "worst" / "worst.csv")
    assert len(per_class) == 11 and len(worst) == 17  # 10 classes, 16 worst images, each with its header

    # wandb: the fit run has the validation images, the test run the tables and pictures (keys as before)
    fit_run, test_run = sorted((root / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime)
    samples = list((fit_run / "files" / "media" / "images" / "val").glob("samples_*.png"))
    assert len(samples) == 2  # one sample from each of the 2 validation batches
    from PIL import Image

    with Image.open(samples[0]) as picture:  # uint8 pixels, not a float image wandb would cast to black
        assert np.asarray(picture).max() > 0
    media = test_run / "files" / "media"
    table = json.loads(next((media / "table" / "test").glob("per_class_*.table.json")).read_text())
    assert table["columns"] == per_class[0] and [row[0] for row in table["data"]] == [r[0] for r in per_class[1:]]
    assert len(next((media / "table" / "test").glob("worst_*.table.json")).read_text()) > 0
    assert len(list((media / "images" / "test").glob("confusion_matrix_*.png"))) == 1
    assert len(list((media / "images" / "test").glob("worst_images_*.png"))) == 16

    # TensorBoard: one image tag per validation sample in the fit's events, tables as markdown in the test's
    fit_events, test_events = (events(root / "tb" / f"version_{v}") for v in (0, 1))
    val_tags = sorted(t for t in fit_events.Tags()["images"] if t.startswith("val/"))
    assert val_tags == ["val/samples/00", "val/samples/01"]
    assert "val/samples/captions/text_summary" in fit_events.Tags()["tensors"]
    assert all(len(fit_events.Images(f"val/samples/{n}")) == 1 for n in ("00", "01"))
    assert markdown_rows(text(test_events, "test/per_class"))[0][0] == per_class[1][0]
    assert len(markdown_rows(text(test_events, "test/per_class"))) == 10
    assert len(markdown_rows(text(test_events, "test/worst"))) == 16
    assert len(markdown_rows(text(test_events, "test/worst_images/captions"))) == 16
    image_tags = test_events.Tags()["images"]
    assert "test/confusion_matrix" in image_tags
    assert sorted(t for t in image_tags if t.startswith("test/worst_images/")) == [
        f"test/worst_images/{n:02d}" for n in range(16)]
    with Image.open(predictions / "worst" / worst[1][-1]) as first:  # the worst image as test drew it
        shown = test_events.Images("test/worst_images/00")[0]
        assert (shown.width, shown.height) == first.size
    assert fit_events.Images("val/samples/00")[0].step == 4  # the trainer's global step
    assert test_events.Images("test/confusion_matrix")[0].step == 0  # `test`'s trainer has taken no step

    # CSV: the same tables as CSV files, the pictures as PNGs, under the CSV logger's log_dir
    fit_media, test_media = (root / "csv" / f"version_{v}" / "media" for v in (0, 1))
    assert sorted(p.name for p in (fit_media / "val" / "samples").iterdir()) == [
        "step_4_00.png", "step_4_01.png", "step_4_captions.csv"]
    rows = read_csv(test_media / "test" / "per_class" / "step_0.csv")
    assert [row[0] for row in rows] == [row[0] for row in per_class]
    assert all(float(a) == float(b) for row, expected in zip(rows[1:], per_class[1:])
               for a, b in zip(row[1:], expected[1:]))
    assert len(read_csv(test_media / "test" / "worst" / "step_0.csv")) == 17
    assert (test_media / "test" / "confusion_matrix" / "step_0.png").is_file()
    assert len(list((test_media / "test" / "worst_images").glob("step_0_*.png"))) == 16
    captions = read_csv(test_media / "test" / "worst_images" / "step_0_captions.csv")
    assert captions[1] == ["step_0_00.png", f"1: {worst[1][1]}"]


@pytest.mark.slow  # ~2 min on 2 cores; the classification case above keeps a real run in the default suite
@pytest.mark.filterwarnings("ignore")
def test_segmentation_validation_overlays_reach_tensorboard(run_cli, tmp_path):
    """Without wandb's mask overlays, each validation image is drawn as image | prediction | truth."""
    pytest.importorskip("tensorboard")
    run_cli("segment", "fit", "--data.crop_size", "64", "--data.scale_range", "[0.75, 1.25]", "--data.batch_size", "4",
            "--data.num_workers", "0", "--data.eval_short_side", "null", "--trainer.max_epochs", "1",
            "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "2",
            "--trainer.check_val_every_n_epoch", "1", "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu", *loggers("tensorboard"))
    accumulator = events(tmp_path / "runs" / "segment" / "tb" / "version_0")
    tags = sorted(t for t in accumulator.Tags()["images"] if t.startswith("val/overlays/"))
    assert tags == ["val/overlays/00", "val/overlays/01"]  # one sample from each validation batch
    for tag in tags:
        (shown,) = accumulator.Images(tag)
        assert shown.step == 2
        from PIL import Image

        with Image.open(io.BytesIO(shown.encoded_image_string)) as picture:
            pixels = np.asarray(picture.convert("RGB"))
        width = pixels.shape[1] // 3
        assert pixels.shape[1] == 3 * width
        image, prediction, truth = pixels[:, :width], pixels[:, width:2 * width], pixels[:, 2 * width:]
        assert not np.array_equal(image, prediction) and not np.array_equal(image, truth)  # colours blended in
    class_names = [row[0] for row in markdown_rows(text(accumulator, "val/per_class"))]
    assert len(class_names) > 1


# -- the sinks alone --------------------------------------------------------------------------------------
def fake_trainer(*loggers, rank: int = 0, global_step: int = 7):
    return SimpleNamespace(global_rank=rank, loggers=list(loggers), global_step=global_step)


def test_no_logger_that_shows_media_means_no_sink_and_nothing_collected(tmp_path):
    from lightning.pytorch.loggers import CSVLogger, Logger

    from tasks.outputs.classification import ValidationImages

    class Plain(Logger):  # a logger the suite has no sink for
        name, version = "plain", 0

        def log_metrics(self, metrics, step=None):
            pass

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    csv_logger = CSVLogger(tmp_path)
    assert media_sink(fake_trainer()) is None and media_sink(fake_trainer(Plain())) is None
    assert media_sink(fake_trainer(csv_logger, rank=1)) is None  # rank 0 logs the media
    assert isinstance(media_sink(fake_trainer(Plain(), csv_logger)), CsvSink)
    both = media_sink(fake_trainer(csv_logger, CSVLogger(tmp_path, name="other")))
    assert isinstance(both, AllSinks) and len(both.sinks) == 2

    callback = ValidationImages(4)
    trainer = SimpleNamespace(global_rank=0, loggers=[Plain()], sanity_checking=False, num_val_batches=[8])
    callback.on_validation_epoch_start(trainer, None)
    callback.on_validation_batch_end(trainer, None, {"sample": (torch.zeros(3, 4, 4), 0, 0)}, None, 0)
    assert callback.batches == set() and callback.samples == []
    trainer.loggers = [csv_logger]
    callback.on_validation_epoch_start(trainer, None)
    callback.on_validation_batch_end(trainer, None, {"sample": (torch.zeros(3, 4, 4), 0, 0)}, None, 0)
    assert callback.batches == {0, 2, 4, 6} and len(callback.samples) == 1
    trainer.num_val_batches = [2]  # fewer batches than samples wanted: one from each
    callback.on_validation_epoch_start(trainer, None)
    assert callback.batches == {0, 1}


def test_overlays_are_drawn_for_loggers_without_their_own():
    picture = np.full((8, 10, 3), 100, np.uint8)
    names = {0: "a", 1: "b"}
    boxes = Boxes(torch.tensor([[1.0, 1.0, 6.0, 5.0]]), torch.tensor([1]), names, torch.tensor([0.5]))
    with_boxes = drawn(picture, {"predictions": boxes})
    assert with_boxes.shape == picture.shape and (with_boxes[1, 1:7] == [255, 0, 0]).all()  # red outline
    palette = np.array([[0, 0, 0], [200, 0, 0]], np.uint8)
    labels = np.zeros((8, 10), np.uint8)
    labels[0, 0], labels[0, 1] = 1, 255
    masks = {"prediction": Mask(labels, names, palette, 255), "ground_truth": Mask(labels, names, palette, 255)}
    panels = drawn(picture, masks)
    assert panels.shape == (8, 30, 3)  # image | prediction | truth
    assert (panels[0, 10] == [150, 50, 50]).all() and (panels[0, 11] == [178, 178, 178]).all()  # blended, ignore white
    assert (panels[1, 10] == [50, 50, 50]).all() and (panels[:, :10] == 100).all()
    assert boxes.wandb()["box_data"][0]["box_caption"] == "b 0.50"
    assert markdown_table(["a", "b"], [["x|y", "line\nbreak"]]).splitlines()[2] == "| x\\|y | line break |"


def test_wandb_gets_one_picture_as_one_and_a_list_as_a_list():
    import wandb

    logged = []

    class Logger:
        def log_image(self, key, images, step=None, **kwargs):
            logged.append(("list", key, images, step, kwargs))

        def log_metrics(self, metrics, step=None):
            logged.append(("one", metrics, step))

        def log_table(self, key, columns, data, step=None):
            logged.append(("table", key, columns, data, step))

    sink = WandbSink(Logger())
    picture = np.zeros((4, 4, 3), np.uint8)
    sink.log_image("k", [picture], captions=["c"])
    sink.log_image("single", picture)
    sink.log_table("t", ["x"], [[1]])
    assert logged[0] == ("list", "k", [picture], None, {"caption": ["c"]})
    assert logged[1][0] == "one" and isinstance(logged[1][1]["single"], wandb.Image)
    assert logged[2] == ("table", "t", ["x"], [[1]], None)


def test_tensorboard_sink_writes_images_captions_and_tables(tmp_path):
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path, name="tb")
    sink = TensorBoardSink(logger, fake_trainer(logger, global_step=3))
    sink.log_image("val/pics", [np.zeros((4, 6, 3), np.uint8)] * 3, captions=["a", "b", "c"])
    sink.log_image("one", np.zeros((5, 5, 3), np.uint8), step=9)
    sink.log_table("val/table", ["class", "iou"], [["cat", 0.5], ["dog", 0.25]])
    logger.finalize("success")
    accumulator = events(Path(logger.log_dir))
    assert sorted(accumulator.Tags()["images"]) == ["one", "val/pics/00", "val/pics/01", "val/pics/02"]
    assert accumulator.Images("one")[0].step == 9 and accumulator.Images("val/pics/00")[0].step == 3
    assert (accumulator.Images("val/pics/00")[0].width, accumulator.Images("val/pics/00")[0].height) == (6, 4)
    assert markdown_rows(text(accumulator, "val/table")) == [["cat", "0.5"], ["dog", "0.25"]]
    assert markdown_rows(text(accumulator, "val/pics/captions")) == [["00", "a"], ["01", "b"], ["02", "c"]]


def test_mlflow_sink_logs_artifacts_through_the_client():
    """The calls the sink makes on MLflow's client (artifact names under ``media/<key>/``), with a stand-in."""
    calls = []

    class Client:
        def log_image(self, run_id, image, artifact_file):
            calls.append(("image", run_id, image.shape, artifact_file))

        def log_table(self, run_id, data, artifact_file):
            calls.append(("table", run_id, data, artifact_file))

    logger = SimpleNamespace(experiment=Client(), run_id="r1")
    sink = MlflowSink(logger, fake_trainer(logger, global_step=5))
    sink.log_image("val/samples", [np.zeros((4, 4, 3), np.uint8)] * 2, captions=["a", "b"])
    sink.log_table("test/per_class", ["class", "iou"], [["cat", 0.5]])
    assert calls == [("image", "r1", (4, 4, 3), "media/val/samples/step_5_00.png"),
                     ("image", "r1", (4, 4, 3), "media/val/samples/step_5_01.png"),
                     ("table", "r1", {"file": ["step_5_00.png", "step_5_01.png"], "caption": ["a", "b"]},
                      "media/val/samples/step_5_captions.json"),
                     ("table", "r1", {"class": ["cat"], "iou": [0.5]}, "media/test/per_class/step_5.json")]


def test_mlflow_sink_with_mlflow(tmp_path):
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger

    logger = MLFlowLogger(experiment_name="media", tracking_uri=f"file:{tmp_path / 'mlruns'}")
    sink = media_sink(fake_trainer(logger, global_step=2))
    assert isinstance(sink, MlflowSink)
    sink.log_image("val/samples", [np.zeros((4, 4, 3), np.uint8)], captions=["a"])
    sink.log_table("test/per_class", ["class", "iou"], [["cat", 0.5]])
    artifacts = {a.path for a in logger.experiment.list_artifacts(logger.run_id, "media/val/samples")}
    assert artifacts == {"media/val/samples/step_2_00.png", "media/val/samples/step_2_captions.json"}
    assert [a.path for a in logger.experiment.list_artifacts(logger.run_id, "media/test/per_class")] == [
        "media/test/per_class/step_2.json"]


# -- predict's translations go to the stream they are given ---------------------------------------------------
def test_predicted_translations_go_to_the_given_stream(tmp_path):
    from tasks.outputs.translation import PredictedTranslations

    task = SimpleNamespace(max_positions=64)
    rows = [(1, "zwei", False), (0, "eins", False), (1, "zwei", False)]  # a padding sampler repeats a line
    stream = io.StringIO()
    writer = PredictedTranslations("-", stream=stream)
    writer.write(None, tmp_path, rows, task)
    assert stream.getvalue() == "eins\nzwei\n" and writer.destination(None) == "standard output"
    assert not list(tmp_path.iterdir())
    PredictedTranslations(str(tmp_path / "out.txt")).write(None, tmp_path, rows, task)  # no stream: the file
    assert (tmp_path / "out.txt").read_text() == "eins\nzwei\n"
