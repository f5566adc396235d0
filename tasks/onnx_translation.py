"""Translate with an exported Transformer on ONNX Runtime: greedy and beam search over the graphs
``python -m tasks.translate export`` writes (``<stem>.encoder.onnx``, ``<stem>.decoder_step.onnx``,
``<stem>.spm.model``; see :mod:`tasks.export`).

The search is :mod:`heads.decoding`'s, the one the PyTorch model uses, run on a decoder whose
every step is one ONNX Runtime call of the cached decoder step, so both produce the same
hypotheses. In Python::

    translator = OnnxTranslator("runs/translate/checkpoints/last.encoder.onnx")
    translator.translate(["Germany", "France"], beam_size=4)

From the shell (one sentence per line; translations on standard output)::

    python -m tasks.onnx_translation runs/translate/checkpoints/last.encoder.onnx < source.en > out.de
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from heads.decoding import Hypotheses, beam_search, greedy_search, max_output_lengths


class OnnxDecoderCache:
    """The self-attention keys/values of the tokens decoded so far, ``past_kv (N, 2L, H, t, d)``, and the
    graph's cross-attention inputs repeated for each of a sentence's hypotheses."""

    def __init__(self, past: np.ndarray):
        self.past = past
        self.cross_kv: np.ndarray | None = None
        self.source_padding: np.ndarray | None = None

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (beam search's surviving hypotheses), in that order."""
        self.past = self.past[index.numpy()]


class OnnxDecoder:
    """The decoder interface of :mod:`heads.decoding` on ONNX Runtime: ``memory`` is the encoder
    graph's ``cross_kv`` (B, 2L, H, S, d), and a call runs one cached step for the newest token
    of each of the N = K * B hypotheses (a sentence's K hypotheses in consecutive rows)."""

    def __init__(self, session, num_layers: int, num_heads: int, head_dim: int):
        self.session = session
        self.kv_shape = (2 * num_layers, num_heads, 0, head_dim)

    def new_cache(self) -> OnnxDecoderCache:
        return OnnxDecoderCache(np.zeros((0, *self.kv_shape), dtype=np.float32))

    def __call__(self, tgt: torch.Tensor, memory: torch.Tensor, memory_padding_mask: torch.Tensor | None,
                 cache: OnnxDecoderCache | None = None) -> torch.Tensor:
        """tgt (N, 1) newest tokens -> logits (N, 1, V); appends the step's keys/values to ``cache``."""
        if cache is None:
            raise ValueError("the ONNX decoder runs one cached step at a time: search with use_cache=True")
        n = tgt.shape[0]
        if cache.cross_kv is None:  # the first step: no token before; the graph takes the memory per hypothesis
            hypotheses = n // memory.shape[0]
            padding = (memory_padding_mask if memory_padding_mask is not None
                       else torch.zeros(memory.shape[0], memory.shape[3], dtype=torch.bool))
            cache.cross_kv = memory.repeat_interleave(hypotheses, dim=0).numpy()
            cache.source_padding = padding.repeat_interleave(hypotheses, dim=0).numpy()
            cache.past = np.zeros((n, *self.kv_shape), dtype=np.float32)
        logits, cache.past = self.session.run(None, {
            "tokens": tgt.numpy(), "cross_kv": cache.cross_kv, "source_padding": cache.source_padding,
            "past_kv": cache.past})
        return torch.from_numpy(logits).unsqueeze(1)


class OnnxTranslator:
    """Greedy / beam search with the exported encoder and decoder step (paths from the encoder's metadata).

    Args:
        encoder_path: ``<stem>.encoder.onnx`` as written by ``export``; the decoder step and the
            sentencepiece model are found next to it.
    """

    def __init__(self, encoder_path: str | Path):
        from datamodules.tokenizer import Tokenizer
        from tasks.export import ort_session, read_metadata

        encoder_path = Path(encoder_path)
        if not encoder_path.is_file():
            raise FileNotFoundError(f"{encoder_path} does not exist: give the <stem>.encoder.onnx that "
                                    "`python -m tasks.translate export` wrote")
        self.encoder = ort_session(encoder_path)
        meta = read_metadata(self.encoder)
        if meta.get("task") != "translation" or "decoder_step" not in meta:
            raise ValueError(f"{encoder_path} is not the encoder of a translation export (its suite.task is "
                             f"{meta.get('task')!r})")
        self.meta = meta
        self.decoder_step = ort_session(encoder_path.parent / meta["decoder_step"])
        self.decoder = OnnxDecoder(self.decoder_step, meta["num_layers"], meta["num_heads"], meta["head_dim"])
        self.tokenizer = Tokenizer(encoder_path.parent / meta["tokenizer"])
        self.bos_id, self.eos_id, self.pad_id = meta["bos_id"], meta["eos_id"], meta["pad_id"]

    def translate_ids(self, src: torch.Tensor, beam_size: int | None = None) -> Hypotheses:
        """src (B, S) padded ids ending in eos -> the best hypothesis per sentence, as
        :meth:`tasks.translate.TranslationTask.translate` returns it."""
        meta = self.meta
        beam_size = meta["beam_size"] if beam_size is None else beam_size
        cross_kv, padding = (torch.from_numpy(a) for a in self.encoder.run(None, {"src": src.numpy()}))
        max_len = max_output_lengths(src.ne(self.pad_id).sum(dim=1), meta["max_len_a"], meta["max_len_b"],
                                     meta["max_positions"] - 1)
        ids = dict(bos_id=self.bos_id, eos_id=self.eos_id, pad_id=self.pad_id)
        if beam_size == 1:
            return greedy_search(self.decoder, cross_kv, padding, max_len, **ids)
        # exports made before the option existed used the only form there was, GNMT's
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.onnx_translation", description=__doc__.split("\n\n")[0])
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
