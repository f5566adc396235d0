"""ONNX export of a translation checkpoint, and translation with it on ONNX Runtime.

``python -m tasks.translate export`` writes three files named after ``--output``: ``<stem>.encoder.onnx``
(``src (B, S) -> cross_kv (B, 2L, H, S, d), source_padding (B, S)``: the source's keys and values of every
decoder layer's cross-attention), ``<stem>.decoder_step.onnx`` (one cached step: ``tokens (N, 1), cross_kv,
source_padding, past_kv (N, 2L, H, t, d) -> logits (N, V), present_kv (N, 2L, H, t + 1, d)``) and
``<stem>.spm.model`` (the sentencepiece model). :class:`OnnxTranslator` runs greedy and beam search on them.

The search is :mod:`heads.decoding`'s, the one the PyTorch model uses, run on a decoder whose
every step is one ONNX Runtime call of the cached decoder step, so both produce the same
hypotheses. In Python::

    translator = OnnxTranslator("runs/translate/checkpoints/last.encoder.onnx")
    translator.translate(["Germany", "France"], beam_size=4)

From the shell (one sentence per line; translations on standard output)::

    python -m tasks.export.translation runs/translate/checkpoints/last.encoder.onnx < source.en > out.de
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

import torch.nn as nn
import torch.nn.functional as F

from heads.decoding import Hypotheses, beam_search, greedy_search, max_output_lengths
from heads.seq2seq import padding_bias
from layers.attention import KVCache
from tasks.export.onnx import (ATOL, Check, ExportReport, ExportRequest, export_graph, io_note, ort_session, read_metadata,
                               session_runner)
from tasks.export.programs import ProgramGraph, TaskProgram

#: the command's own flags, with their help
FLAGS: dict[str, str] = {}


# -- the graphs ``python -m tasks.translate export`` writes ------------------------------------------------------


class TranslationEncoderGraph(nn.Module):
    """src (B, S) int64 padded with pad_id -> ``cross_kv (B, 2L, H, S, d)`` (layer i's cross-attention
    keys at 2i, values at 2i + 1) and ``source_padding (B, S)`` bool (True = pad)."""

    def __init__(self, task: nn.Module):
        super().__init__()
        self.encoder, self.decoder = task.encoder, task.decoder

    def forward(self, src: torch.Tensor):
        padding = src.eq(self.encoder.pad_id)
        x = self.encoder.embed(src)
        for layer in self.encoder.layers:  # the mask always applies: a graph has no data-dependent branch
            x = layer(x, padding)
        memory = self.encoder.norm(x)
        kv = []
        for layer in self.decoder.layers:  # what the first cached step of PyTorch's search projects
            kv += layer.cross_attn.project_memory(memory)
        return torch.stack(kv, dim=1), padding


class GraphDecoderCache:
    """:class:`heads.seq2seq.DecoderCache`'s interface over the decoder step graph's inputs: the past
    self-attention keys/values are concatenated with the new ones (a graph output is a new tensor)
    and collected in ``present``; the memory's keys/values and padding come from the encoder graph."""

    def __init__(self, past_kv: torch.Tensor, cross_kv: torch.Tensor, source_padding: torch.Tensor, num_layers: int):
        self.past_kv, self.steps = past_kv, past_kv.shape[3]
        self.cross_attn = [KVCache(key=cross_kv[:, 2 * i], value=cross_kv[:, 2 * i + 1], static=True)
                           for i in range(num_layers)]
        self.memory_bias = padding_bias(source_padding, cross_kv.dtype)  # always applied: no data-dependent branch
        self.present: list[torch.Tensor] = []

    def append(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new_keys, new_values = kv.permute(2, 0, 3, 1, 4)  # (N, T, 2, H, d) -> 2 x (N, H, T, d)
        keys = torch.cat([self.past_kv[:, 2 * layer], new_keys], dim=2)
        values = torch.cat([self.past_kv[:, 2 * layer + 1], new_values], dim=2)
        self.present += [keys, values]
        return keys, values


class TranslationDecoderStep(nn.Module):
    """One cached decoder step: ``tokens (N, 1)`` (the newest token of each hypothesis),
    ``cross_kv (N, 2L, H, S, d)``, ``source_padding (N, S)``, ``past_kv (N, 2L, H, t, d)`` (the
    self-attention keys/values of the t tokens before; t = 0 at the first step) ->
    ``logits (N, V)`` of the next token and ``present_kv (N, 2L, H, t + 1, d)``."""

    def __init__(self, task: nn.Module):
        super().__init__()
        self.decoder = task.decoder

    def forward(self, tokens: torch.Tensor, cross_kv: torch.Tensor, source_padding: torch.Tensor,
                past_kv: torch.Tensor):
        cache = GraphDecoderCache(past_kv, cross_kv, source_padding, self.decoder.depth)
        logits = self.decoder(tokens, None, None, cache)
        return logits[:, -1], torch.stack(cache.present, dim=1)


def translation_files(output: Path) -> dict[str, Path]:
    """The files a translation export writes for ``--output``: encoder, decoder step, tokenizer."""
    stem = output.with_suffix("") if output.suffix == ".onnx" else output
    return {"encoder": stem.with_name(stem.name + ".encoder.onnx"),
            "decoder_step": stem.with_name(stem.name + ".decoder_step.onnx"),
            "tokenizer": stem.with_name(stem.name + ".spm.model")}


KV_DOC = "float32 (N, 2 * layers, heads, {}, head_dim): layer i's keys at 2i, values at 2i + 1"
DOCS = {"src": "int64 (batch, source_length) token ids ending in eos, then pad_id",
        "cross_kv": KV_DOC.format("source_length") + " (cross-attention over the source)",
        "source_padding": "bool (batch, source_length), True at padding",
        "tokens": "int64 (N, 1), the newest token of each hypothesis (bos at the first step)",
        "past_kv": KV_DOC.format("t") + " of the t tokens before (t = 0 at the first step)",
        "logits": "float32 (N, vocab_size), scores of the next token",
        "present_kv": KV_DOC.format("t + 1") + ", the next step's past_kv"}
ENCODER_IO = (["src"], ["cross_kv", "source_padding"])
STEP_IO = (["tokens", "cross_kv", "source_padding", "past_kv"], ["logits", "present_kv"])
#: BLEU, as ``test`` logs it, is already in points
SCORE_POINTS = 1.0


def metadata_of(model: nn.Module) -> dict:
    """What a translator needs besides the graphs: token ids, search settings, the cache's shape."""
    decoder = model.decoder
    attention = decoder.layers[0].cross_attn
    return {"task": "translation", "bos_id": model.bos_id, "eos_id": model.eos_id, "pad_id": model.pad_id,
            "max_positions": model.max_positions, "max_len_a": model.max_len_a, "max_len_b": model.max_len_b,
            "beam_size": model.beam_size, "length_penalty": model.length_penalty,
            "length_penalty_form": model.length_penalty_form, "num_layers": decoder.depth,
            "num_heads": attention.num_heads, "head_dim": attention.head_dim,
            "vocab_size": decoder.embed.tokens.num_embeddings}


def example_inputs(model: nn.Module, past_length: int = 3) -> tuple[torch.Tensor, tuple]:
    """(4 seeded random sources, the decoder step's inputs for them after ``past_length`` tokens)."""
    generator = torch.Generator().manual_seed(0)
    src = random_sources(4, 12, model, generator)
    with torch.no_grad():
        cross_kv, padding = TranslationEncoderGraph(model).eval()(src)
    meta = metadata_of(model)
    tokens = torch.full((len(src), 1), model.bos_id, dtype=torch.long)
    past = torch.randn(len(src), 2 * meta["num_layers"], meta["num_heads"], past_length, meta["head_dim"],
                       generator=generator)
    return src, (tokens, cross_kv, padding, past)


def program(request: ExportRequest) -> TaskProgram:
    """The encoder and the cached decoder step for the torch.export targets, their batch (the number of
    hypotheses), source length and past length dynamic; the tokenizer is written beside them."""
    from tasks.export.programs import MAX_BATCH

    model = request.model
    src, step_inputs = example_inputs(model)
    longest = model.max_positions - 1
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    source = torch.export.Dim("source_length", min=2, max=longest)
    past = torch.export.Dim("past_length", min=0, max=longest)
    _, zero_past = example_inputs(model, past_length=0)
    # the largest inputs (ExecuTorch plans its memory for the traced shapes)
    widest = torch.full((MAX_BATCH, longest), model.eos_id, dtype=torch.long)
    tokens, cross_kv, padding, past_kv = step_inputs
    wide_step = (tokens[:1].expand(MAX_BATCH, 1).contiguous(),
                 cross_kv[:1, :, :, :1].expand(MAX_BATCH, -1, -1, longest, -1).contiguous(),
                 torch.zeros(MAX_BATCH, longest, dtype=torch.bool),
                 past_kv[:1, :, :, :1].expand(MAX_BATCH, -1, -1, longest, -1).contiguous())
    encoder = ProgramGraph("encoder", TranslationEncoderGraph(model).eval(), (src,), *ENCODER_IO,
                           ({0: batch, 1: source},), [((src,), "4 random sources")], bound_inputs=(widest,))
    step = ProgramGraph("decoder_step", TranslationDecoderStep(model).eval(), step_inputs, *STEP_IO,
                        ({0: batch}, {0: batch, 3: source}, {0: batch, 1: source}, {0: batch, 3: past}),
                        [(step_inputs, "a decoder step after 3 tokens"), (zero_past, "the first decoder step")],
                        bound_inputs=wide_step)
    return TaskProgram([encoder, step], metadata_of(model), DOCS, {"spm.model": model.tokenizer.serialized()},
                       int8_refusal="INT8 is built for the image tasks (static quantization calibrated on "
                                    "images); translation has no calibration path",
                       notes=[f"batch up to {MAX_BATCH} hypotheses per call (larger batches are split), "
                              f"source and decoded length up to {longest}"])


def score_with(model: nn.Module, runners: dict, target: str) -> None:
    """Make ``model``'s ``test`` translate with the exported graphs (greedy or beam search as ever, every
    step one call of the decoder step program)."""
    translator = GraphTranslator(runners["encoder"], runners["decoder_step"], metadata_of(model), model.tokenizer)
    model.translate = lambda src, beam_size=None, src_padded=None: translator.translate_ids(src, beam_size)


def export(request: ExportRequest) -> ExportReport:
    """Write the graph(s) of ``request.model`` to ``request.output``, run them with ONNX Runtime and compare."""
    model, opset = request.model, request.opset
    files = translation_files(request.output)
    src, (tokens, cross_kv, padding, past) = example_inputs(model)
    encoder_graph, step_graph = TranslationEncoderGraph(model).eval(), TranslationDecoderStep(model).eval()
    metadata = {**metadata_of(model), "encoder": files["encoder"].name, "decoder_step": files["decoder_step"].name,
                "tokenizer": files["tokenizer"].name}
    source_axes = {0: "batch", 1: "source_length"}
    export_graph(encoder_graph, (src,), files["encoder"], *ENCODER_IO, {"src": source_axes}, opset, metadata, DOCS)
    step_axes = {"tokens": {0: "batch"}, "cross_kv": {0: "batch", 3: "source_length"},
                 "source_padding": source_axes, "past_kv": {0: "batch", 3: "past_length"}}
    export_graph(step_graph, (tokens, cross_kv, padding, past), files["decoder_step"], *STEP_IO, step_axes, opset,
                 metadata, DOCS)
    files["tokenizer"].write_bytes(model.tokenizer.serialized())
    translator = OnnxTranslator(files["encoder"])
    report = ExportReport(list(files.values()), [
        "batch, source length and decoded length dynamic",
        f"encoder: {io_note(translator.encoder)}", f"decoder step: {io_note(translator.decoder_step)}",
        f"translate with: python -m tasks.export.translation {files['encoder']} < source.txt"])
    encoded = translator.encoder.run(None, {"src": src.numpy()})
    report.checks.append(Check("max |cross_kv| difference, 4 random sources",
                               float(np.abs(encoded[0] - cross_kv.numpy()).max()), ATOL))
    with torch.no_grad():
        step = step_graph(tokens, cross_kv, padding, past)
    got = translator.decoder_step.run(None, {"tokens": tokens.numpy(), "cross_kv": cross_kv.numpy(),
                                             "source_padding": padding.numpy(), "past_kv": past.numpy()})
    report.checks.append(Check("max |logits| difference of a decoder step", float(np.abs(got[0] - step[0].numpy()).max()),
                               ATOL))
    report.checks += hypothesis_checks(model, src, translator)
    return report


def hypothesis_checks(model: nn.Module, src: torch.Tensor, translator: "GraphTranslator") -> list[Check]:
    """Rows whose hypotheses differ between the model's search and ``translator``'s, greedy and with the
    checkpoint's beam."""
    checks = []
    for beam in sorted({1, model.beam_size}):
        expected = model.translate(src, beam_size=beam).tokens
        hypotheses = translator.translate_ids(src, beam_size=beam).tokens
        checks.append(Check(f"hypotheses that differ, {len(src)} random sources, "
                            f"{'greedy' if beam == 1 else f'beam {beam}'}",
                            hypothesis_differences(expected, hypotheses, model.pad_id), 0))
    return checks


def random_sources(count: int, longest: int, model, generator: torch.Generator) -> torch.Tensor:
    """(count, longest) padded random sources of decreasing lengths, ending in eos: ordinary tokens only."""
    special = {model.pad_id, model.bos_id, model.eos_id}
    vocab = model.decoder.embed.tokens.num_embeddings
    src = torch.full((count, longest), model.pad_id, dtype=torch.long)
    for row in range(count):
        length = max(2, longest - 3 * row)
        ids = torch.randint(0, vocab, (length - 1,), generator=generator)
        ids = torch.where(torch.isin(ids, torch.tensor(sorted(special))), max(special) + 1, ids)
        src[row, : length - 1] = ids
        src[row, length - 1] = model.eos_id
    return src


def hypothesis_differences(a: torch.Tensor, b: torch.Tensor, pad_id: int) -> int:
    """Rows of two (B, L) padded token batches that differ (ignoring padding width)."""
    width = max(a.shape[1], b.shape[1])
    a = F.pad(a, (0, width - a.shape[1]), value=pad_id)
    b = F.pad(b, (0, width - b.shape[1]), value=pad_id)
    return int((a != b).any(dim=1).sum())



# -- running them -------------------------------------------------------------------------------------------------
class OnnxDecoderCache:
    """The self-attention keys/values of the tokens decoded so far, ``past_kv (N, 2L, H, t, d)``, and the
    graph's cross-attention inputs repeated for each of a sentence's hypotheses."""

    def __init__(self, past: torch.Tensor):
        self.past = past
        self.cross_kv: torch.Tensor | None = None
        self.source_padding: torch.Tensor | None = None

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (beam search's surviving hypotheses), in that order."""
        self.past = self.past[index]


class OnnxDecoder:
    """The decoder interface of :mod:`heads.decoding` on an exported decoder step (ONNX Runtime or a
    torch.export target): ``memory`` is the encoder graph's ``cross_kv`` (B, 2L, H, S, d), and a call runs
    one cached step for the newest token of each of the N = K * B hypotheses (a sentence's K hypotheses in
    consecutive rows). ``step(tokens, cross_kv, source_padding, past_kv) -> (logits, present_kv)``."""

    def __init__(self, step, num_layers: int, num_heads: int, head_dim: int):
        self.step = step
        self.kv_shape = (2 * num_layers, num_heads, 0, head_dim)

    def new_cache(self) -> OnnxDecoderCache:
        return OnnxDecoderCache(torch.zeros(0, *self.kv_shape))

    def __call__(self, tgt: torch.Tensor, memory: torch.Tensor, memory_padding_mask: torch.Tensor | None,
                 cache: OnnxDecoderCache | None = None) -> torch.Tensor:
        """tgt (N, 1) newest tokens -> logits (N, 1, V); appends the step's keys/values to ``cache``."""
        if cache is None:
            raise ValueError("the exported decoder runs one cached step at a time: search with use_cache=True")
        n = tgt.shape[0]
        if cache.cross_kv is None:  # the first step: no token before; the graph takes the memory per hypothesis
            hypotheses = n // memory.shape[0]
            padding = (memory_padding_mask if memory_padding_mask is not None
                       else torch.zeros(memory.shape[0], memory.shape[3], dtype=torch.bool))
            cache.cross_kv = memory.repeat_interleave(hypotheses, dim=0).contiguous()
            cache.source_padding = padding.repeat_interleave(hypotheses, dim=0).contiguous()
            cache.past = torch.zeros(n, *self.kv_shape)
        logits, cache.past = self.step(tgt.contiguous(), cache.cross_kv, cache.source_padding, cache.past)
        return logits.unsqueeze(1)


class GraphTranslator:
    """Greedy / beam search with an exported encoder and decoder step, each a callable of tensors ->
    tuple of tensors (``encode(src) -> (cross_kv, source_padding)``, ``step`` as :class:`OnnxDecoder`'s),
    with the translation ``meta``data and the tokenizer the export wrote."""

    def __init__(self, encode, step, meta: dict, tokenizer):
        self.encode_graph, self.meta, self.tokenizer = encode, meta, tokenizer
        self.decoder = OnnxDecoder(step, meta["num_layers"], meta["num_heads"], meta["head_dim"])
        self.bos_id, self.eos_id, self.pad_id = meta["bos_id"], meta["eos_id"], meta["pad_id"]

    def translate_ids(self, src: torch.Tensor, beam_size: int | None = None) -> Hypotheses:
        """src (B, S) padded ids ending in eos -> the best hypothesis per sentence, as
        :meth:`tasks.translate.TranslationTask.translate` returns it."""
        meta = self.meta
        beam_size = meta["beam_size"] if beam_size is None else beam_size
        cross_kv, padding = self.encode_graph(src.contiguous())[:2]
        max_len = max_output_lengths(src.ne(self.pad_id).sum(dim=1), meta["max_len_a"], meta["max_len_b"],
                                     meta["max_positions"] - 1)
        ids = dict(bos_id=self.bos_id, eos_id=self.eos_id, pad_id=self.pad_id)
        if beam_size == 1:
            return greedy_search(self.decoder, cross_kv, padding, max_len, **ids)
        # a graph whose metadata names no length_penalty_form uses GNMT's
        return beam_search(self.decoder, cross_kv, padding, max_len, beam_size=beam_size,
                           alpha=meta["length_penalty"], length_penalty_form=meta.get("length_penalty_form", "gnmt"),
                           **ids)

    def encode(self, texts: list[str]) -> torch.Tensor:
        """Raw lines -> (B, S) padded ids ending in eos, cut to ``max_positions - 1`` tokens (as the task does)."""
        limit = self.meta["max_positions"] - 1
        ids = [seq[:limit] + [self.eos_id] for seq in self.tokenizer.encode(texts)]
        src = torch.full((len(ids), max(len(seq) for seq in ids)), self.pad_id, dtype=torch.long)
        for row, seq in enumerate(ids):
            src[row, : len(seq)] = torch.tensor(seq)
        return src

    def translate(self, texts: list[str], beam_size: int | None = None, batch_size: int = 32) -> list[str]:
        out = []
        for start in range(0, len(texts), batch_size):
            batch = texts[start:start + batch_size]
            out += self.tokenizer.decode(self.translate_ids(self.encode(batch), beam_size).tokens.tolist())
        return out


class OnnxTranslator(GraphTranslator):
    """:class:`GraphTranslator` on the ONNX files ``export`` wrote (paths from the encoder's metadata).

    Args:
        encoder_path: ``<stem>.encoder.onnx`` as written by ``export``; the decoder step and the
            sentencepiece model are found next to it.
    """

    def __init__(self, encoder_path: str | Path):
        from datamodules.tokenizer import Tokenizer

        encoder_path = Path(encoder_path)
        if not encoder_path.is_file():
            raise FileNotFoundError(f"{encoder_path} does not exist: give the <stem>.encoder.onnx that "
                                    "`python -m tasks.translate export` wrote")
        self.encoder = ort_session(encoder_path)
        meta = read_metadata(self.encoder)
        if meta.get("task") != "translation" or "decoder_step" not in meta:
            raise ValueError(f"{encoder_path} is not the encoder of a translation export (its suite.task is "
                             f"{meta.get('task')!r})")
        self.decoder_step = ort_session(encoder_path.parent / meta["decoder_step"])
        super().__init__(session_runner(self.encoder), session_runner(self.decoder_step), meta,
                         Tokenizer(encoder_path.parent / meta["tokenizer"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.export.translation", description=__doc__.split("\n\n")[0])
    parser.add_argument("encoder", help="the <stem>.encoder.onnx written by `python -m tasks.translate export`")
    parser.add_argument("--beam_size", type=int, default=None, help="1 = greedy (default: the checkpoint's)")
    parser.add_argument("--input", default="-", help="source lines (default: standard input)")
    parser.add_argument("--output", default="-", help="translations (default: standard output)")
    args = parser.parse_args(argv)
    translator = OnnxTranslator(args.encoder)
    source = sys.stdin.read() if args.input == "-" else Path(args.input).read_text(encoding="utf-8")
    lines = translator.translate(source.splitlines(), args.beam_size)
    text = "".join(line + "\n" for line in lines)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
