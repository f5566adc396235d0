"""Which input a model takes is decided once (datamodules/input_spec.py::resolve_preprocessing) and read
alike by its three readers: the datamodule the CLI builds (told by tasks/cli/links.py), the model a
checkpoint loads into (``tasks.load(ckpt).input_spec``) and ``export`` (the metadata of its graph). They
agree for a registered weights name, for a checkpoint whose stored specification is not ImageNet's, and
for a mean and std given explicitly. Also: backbones/pretrained.py and backbones/weights.py do not import
each other."""
from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

from backbones.pretrained import IMAGENET_MEAN, IMAGENET_STD, PRETRAINED, Preprocessing
from datamodules.input_spec import InputSpec, normalization, resolve_preprocessing
from tests.conftest import REPO

#: a normalisation no weights are registered with, different from ImageNet's
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
WEIGHTS = "mobilevitv2_050.cvnets_in1k"  # the demo recipe's backbone, MobileViTv2-0.5
TINY = ["--data.image_size", "32", "--data.eval_resize", "32", "--data.batch_size", "16", "--data.num_workers", "0",
        "--model.scheduler.init_args.warmup_steps", "2", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu", "--trainer.num_sanity_val_steps", "0"]
ONE_STEP = ["--trainer.max_steps", "1", "--trainer.limit_val_batches", "1"]


def normalisation(spec) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return tuple(spec.mean), tuple(spec.std)


def classify(*args: str):
    """``python -m tasks.classify *args`` in this process (the working directory is the test's); what it built."""
    from tasks.cli.suite import main

    return main("classify", list(args), exit_on_error=False)


def fit(*args: str) -> tuple[InputSpec, Path]:
    """(the datamodule's input specification, ``last.ckpt``) of a one-step fit of the demo recipe."""
    cli = classify("fit", *TINY, *ONE_STEP, *args)
    return cli.datamodule.input_spec, Path("runs/classify/checkpoints/last.ckpt").resolve()


def evaluated(ckpt: Path, *args: str) -> InputSpec:
    """The input specification of the datamodule ``validate --ckpt_path ckpt`` scores on."""
    return classify("validate", "--ckpt_path", str(ckpt), *TINY, "--trainer.limit_val_batches", "1",
                    *args).datamodule.input_spec


def loaded(ckpt: Path) -> InputSpec:
    """The input specification of the model ``tasks.load`` gives (what ``model.predict`` prepares images with)."""
    import tasks

    return tasks.load(ckpt).input_spec


def exported(ckpt: Path, monkeypatch, *args: str) -> tuple[tuple, tuple]:
    """(mean, std) that ``export --ckpt_path ckpt *args`` writes into the graph's metadata. The command runs as
    it is up to the task's exporter, which is replaced by one that builds the metadata as every image
    exporter does (:func:`tasks.export.onnx.image_metadata` of the request's spec) instead of writing ONNX."""
    from tasks.export import command
    from tasks.export.onnx import ExportReport, image_metadata

    written = {}

    class MetadataOnly:
        FLAGS: dict = {}

        @staticmethod
        def export(request) -> ExportReport:
            written.update(image_metadata(request.spec, request.spec.image_size, None))
            return ExportReport()

    monkeypatch.setattr(command, "exporter_of", lambda model_class: MetadataOnly)
    classify("export", "--ckpt_path", str(ckpt), *args)
    return tuple(written["mean"]), tuple(written["std"])


@pytest.fixture(scope="module")
def explicit_fit(tmp_path_factory):
    """(datamodule spec, last.ckpt) of a fit given ``--data.mean MEAN --data.std STD`` and random weights."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("explicit"))
        return fit("--data.mean", str(list(MEAN)), "--data.std", str(list(STD)))


def test_a_registered_weights_name_reaches_the_datamodule_the_loaded_model_and_the_export(tmp_path, monkeypatch):
    from backbones.mobilevitv2 import MobileViTv2

    monkeypatch.chdir(tmp_path)
    entry = PRETRAINED.get(WEIGHTS)
    Path(entry.file).parent.mkdir(parents=True)
    torch.save(MobileViTv2(width=0.5).state_dict(), entry.file)  # stands in for CVNets' file at its place
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data, ckpt = fit("--model.backbone.init_args.pretrained", WEIGHTS)
    # the weights say their input and nothing contradicts it: no word about the normalisation
    assert not [w for w in caught if "was trained with" in str(w.message) or "which input" in str(w.message)]
    trained = (entry.preprocessing.mean, entry.preprocessing.std)
    assert trained == ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # CVNets feeds [0, 1] pixels as they are
    assert normalisation(data) == normalisation(loaded(ckpt)) == exported(ckpt, monkeypatch) == trained


def test_explicit_mean_and_std_reach_the_datamodule_the_loaded_model_and_the_export(explicit_fit, monkeypatch):
    data, ckpt = explicit_fit
    assert normalisation(data) == normalisation(loaded(ckpt)) == exported(ckpt, monkeypatch) == (MEAN, STD)


def test_a_checkpoint_is_scored_loaded_and_exported_with_its_stored_normalisation(explicit_fit, tmp_path,
                                                                                 monkeypatch):
    """No data flags: the checkpoint's stored specification (not ImageNet's, not the recipe's) decides."""
    _, ckpt = explicit_fit
    monkeypatch.chdir(tmp_path)
    stored = torch.load(ckpt, map_location="cpu", weights_only=True)["input_spec"]
    assert (tuple(stored["mean"]), tuple(stored["std"])) == (MEAN, STD) != (IMAGENET_MEAN, IMAGENET_STD)
    assert normalisation(evaluated(ckpt)) == normalisation(loaded(ckpt)) == exported(ckpt, monkeypatch) == (MEAN, STD)


def test_a_mean_given_against_a_checkpoint_wins_in_the_datamodule_and_the_export_and_is_warned_about(
        explicit_fit, tmp_path, monkeypatch):
    _, ckpt = explicit_fit
    monkeypatch.chdir(tmp_path)
    given = ["--data.mean", "[0.1, 0.2, 0.3]"]
    contradiction = r"data.mean=\[0.1, 0.2, 0.3\] differs from the mean \[0.5, 0.4, 0.3\] that the checkpoint"
    with pytest.warns(UserWarning, match=contradiction):
        data = evaluated(ckpt, *given)
    with pytest.warns(UserWarning, match=contradiction):
        export = exported(ckpt, monkeypatch, *given)
    assert normalisation(data) == export == ((0.1, 0.2, 0.3), STD)  # the std left unset is the checkpoint's


# -- the resolver itself --------------------------------------------------------------------------------------
def test_the_resolver_takes_a_checkpoints_specification_over_weights_and_given_values_over_both():
    stored = InputSpec.center_crop(224, 256, MEAN, STD, "bicubic")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_preprocessing(WEIGHTS, stored=stored.to_dict()) == Preprocessing(MEAN, STD, 224, 256, "bicubic")
        assert resolve_preprocessing(stored=stored) == resolve_preprocessing(stored=stored.to_dict())
        assert resolve_preprocessing(WEIGHTS) == PRETRAINED.get(WEIGHTS).preprocessing
        assert resolve_preprocessing() == Preprocessing(IMAGENET_MEAN, IMAGENET_STD)  # no weights: ImageNet's
        assert normalization(WEIGHTS, std=(1, 1, 1)) == ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # agrees: no warning
    with pytest.warns(UserWarning, match=rf"data.std=\[0.5, 0.5, 0.5\] differs from the std \[1.0, 1.0, 1.0\] that "
                                         rf"{WEIGHTS} was trained with"):
        resolved = resolve_preprocessing(WEIGHTS, std=(0.5, 0.5, 0.5))
    assert resolved == Preprocessing((0.0, 0.0, 0.0), (0.5, 0.5, 0.5), 256, 288, "bicubic")
    # a square (detection) or short-side (segmentation) spec has no resize before a centre crop
    square = resolve_preprocessing(stored=InputSpec.square(320, MEAN, STD))
    assert (square.input_size, square.resize_size) == (320, None)


def test_a_loaded_model_takes_the_checkpoints_spec_unless_a_fit_resumes_with_its_own_data():
    """``Predictor.on_load_checkpoint``: ``tasks.load`` (no Trainer) and evaluations take the stored spec; a
    resumed fit keeps the one its datamodule gave; a checkpoint without one is read through the task's rule."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.trainer.states import TrainerFn

    from backbones.mobilevitv2 import MobileViTv2
    from tasks.classify import ClassificationTask

    own, stored = InputSpec.center_crop(32, 32, MEAN, STD), InputSpec.center_crop(64, 72, IMAGENET_MEAN, IMAGENET_STD)
    model = ClassificationTask(MobileViTv2(width=0.25), class_names=["a", "b"])
    model.on_load_checkpoint({"input_spec": stored.to_dict()})  # not attached to a Trainer
    assert model.input_spec == stored
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
    model.trainer = trainer
    for fn, expected in ((TrainerFn.FITTING, own), (TrainerFn.VALIDATING, stored)):
        model.input_spec, trainer.state.fn = own, fn
        model.on_load_checkpoint({"input_spec": stored.to_dict()})
        assert model.input_spec == expected, fn
    model.input_spec = None
    model.on_load_checkpoint({"datamodule_hyper_parameters": {"image_size": 64, "eval_resize": 72}})
    assert model.input_spec == stored  # ImageFolder's arguments, no weights: ImageNet's mean and std


# -- the modules ------------------------------------------------------------------------------------------------
def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_weights_registry_and_the_weights_reader_do_not_import_each_other():
    """backbones/weights.py reads files and converts them with the registry's facts; the registry reads no
    file. One direction only: the two modules are no circle."""
    assert "backbones.pretrained" in imported_modules(REPO / "backbones/weights.py")
    assert not {"backbones.weights", "backbones"} & imported_modules(REPO / "backbones/pretrained.py")


def defines(path: Path, name: str) -> bool:
    """Whether a top-level assignment of ``path`` binds ``name``."""
    for node in ast.parse(path.read_text()).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            return True
    return False


def test_imagenet_mean_and_std_are_defined_once():
    for name in ("IMAGENET_MEAN", "IMAGENET_STD"):
        where = [path.relative_to(REPO).as_posix()
                 for folder in ("backbones", "datamodules", "heads", "layers", "tasks")
                 for path in sorted((REPO / folder).rglob("*.py")) if defines(path, name)]
        assert where == ["backbones/pretrained.py"], (name, where)
