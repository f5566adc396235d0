"""What translation's `test` and `predict` write (:class:`tasks.translate.TranslationTask` computes it).

Under ``predictions/``: ``hypotheses.txt`` (one line per source line, in order), ``bleu_signature.txt``
(sacreBLEU's signature of the corpus BLEU in ``metrics.json``), ``hypotheses.tsv`` (per sentence: line, sentence
BLEU and chrF, source, reference, hypothesis) and ``worst/worst.tsv`` (the lowest-chrF sentences). All read the
task's ``evaluated_sentences``: ``(index, source, reference, hypothesis)`` of the whole split, in file order.
`predict` writes its translations to ``--model.predict_output``, a file or standard output (``-``); the
validation and test translations go to the run's loggers as tables (:mod:`tasks.outputs.media`).
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path
from typing import Iterator, TextIO

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn

from tasks.outputs.common import predictions_dir, PredictWriter, write_atomically, write_worst_csv
from tasks.outputs.media import media_sink
from tasks.metrics.bleu import bleu_signature, sentence_bleu, sentence_chrf

#: the columns of ``hypotheses.tsv`` (``worst.tsv`` puts ``rank`` first)
COLUMNS = ["line", "bleu", "chrf", "source", "reference", "hypothesis"]


def write_lines(path: Path, lines: list[str]) -> None:
    """``lines``, one per line, UTF-8 with ``\\n`` line ends on every platform, written atomically (an
    interrupted run leaves the earlier file or none, never part of one)."""
    write_atomically(path, "".join(line + "\n" for line in lines))


@functools.lru_cache(maxsize=1 << 16)
def sentence_scores(hypothesis: str, reference: str) -> tuple[float, float]:
    """sacreBLEU's sentence BLEU and chrF of one sentence, computed once for all the files that show them
    (``hypotheses.tsv`` and ``worst.tsv`` score the same split)."""
    return sentence_bleu(hypothesis, reference), sentence_chrf(hypothesis, reference)


def scored_row(index: int, source: str, reference: str, hypothesis: str) -> list:
    """A row of ``hypotheses.tsv``: the 1-based line of the test file, sacreBLEU's sentence BLEU and chrF
    (written with ``repr``: all digits), source, reference and hypothesis."""
    bleu, chrf = sentence_scores(hypothesis, reference)
    return [index + 1, repr(bleu), repr(chrf), source, reference, hypothesis]


class SentencesFile(Callback):
    """Base of the files written from the test split's sentences: :meth:`write` runs on rank 0 at the end
    of `test` with the task's ``evaluated_sentences`` (gathered from every rank by the task)."""

    def on_test_end(self, trainer, pl_module) -> None:
        sentences = getattr(pl_module, "evaluated_sentences", None)
        if trainer.global_rank == 0 and sentences is not None:
            self.write(predictions_dir(trainer), sentences)

    def write(self, folder: Path, sentences: list[tuple[int, str, str, str]]) -> None:
        raise NotImplementedError


class HypothesesTxt(SentencesFile):
    """``predictions/hypotheses.txt``: one translation per line of the test source file, in its order."""

    def write(self, folder: Path, sentences: list) -> None:
        write_lines(folder / "hypotheses.txt", [hypothesis for *_, hypothesis in sentences])


class BleuSignatureTxt(SentencesFile):
    """``predictions/bleu_signature.txt``: sacreBLEU's signature of the corpus BLEU in ``metrics.json``."""

    def write(self, folder: Path, sentences: list) -> None:
        signature = bleu_signature([s[3] for s in sentences], [s[2] for s in sentences])
        write_atomically(folder / "bleu_signature.txt", signature + "\n")


class HypothesesTsv(SentencesFile):
    """``predictions/hypotheses.tsv``: per sentence, in file order, the :func:`scored_row` columns.
    Tab-separated, written with the csv module (a field holding a tab or a quote is quoted)."""

    def write(self, folder: Path, sentences: list) -> None:
        write_worst_csv(folder / "hypotheses.tsv", COLUMNS, [scored_row(*s) for s in sentences], delimiter="\t")


class WorstTranslations(SentencesFile):
    """``predictions/worst/worst.tsv``: the ``k`` sentences of lowest sentence chrF (ties in file order),
    lowest first, ranked, with the columns of ``hypotheses.tsv``. chrF, unlike sentence BLEU, is rarely 0
    for a partly right translation, so the order tells the sentences apart."""

    def __init__(self, k: int):
        self.k = k

    def write(self, folder: Path, sentences: list) -> None:
        chrf = [sentence_scores(hypothesis, reference)[1] for _, _, reference, hypothesis in sentences]
        order = sorted(range(len(sentences)), key=lambda i: (chrf[i], sentences[i][0]))[: max(self.k, 0)]
        if order:
            write_worst_csv(folder / "worst" / "worst.tsv", ["rank", *COLUMNS],
                            [[rank, *scored_row(*sentences[i])] for rank, i in enumerate(order, start=1)],
                            delimiter="\t")


class ValidationTranslations(Callback):
    """``val/translations`` and ``test/translations`` to the run's loggers: ``count`` sentences spread over the
    split (the same ones every epoch) with their line, source, reference and hypothesis, as one table."""

    def __init__(self, count: int):
        self.count = count

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.log_table(trainer, pl_module, "val")

    def on_test_end(self, trainer, pl_module) -> None:
        self.log_table(trainer, pl_module, "test")

    def log_table(self, trainer, pl_module, stage: str) -> None:
        sentences = getattr(pl_module, "evaluated_sentences", None)
        if self.count <= 0 or not sentences:
            return
        media = media_sink(trainer)
        if media is None:
            return
        step = max(1, len(sentences) // self.count)
        media.log_table(f"{stage}/translations", ["line", "source", "reference", "hypothesis"],
                        [list(s) for s in sentences[::step][: self.count]])




@contextlib.contextmanager
def standard_output_kept() -> Iterator[TextIO]:
    """A stream to the process's standard output, kept for one writer: meanwhile everything else printed to
    standard output (progress bars, wandb and Lightning messages) goes to standard error, so
    ``predict < in > out`` yields clean text."""
    sys.stdout.flush()
    saved_fd = os.dup(1)
    kept = open(os.dup(saved_fd), "w", encoding="utf-8", closefd=True)
    saved_stdout, sys.stdout = sys.stdout, sys.stderr
    os.dup2(2, 1)
    try:
        yield kept
    finally:
        kept.close()
        sys.stdout.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        sys.stdout = saved_stdout


class PredictedTranslations(PredictWriter):
    """`predict`'s translations, one per input line in its order. Rows: ``(index, translation, whether the
    source was cut to max_positions - 1 tokens)``; the cut lines are warned about, naming the first.

    ``output``: a file, or ``-`` for standard output, which the writer keeps for the translations alone while
    `predict` runs (:func:`standard_output_kept`). ``stream``: where the translations go instead (Python use)."""

    writes_folder = False  # one file, written atomically, or a stream: nothing in predictions/predict/

    def __init__(self, output: str, stream: TextIO | None = None):
        super().__init__()
        self.output = output
        self.stream = stream
        self.kept_output = None  # standard output, kept from setup to teardown of `predict`

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "predict" and self.output == "-" and self.stream is None:
            self.kept_output = standard_output_kept()
            self.stream = self.kept_output.__enter__()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.kept_output is not None:
            self.kept_output.__exit__(None, None, None)
            self.kept_output = self.stream = None

    def destination(self, trainer) -> str:
        if self.output == "-":
            return "standard output"
        if self.stream is not None:
            return str(getattr(self.stream, "name", "the given stream"))
        return str(Path(self.output).resolve())

    def write(self, trainer, folder: Path, rows: list, pl_module) -> None:
        translations = {index: text for index, text, _ in sorted(rows)}  # a padding sampler repeats lines
        cut = sorted({index for index, _, was_cut in rows if was_cut})
        if cut:
            limit = pl_module.max_positions - 1
            rank_zero_warn(f"predict: {len(cut)} of {len(translations)} lines had more than {limit} tokens and were "
                           f"truncated to {limit} tokens (the model's max_positions {pl_module.max_positions}, eos "
                           f"included); the first is line {cut[0] + 1}")
        lines = list(translations.values())
        stream = self.stream
        if stream is None and self.output != "-":
            write_lines(Path(self.output), lines)
            return
        if stream is None:  # not set up by a Trainer's predict: this process's standard output as it is
            stream = sys.stdout
        stream.write("".join(line + "\n" for line in lines))
        stream.flush()
