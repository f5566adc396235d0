"""``export --format onnx|executorch|aoti|coreml|all``, ``--int8`` and metric parity (``--score``).

Each export runs on a copy of the session's shared short fit of the task's demo recipe (conftest's
``demo_fit``) and is scored by the task's own ``test`` on the demo test split against the checkpoint.
Lowering to ExecuTorch takes minutes of CPU on this machine and an AOTInductor compile 30 s and more,
so every export carries the ``slow`` marker; the default suite checks the interface, the refusals and
the score check itself, on the real task's ``test``.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.test_export import export


def demo_checkpoint(demo_fit, task: str, tmp_path):
    """A copy of the session's demo checkpoint of ``task`` in ``tmp_path`` (an export writes beside it)."""
    return shutil.copy(demo_fit(task) / "checkpoints" / "last.ckpt", tmp_path / "last.ckpt")


# -- the interface --------------------------------------------------------------------------------------------------
def test_an_unknown_format_is_refused_naming_the_targets(capsys):
    with pytest.raises(ValueError, match=r"--format tflite is not a target: choose one of onnx, executorch, aoti, "
                                         r"coreml, all"):
        export("classify", "--ckpt_path", "any.ckpt", "--format", "tflite", capsys=capsys)


def test_calibration_needs_images(capsys):
    with pytest.raises(ValueError, match=r"--calibration 0: give the number of training images"):
        export("classify", "--ckpt_path", "any.ckpt", "--int8", "true", "--calibration", "0", capsys=capsys)


def test_coreml_finds_the_rank_6_tensor_of_a_mobilevitv2_block_and_converts_only_without_it():
    """Core ML holds tensors of rank <= 5. The MobileViTv2 block's default path makes a rank-6 patch grid,
    which the check names (op and module); the target exports in the blocks' Core ML layout where the
    backbones have it (then nothing is refused), and refuses naming the op where they do not."""
    from backbones.mobilevitv2 import MobileViTv2Block
    from tasks.export import coreml_target
    from tasks.export.programs import ProgramGraph, export_graph

    block = MobileViTv2Block(16, 32, depth=1, patch_size=2).eval()
    graph = ProgramGraph("", block, (torch.randn(1, 16, 8, 8),), ["x"], ["y"], ({},), [])
    exported = export_graph(graph)
    high = coreml_target.first_high_rank(exported)
    assert high is not None and "makes a rank-6 tensor" in high, high
    reason = coreml_target.refusal(graph, exported, int8=False)
    if coreml_target.coreml_layout is not None:
        assert reason is None
    else:
        assert reason == f"Core ML tensors have rank <= 5: {high}"
    assert "INT8" in coreml_target.refusal(graph, exported, int8=True)


def test_executorch_refuses_the_in_graph_nms_of_the_onnx_detection_graph(demo_fit, tmp_path):
    """The ONNX detection graph selects inside (NMS is the Python custom op suite::nms_keep_mask): neither
    ExecuTorch nor an AOTInductor package can run it, which is why their detection program is the raw head."""
    from tasks.detect import DetectionTask
    from tasks.export import aoti, executorch
    from tasks.export.detection import DetectorGraph
    from tasks.export.programs import ProgramGraph, export_graph

    model = DetectionTask.load_from_checkpoint(demo_checkpoint(demo_fit, "detect", tmp_path), weights_only=True).eval()
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        model(images)  # builds the anchors for this size, constants of the graph (as export does first)
    graph = ProgramGraph("", DetectorGraph(model), (images,), ["images"], ["boxes"], ({0: torch.export.Dim("b")},), [])
    exported = export_graph(graph)
    assert executorch.refusal(graph, exported, False) == (
        "the graph calls suite.nms_keep_mask.default, a custom op with no ExecuTorch kernel (it runs in Python only)")
    assert "a custom op implemented in Python" in aoti.refusal(graph, exported, False)


# -- metric parity ---------------------------------------------------------------------------------------------------
def classification_scorer(demo_fit, tmp_path, limit=None):
    from configs.tasks import task_declaration
    from tasks.classify import ClassificationTask
    from tasks.export import classification
    from tasks.export.scoring import Scorer, datamodule_of

    ckpt = demo_checkpoint(demo_fit, "classify", tmp_path)
    load = lambda: ClassificationTask.load_from_checkpoint(ckpt, weights_only=True).eval()  # noqa: E731
    return Scorer(load, classification, datamodule_of(ckpt, {}), task_declaration("classify").test_metric,
                  "the demo test split", limit), load


def test_the_score_check_passes_the_model_itself_and_fails_a_wrong_one(demo_fit, tmp_path):
    """The score is ``test``'s top-1 over the whole demo test split, through the task's own loop: the
    checkpoint's network as the "exported program" scores exactly the checkpoint's top-1; an oracle
    program (each test image's true class, looked up) scores 100, which the check fails (the command
    then exits non-zero). (A shifted or reversed copy of a 3-step model would not do: it predicts one
    class, and on the balanced demo split every constant prediction scores the same 10 %.)"""
    scorer, load = classification_scorer(demo_fit, tmp_path)
    model = load()
    same = scorer.check("executorch", False, {"model": lambda images: (model(images),)})
    assert same.ok and same.difference == 0 and same.exported == scorer.checkpoint
    assert 0 <= same.checkpoint < 100 and same.tolerance == 0.1

    scorer.datamodule.setup("test")
    truth = {image.numpy().tobytes(): int(target) for batch in scorer.datamodule.test_dataloader()
             for image, target in zip(batch["image"], batch["target"])}

    def oracle(images):
        labels = torch.tensor([truth[image.numpy().tobytes()] for image in images])
        return (torch.nn.functional.one_hot(labels, len(model.class_names)).float(),)

    wrong = scorer.check("executorch", False, {"model": oracle})
    assert wrong.exported == pytest.approx(100.0) and not wrong.ok and "FAILED" in str(wrong)
    # the bound of an INT8 program is a point
    assert scorer.check("onnx", True, {"model": lambda images: (model(images),)}).tolerance == 1.0


# -- slow: the exports ------------------------------------------------------------------------------------------------
def parity_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("parity:")]


@pytest.mark.slow
def test_classification_on_executorch_passes_tensor_and_metric_parity_in_fp32_and_int8(demo_fit, tmp_path, capsys):
    ckpt = demo_checkpoint(demo_fit, "classify", tmp_path)
    out = export("classify", "--ckpt_path", str(ckpt), "--format", "executorch", "--int8", "true",
                 "--calibration", "32", capsys=capsys)
    assert "FAILED" not in out, out
    pte, int8 = tmp_path / "last.pte", tmp_path / "last.int8.pte"
    assert pte.is_file() and int8.is_file() and int8.stat().st_size < pte.stat().st_size
    meta = json.loads((tmp_path / "last.pte.json").read_text())
    assert meta["task"] == "classification" and meta["format"] == "executorch" and meta["int8"] is False
    assert len(meta["class_names"]) == 10 and meta["mean"] == [0.485, 0.456, 0.406]
    scores = [line for line in parity_lines(out) if "test/top1 of the" in line]
    assert len(scores) == 2 and "executorch model" in scores[0] and "executorch int8 model" in scores[1], out

    # the program run back by ExecuTorch's runtime gives the checkpoint's logits on demo test images
    from datamodules.imagefolder import ImageFolderDataModule
    from tasks.classify import ClassificationTask
    from tasks.export.executorch import load

    model = ClassificationTask.load_from_checkpoint(ckpt, weights_only=True).eval()
    data = ImageFolderDataModule(root=None, image_size=32, eval_resize=32, batch_size=37, num_workers=0)
    data.setup("test")
    images = next(iter(data.test_dataloader()))["image"]  # 37 images: more than one program batch
    with torch.no_grad():
        torch.testing.assert_close(load(pte)(images)[0], model(images), rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["classify", "detect", "segment", "translate"])
def test_every_format_passes_parity_or_is_refused_by_name(task, demo_fit, tmp_path, capsys):
    """``--format all`` writes each target that applies, each passing tensor and metric parity (float32
    within 0.1 point of the checkpoint's score); what does not apply is one ``refused:`` line."""
    ckpt = demo_checkpoint(demo_fit, task, tmp_path)
    # ExecuTorch's image programs are static: segmentation is exported at the demo test images' 128 px
    size = ["--data.crop_size", "128"] if task == "segment" else []
    out = export(task, "--ckpt_path", str(ckpt), "--format", "all", *size, capsys=capsys)
    assert "FAILED" not in out, out
    refused = [line for line in out.splitlines() if line.startswith("refused:")]
    scored = [line for line in parity_lines(out) if " model on the demo test split: " in line]
    written = {"onnx", "executorch", "aoti"} - {line.split()[1].rstrip(":") for line in refused}
    for target in written:
        assert any(f"of the {target} model" in line for line in scored), (target, out)
    assert "aoti" in written and "onnx" in written  # every task
    if task != "translate":
        assert "executorch" in written
    assert all("coreml" in line or "executorch" in line for line in refused), refused
    # Core ML: converted here (not run; translation's two graphs, one package each), or refused naming why
    packages = sorted(path.name for path in tmp_path.glob("*.mlpackage"))
    expected = ["last.decoder_step.mlpackage", "last.encoder.mlpackage"] if task == "translate" else ["last.mlpackage"]
    assert packages == expected or any("coreml" in line for line in refused), packages


@pytest.mark.slow
def test_onnx_int8_quantizes_the_convolutions_and_matmuls_and_passes_its_bound(demo_fit, tmp_path, capsys):
    """ONNX Runtime's static quantization (``--format onnx --int8 true``): the convolutions read int8
    inputs and weights, only the ops of :data:`tasks.export.onnx.INT8_OPS` hold int8 weights, the metadata is the float graph's plus ``suite.int8``, and
    the quantized graph scores within a point of the checkpoint on the demo test split."""
    import onnx

    from tasks.export.onnx import INT8_OPS, ort_session, read_metadata

    ckpt = demo_checkpoint(demo_fit, "classify", tmp_path)
    out = export("classify", "--ckpt_path", str(ckpt), "--format", "onnx", "--int8", "true", "--calibration", "32",
                 capsys=capsys)
    assert "FAILED" not in out, out
    assert any("test/top1 of the onnx int8 model" in line for line in parity_lines(out)), out
    graph = onnx.load(str(tmp_path / "last.int8.onnx")).graph
    dequantized = {node.output[0] for node in graph.node if node.op_type == "DequantizeLinear"}
    convolutions = [node for node in graph.node if node.op_type == "Conv"]
    assert convolutions and all(node.input[0] in dequantized and node.input[1] in dequantized for node in convolutions)
    # only those ops have int8 weights: every quantized constant is read by one of them
    constants = {tensor.name for tensor in graph.initializer}
    int8_constants = {node.output[0] for node in graph.node
                      if node.op_type == "DequantizeLinear" and node.input[0] in constants}
    readers = {node.op_type for node in graph.node if int8_constants.intersection(node.input)}
    assert readers and readers <= set(INT8_OPS), readers
    float_meta = read_metadata(ort_session(tmp_path / "last.onnx"))
    assert read_metadata(ort_session(tmp_path / "last.int8.onnx")) == {**float_meta, "int8": True}
