"""Machine translation: ``python -m tasks.translate {fit,validate,test,predict}``.

The encoder-decoder Transformer of "Attention is all you need", trained with
label-smoothed cross-entropy; validation and test decode with beam search and
score sacreBLEU (13a tokenization, detokenized hypotheses vs raw references), chrF and
``bleu_tok_compound`` (the tokenized, compound-split BLEU the Transformer paper reports; see
:func:`tokenized_compound_split_bleu`), corpus-level, over every sentence exactly once across ranks
(`test` also chrF++). `test` writes
``predictions/hypotheses.txt`` (one line per source line, in order), ``predictions/metrics.json``,
``predictions/bleu_signature.txt`` (sacreBLEU's signature) and ``predictions/hypotheses.tsv``
(line, sentence BLEU and chrF, source, reference, hypothesis), the lowest-chrF sentences first in
``predictions/worst/worst.tsv``; `predict` translates ``--data.predict_path`` (a file
or ``-`` for standard input) to ``--model.predict_output`` (a file or ``-``).

The checkpoint carries the sentencepiece model the network was trained with, so `predict`
needs nothing but the checkpoint and the text, and `validate`/`test` refuse data whose
vocabulary is another one.
"""
from __future__ import annotations

import contextlib
import csv
import functools
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Literal

import sacrebleu
import torch
from sacremoses import MosesTokenizer
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric

from backbones.transformer import TransformerEncoder
from datamodules.tokenizer import Tokenizer
from heads.decoding import Hypotheses, beam_search, greedy_search, max_output_lengths
from heads.seq2seq import TransformerDecoder
from tasks.engine.analysis import write_worst_csv
from tasks.export import translation as onnx_translation
from tasks.engine.predictor import Predictor
from tasks.engine.base import TaskModule


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


@functools.lru_cache(maxsize=None)
def moses_tokenizer(lang: str) -> MosesTokenizer:
    return MosesTokenizer(lang=lang)


def split_compounds(line: str) -> str:
    r"""``Café-Liebhaber`` -> ``Café ##AT##-##AT## Liebhaber``: the substitution
    ``s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g`` of fairseq's ``scripts/compound_split_bleu.sh`` and
    tensor2tensor's ``get_ende_bleu.sh`` (left to right, matches do not overlap: ``a-b-c`` ->
    ``a ##AT##-##AT## b-c``, as in Perl)."""
    return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line)


def tokenized_compound_split_bleu(hypotheses: list[str], references: list[str], lang: str) -> float:
    """Corpus BLEU as Vaswani et al. 2017 report it (tensor2tensor's ``get_ende_bleu.sh``, fairseq's
    ``compound_split_bleu.sh``): hypotheses and references Moses-tokenized (``tokenizer.perl -l lang``
    defaults: special characters escaped, no aggressive hyphen splitting; here sacremoses), hyphenated
    compounds split by :func:`split_compounds`, then ``multi-bleu.perl``: case-sensitive BLEU-4 over
    whitespace tokens, unsmoothed. That last step is sacreBLEU with ``tokenize="none"`` and
    ``smooth_method="none"`` (sacreBLEU's default ``exp`` smoothing would differ from multi-bleu
    whenever some n-gram order has no match). Not comparable with sacreBLEU's detokenized score:
    fairseq's scaling_nmt README reports one model at 29.3 this way and 28.6 sacreBLEU."""
    if not hypotheses:
        return 0.0
    tokenizer = moses_tokenizer(lang)

    def prepare(lines: list[str]) -> list[str]:
        return [split_compounds(tokenizer.tokenize(line, return_str=True, escape=True)) for line in lines]

    bleu = sacrebleu.BLEU(tokenize="none", smooth_method="none")
    return bleu.corpus_score(prepare(hypotheses), [prepare(references)]).score


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
        num_sample_translations: rows of the wandb table of validation translations.
        predict_output: where `predict` writes its translations (``-`` = standard output).
        Remaining arguments: see :class:`tasks.engine.base.TaskModule`.
    """

    DATA_LINKS = {"vocab_size": "vocab_size", "pad_id": "pad_id", "bos_id": "bos_id", "eos_id": "eos_id",
                  "max_positions": "max_positions"}
    #: the module that writes this task's ONNX graph and checks it (``python -m tasks.translate export``)
    onnx_export = onnx_translation

    def __init__(self, vocab_size: int, pad_id: int = 0, bos_id: int = 2, eos_id: int = 3,
                 max_positions: int = 256, dim: int = 512, encoder_depth: int = 6, decoder_depth: int = 6,
                 num_heads: int = 8, ffn_dim: int = 2048, dropout: float = 0.1, attention_dropout: float = 0.0,
                 activation_dropout: float = 0.0, encoder_attention: str = "mha",
                 encoder_attention_kwargs: dict | None = None, pre_norm: bool = False,
                 learned_positions: bool = False, share_embeddings: bool = True, label_smoothing: float = 0.1,
                 beam_size: int = 4, length_penalty: float = 0.6,
                 length_penalty_form: Literal["gnmt", "fairseq"] = "gnmt", max_len_a: float = 1.2, max_len_b: int = 10,
                 num_sample_translations: int = 16, predict_output: str = "-", **kwargs):
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
        self.num_sample_translations = num_sample_translations
        self.predict_output = predict_output
        self.eval_nll = MeanMetric()
        self._rows: list[tuple[int, str, str, str]] = []
        self._cut_lines: list[int] = []  # predict: lines whose source was truncated
        self._tokenizer: Tokenizer | None = None

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
        theirs = datamodule.vocabulary_fingerprint
        if self._tokenizer is not None and self._tokenizer.fingerprint != theirs:
            mismatches.append(f"sentencepiece vocabulary: model {self._tokenizer.fingerprint} vs data {theirs}")
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
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/ppl", (nll_sum / n).clamp(max=50.0).exp())
        self.log("train/target_tokens", tokens.float(), reduce_fx="sum", on_step=False, on_epoch=True)
        return loss

    # -- evaluation ------------------------------------------------------------------------------
    def _eval_step(self, batch: dict, stage: str) -> None:
        logits = self(batch["src"], batch["tgt_in"], batch.get("src_padded"))
        loss_sum, nll_sum, n = label_smoothed_nll(logits, batch["tgt_out"], self.label_smoothing, self.pad_id)
        if n:
            self.eval_losses[stage].update(loss_sum / n, weight=n)
            self.eval_nll.update(nll_sum / n, weight=n)
        hypotheses = self.translate(batch["src"], src_padded=batch.get("src_padded"))
        hyps = self.tokenizer.decode(hypotheses.tokens.tolist())
        self._rows += zip(batch["index"].tolist(), batch["src_text"], batch["tgt_text"], hyps)

    def _eval_epoch_end(self, stage: str) -> dict[str, float]:
        """Corpus scores over all ranks' sentences (each exactly once), logged the same on every rank."""
        rows = sorted(self.all_gather_objects(self._rows))
        self._rows = []
        hyps = [r[3] for r in rows]
        refs = [r[2] for r in rows]
        loss, nll = self.eval_loss_value(stage), self.eval_nll.compute()
        self.eval_losses[stage].reset()
        self.eval_nll.reset()
        metrics = {
            **loss,
            f"{stage}/ppl": math.exp(min(float(nll), 50.0)),
            f"{stage}/bleu": sacrebleu.corpus_bleu(hyps, [refs], tokenize="13a").score if rows else 0.0,
            f"{stage}/chrf": sacrebleu.corpus_chrf(hyps, [refs]).score if rows else 0.0,
            f"{stage}/bleu_tok_compound": tokenized_compound_split_bleu(hyps, refs, self.trainer.datamodule.tgt_lang),
        }
        self.log_dict(metrics, prog_bar=False)
        self._log_samples(stage, rows)
        return metrics, rows

    def on_validation_epoch_start(self) -> None:
        self._rows = []

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def on_test_epoch_start(self) -> None:
        super().on_test_epoch_start()
        self._rows = []

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        metrics, rows = self._eval_epoch_end("test")
        hyps, refs = [r[3] for r in rows], [r[2] for r in rows]
        # chrF++ (character n-grams plus word uni- and bigrams), from the same gathered sentences
        chrf_pp = sacrebleu.corpus_chrf(hyps, [refs], word_order=2).score if rows else 0.0
        self.log("test/chrf++", chrf_pp)
        metrics["test/chrf++"] = chrf_pp
        if self.global_rank != 0:
            return
        self.predictions_dir.mkdir(parents=True, exist_ok=True)
        write_lines(self.predictions_dir / "hypotheses.txt", hyps)
        self.write_metrics_json(metrics)
        self.write_sentence_scores(rows)

    def write_sentence_scores(self, rows: list) -> None:
        """``predictions/bleu_signature.txt`` (sacreBLEU's signature of the corpus BLEU in metrics.json)
        and ``predictions/hypotheses.tsv``: per sentence, in file order, ``line`` (1-based line of the
        test file), sentence BLEU and chrF (sacreBLEU's ``sentence_bleu`` / ``sentence_chrf``), source,
        reference and hypothesis. Tab-separated, written with the csv module (a field holding a tab
        or a quote is quoted)."""
        bleu = sacrebleu.BLEU(tokenize="13a")
        bleu.corpus_score([r[3] for r in rows], [[r[2] for r in rows]])
        (self.predictions_dir / "bleu_signature.txt").write_text(str(bleu.get_signature()) + "\n", encoding="utf-8")
        scored = [[index + 1, sacrebleu.sentence_bleu(hypothesis, [reference]).score,
                   sacrebleu.sentence_chrf(hypothesis, [reference]).score, source, reference, hypothesis]
                  for index, source, reference, hypothesis in rows]
        columns = ["line", "bleu", "chrf", "source", "reference", "hypothesis"]
        write_worst_csv(self.predictions_dir / "hypotheses.tsv", columns,
                        [[line, repr(b), repr(c), *texts] for line, b, c, *texts in scored], delimiter="\t")
        # the k lowest sentence chrF (ties: file order); chrF, unlike sentence BLEU, is rarely 0 for
        # a partly right translation, so the order is informative
        worst = sorted(scored, key=lambda row: (row[2], row[0]))[: self.worst_examples.k]
        if worst:
            write_worst_csv(self.worst_dir / "worst.tsv", ["rank", *columns],
                            [[rank, line, repr(b), repr(c), *texts] for rank, (line, b, c, *texts)
                             in enumerate(worst, start=1)], delimiter="\t")

    def _log_samples(self, stage: str, rows: list) -> None:
        logger = self.wandb_logger
        if logger is None or self.num_sample_translations <= 0 or self.trainer.sanity_checking or not rows:
            return
        step = max(1, len(rows) // self.num_sample_translations)  # spread over the split, same rows each epoch
        data = [[i, s, r, h] for i, s, r, h in rows[::step][: self.num_sample_translations]]
        logger.log_table(key=f"{stage}/translations", columns=["line", "source", "reference", "hypothesis"], data=data)

    # -- predict ---------------------------------------------------------------------------------
    def on_predict_epoch_start(self) -> None:
        self._rows, self._cut_lines = [], []

    def translate_texts(self, texts: list[str], cut: list[int] | None = None, beam_size: int | None = None) -> list[str]:
        """Raw source lines -> their translations (see :meth:`encode_sources` for ``cut``)."""
        return self.tokenizer.decode(self.translate(self.encode_sources(texts, cut), beam_size).tokens.tolist())

    #: sentences per forward of ``model.predict`` (the datamodule's ``predict_batch_size``)
    predict_batch_size = 32

    def is_one_input(self, inputs) -> bool:
        return isinstance(inputs, str)

    def predict_inputs(self, inputs: list[str], beam_size: int | None = None) -> list[str]:
        """``model.predict(texts, beam_size=None)`` (:mod:`tasks.engine.predictor`): each source sentence's translation;
        a sentence longer than ``max_positions - 1`` tokens is cut there, with a warning, as `predict` does."""
        cut: list[int] = []
        translations = self.translate_texts([str(text) for text in inputs], cut, beam_size)
        if cut:
            rank_zero_warn(f"predict: {len(cut)} of {len(inputs)} sentences had more than {self.max_positions - 1} "
                           f"tokens and were truncated (the model's max_positions {self.max_positions}, eos included)")
        return translations

    def predict_step(self, batch: dict, batch_idx: int) -> list[str]:
        cut: list[int] = []
        hyps = self.translate_texts(batch["src_text"], cut)
        self._rows += zip(batch["index"].tolist(), hyps)
        self._cut_lines += [int(batch["index"][row]) for row in cut]
        return hyps

    def on_predict_epoch_end(self) -> None:
        rows = sorted(self.all_gather_objects(self._rows))
        self._rows = []
        cut = sorted(set(self.all_gather_objects(self._cut_lines)))
        self._cut_lines = []
        if cut:
            limit = self.max_positions - 1
            rank_zero_warn(f"predict: {len(cut)} of {len(dict(rows))} lines had more than {limit} tokens and were "
                           f"truncated to {limit} tokens (the model's max_positions {self.max_positions}, eos "
                           f"included); the first is line {cut[0] + 1}")
        if self.global_rank != 0:
            return
        lines = [h for _, h in dict(rows).items()]  # a sampler that pads would repeat indices
        if self.predict_output == "-":
            stream = _TRANSLATIONS_STDOUT or sys.stdout
            stream.write("".join(line + "\n" for line in lines))
            stream.flush()
        else:
            write_lines(Path(self.predict_output), lines)

    @property
    def predict_destination(self) -> str:
        return "standard output" if self.predict_output == "-" else str(Path(self.predict_output).resolve())


def write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(line + "\n" for line in lines)


#: where `predict` writes translations for ``predict_output="-"`` (see :func:`_stdout_for_translations`)
_TRANSLATIONS_STDOUT = None


@contextlib.contextmanager
def _stdout_for_translations(enabled: bool):
    """Keep standard output for the translations only: progress bars, wandb and Lightning
    messages printed meanwhile go to standard error, so ``predict < in > out`` yields clean text."""
    global _TRANSLATIONS_STDOUT
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved_fd = os.dup(1)
    _TRANSLATIONS_STDOUT = open(os.dup(saved_fd), "w", encoding="utf-8", closefd=True)
    saved_stdout, sys.stdout = sys.stdout, sys.stderr
    os.dup2(2, 1)
    try:
        yield
    finally:
        _TRANSLATIONS_STDOUT.close()
        _TRANSLATIONS_STDOUT = None
        sys.stdout.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        sys.stdout = saved_stdout


def main(args=None) -> None:
    from datamodules.wmt import TranslationDataModule
    from tasks.engine.cli import SuiteCLI

    argv = sys.argv[1:] if args is None else list(args)
    with _stdout_for_translations("predict" in argv and "--print_config" not in argv):
        SuiteCLI(TranslationTask, TranslationDataModule, task="translate", default_config="demo_transformer.yaml",
                 monitor="val/bleu", mode="max", args=args)


if __name__ == "__main__":
    main()
