"""Interleaved rounds: several variants of one workload timed turn by turn, so that a slow moment of the machine
(another process, clocks, a thermal step) hits every variant instead of whichever happened to run then.

Each round times every variant for the same number of calls; the order rotates by one each round (two variants:
A B, B A, A B, ...), so no variant is always first after the previous round's last. On CUDA each timing is
bracketed by two CUDA events on the current stream and the host waits on the end event only (the start is
recorded in stream order, nothing else is synchronised); on a CPU by ``time.perf_counter`` after a
synchronisation. Ratios between variants are taken within a round, then summarised over the rounds by their
median and spread (:func:`spread`).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable

import torch


def time_calls(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Seconds that ``calls`` calls of ``fn()`` take on ``device``: CUDA events on the GPU, the host clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - began


def round_orders(names: list, rounds: int) -> list[list]:
    """The order of each round: ``names`` rotated by one more each round (two names: alternating)."""
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)]


def timed_rounds(variants: dict[Hashable, Callable[[], object]], rounds: int, calls: int,
                 device: torch.device) -> tuple[dict[Hashable, list[float]], list[list]]:
    """(seconds of ``calls`` calls per round for each variant, the order of each round). Warm the variants up
    first: every round is timed."""
    if rounds < 1 or calls < 1:
        raise ValueError(f"rounds and calls must be at least 1, got rounds={rounds}, calls={calls}")
    orders = round_orders(list(variants), rounds)
    seconds: dict[Hashable, list[float]] = {name: [] for name in variants}
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the warm-up's work is not the first round's
    for order in orders:
        for name in order:
            seconds[name].append(time_calls(variants[name], calls, device))
    return seconds, orders


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max and quartiles (``statistics.quantiles``, inclusive) of per-round values."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "q1": q1, "q3": q3}
