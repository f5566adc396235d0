"""``python -m tasks.<task> export --ckpt_path CKPT [--output FILE] [--opset N]``: a checkpoint as ONNX.

The checkpoint supplies the model (as for ``validate``/``test``/``predict``) and its input specification
(:class:`datamodules.input_spec.InputSpec`: size, mean, std), whose size, mean and std may be overridden
(``--data.image_size 256``; segmentation's ``--data.crop_size``). ``--data.mean`` and ``--data.std`` are
resolved against the checkpoint's as the datamodule resolves them
(:func:`datamodules.input_spec.resolve_preprocessing`, which warns about a contradiction). The command
writes the graph next to the checkpoint (``<ckpt stem>.onnx``) unless ``--output`` says otherwise, runs
it with ONNX Runtime against the PyTorch model on seeded random inputs, and prints where it wrote and
the difference it measured. Every input and output is named and the batch size is dynamic. What each
task's graph computes is in its module, which the task's declaration names (``export`` in
``configs/<task>/task.yaml``):
:mod:`tasks.export.classification`, :mod:`tasks.export.detection`, :mod:`tasks.export.segmentation`,
:mod:`tasks.export.translation`; what they share is :mod:`tasks.export.onnx`.

Image size. MobileViT and MobileViTv2 graphs take any height and width that are multiples of
the backbone's ``size_multiple`` (64 at output stride 32, 32 at 16, 16 at 8): there no block
resizes its input, which is the branch the graph holds. ConvMixer graphs take any multiple of
its deepest stride. Parity is checked at the export size and at one multiple above it. ViT
(position embeddings) and MLP-Mixer (token-mixing MLPs) take only the size they were built
for, and so do detection graphs (the anchors are constants of the graph) and a size that is
not such a multiple.
"""
from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any, Sequence

import yaml

from datamodules.input_spec import InputSpec, resolve_preprocessing
from configs.recipes import CommandLine, split_command_line
from configs.tasks import declaration_of
from tasks.export.onnx import (DEFAULT_OPSET, INT8_OPS, MAX_OPSET, MIN_OPSET, ExportReport, ExportRequest,
                               check_opset, ort_session, quantize_onnx, require_export_extra, session_runner)
from tasks.export.programs import FORMATS, Refused, export_program
from tasks.export.scoring import Scorer, calibration_images, datamodule_of


# -- the command -----------------------------------------------------------------------------------------------
def exporter_of(model_class: type):
    """The module exporting ``model_class``'s checkpoints (its ``FLAGS`` and ``export(request)``), as the
    declaration of its task names it (``export`` in ``configs/<task>/task.yaml``)."""
    from tasks.engine.checkpoints import qualified_name

    declaration = declaration_of(qualified_name(model_class))
    if declaration is None or not declaration.export:
        raise ValueError(f"{model_class.__name__} has no ONNX export (no task declares it with an export module)")
    return importlib.import_module(declaration.export)


def export_parser(model_class: type, prog: str):
    """The ``export`` subcommand's parser. ``--data.KEY VALUE`` arguments are read apart (:func:`data_overrides`)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog=prog, description=(
        "Export the checkpoint's model to ONNX, check it with ONNX Runtime against PyTorch, and print where it "
        "wrote and the difference measured. --data.image_size N (--data.crop_size N for segmentation), --data.mean and "
        "--data.std override the input specification the checkpoint carries."),
        exit_on_error=True)
    parser.add_argument("--ckpt_path", type=str, required=True, help="a checkpoint of this task, written by fit")
    parser.add_argument("--output", type=str | None, default=None,
                        help="the .onnx file to write (null: <ckpt stem>.onnx next to the checkpoint; translation "
                             "writes <stem>.encoder.onnx, <stem>.decoder_step.onnx and <stem>.spm.model)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET,
                        help=f"ONNX opset, {MIN_OPSET} to {MAX_OPSET} ({DEFAULT_OPSET} is read by ONNX Runtime >= 1.14)")
    parser.add_argument("--format", type=str, default="onnx",
                        help=f"what to write: {', '.join(FORMATS[:-1])}, or all (each target that applies; one that "
                             "does not is refused by name with the reason)")
    parser.add_argument("--int8", type=bool, default=False,
                        help="also write an INT8 model (static quantization calibrated on training images): "
                             "executorch (PT2E, XNNPACK quantizer) and onnx (ONNX Runtime)")
    parser.add_argument("--calibration", type=int, default=64, help="training images that calibrate --int8")
    parser.add_argument("--score", type=bool, default=True,
                        help="score each exported model on the test split with test's metric beside the "
                             "checkpoint's (within 0.1 point in float32, 1 point in INT8)")
    parser.add_argument("--score_batches", type=int | None, default=None,
                        help="score on the first N test batches only (null: the whole split)")
    for flag, text in exporter_of(model_class).FLAGS.items():
        parser.add_argument(f"--{flag}", type=bool, default=False, help=text)
    return parser


def data_overrides(command: CommandLine) -> dict[str, Any]:
    """``{KEY: value}`` of the command line's ``--data.KEY VALUE`` / ``--data.KEY=VALUE`` (YAML values)."""
    overrides = {}
    for flag in command.flags:
        if flag.name.startswith("data."):
            if flag.value is None:
                raise ValueError(f"--{flag.name} needs a value")
            overrides[flag.name[len("data."):]] = yaml.safe_load(flag.value)
    return overrides


#: ``--data.KEY`` options that set the size an image graph is exported at (segmentation's is its crop)
SIZE_OPTIONS = ("image_size", "crop_size")


def export_spec(model, overrides: dict[str, Any]) -> InputSpec | None:
    """The input specification to export at: the model's (from its checkpoint) with the command line's size
    (``--data.image_size``, segmentation's ``--data.crop_size``), and the mean and std
    :func:`datamodules.input_spec.resolve_preprocessing` gives for the checkpoint's and ``--data.mean`` /
    ``--data.std``; for a checkpoint that records none, the task's rule applied to those options alone
    (``None`` without a size among them)."""
    trained = getattr(model, "input_spec", None)
    size = {"image_size": overrides[key] for key in SIZE_OPTIONS if key in overrides}
    if trained is not None:
        resolved = resolve_preprocessing(stored=trained, mean=overrides.get("mean"), std=overrides.get("std"))
        return dataclasses.replace(trained, mean=resolved.mean, std=resolved.std, **size)
    rule = getattr(model, "input_spec_rule", None)
    try:
        return rule(overrides) if rule is not None and size else None
    except KeyError:  # the rule's own size option is not among them
        return None


@dataclasses.dataclass
class ExportJob:
    """An ``export`` command, read and checked: the parsed arguments, the task's exporter module, the
    request (model, input specification, output), the scorer (``--score``) and calibration inputs (``--int8``)."""

    args: Any
    exporter: Any
    request: ExportRequest
    scorer: Scorer | None
    calibration: list[tuple] | None

    @property
    def targets(self) -> list[str]:
        return list(FORMATS[:-1]) if self.args.format == "all" else [self.args.format]


@dataclasses.dataclass
class Exported:
    """One target written (``int8`` or not): its report and its loaded programs (none for Core ML)."""

    target: str
    int8: bool
    report: ExportReport
    runners: dict


def run_export(argv: CommandLine | Sequence[str], model_class: type, prog: str = "export"
               ) -> ExportReport | list[ExportReport]:
    """``export`` for ``model_class``'s task: read the command line (``argv``: the arguments after ``export``, or
    the whole command line split by :func:`configs.recipes.split_command_line`), export, check, print."""
    job = prepare_export(argv, model_class, prog)
    reports = []
    for done in export_targets(job):
        if isinstance(done, Refused):
            print(f"refused:   {done}", flush=True)
            if job.args.format != "all":
                raise SystemExit(f"cannot export: {done}")
            continue
        if not reports:
            done.report.notes.insert(0, f"from {Path(job.args.ckpt_path).resolve()}")
        print(done.report, flush=True)
        reports.append(done.report)
    failed = [f for report in reports if not report.ok for f in report.files]
    if failed:
        raise SystemExit(f"the exported model does not compute what the checkpoint computes (see FAILED above); "
                         f"the files are kept for inspection: {', '.join(str(f) for f in failed)}")
    return reports[0] if len(reports) == 1 else reports


def export_targets(job: ExportJob):
    """Write each target of ``job`` (float32, then INT8 with ``--int8``) and check it; yields an
    :class:`Exported` per file set written, the :class:`Refused` of each target that does not apply."""
    for target in job.targets:
        for int8 in (False, True) if job.args.int8 else (False,):
            try:
                report, runners = export_target(target, job.exporter, job.request, job.calibration if int8 else None)
            except Refused as refusal:
                yield refusal
                continue
            if job.scorer is not None and runnable(runners):
                report.checks.append(job.scorer.check(target, int8, runners))
            yield Exported(target, int8, report, runners)


def runnable(runners: dict) -> bool:
    """Whether every program of a target was loaded back here (a Core ML package runs on macOS only)."""
    return bool(runners) and all(run is not None for run in runners.values())


def prepare_export(argv: CommandLine | Sequence[str], model_class: type, prog: str = "export") -> ExportJob:
    """Read and check an ``export`` command line; load the checkpoint's model, datamodule and calibration images."""
    from tasks.engine.checkpoints import qualified_name
    from tasks.engine.checkpoints import check_checkpoint_file

    exporter = exporter_of(model_class)
    command = argv if isinstance(argv, CommandLine) else split_command_line(argv)
    if command.recipes:
        raise ValueError(f"export takes no --config ({command.recipes[0]}): the checkpoint is the model's recipe; "
                         "--data.image_size, --data.mean and --data.std change its input specification")
    overrides = data_overrides(command)
    args = export_parser(model_class, prog).parse_args(
        command.tokens(without=[flag.name for flag in command.flags if flag.name.startswith("data.")]))
    if args.format not in FORMATS:
        raise ValueError(f"--format {args.format} is not a target: choose one of {', '.join(FORMATS)}")
    if args.calibration < 1:
        raise ValueError(f"--calibration {args.calibration}: give the number of training images (>= 1)")
    require_export_extra()
    check_opset(args.opset)
    checkpoint = check_checkpoint_file(args.ckpt_path, model_class)
    if not checkpoint.get("hyper_parameters"):
        raise ValueError(f"{args.ckpt_path} holds no constructor arguments, so the model cannot be rebuilt from it: "
                         "export a checkpoint written by this suite's fit")
    data = dict(checkpoint.get("datamodule_hyper_parameters") or {})
    unknown = sorted(set(overrides) - set(data)) if data else []
    if unknown:
        known = ", ".join(k for k in data if not k.startswith("_"))
        raise ValueError(f"--data.{unknown[0]} is not a data option of this checkpoint's datamodule "
                         f"({data.get('_class_path', '?')}: {known})")
    del checkpoint
    # the class from its module, also under `python -m tasks.<task>` (where model_class lives in __main__,
    # whose forward references Lightning's rebuild of the arguments cannot resolve)
    module_name, class_name = qualified_name(model_class).rsplit(".", 1)
    task_class = getattr(importlib.import_module(module_name), class_name)
    model = task_class.load_from_checkpoint(args.ckpt_path, map_location="cpu", weights_only=True).eval()
    output = Path(args.output) if args.output else Path(args.ckpt_path).with_suffix(".onnx")
    options = {flag: getattr(args, flag) for flag in exporter.FLAGS}
    request = ExportRequest(model, export_spec(model, overrides), getattr(model, "input_spec", None), output,
                            args.opset, options)
    scorer = calibration = None
    if args.score or args.int8:
        datamodule = datamodule_of(args.ckpt_path, overrides)
        if args.score:
            where = f"the test split of {overrides['root']}" if overrides.get("root") else "the demo test split"
            scorer = Scorer(lambda: task_class.load_from_checkpoint(args.ckpt_path, map_location="cpu",
                                                                    weights_only=True).eval(),
                            exporter, datamodule, declaration_of(qualified_name(model_class)).test_metric, where,
                            args.score_batches)
        if args.int8:
            calibration = [(images,) for images in calibration_images(datamodule, args.calibration)]
    return ExportJob(args, exporter, request, scorer, calibration)


def export_target(target: str, exporter, request: ExportRequest, calibration: list[tuple] | None
                  ) -> tuple[ExportReport, dict]:
    """Write one target (INT8 with ``calibration``), check its tensors; (the report, the loaded programs)."""
    if target == "onnx":
        if calibration is not None:
            return export_onnx_int8(exporter, request, calibration)
        report = exporter.export(request)
        report.notes.insert(0, f"opset {request.opset}")
        return report, onnx_runners(report.files)
    stem = request.output.with_suffix("") if request.output.suffix in SUFFIXES else request.output
    return export_program(target, exporter.program(request), stem, calibration)


#: the file suffixes --output may carry (replaced by each target's own)
SUFFIXES = (".onnx", ".pte", ".pt2", ".mlpackage")


def onnx_runners(files: Sequence[Path]) -> dict:
    """The ONNX files an export wrote, each loaded as a callable: ``model``, or translation's ``encoder`` and
    ``decoder_step`` (``<stem>.<graph>.onnx``)."""
    graphs = [f for f in files if f.suffix == ".onnx"]
    return {("model" if len(graphs) == 1 else f.suffixes[-2][1:]): session_runner(ort_session(f)) for f in graphs}


def export_onnx_int8(exporter, request: ExportRequest, calibration: list[tuple]) -> tuple[ExportReport, dict]:
    """The float32 ONNX graph (``<stem>.onnx``, written first when missing) quantized by ONNX Runtime into
    ``<stem>.int8.onnx``."""
    refusal = exporter.program(request).int8_refusal
    if refusal:
        raise Refused(f"onnx int8: {refusal}")
    if not request.output.is_file():
        exporter.export(request)
    quantized = request.output.with_name(request.output.stem + ".int8.onnx")
    quantize_onnx(request.output, quantized, [inputs[0] for inputs in calibration])
    report = ExportReport([quantized], [f"ONNX Runtime static quantization of {request.output.name} (QDQ around "
                                        f"{', '.join(INT8_OPS)}: int8 activations, per-channel int8 weights; the "
                                        f"rest float), calibrated on {sum(len(x[0]) for x in calibration)} "
                                        "training images"])
    return report, onnx_runners(report.files)
