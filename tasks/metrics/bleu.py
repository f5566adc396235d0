"""Translation scores, the two kinds papers report.

- sacreBLEU's (Post 2018, "A call for clarity in reporting BLEU scores"): detokenized hypotheses against the
  raw references, BLEU with the 13a tokenizer of WMT's ``mteval-v13a.pl`` (:func:`corpus_bleu`, its signature
  :func:`bleu_signature`, :func:`sentence_bleu`) and chrF / chrF++ (:func:`corpus_chrf`, :func:`sentence_chrf`).
  Comparable across papers and tokenizations.
- The tokenized, compound-split BLEU of Vaswani et al. 2017, Table 2 (:func:`tokenized_compound_split_bleu`):
  Moses ``tokenizer.perl``, ``a-b`` -> ``a ##AT##-##AT## b``, then ``multi-bleu.perl``. Comparable only with
  numbers computed the same way: fairseq's scaling_nmt README reports one model at 29.3 this way and at 28.6
  with sacreBLEU.

The Moses tokenizer exists in two versions that differ on one rule (``moses`` argument, :data:`MOSES_VERSIONS`):

- ``"paper"``: sacremoses as it is, which tokenizes as mosesdecoder's ``scripts/tokenizer/tokenizer.perl`` did
  at 59119c0 (2016-12-23), the script of 2017 when the Transformer paper was scored (tensor2tensor's
  ``get_ende_bleu.sh`` clones mosesdecoder). A sentence-final non-breaking prefix keeps its period:
  ``"vor 7 Q."`` -> ``"vor 7 Q."``.
- ``"master"``: ``tokenizer.perl`` since 9fc964d (2018-11-07, "split final dots unconditionally"), today's
  script and its C++ port: the last word always gives up its final period, ``"vor 7 Q."`` -> ``"vor 7 Q ."``,
  ``"iPhone 5."`` -> ``"iPhone 5 ."`` (:class:`MosesMasterTokenizer`). For English and German nothing else
  of the script changed between the two commits.
"""
from __future__ import annotations

import functools
import re
from typing import Literal

import sacrebleu
from sacremoses import MosesTokenizer

#: which Moses ``tokenizer.perl`` the tokenized BLEU follows (see the module docstring)
MosesVersion = Literal["paper", "master"]
MOSES_VERSIONS: tuple[str, ...] = ("paper", "master")

#: sacreBLEU's tokenizer for BLEU: WMT's ``mteval-v13a.pl``
SACREBLEU_TOKENIZE = "13a"


# -- sacreBLEU: detokenized hypotheses, raw references ------------------------------------------------------------
def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """sacreBLEU's corpus BLEU (13a, case-sensitive, ``exp`` smoothing), one reference per hypothesis; 0 for
    no sentence."""
    if not hypotheses:
        return 0.0
    return sacrebleu.corpus_bleu(hypotheses, [references], tokenize=SACREBLEU_TOKENIZE).score


def bleu_signature(hypotheses: list[str], references: list[str]) -> str:
    """sacreBLEU's signature of :func:`corpus_bleu` on these sentences (``nrefs:1|case:mixed|...``)."""
    bleu = sacrebleu.BLEU(tokenize=SACREBLEU_TOKENIZE)
    bleu.corpus_score(hypotheses, [references])
    return str(bleu.get_signature())


def corpus_chrf(hypotheses: list[str], references: list[str], word_order: int = 0) -> float:
    """sacreBLEU's corpus chrF (character 6-grams, beta 2); ``word_order=2`` adds word uni- and bigrams
    (chrF++). 0 for no sentence."""
    if not hypotheses:
        return 0.0
    return sacrebleu.corpus_chrf(hypotheses, [references], word_order=word_order).score


def sentence_bleu(hypothesis: str, reference: str) -> float:
    """sacreBLEU's sentence BLEU (13a, ``exp`` smoothing, effective order)."""
    return sacrebleu.sentence_bleu(hypothesis, [reference]).score


def sentence_chrf(hypothesis: str, reference: str) -> float:
    """sacreBLEU's sentence chrF."""
    return sacrebleu.sentence_chrf(hypothesis, [reference]).score


# -- the Transformer paper's BLEU: Moses-tokenized, compound-split, multi-bleu.perl --------------------------------
#: a whitespace token that ends in a period with something before it (tokenizer.perl's ``/^(\S+)\.$/``)
WORD_WITH_FINAL_PERIOD = re.compile(r"^(\S+)\.$")


class MosesMasterTokenizer(MosesTokenizer):
    """sacremoses' tokenizer with the rule ``tokenizer.perl`` gained in mosesdecoder 9fc964d: in the
    non-breaking-prefix step, the last word's final period becomes a token of its own whatever the word
    (``"So am I."`` -> ``"So am I ."``, ``"vor 7 Q."`` -> ``"vor 7 Q ."``, ``"U.S."`` -> ``"U.S ."``).
    sacremoses decides the other words. For :meth:`tokenize` only: Moses' Penn Treebank mode has no such rule."""

    def handles_nonbreaking_prefixes(self, text: str) -> str:
        words = text.split()
        if words:
            final = WORD_WITH_FINAL_PERIOD.match(words[-1])
            if final:
                # a lone "." is not a word ending in a period, and the word before it sees the same first
                # character of its next word, so sacremoses decides every other word as tokenizer.perl does
                words[-1] = final.group(1) + " ."
        return super().handles_nonbreaking_prefixes(" ".join(words))


@functools.lru_cache(maxsize=None)
def moses_tokenizer(lang: str, moses: MosesVersion = "paper") -> MosesTokenizer:
    """The Moses tokenizer of ``lang`` as ``tokenizer.perl`` of the version ``moses`` (one per language and version)."""
    if moses not in MOSES_VERSIONS:
        raise ValueError(f"unknown Moses tokenizer version {moses!r}: choose one of {', '.join(MOSES_VERSIONS)} "
                         "(paper: tokenizer.perl of 2016-12 as the Transformer paper used; master: since 2018-11)")
    return MosesMasterTokenizer(lang=lang) if moses == "master" else MosesTokenizer(lang=lang)


def moses_tokenize(line: str, lang: str, moses: MosesVersion = "paper") -> str:
    """``tokenizer.perl -l lang`` of the version ``moses`` on one line: its defaults, special characters
    escaped (``&quot;``, ``&apos;``, ...), no aggressive hyphen splitting."""
    return moses_tokenizer(lang, moses).tokenize(line, return_str=True, escape=True)


def split_compounds(line: str) -> str:
    r"""``Café-Liebhaber`` -> ``Café ##AT##-##AT## Liebhaber``: the substitution
    ``s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g`` of fairseq's ``scripts/compound_split_bleu.sh`` and
    tensor2tensor's ``get_ende_bleu.sh`` (left to right, matches do not overlap: ``a-b-c`` ->
    ``a ##AT##-##AT## b-c``, as in Perl)."""
    return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line)


def tokenized_compound_split_bleu(hypotheses: list[str], references: list[str], lang: str,
                                  moses: MosesVersion = "paper") -> float:
    """Corpus BLEU as Vaswani et al. 2017 report it (tensor2tensor's ``get_ende_bleu.sh``, fairseq's
    ``compound_split_bleu.sh``): hypotheses and references through :func:`moses_tokenize` (``moses``: which
    ``tokenizer.perl``, the paper's by default), hyphenated compounds split by :func:`split_compounds`, then
    ``multi-bleu.perl``: case-sensitive BLEU-4 over whitespace tokens, unsmoothed. That last step is
    sacreBLEU with ``tokenize="none"`` and ``smooth_method="none"`` (sacreBLEU's default ``exp`` smoothing
    would differ from multi-bleu whenever some n-gram order has no match). 0 for no sentence."""
    moses_tokenizer(lang, moses)  # an unknown version is refused even for an empty corpus
    if not hypotheses:
        return 0.0

    def prepare(lines: list[str]) -> list[str]:
        return [split_compounds(moses_tokenize(line, lang, moses)) for line in lines]

    bleu = sacrebleu.BLEU(tokenize="none", smooth_method="none")
    return bleu.corpus_score(prepare(hypotheses), [prepare(references)]).score
