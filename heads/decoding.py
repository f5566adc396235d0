"""Greedy and beam search for encoder-decoder models, batched and with the decoder's cache.

Both work on any ``decoder`` with the interface of :class:`heads.seq2seq.TransformerDecoder`:
``decoder(tgt (N, T), memory (B, S, D), memory_padding_mask (B, S), cache) -> logits (N, T, V)``,
where the N = K * B rows are the K hypotheses of each sentence in consecutive rows (K = 1
for greedy search), and ``decoder.new_cache()`` returning an object with ``reorder(index)``.

Every step is one decoder call on all sentences (times beams) at once; no Python loop
runs over sentences. With ``use_cache=True`` a step feeds only the newest token and the
decoder appends its keys/values to the cache; with ``use_cache=False`` it recomputes the
whole prefix (the reference the cached path must match).

Beam search (as fairseq's; the length penalty GNMT's of Wu et al. 2016 or fairseq's ``--lenpen``):
- each step, every live beam is extended by every token; of the best ``2K`` candidates
  per sentence, those ending in eos *within the top K* become finished hypotheses, and
  the best ``K`` not ending in eos stay live;
- finished hypotheses are scored ``log p(y|x) / lp(y)`` and kept, the best ``K`` per sentence,
  until the sentence has ``K`` of them; the search ends when every sentence has. ``lp`` is
  ``((5 + |y|) / 6) ** alpha`` (``length_penalty_form="gnmt"``, what the Transformer paper cites
  for its alpha = 0.6) or ``|y| ** alpha`` (``"fairseq"``: ``SequenceGenerator.finalize_hypos``
  divides by ``(step + 1) ** len_penalty``); in both |y| counts eos;
- a sentence's output is at most ``max_len`` tokens (eos included): at the last step only
  eos is allowed, so every beam ends;
- pad and bos are never generated.

With ``beam_size=1`` this is greedy search, whatever alpha is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class Hypotheses:
    """Best output per sentence: ``tokens`` (B, L) ending in eos then pad, ``scores`` (B,) the
    sum of token log-probabilities (eos included), ``normalized`` (B,) the score the search
    ranked by (``scores`` for greedy, ``scores / lp`` for beam search)."""

    tokens: Tensor
    scores: Tensor
    normalized: Tensor


def max_output_lengths(src_lengths: Tensor, a: float = 1.2, b: int = 10, limit: int | None = None) -> Tensor:
    """(B,) ``floor(a * src_len + b)`` output tokens per sentence, capped at ``limit``, at least 1."""
    lengths = (src_lengths.float() * a + b).floor().long().clamp_min(1)
    return lengths if limit is None else lengths.clamp_max(limit)


def gnmt_length_penalty(length: Tensor | int, alpha: float) -> Tensor | float:
    """Wu et al. 2016, eq. 14: ``((5 + |y|) / 6) ** alpha``."""
    return ((5.0 + length) / 6.0) ** alpha


def fairseq_length_penalty(length: Tensor | int, alpha: float) -> Tensor | float:
    """fairseq's ``--lenpen alpha``: ``|y| ** alpha``."""
    return (1.0 * length) ** alpha


#: ``length_penalty_form`` -> ``lp(|y|, alpha)``, the divisor of a finished hypothesis' log-probability
LENGTH_PENALTIES = {"gnmt": gnmt_length_penalty, "fairseq": fairseq_length_penalty}


class _Stepper:
    """Next-token log-probabilities (N, V) for the prefixes (N, t), with or without the cache."""

    def __init__(self, decoder, memory: Tensor, memory_padding_mask: Tensor | None, use_cache: bool):
        self.decoder, self.memory, self.mask = decoder, memory, memory_padding_mask
        self.cache = decoder.new_cache() if use_cache else None

    def __call__(self, prefix: Tensor) -> Tensor:
        if self.cache is not None:
            logits = self.decoder(prefix[:, -1:], self.memory, self.mask, self.cache)
        else:
            logits = self.decoder(prefix, self.memory, self.mask)
        return logits[:, -1].float().log_softmax(dim=-1)

    def reorder(self, index: Tensor) -> None:
        if self.cache is not None:
            self.cache.reorder(index)


class _TokenRules:
    """Which tokens step t may produce, as an additive bias (0 or -inf) on log-probabilities:
    never pad or bos; no eos before ``min_len`` tokens; only eos at a sentence's last step."""

    def __init__(self, max_len: Tensor, min_len: int, bos_id: int, eos_id: int, pad_id: int):
        self.max_len, self.min_len, self.eos_id = max_len, min_len, eos_id
        self.banned = [pad_id, bos_id]
        self.earliest_last_step = int(max_len.min()) - 1 if max_len.numel() else 0
        self.biases = None

    def eos_possible(self, t: int) -> bool:
        return t >= self.min_len - 1 or t >= self.earliest_last_step

    def __call__(self, t: int, vocab: int, device: torch.device) -> Tensor:
        """(V,) or, when some sentence is at its last step, (B, 1, V)."""
        if self.biases is None:
            free = torch.zeros(vocab, device=device)
            free[self.banned] = float("-inf")
            short = free.clone()
            short[self.eos_id] = float("-inf")
            last = torch.full((vocab,), float("-inf"), device=device)
            last[self.eos_id] = 0.0
            self.biases = free, short, last
        free, short, last = self.biases
        bias = short if t < self.min_len - 1 else free
        if t < self.earliest_last_step:
            return bias
        return torch.where((t >= self.max_len - 1)[:, None, None], last, bias)


@torch.no_grad()
def greedy_search(decoder, memory: Tensor, memory_padding_mask: Tensor | None, max_len: Tensor, *,
                  bos_id: int, eos_id: int, pad_id: int, min_len: int = 1, use_cache: bool = True) -> Hypotheses:
    """Arg-max decoding. memory (B, S, D), max_len (B,) output tokens per sentence (eos included);
    ``min_len``: no eos before that many tokens (unless ``max_len`` is shorter)."""
    b = memory.shape[0]
    step = _Stepper(decoder, memory, memory_padding_mask, use_cache)
    rules = _TokenRules(max_len, min_len, bos_id, eos_id, pad_id)
    tokens = torch.full((b, 1), bos_id, dtype=torch.long, device=memory.device)
    scores = torch.zeros(b, device=memory.device)
    done = torch.zeros(b, dtype=torch.bool, device=memory.device)
    for t in range(int(max_len.max())):
        log_probs = step(tokens)
        best, nxt = (log_probs + rules(t, log_probs.shape[-1], log_probs.device).view(-1, log_probs.shape[-1])).max(dim=-1)
        scores += best.masked_fill(done, 0.0)
        nxt = nxt.masked_fill(done, pad_id)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if rules.eos_possible(t):
            done |= nxt == eos_id
            if done.all():
                break
    return Hypotheses(tokens[:, 1:], scores, scores.clone())


@torch.no_grad()
def beam_search(decoder, memory: Tensor, memory_padding_mask: Tensor | None, max_len: Tensor, *,
                beam_size: int = 4, alpha: float = 0.6, length_penalty_form: str = "gnmt", bos_id: int,
                eos_id: int, pad_id: int, min_len: int = 1, use_cache: bool = True) -> Hypotheses:
    """Batched beam search (see the module docstring). memory (B, S, D) from the encoder,
    memory_padding_mask (B, S) True = pad, max_len (B,) output tokens per sentence,
    ``alpha`` and ``length_penalty_form`` (a key of :data:`LENGTH_PENALTIES`): the length penalty,
    ``min_len``: no eos before that many tokens (unless ``max_len`` is shorter)."""
    if length_penalty_form not in LENGTH_PENALTIES:
        raise ValueError(f"length_penalty_form={length_penalty_form!r}: expected one of {sorted(LENGTH_PENALTIES)}")
    length_penalty = LENGTH_PENALTIES[length_penalty_form]
    b, k, device = memory.shape[0], beam_size, memory.device
    step = _Stepper(decoder, memory, memory_padding_mask, use_cache)
    rules = _TokenRules(max_len, min_len, bos_id, eos_id, pad_id)
    longest = int(max_len.max())
    neg_inf = float("-inf")

    tokens = torch.full((b * k, 1), bos_id, dtype=torch.long, device=device)
    # all beams start from the same prefix: keep only one alive so the first step has no duplicates
    live_scores = torch.full((b, k), neg_inf, device=device)
    live_scores[:, 0] = 0.0
    fin_tokens = torch.full((b, k, longest), pad_id, dtype=torch.long, device=device)
    fin_norm = torch.full((b, k), neg_inf, device=device)
    fin_raw = torch.full((b, k), neg_inf, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    beam_offset = torch.arange(b, device=device)[:, None] * k

    for t in range(longest):
        log_probs = step(tokens)
        vocab = log_probs.shape[-1]
        scores = log_probs.view(b, k, vocab).add_(rules(t, vocab, device)).add_(live_scores[:, :, None])
        cand_scores, cand = scores.view(b, k * vocab).topk(2 * k, dim=1)
        cand_beam, cand_token = cand // vocab, cand % vocab
        if not rules.eos_possible(t):  # the best K candidates are the live beams
            live_scores, parent_beam, live_token = cand_scores[:, :k], cand_beam[:, :k], cand_token[:, :k]
        else:
            is_eos = cand_token == eos_id
            # finished hypotheses: eos among the top K candidates of a sentence still searching
            new_fin = is_eos[:, :k] & ~done[:, None] & cand_scores[:, :k].isfinite()
            if new_fin.any():
                new_raw = cand_scores[:, :k].masked_fill(~new_fin, neg_inf)
                new_norm = new_raw / length_penalty(t + 1, alpha)  # t + 1 tokens, eos included
                prefix = tokens[:, 1:].view(b, k, t).gather(1, cand_beam[:, :k, None].expand(b, k, t))
                new_tokens = torch.full((b, k, longest), pad_id, dtype=torch.long, device=device)
                new_tokens[:, :, :t] = prefix
                new_tokens[:, :, t] = eos_id
                fin_norm, keep = torch.cat([fin_norm, new_norm], dim=1).topk(k, dim=1)
                fin_raw = torch.cat([fin_raw, new_raw], dim=1).gather(1, keep)
                fin_tokens = torch.cat([fin_tokens, new_tokens], dim=1).gather(1, keep[:, :, None].expand(b, k, longest))
                done |= fin_norm[:, -1].isfinite()  # K finished hypotheses
                if done.all():
                    break
            # live beams: the best K candidates that did not end
            live_scores, pick = cand_scores.masked_fill(is_eos, neg_inf).topk(k, dim=1)
            parent_beam, live_token = cand_beam.gather(1, pick), cand_token.gather(1, pick)
        parent = (beam_offset + parent_beam).view(-1)
        tokens = torch.cat([tokens.index_select(0, parent), live_token.reshape(-1, 1)], dim=1)
        step.reorder(parent)

    best = fin_norm.argmax(dim=1)
    pick = torch.arange(b, device=device)
    out = fin_tokens[pick, best]
    width = int((out != pad_id).sum(dim=1).max()) if out.numel() else 0
    return Hypotheses(out[:, : max(width, 1)], fin_raw[pick, best], fin_norm[pick, best])
