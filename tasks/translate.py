"""Machine translation: ``python -m tasks.translate {fit,validate,test,predict}``.

The encoder-decoder Transformer of "Attention is all you need", trained with label-smoothed cross-entropy;
validation and test decode with beam search and score, corpus-level over every sentence exactly once across
ranks (:mod:`tasks.metrics.bleu`): sacreBLEU (13a tokenization, detokenized hypotheses vs raw references), chrF
(`test` also chrF++) and ``bleu_tok_compound``, the tokenized, compound-split BLEU the Transformer paper reports.
What `test` and `predict` write (hypotheses, sentence scores, the worst sentences, the translations of
``--data.predict_path``, a file or ``-`` for standard input) is :mod:`tasks.outputs.translation`.

The checkpoint carries the sentencepiece model the network was trained with, so `predict` needs nothing but
the checkpoint and the text, and `validate`/`test` refuse data whose vocabulary is another one.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric

from backbones.transformer import TransformerEncoder
from datamodules.tokenizer import Tokenizer
from heads.decoding import Hypotheses, beam_search, greedy_search, max_output_lengths
from heads.seq2seq import TransformerDecoder
from tasks.engine.base import TaskModule
from tasks.engine.predictor import Predictor
from tasks.metrics.bleu import MosesVersion, corpus_bleu, corpus_chrf, tokenized_compound_split_bleu
from tasks.outputs import translation as outputs


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, epsilon: float, ignore_index: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed label-smoothed loss and summed NLL over non-pad targets, and their count: 0-d
    tensors, masked rather than selected, so a GPU computes them without the host waiting.

    logits (B, T, V), target (B, T). The smoothed target puts ``1 - eps`` on the
    reference and spreads ``eps`` uniformly over the vocabulary (Szegedy et al.; what
    ``F.cross_entropy(label_smoothing=eps)`` computes), from one log-softmax.
    """
    log_probs = logits.float().log_softmax(dim=-1)
    keep = target.ne(ignore_index)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smooth = -log_probs.mean(dim=-1)
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    return torch.where(keep, loss, 0.0).sum(), torch.where(keep, nll, 0.0).sum(), keep.sum()


class TranslationTask(Predictor, TaskModule):
    """Transformer encoder-decoder with a shared vocabulary and tied embeddings.

    Args:
        vocab_size, pad_id, bos_id, eos_id, max_positions: linked from the datamodule.
        dim, encoder_depth, decoder_depth, num_heads, ffn_dim, dropout: d_model, N (per
            side), h, d_ff, P_drop of the paper.
        attention_dropout, activation_dropout: dropout on attention weights / in the FFN.
        encoder_attention: attention-zoo name of the encoder self-attention (``mha``,
            ``separable``, ``linformer``, ``synthesizer_dense``, ...); ``encoder_attention_kwargs``
            its extra arguments. The decoder always uses standard attention with a cache.
        pre_norm: layer norm before each sub-layer instead of after (the paper).
        learned_positions: learned position embeddings instead of sinusoids.
        share_embeddings: one token table for encoder input, decoder input and output.
        label_smoothing: epsilon of the smoothed cross-entropy.
        beam_size, length_penalty: beam width and length-penalty alpha for validate/test/predict
            (``beam_size=1`` decodes greedily).
        length_penalty_form: ``gnmt`` (``((5 + |y|) / 6) ** alpha``, Wu et al. 2016, the penalty the
            Transformer paper cites) or ``fairseq`` (``|y| ** alpha``, fairseq's ``--lenpen``); |y| counts eos.
        max_len_a, max_len_b: outputs are at most ``a * source length + b`` tokens.
        tokenized_bleu_moses: the Moses ``tokenizer.perl`` of the tokenized compound-split BLEU
            (:mod:`tasks.metrics.bleu`): ``paper`` (the 2016-12 script the Transformer paper was scored with,
            logged as ``*/bleu_tok_compound``) or ``master`` (the script since 2018-11, which splits a
            sentence-final non-breaking prefix's period, logged as ``*/bleu_tok_compound_moses_master``).
        num_sample_translations: rows of the logged tables of validation and test translations.
        predict_output: where `predict` writes its translations (``-`` = standard output).
        Remaining arguments: see :class:`tasks.engine.base.TaskModule`.
    """

    DATA_LINKS = {"vocab_size": "vocab_size", "pad_id": "pad_id", "bos_id": "bos_id", "eos_id": "eos_id",
                  "max_positions": "max_positions"}

    def __init__(self, vocab_size: int, pad_id: int = 0, bos_id: int = 2, eos_id: int = 3,
                 max_positions: int = 256, dim: int = 512, encoder_depth: int = 6, decoder_depth: int = 6,
                 num_heads: int = 8, ffn_dim: int = 2048, dropout: float = 0.1, attention_dropout: float = 0.0,
                 activation_dropout: float = 0.0, encoder_attention: str = "mha",
                 encoder_attention_kwargs: dict | None = None, pre_norm: bool = False,
                 learned_positions: bool = False, share_embeddings: bool = True, label_smoothing: float = 0.1,
                 beam_size: int = 4, length_penalty: float = 0.6,
                 length_penalty_form: Literal["gnmt", "fairseq"] = "gnmt", max_len_a: float = 1.2, max_len_b: int = 10,
                 tokenized_bleu_moses: MosesVersion = "paper", num_sample_translations: int = 16,
                 predict_output: str = "-", **kwargs):
        super().__init__(**kwargs)
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.max_positions = max_positions
        self.encoder = TransformerEncoder(
            vocab_size, dim, encoder_depth, num_heads, ffn_dim, dropout, encoder_attention,
            encoder_attention_kwargs, attention_dropout, activation_dropout, pre_norm, max_positions,
            learned_positions, pad_id)
        self.decoder = TransformerDecoder(
            vocab_size, dim, decoder_depth, num_heads, ffn_dim, dropout, attention_dropout, activation_dropout,
            pre_norm, max_positions, learned_positions, pad_id,
            embed_tokens=self.encoder.embed.tokens if share_embeddings else None)
        self.label_smoothing = label_smoothing
        self.beam_size, self.length_penalty, self.length_penalty_form = beam_size, length_penalty, length_penalty_form
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.tokenized_bleu_moses = tokenized_bleu_moses
        self.num_sample_translations = num_sample_translations
        self.predict_output = predict_output
        self.eval_nll = MeanMetric()
        self._sentences: list[tuple[int, str, str, str]] = []  # this rank's, for the corpus scores
        #: ``(index, source, reference, hypothesis)`` of the split last validated or tested, every rank's,
        #: in file order (what the output callbacks write)
        self.evaluated_sentences: list[tuple[int, str, str, str]] | None = None
        self._tokenizer: Tokenizer | None = None

    def output_callbacks(self) -> list:
        return [outputs.HypothesesTxt(), outputs.BleuSignatureTxt(), outputs.HypothesesTsv(),
                outputs.WorstTranslations(self.num_worst_examples), outputs.PredictedTranslations(self.predict_output),
                outputs.ValidationTranslations(self.num_sample_translations)]

    # -- model -----------------------------------------------------------------------------------
    #: the sentence pair whose teacher-forced forward gives ``gflops``: 32 source and 32 target
    #: tokens, about a WMT14 sentence under a 32k-piece vocabulary
    FLOPS_TOKENS = 32

    def example_input(self, datamodule) -> tuple[torch.Tensor, torch.Tensor]:
        length = min(self.FLOPS_TOKENS, self.max_positions)
        tokens = torch.full((1, length), self.eos_id, dtype=torch.long)
        return tokens, tokens.clone()

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, src_padded: bool | None = None) -> torch.Tensor:
        """Teacher forcing: src (B, S), tgt_in (B, T) -> logits (B, T, V). ``src_padded``: whether any
        source row is padded, when known on the host (a batch's ``src_padded``); ``None`` reads it from ``src``."""
        padded = self.has_padding(src) if src_padded is None else src_padded
        memory, padding = self.encoder(src, padded)
        return self.decoder(tgt_in, memory, padding if padded else None)

    def has_padding(self, src: torch.Tensor) -> bool:
        """Whether any row of ``src`` (B, S) is padded (on a GPU the host waits to read it)."""
        return bool(src.eq(self.pad_id).any())

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # the batch is still on the host here: knowing whether a source is padded is free, and the
        # forward then chooses its attention kernels without reading the device
        if isinstance(batch, dict) and torch.is_tensor(batch.get("src")):
            batch["src_padded"] = self.has_padding(batch["src"])
        return batch

    @torch.no_grad()
    def translate(self, src: torch.Tensor, beam_size: int | None = None, src_padded: bool | None = None) -> Hypotheses:
        """src (B, S) padded ids -> best hypotheses (token ids ending in eos); ``src_padded`` as in :meth:`forward`."""
        beam_size = self.beam_size if beam_size is None else beam_size
        padded = self.has_padding(src) if src_padded is None else src_padded
        memory, padding = self.encoder(src, padded)
        padding = padding if padded else None
        limit = self.max_positions - 1  # the decoder also sees bos
        max_len = max_output_lengths(src.ne(self.pad_id).sum(dim=1), self.max_len_a, self.max_len_b, limit)
        ids = dict(bos_id=self.bos_id, eos_id=self.eos_id, pad_id=self.pad_id)
        if beam_size == 1:
            return greedy_search(self.decoder, memory, padding, max_len, **ids)
        return beam_search(self.decoder, memory, padding, max_len, beam_size=beam_size, alpha=self.length_penalty,
                           length_penalty_form=self.length_penalty_form, **ids)

    # -- the vocabulary, carried by the checkpoint ---------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise RuntimeError("TranslationTask has no tokenizer: train it on data, or load it from a checkpoint")
        return self._tokenizer

    def setup(self, stage: str) -> None:
        super().setup(stage)
        # a checkpoint restored after this replaces it with the one the network was trained with
        if stage in ("fit", "validate", "test") and self._tokenizer is None:
            self._tokenizer = self.trainer.datamodule.tokenizer

    def on_predict_start(self) -> None:
        if self._tokenizer is None:  # no checkpoint: a fresh model predicts with the data's vocabulary
            self._tokenizer = self.trainer.datamodule.tokenizer

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if self._tokenizer is not None:
            checkpoint["tokenizer"] = torch.frombuffer(bytearray(self._tokenizer.serialized()), dtype=torch.uint8)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        if "tokenizer" in checkpoint:
            self._tokenizer = Tokenizer.from_serialized(checkpoint["tokenizer"].numpy().tobytes())

    def data_identity_mismatches(self, datamodule) -> list[str]:
        mismatches = super().data_identity_mismatches(datamodule)
        if self._tokenizer is not None:
            # what the vocabularies hold, not their model files' bytes: sentencepiece records the training files'
            # paths in the model, so an identical copy of the data in another folder is the same vocabulary
            ours = self._tokenizer.content_fingerprint
            theirs = datamodule.tokenizer.content_fingerprint if datamodule.vocabulary_fingerprint else None
            if ours != theirs:
                mismatches.append(f"sentencepiece vocabulary: model {ours} vs data {theirs}")
        return mismatches

    def encode_sources(self, texts: list[str], cut: list[int] | None = None) -> torch.Tensor:
        """Raw source lines -> (B, S) padded ids ending in eos, cut to ``max_positions - 1`` tokens.
        ``cut``, when given, is extended with the rows that were cut."""
        limit = self.max_positions - 1
        encoded = self.tokenizer.encode(texts)
        if cut is not None:
            cut += [row for row, seq in enumerate(encoded) if len(seq) > limit]
        ids = [seq[:limit] + [self.eos_id] for seq in encoded]
        src = torch.full((len(ids), max(len(seq) for seq in ids)), self.pad_id, dtype=torch.long)
        for row, seq in enumerate(ids):
            src[row, : len(seq)] = torch.tensor(seq)
        return src.to(self.device)

    # -- training --------------------------------------------------------------------------------
    def training_loss(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self(batch["src"], batch["tgt_in"], batch.get("src_padded"))
        loss_sum, nll_sum, tokens = label_smoothed_nll(logits, batch["tgt_out"], self.label_smoothing, self.pad_id)
        n = tokens.clamp(min=1)
        loss = loss_sum / n
        # tensors, logged per step: Lightning reads them when it writes the logs, not here
        # not prog_bar: Lightning turns progress-bar values into floats every batch (a host sync); the bars
        # read the loss from callback_metrics at their own interval (tasks.cli.progress.training_loss)
        self.log("train/loss", loss, prog_bar=False)
        self.log("train/ppl", (nll_sum / n).clamp(max=50.0).exp())
        self.log("train/target_tokens", tokens.float(), reduce_fx="sum", on_step=False, on_epoch=True)
        return loss

    # -- evaluation ------------------------------------------------------------------------------
    @property
    def tokenized_bleu_name(self) -> str:
        """The metric name of the tokenized compound-split BLEU under :attr:`tokenized_bleu_moses`."""
        return "bleu_tok_compound" if self.tokenized_bleu_moses == "paper" else "bleu_tok_compound_moses_master"

    def _eval_step(self, batch: dict, stage: str) -> None:
        logits = self(batch["src"], batch["tgt_in"], batch.get("src_padded"))
        loss_sum, nll_sum, n = label_smoothed_nll(logits, batch["tgt_out"], self.label_smoothing, self.pad_id)
        if n:
            self.eval_losses[stage].update(loss_sum / n, weight=n)
            self.eval_nll.update(nll_sum / n, weight=n)
        hypotheses = self.translate(batch["src"], src_padded=batch.get("src_padded"))
        hyps = self.tokenizer.decode(hypotheses.tokens.tolist())
        self._sentences += zip(batch["index"].tolist(), batch["src_text"], batch["tgt_text"], hyps)

    def _eval_epoch_end(self, stage: str) -> dict[str, float]:
        """Corpus scores over all ranks' sentences (each exactly once), logged the same on every rank; the
        sentences are left in :attr:`evaluated_sentences`."""
        sentences = sorted(self.all_gather_objects(self._sentences))
        self._sentences = []
        hyps, refs = [s[3] for s in sentences], [s[2] for s in sentences]
        loss, nll = self.eval_loss_value(stage), self.eval_nll.compute()
        self.eval_losses[stage].reset()
        self.eval_nll.reset()
        lang = self.trainer.datamodule.tgt_lang
        metrics = {
            **loss,
            f"{stage}/ppl": math.exp(min(float(nll), 50.0)),
            f"{stage}/bleu": corpus_bleu(hyps, refs),
            f"{stage}/chrf": corpus_chrf(hyps, refs),
            f"{stage}/{self.tokenized_bleu_name}": tokenized_compound_split_bleu(hyps, refs, lang,
                                                                                 self.tokenized_bleu_moses),
        }
        self.log_dict(metrics, prog_bar=False)
        self.evaluated_sentences = sentences
        return metrics

    def on_validation_epoch_start(self) -> None:
        self._sentences = []

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def on_test_epoch_start(self) -> None:
        self._sentences = []

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        metrics = self._eval_epoch_end("test")
        sentences = self.evaluated_sentences
        # chrF++ (character n-grams plus word uni- and bigrams), from the same gathered sentences
        metrics["test/chrf++"] = corpus_chrf([s[3] for s in sentences], [s[2] for s in sentences], word_order=2)
        self.log("test/chrf++", metrics["test/chrf++"])
        self.test_metrics = metrics

    # -- predict ---------------------------------------------------------------------------------
    def translate_texts(self, texts: list[str], cut: list[int] | None = None,
                        beam_size: int | None = None) -> list[str]:
        """Raw source lines -> their translations (see :meth:`encode_sources` for ``cut``)."""
        return self.tokenizer.decode(self.translate(self.encode_sources(texts, cut), beam_size).tokens.tolist())

    #: sentences per forward of ``model.predict`` (the datamodule's ``predict_batch_size``)
    predict_batch_size = 32

    def is_one_input(self, inputs) -> bool:
        """A string is one sentence, a list or tuple of strings is several; anything else is refused, naming
        what it is (a numpy array, bytes, a path, an image, ``None``, a number), never turned into text."""
        if isinstance(inputs, str):
            return True
        if not isinstance(inputs, (list, tuple)):
            raise TypeError(f"predict: cannot translate {_described(inputs)}; give a string or a list of strings")
        for position, item in enumerate(inputs):
            if not isinstance(item, str):
                raise TypeError(f"predict: input {position} is {_described(item)}; the translation model translates "
                                "strings")
        return False

    def predict_inputs(self, inputs: list[str], beam_size: int | None = None) -> list[str]:
        """``model.predict(texts, beam_size=None)`` (:mod:`tasks.engine.predictor`): each source sentence's translation;
        a sentence longer than ``max_positions - 1`` tokens is cut there, with a warning, as `predict` does."""
        cut: list[int] = []
        translations = self.translate_texts([str(text) for text in inputs], cut, beam_size)
        if cut:
            rank_zero_warn(f"predict: {len(cut)} of {len(inputs)} sentences had more than {self.max_positions - 1} "
                           f"tokens and were truncated (the model's max_positions {self.max_positions}, eos included)")
        return translations

    def predict_step(self, batch: dict, batch_idx: int) -> list[tuple[int, str, bool]]:
        """Per source line ``(index, translation, whether the source was cut to max_positions - 1 tokens)``."""
        cut: list[int] = []
        translations = self.translate_texts(batch["src_text"], cut)
        return [(index, text, row in cut) for row, (index, text)
                in enumerate(zip(batch["index"].tolist(), translations))]


def _described(value) -> str:
    """What a non-string input to the translation model is, with what to give instead."""
    if isinstance(value, (bytes, bytearray)):
        return f"bytes ({bytes(value)!r:.40}): decode them first, e.g. data.decode('utf-8')"
    if isinstance(value, Path):
        return (f"a path ({value}): give its lines, Path(...).read_text(encoding='utf-8').splitlines(), or run "
                "`python -m tasks.translate predict --data.predict_path FILE`")
    if isinstance(value, np.ndarray):
        return f"a numpy array {value.shape} of {value.dtype}: give its strings as a list (array.tolist())"
    if value is None:
        return "None"
    kind = type(value)
    if kind.__module__.startswith("PIL."):
        return "an image: the translation model translates text"
    return f"{value!r:.40} (of type {kind.__module__ + '.' if kind.__module__ != 'builtins' else ''}{kind.__qualname__})"


def main(args=None):
    """``python -m tasks.translate fit|validate|test|predict|export``; returns what the command built."""
    from tasks.cli.suite import main as run_command

    return run_command("translate", args)


if __name__ == "__main__":
    main()
