"""Modes of one benchmark timed in interleaved blocks, so that drift of the machine hits every mode alike.

Each round runs every mode's block of steps, in the listed order on even rounds and reversed on odd ones;
``paired`` compares two modes by the median over rounds of the ratio of their block means in the same round,
which a slow minute of the machine moves far less than a ratio of overall means.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["Timings", "interleave"]


class Timings:
    """Every step's seconds per mode, and per round each mode's block mean."""

    def __init__(self, modes: tuple[str, ...]):
        self.steps: dict[str, list[float]] = {m: [] for m in modes}
        self.rounds: list[dict[str, float]] = []

    def median(self, mode: str) -> float:
        return statistics.median(self.steps[mode])

    def mean(self, mode: str) -> float:
        return statistics.fmean(self.steps[mode])

    def paired(self, a: str, b: str) -> float:
        """Median over rounds of ``a``'s block mean over ``b``'s in the same round."""
        return statistics.median(r[a] / r[b] for r in self.rounds)


def interleave(steps: dict[str, Callable[[], float]], rounds: int, block: int, pause: float = 0.0) -> Timings:
    """``rounds`` rounds of ``block`` calls of each mode's ``step`` (which returns its own seconds), with
    ``pause`` seconds after each block (untimed: background work of a mode finishes outside the next)."""
    modes = tuple(steps)
    got = Timings(modes)
    for r in range(rounds):
        this = {}
        for m in modes if r % 2 == 0 else modes[::-1]:
            times = [steps[m]() for _ in range(block)]
            got.steps[m] += times
            this[m] = statistics.fmean(times)
            if pause:
                time.sleep(pause)
        got.rounds.append(this)
    return got
