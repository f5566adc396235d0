"""``bleu_tok_compound``: the BLEU of Vaswani et al. 2017 (Moses tokenizer, compound splitting,
multi-bleu.perl), checked against a computation written here: sacremoses, the ``##AT##``
rewrite as a character loop, and multi-bleu.perl's arithmetic in plain Python. The two Moses
``tokenizer.perl`` versions it offers differ exactly where mosesdecoder 9fc964d says they do."""
import math
from collections import Counter

import pytest
import sacrebleu
from sacremoses import MosesTokenizer

from tasks.metrics.bleu import moses_tokenize, split_compounds, tokenized_compound_split_bleu

REFERENCES = [
    "Der Café-Liebhaber trinkt jeden Morgen einen Espresso.",
    "Die E-Mail-Adresse des Bundesfinanzministeriums steht auf der Website.",
    "Im Nord-Süd-Konflikt ging es um \"faire\" Handelsbedingungen & Entwicklungshilfe.",
    "Die 3-Zimmer-Wohnung liegt in Baden-Württemberg, nahe der deutsch-französischen Grenze.",
    "Er sagte -- ohne zu zögern -- ja.",
]
HYPOTHESES = [
    "Der Café-Liebhaber trinkt jeden Morgen Espresso.",
    "Die E-Mail-Adresse des Finanzministeriums ist auf der Website.",
    "Im Nord-Süd-Konflikt ging es um faire Handelsbedingungen und Entwicklungshilfe.",
    "Die 3-Zimmer-Wohnung ist in Baden-Württemberg nahe der deutsch-französischen Grenze.",
    "Er sagte ohne zu zögern ja.",
]


def split_compounds_by_hand(line: str) -> str:
    """Perl's ``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g`` as a scan: at each hyphen with a non-space
    character on both sides, where the left one was not consumed by the previous match."""
    out, i, consumed = [], 0, 0  # consumed: characters before this index belong to an earlier match
    while i < len(line):
        if (line[i] == "-" and i - 1 >= consumed and i + 1 < len(line) and not line[i - 1].isspace()
                and not line[i + 1].isspace()):
            out.append(" ##AT##-##AT## " + line[i + 1])
            i += 2
            consumed = i
            continue
        out.append(line[i])
        i += 1
    return "".join(out)


def multi_bleu(hypotheses: list[str], references: list[str]) -> float:
    """multi-bleu.perl with one reference: clipped n-gram precisions (n = 1..4) over whitespace tokens,
    their geometric mean (0 if any is 0), brevity penalty exp(1 - r / c) when c < r; x 100."""
    correct, total, hyp_len, ref_len = [0] * 4, [0] * 4, 0, 0
    for hyp, ref in zip(hypotheses, references):
        h, r = hyp.split(), ref.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            h_ngrams = Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            r_ngrams = Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
            correct[n - 1] += sum(min(count, r_ngrams[g]) for g, count in h_ngrams.items())
            total[n - 1] += max(len(h) - n + 1, 0)
    if not all(total) or not all(correct):
        return 0.0
    log_precision = sum(math.log(c / t) for c, t in zip(correct, total)) / 4
    brevity = 1.0 if hyp_len >= ref_len else math.exp(1 - ref_len / hyp_len)
    return 100 * brevity * math.exp(log_precision)


def by_hand(hypotheses: list[str], references: list[str], tokenized: dict[str, str] | None = None) -> float:
    """multi-bleu.perl of the compound-split sacremoses tokens; ``tokenized`` gives the tokens of some lines
    instead (what another tokenizer.perl writes for them)."""
    moses = MosesTokenizer(lang="de")
    tokenized = tokenized or {}

    def prepare(lines):
        return [split_compounds_by_hand(tokenized.get(line) or moses.tokenize(line, return_str=True, escape=True))
                for line in lines]

    return multi_bleu(prepare(hypotheses), prepare(references))


@pytest.mark.parametrize("line, expected", [
    # written out from Perl's output of the substitution (perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g')
    ("Café-Liebhaber", "Café ##AT##-##AT## Liebhaber"),
    ("E-Mail-Adresse", "E ##AT##-##AT## Mail ##AT##-##AT## Adresse"),
    ("a-b-c", "a ##AT##-##AT## b-c"),  # matches do not overlap
    ("3-4-Zimmer", "3 ##AT##-##AT## 4-Zimmer"),
    ("x-- y -- z -", "x ##AT##-##AT## - y -- z -"),
])
def test_compound_split_is_perls_substitution(line, expected):
    assert split_compounds(line) == expected
    assert split_compounds_by_hand(line) == expected


def test_tokenized_compound_split_bleu_equals_the_hand_computation():
    moses = MosesTokenizer(lang="de")
    tokenized = moses.tokenize(REFERENCES[1], return_str=True, escape=True)
    assert "E-Mail-Adresse" in tokenized  # Moses (not aggressive) keeps the compound; the split is ours
    assert moses.tokenize(REFERENCES[2], return_str=True, escape=True).count("&quot;") == 2  # escaped as tokenizer.perl

    ours = tokenized_compound_split_bleu(HYPOTHESES, REFERENCES, "de")
    assert ours == pytest.approx(by_hand(HYPOTHESES, REFERENCES), abs=1e-9)
    # it is neither sacreBLEU's detokenized score nor tokenized BLEU without the split
    assert abs(ours - sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score) > 1.0
    unsplit = multi_bleu([moses.tokenize(h, return_str=True) for h in HYPOTHESES],
                         [moses.tokenize(r, return_str=True) for r in REFERENCES])
    assert abs(ours - unsplit) > 1.0


def test_no_four_gram_match_scores_zero_as_multi_bleu_not_smoothed():
    """multi-bleu.perl does not smooth; sacreBLEU's default (exp smoothing) would give a positive score."""
    hypotheses, references = ["Die Wohnung liegt gut"], ["Die Wohnung ist gut gelegen"]
    assert tokenized_compound_split_bleu(hypotheses, references, "de") == 0.0 == by_hand(hypotheses, references)
    assert sacrebleu.corpus_bleu(hypotheses, [references], tokenize="none").score > 0
    assert tokenized_compound_split_bleu([], [], "de") == 0.0


# -- the two tokenizer.perl versions ------------------------------------------------------------------------------
@pytest.mark.parametrize("lang, line, paper, master", [
    # the examples of mosesdecoder 9fc964d ("tokenizer.perl: split final dots unconditionally"), old and new output
    ("en", "So am I.", "So am I.", "So am I ."),
    ("de", "... schwer wie ein iPhone 5.", "... schwer wie ein iPhone 5.", "... schwer wie ein iPhone 5 ."),
    ("fr", "Des gens admirent une œuvre d'art.", "Des gens admirent une œuvre d&apos; art.",
     "Des gens admirent une œuvre d&apos; art ."),
    # a German non-breaking prefix ending the sentence
    ("de", "Die Zahlen kommen vor 7 Q.", "Die Zahlen kommen vor 7 Q.", "Die Zahlen kommen vor 7 Q ."),
])
def test_the_versions_tokenize_a_sentence_final_non_breaking_prefix_as_their_tokenizer_perl(lang, line, paper, master):
    assert moses_tokenize(line, lang) == paper == moses_tokenize(line, lang, "paper")
    assert moses_tokenize(line, lang, "master") == master


AGREEING = [
    *REFERENCES, *HYPOTHESES,
    "Dr. Müller kommt am 3. Mai um 7 Uhr.",  # non-breaking prefixes inside the sentence
    "Q. 3 war besser als Q. 2, sagte Prof. Schmidt.",
    "Er sagte etc...",  # a final multi-dot is not a word ending in a period
    "Die Sitzung endet vor 7 Q. Danach gibt es Kaffee.",
    "Wer? Niemand!",
    "",
]


def test_the_versions_agree_on_every_other_sentence():
    paper = [moses_tokenize(line, "de") for line in AGREEING]
    assert [moses_tokenize(line, "de", "master") for line in AGREEING] == paper
    assert (tokenized_compound_split_bleu(HYPOTHESES, REFERENCES, "de", "master")
            == tokenized_compound_split_bleu(HYPOTHESES, REFERENCES, "de"))


def test_the_versions_score_a_corpus_with_a_sentence_final_prefix_apart_each_as_computed_by_hand():
    final_prefix = {"Die Zahlen kommen vor 7 Q.": "Die Zahlen kommen vor 7 Q .",
                    "Die Zahlen kamen schon vor 7 Q.": "Die Zahlen kamen schon vor 7 Q ."}
    hypotheses = [*HYPOTHESES, "Die Zahlen kamen schon vor 7 Q."]
    references = [*REFERENCES, "Die Zahlen kommen vor 7 Q."]
    paper = tokenized_compound_split_bleu(hypotheses, references, "de")
    master = tokenized_compound_split_bleu(hypotheses, references, "de", "master")
    assert paper == pytest.approx(by_hand(hypotheses, references), abs=1e-9)
    assert master == pytest.approx(by_hand(hypotheses, references, tokenized=final_prefix), abs=1e-9)
    assert abs(master - paper) > 0.1


def test_an_unknown_version_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown Moses tokenizer version 'latest': choose one of paper, master"):
        tokenized_compound_split_bleu([], [], "de", "latest")
