"""Greedy and beam search: beam 1 is greedy, the cache changes nothing, padding changes
nothing, and on a tiny vocabulary beam search finds the exhaustive optimum."""
import itertools
import math

import pytest
import torch
import torch.nn as nn

from backbones.transformer import TransformerEncoder
from heads.decoding import LENGTH_PENALTIES, beam_search, greedy_search, max_output_lengths
from heads.seq2seq import TransformerDecoder

PAD, UNK, BOS, EOS = 0, 1, 2, 3
IDS = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    vocab, dim = 30, 32
    enc = TransformerEncoder(vocab, dim, 2, 4, 64, 0.0, max_positions=64)
    dec = TransformerDecoder(vocab, dim, 2, 4, 64, 0.0, max_positions=64, embed_tokens=enc.embed.tokens)
    # a sharper output distribution than at init, so hypotheses end at different lengths
    with torch.no_grad():
        enc.embed.tokens.weight.mul_(3.0)
    return enc.double().eval(), dec.double().eval()


def source_batch(lengths, vocab=30, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (len(lengths), max(lengths)), generator=g)
    for i, n in enumerate(lengths):
        ids[i, n:] = PAD
    return ids


def encode(model, src):
    enc, _ = model
    memory, padding = enc(src)
    return memory, padding, max_output_lengths(src.ne(PAD).sum(1), 1.0, 4)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_size_one_is_greedy(model, alpha):
    memory, padding, max_len = encode(model, source_batch([5, 2, 8, 3]))
    greedy = greedy_search(model[1], memory, padding, max_len, **IDS)
    beam = beam_search(model[1], memory, padding, max_len, beam_size=1, alpha=alpha, **IDS)
    width = beam.tokens.shape[1]
    assert greedy.tokens[:, width:].eq(PAD).all()
    assert torch.equal(greedy.tokens[:, :width], beam.tokens)
    torch.testing.assert_close(greedy.scores, beam.scores)


@pytest.mark.parametrize("search", ["greedy", "beam", "beam-fairseq-penalty"])
def test_cached_decoding_equals_recomputing_the_prefix(model, search):
    memory, padding, max_len = encode(model, source_batch([5, 2, 8, 3]))
    form = "fairseq" if search.endswith("fairseq-penalty") else "gnmt"
    run = (lambda **kw: greedy_search(model[1], memory, padding, max_len, **IDS, **kw)) if search == "greedy" else \
        (lambda **kw: beam_search(model[1], memory, padding, max_len, beam_size=4, alpha=0.6,
                                  length_penalty_form=form, **IDS, **kw))
    cached, full = run(use_cache=True), run(use_cache=False)
    assert torch.equal(cached.tokens, full.tokens)
    torch.testing.assert_close(cached.scores, full.scores)
    torch.testing.assert_close(cached.normalized, full.normalized)


def test_padding_a_batch_does_not_change_any_output(model):
    lengths = [5, 2, 8, 3]
    src = source_batch(lengths)
    memory, padding, max_len = encode(model, src)
    batched = beam_search(model[1], memory, padding, max_len, beam_size=4, alpha=0.6, **IDS)
    lengths_out = batched.tokens.ne(PAD).sum(1)
    assert len(set(lengths_out.tolist())) > 1, "the check is weak if every output has the same length"
    for i, n in enumerate(lengths):
        m, p, ml = encode(model, src[i : i + 1, :n])
        alone = beam_search(model[1], m, p, ml, beam_size=4, alpha=0.6, **IDS)
        k = alone.tokens.shape[1]
        assert torch.equal(batched.tokens[i, :k], alone.tokens[0]) and batched.tokens[i, k:].eq(PAD).all()
        torch.testing.assert_close(batched.scores[i : i + 1], alone.scores)


def test_outputs_end_in_eos_within_the_length_limit(model):
    memory, padding, max_len = encode(model, source_batch([5, 2, 8, 3]))
    out = beam_search(model[1], memory, padding, max_len, beam_size=3, alpha=0.6, **IDS)
    lengths = out.tokens.ne(PAD).sum(1)
    assert (lengths <= max_len).all()
    assert out.tokens[torch.arange(4), lengths - 1].eq(EOS).all()
    assert not out.tokens.eq(BOS).any()


class MarkovDecoder(nn.Module):
    """A toy decoder whose next-token log-probabilities depend on (position, last token) only,
    so every sequence's score can be enumerated. Follows the decoder interface, cache included."""

    def __init__(self, vocab: int, positions: int):
        super().__init__()
        self.table = torch.randn(positions, vocab, vocab, generator=torch.Generator().manual_seed(3)) * 2

    class Cache:
        def __init__(self):
            self.steps = 0

        def reorder(self, index):
            pass

    def new_cache(self):
        return self.Cache()

    def forward(self, tgt, memory, memory_padding_mask=None, cache=None):
        offset = 0 if cache is None else cache.steps
        positions = torch.arange(offset, offset + tgt.shape[1])
        if cache is not None:
            cache.steps += tgt.shape[1]
        return self.table[positions[None, :], tgt]  # (B, T, V)


@pytest.mark.parametrize("form", sorted(LENGTH_PENALTIES))
@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_wide_beam_finds_the_exhaustive_best_length_normalised_hypothesis(alpha, form):
    vocab, max_len = 6, 4
    decoder = MarkovDecoder(vocab, max_len + 1)
    memory = torch.zeros(1, 1, 1)
    log_probs = decoder.table.log_softmax(-1)  # pad/bos are banned after normalising, as in fairseq
    allowed = [t for t in range(vocab) if t not in (PAD, BOS, EOS)]
    best, best_tokens = float("-inf"), None
    for n in range(max_len):  # n tokens before eos
        for body in itertools.product(allowed, repeat=n):
            seq = list(body) + [EOS]
            prev, score = BOS, 0.0
            for t, tok in enumerate(seq):
                score += log_probs[t, prev, tok].item()
                prev = tok
            # written out here, not taken from heads.decoding: GNMT's eq. 14, fairseq's |y| ** lenpen
            penalty = ((5 + len(seq)) / 6) ** alpha if form == "gnmt" else len(seq) ** alpha
            norm = score / penalty
            if norm > best:
                best, best_tokens = norm, seq
    # 2K >= every candidate and K >= every live prefix: nothing is pruned
    out = beam_search(decoder, memory, None, torch.tensor([max_len]), beam_size=len(allowed) ** max_len, alpha=alpha,
                      length_penalty_form=form, **IDS)
    assert out.tokens[0][out.tokens[0] != PAD].tolist() == best_tokens
    assert out.normalized.item() == pytest.approx(best)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_min_len_delays_eos_up_to_max_len(model, search):
    memory, padding, _ = encode(model, source_batch([5, 2, 8, 3]))
    max_len = torch.tensor([9, 9, 9, 4])
    fn = greedy_search if search == "greedy" else beam_search
    out = fn(model[1], memory, padding, max_len, min_len=7, **IDS)
    lengths = out.tokens.ne(PAD).sum(1)
    assert lengths[:3].ge(7).all() and lengths[3] == 4  # max_len wins over min_len


class MemoryPerHypothesis(nn.Module):
    """The reference layout of the memory: one copy per hypothesis, no cache (the decoder then
    sees one hypothesis per sentence, so its shared-memory cross-attention is not exercised)."""

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def new_cache(self):
        raise AssertionError("the reference decodes without a cache")

    def forward(self, tgt, memory, memory_padding_mask=None, cache=None):
        repeat = tgt.shape[0] // memory.shape[0]
        return self.decoder(tgt, memory.repeat_interleave(repeat, 0), memory_padding_mask.repeat_interleave(repeat, 0))


@pytest.mark.parametrize("beam_size", [1, 4])
def test_cached_search_beyond_the_first_buffer_equals_the_per_hypothesis_reference(model, beam_size):
    """Float32 random weights, padded sources, 20 tokens forced (the cache buffer starts at 16
    positions and grows): the searched hypotheses equal those of the uncached decoder fed one
    memory copy per hypothesis (the layout before beams shared their sentence's memory)."""
    torch.manual_seed(4)
    vocab = 40
    enc = TransformerEncoder(vocab, 32, 1, 4, 64, 0.0, max_positions=64).eval()
    dec = TransformerDecoder(vocab, 32, 2, 4, 64, 0.0, max_positions=64, embed_tokens=enc.embed.tokens).eval()
    src = source_batch([7, 3, 9, 5], vocab=vocab, seed=5)
    memory, padding = enc(src)
    max_len = torch.tensor([22, 21, 22, 20])
    kw = dict(beam_size=beam_size, alpha=0.6, min_len=20, **IDS)
    cached = beam_search(dec, memory, padding, max_len, **kw)
    reference = beam_search(MemoryPerHypothesis(dec), memory, padding, max_len, use_cache=False, **kw)
    assert cached.tokens.ne(PAD).sum(1).ge(20).all()
    assert torch.equal(cached.tokens, reference.tokens)
    torch.testing.assert_close(cached.scores, reference.scores)
    torch.testing.assert_close(cached.normalized, reference.normalized)


def test_reordered_cache_continues_the_chosen_hypotheses(model):
    """After ``reorder``, a cached step scores the reordered prefixes as a full pass over them does."""
    _, dec = model
    memory, padding, _ = encode(model, source_batch([5, 2, 8]))
    beams = 4
    tgt = torch.randint(4, 30, (3 * beams, 6), generator=torch.Generator().manual_seed(6))
    cache = dec.new_cache()
    for t in range(5):
        dec(tgt[:, t : t + 1], memory, padding, cache)
    # within each sentence's block: some beams continue themselves, others another beam
    index = torch.tensor([0, 0, 3, 1, 5, 5, 6, 7, 11, 8, 8, 9])
    cache.reorder(index)
    reordered = torch.cat([tgt[index, :5], tgt[:, 5:6]], dim=1)
    step = dec(reordered[:, 5:6], memory, padding, cache)
    torch.testing.assert_close(step[:, 0], dec(reordered, memory, padding)[:, 5])
    with pytest.raises(ValueError, match="one index per hypothesis"):
        cache.reorder(index[:4])


A, B = 4, 5  # the two content tokens of the hand-made decoder below (UNK = 1 is never likely)


class TableDecoder(nn.Module):
    """Next-token probabilities given by hand per (position, previous token); rows not listed are uniform."""

    def __init__(self, vocab: int, rows: dict[tuple[int, int], dict[int, float]]):
        super().__init__()
        self.vocab, self.rows = vocab, rows

    def new_cache(self):
        return MarkovDecoder.Cache()

    def forward(self, tgt, memory, memory_padding_mask=None, cache=None):
        offset = 0 if cache is None else cache.steps
        if cache is not None:
            cache.steps += tgt.shape[1]
        probs = torch.full((*tgt.shape, self.vocab), 1.0 / self.vocab, dtype=torch.float64)
        for i, row in enumerate(tgt.tolist()):
            for j, prev in enumerate(row):
                if (offset + j, prev) in self.rows:
                    probs[i, j] = 0.0
                    for token, p in self.rows[offset + j, prev].items():
                        probs[i, j, token] = p
        return probs.log()  # already normalised: log_softmax leaves it unchanged


def test_length_penalty_form_decides_between_a_short_and_a_long_hypothesis():
    """Beam 2, at most 4 tokens. By hand (log-probabilities):
    step 0: A -1.0, B -0.5; step 1: B B -0.7, A eos -2.0 (finished, |y| = 2), A A -2.05, ... (the
    eos is within the top 2, so it finishes; B B and A A stay live); step 2: B B B -0.805,
    A A A -2.155 (no eos in the top 2); step 3 (the last: eos only): B B B eos -2.7, A A A eos -4.05.
    Finished: [A eos] -2.0, [B B B eos] -2.7, [A A A eos] -4.05. With alpha 0.6:
    GNMT ((5 + |y|) / 6) ** 0.6:  -2.0 / 1.0969 = -1.823 beats -2.7 / 1.2754 = -2.117;
    fairseq |y| ** 0.6:           -2.7 / 2.2974 = -1.175 beats -2.0 / 1.5157 = -1.320."""
    e = math.exp
    rows = {
        (0, BOS): {A: e(-1.0), B: e(-0.5), EOS: 1 - e(-1.0) - e(-0.5)},
        (1, A): {EOS: e(-1.0), A: e(-1.05), B: 1 - e(-1.0) - e(-1.05)},
        (1, B): {B: e(-0.2), EOS: 0.05, A: 1 - e(-0.2) - 0.05},
        (2, B): {B: 0.9, EOS: 0.06, A: 0.04},
        (2, A): {A: 0.9, EOS: 0.06, B: 0.04},
        (3, B): {EOS: e(-1.895), B: 1 - e(-1.895)},
        (3, A): {EOS: e(-1.895), A: 1 - e(-1.895)},
    }
    decoder = TableDecoder(6, rows)
    memory, max_len = torch.zeros(1, 1, 1), torch.tensor([4])
    picks = {}
    for form in ("gnmt", "fairseq"):
        for use_cache in (True, False):
            out = beam_search(decoder, memory, None, max_len, beam_size=2, alpha=0.6, length_penalty_form=form,
                              use_cache=use_cache, **IDS)
            tokens = out.tokens[0][out.tokens[0] != PAD].tolist()
            picks[form, use_cache] = tokens, out.scores.item(), out.normalized.item()
    gnmt_tokens, gnmt_score, gnmt_norm = picks["gnmt", True]
    fairseq_tokens, fairseq_score, fairseq_norm = picks["fairseq", True]
    assert gnmt_tokens == [A, EOS] and gnmt_score == pytest.approx(-2.0)
    assert gnmt_norm == pytest.approx(-2.0 / (7 / 6) ** 0.6)
    assert fairseq_tokens == [B, B, B, EOS] and fairseq_score == pytest.approx(-0.5 - 0.2 + math.log(0.9) - 1.895)
    assert fairseq_norm == pytest.approx(fairseq_score / 4 ** 0.6)
    for form in ("gnmt", "fairseq"):  # the cache changes nothing
        assert picks[form, False][0] == picks[form, True][0]
        assert picks[form, False][1:] == pytest.approx(picks[form, True][1:])


def test_an_unknown_length_penalty_form_is_refused():
    with pytest.raises(ValueError, match=r"length_penalty_form='wu'.*'fairseq', 'gnmt'"):
        beam_search(MarkovDecoder(6, 3), torch.zeros(1, 1, 1), None, torch.tensor([2]), length_penalty_form="wu", **IDS)
