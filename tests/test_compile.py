"""``--model.compile``: regional compilation of the repeated blocks (layers/compile.py) and the task's use
of it. Dynamo runs with a counting backend (it hands the traced graph back to run as is), so these
cells check what costs nothing to check on a CPU -- no graph breaks (``fullgraph=True``), one graph
reused by every block of the same signature, outputs and gradients equal to eager, the state dict
unchanged -- without paying inductor's C++ builds. The slow cell runs the real CLI with inductor."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.nn as nn

from backbones import ConvMixer, MlpMixer, MobileViT, MobileViTv2, ViT
from backbones.transformer import TransformerEncoder
from heads.seq2seq import TransformerDecoder
from layers.attention import list_attention
from layers.compile import compile_mode, compile_networks, compile_regions, repeated_blocks
from layers.transformer import TransformerBlock
from tasks.engine.compile_report import CompileReport


class CountingBackend:
    """A ``torch.compile`` backend that records each graph Dynamo hands it and runs it unchanged."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs):
        self.graphs.append(graph)
        return graph.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def train_step_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(x)
    out = out[max(out)] if isinstance(out, dict) else out
    out.float().square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_regional_equals_eager(model: nn.Module, x: torch.Tensor, max_graphs: int) -> CountingBackend:
    """Compile ``model``'s repeated blocks with ``fullgraph=True`` (a graph break is an error), run a training
    step and an eval forward, and compare with an eager copy; at most ``max_graphs`` graphs per mode."""
    torch.manual_seed(0)
    eager = copy.deepcopy(model)
    backend = CountingBackend()
    blocks = compile_regions(model, backend=backend, fullgraph=True)
    assert blocks, f"{type(model).__name__} declares no repeated blocks"
    out, grads = train_step_grads(model, x)
    trained_graphs = len(backend.graphs)
    assert 1 <= trained_graphs <= max_graphs < len(blocks) + 1, (trained_graphs, len(blocks))
    expected, expected_grads = train_step_grads(eager, x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert len(grads) == len(expected_grads)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-3, atol=1e-5)
    model.eval(), eager.eval()
    with torch.no_grad():
        got, want = model(x.detach()), eager(x.detach())
    got, want = (got[max(got)], want[max(want)]) if isinstance(got, dict) else (got, want)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(backend.graphs) - trained_graphs <= max_graphs  # eval mode: the training flag is guarded on
    assert set(model.state_dict()) == set(eager.state_dict())  # no _orig_mod in the keys
    return backend


def test_identical_blocks_share_one_graph():
    """ViT's twelve blocks are one code path with one signature: Dynamo compiles one graph for all of them."""
    torch.manual_seed(0)
    vit = ViT("tiny", patch_size=8, img_size=32, depth=6)
    assert [type(b) for _, b in repeated_blocks(vit)] == [TransformerBlock] * 6
    backend = assert_regional_equals_eager(vit, torch.randn(2, 3, 32, 32), max_graphs=1)
    assert len(backend.graphs) == 2  # one for training, one for eval


@pytest.mark.slow  # ~10 s of tracing; the task cell below compiles the same network in the default run
def test_mobilevitv2_layers_at_three_widths_compile_at_most_one_graph_each():
    """Nine transformer layers at three widths: at most one graph per width and mode (Dynamo may also
    make the sizes dynamic after the second width and reuse that graph)."""
    torch.manual_seed(0)
    model = MobileViTv2(width=0.25)
    assert len(repeated_blocks(model)) == 9
    assert_regional_equals_eager(model, torch.randn(2, 3, 64, 64), max_graphs=3)


@pytest.mark.parametrize("attention", list_attention())
def test_every_attention_of_the_zoo_compiles_without_a_graph_break(attention):
    """Two transformer layers on a MobileViT map (B, H, W, D) cut into 2x2 patches, with each variant of the
    zoo: ``fullgraph=True`` fails on any graph break; one graph serves both layers; training outputs and
    gradients equal eager."""
    torch.manual_seed(0)
    kwargs = {"max_len": 16} if attention in ("linformer", "synthesizer_dense", "synthesizer_random") else {}
    layers = nn.Sequential(*[TransformerBlock(32, 64, attention, 1 if attention == "separable" else 2, norm="group",
                                              patch_size=(2, 2), attention_kwargs=kwargs) for _ in range(2)])
    layers.repeated_blocks = (TransformerBlock,)
    # the map comes from a trained layer, as in the network (an input that needs no gradient is another graph)
    assert_regional_equals_eager(layers, torch.randn(2, 8, 8, 32, requires_grad=True), max_graphs=1)


@pytest.mark.parametrize("build, size, max_graphs", [
    (lambda: MobileViT(size="xxs"), 64, 3),  # nine layers at three widths
    (lambda: ConvMixer(dim=32, depth=4, kernel_size=5, patch_size=4), 32, 1),
    (lambda: MlpMixer("small", patch_size=8, img_size=32, depth=4), 32, 2),  # the first block's input is strided
], ids=["mobilevit", "convmixer", "mlp_mixer"])
def test_every_family_names_its_repeated_blocks(build, size, max_graphs):
    torch.manual_seed(0)
    assert_regional_equals_eager(build(), torch.randn(2, 3, size, size), max_graphs=max_graphs)


def test_translation_layers_compile_and_beam_search_is_unchanged():
    """Encoder and decoder layers compile without graph breaks in training (teacher forcing); decoding with
    the KV cache (one new position per step) runs through the compiled layers and gives the eager tokens."""
    from heads.decoding import beam_search, max_output_lengths

    torch.manual_seed(0)
    encoder = TransformerEncoder(50, 32, 2, 4, 64, dropout=0.0, max_positions=64)
    decoder = TransformerDecoder(50, 32, 2, 4, 64, dropout=0.0, max_positions=64, embed_tokens=encoder.embed.tokens)
    eager_encoder, eager_decoder = copy.deepcopy(encoder), copy.deepcopy(decoder)
    eager_decoder.embed.tokens = eager_encoder.embed.tokens
    backend = CountingBackend()
    summary = compile_networks([encoder, decoder], "regional", backend=backend)
    assert summary == "torch.compile (regional): 2 x EncoderLayer, 2 x DecoderLayer; the rest runs eagerly"
    src = torch.randint(4, 50, (3, 7))
    tgt = torch.randint(4, 50, (3, 6))
    src[0, 5:] = 0
    for enc, dec in ((encoder, decoder), (eager_encoder, eager_decoder)):
        enc.train(), dec.train()
    memory, padding = encoder(src)
    logits = decoder(tgt, memory, padding)
    expected_memory, expected_padding = eager_encoder(src)
    torch.testing.assert_close(logits, eager_decoder(tgt, expected_memory, expected_padding), rtol=1e-4, atol=1e-5)
    assert len(backend.graphs) == 2  # one per layer class

    for module in (encoder, decoder, eager_encoder, eager_decoder):
        module.eval()
    max_len = max_output_lengths(src.ne(0).sum(1), limit=12)
    with torch.no_grad():
        found = beam_search(decoder, *encoder(src), max_len, beam_size=3, bos_id=1, eos_id=2, pad_id=0)
        expected = beam_search(eager_decoder, *eager_encoder(src), max_len, beam_size=3, bos_id=1, eos_id=2, pad_id=0)
    assert torch.equal(found.tokens, expected.tokens)
    torch.testing.assert_close(found.scores, expected.scores, rtol=1e-4, atol=1e-5)


def test_compile_values():
    assert compile_mode(False) is None and compile_mode(True) == "network"
    assert compile_mode("regional") == "regional" and compile_mode("network") == "network"
    with pytest.raises(ValueError, match="'regionl'"):
        compile_mode("regionl")
    with pytest.raises(ValueError, match="Conv2d declare no repeated blocks"):
        compile_networks([nn.Conv2d(3, 3, 1)], "regional")


def test_task_compiles_its_blocks_reports_the_cost_and_keeps_its_checkpoint_keys(tmp_path, monkeypatch):
    """A real classification fit with ``compile="regional"``: every transformer layer goes through
    torch.compile, a CPU run warns what compiling costs there, the first steps' times are reported
    and logged, and the checkpoint's keys are those of an uncompiled model."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    from datamodules.imagefolder import ImageFolderDataModule
    from tasks.classify import ClassificationTask

    backend = CountingBackend()
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: real_compile(model, backend=backend, **kwargs))
    torch.manual_seed(0)
    data = ImageFolderDataModule(image_size=32, eval_resize=32, batch_size=8, num_workers=0)
    model = ClassificationTask(MobileViTv2(width=0.25), class_names=data.classes, compile="regional")
    reference = ClassificationTask(MobileViTv2(width=0.25), class_names=data.classes)
    trainer = Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=3, limit_val_batches=2, num_sanity_val_steps=0, logger=CSVLogger(tmp_path),
                      enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    notices = [str(w.message) for w in caught if "compiling on the CPU (regional)" in str(w.message)]
    assert len(notices) == 1 and "--model.compile false" in notices[0]
    assert 1 <= len(backend.graphs) <= 2 * 3, "one graph per width at most, in training and in evaluation"
    reports = [c for c in trainer.callbacks if isinstance(c, CompileReport)]  # added by the task itself
    assert len(reports) == 1
    assert len(reports[0].durations["train"]) == 2 and len(reports[0].durations["validation"]) == 2
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "compile/first_train_step_s" in metrics and "compile/first_validation_step_s" in metrics
    trainer.save_checkpoint(tmp_path / "compiled.ckpt")
    keys = set(torch.load(tmp_path / "compiled.ckpt", weights_only=True)["state_dict"])
    assert keys == set(reference.state_dict())


@pytest.mark.slow  # inductor builds C++ for each graph: minutes on 2 cores
def test_cli_fit_with_regional_compile_writes_metrics(run_cli, tmp_path):
    """The classification demo through the real CLI and inductor, regionally compiled: it trains, reports
    the compile time and tests, like an eager run."""
    proc = run_cli("classify", "fit", "--model.compile", "regional", "--model.backbone.init_args.width", "0.25",
                   "--trainer.max_steps", "6", "--trainer.limit_val_batches", "2", "--data.image_size", "32",
                   "--data.eval_resize", "32", "--trainer.default_root_dir", str(tmp_path / "run"), timeout=1200)
    log = proc.stdout + proc.stderr
    assert "torch.compile (regional): 9 x TransformerBlock" in log
    assert "compile: the first train step took" in log and "compiling on the CPU (regional)" in log
    run_cli("classify", "test", "--ckpt_path", str(tmp_path / "run" / "checkpoints" / "last.ckpt"),
            "--trainer.default_root_dir", str(tmp_path / "test"), "--data.image_size", "32", "--data.eval_resize", "32",
            "--trainer.limit_test_batches", "2", timeout=600)
    metrics = json.loads((tmp_path / "test" / "predictions" / "metrics.json").read_text())
    assert 0.0 <= metrics["test/top1"] <= 1.0
