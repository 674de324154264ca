"""Episode bookkeeping shared by the per-tensor detectors, vectorised over (steps, tensors).

An *episode* is a maximal run of consecutive steps in which a tensor's condition holds (e.g. "more than
0.1% of elements saturated"). A detector fires at most once per episode, at the first step where its
trigger holds (e.g. "the episode is 3 steps long"), so a persistent problem updates one alert instead of
raising one per step. Run lengths and "already fired" flags carry over between batches.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def run_lengths(mask: np.ndarray, carry_run: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Length of the current episode at each step.

    Args:
        mask: (S, T) bool, condition holds.
        carry_run: (T,) int, episode length at the end of the previous batch.

    Returns:
        run: (S, T) int64, 0 where the condition does not hold.
        last_false: (S, T) int64, index of the latest step <= s without the condition, -1 if none
            in this batch.
    """
    s = mask.shape[0]
    idx = np.arange(s, dtype=np.int64)[:, None]
    last_false = np.maximum.accumulate(np.where(mask, -1, idx), axis=0)
    run = idx - last_false + np.where(last_false < 0, carry_run[None, :], 0)
    return run, last_false


def onsets(
    mask: np.ndarray, trigger: np.ndarray, last_false: np.ndarray, carry_fired: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Steps where `trigger` holds for the first time within its episode.

    Args:
        mask: (S, T) bool episode condition; trigger: (S, T) bool (only counted where mask holds).
        last_false: from `run_lengths`; carry_fired: (T,) bool, fired in the episode open at the batch start.

    Returns:
        fire: (S, T) bool; fired: (T,) bool to carry into the next batch.
    """
    trig = trigger & mask
    count = np.cumsum(trig, axis=0, dtype=np.int64)
    base = np.take_along_axis(count, np.maximum(last_false, 0), axis=0)
    base = np.where(last_false >= 0, base, 0)
    before = (count - trig - base) > 0
    before |= (last_false < 0) & carry_fired[None, :]
    fire = trig & ~before
    fired = mask[-1] & (before[-1] | trig[-1]) if mask.shape[0] else carry_fired
    return fire, fired


def advance(
    mask: np.ndarray,
    run: np.ndarray,
    fired: list[np.ndarray],
    triggers: Callable[[np.ndarray, np.ndarray], list[np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """One batch of episode bookkeeping, touching only tensors with an episode in this batch or one still open
    (the others stay at run 0, not fired), which keeps healthy batches cheap.

    Args:
        mask: (S, T) bool episode condition.
        run: (T,) int64 carried episode lengths; updated in place.
        fired: (T,) bool carried "fired in this episode" flags, one per trigger; updated in place.
        triggers: (run (S, C), cols (C,)) -> one (S, C) bool trigger per `fired` entry.

    Returns:
        cols (C,) tensor indices, run (S, C), and per trigger the (S, C) bool steps where it fires.
    """
    cols = np.flatnonzero(mask.any(axis=0) | (run > 0))
    if cols.size == 0:  # the common, healthy case
        for flags in fired:
            flags[:] = False
        empty = np.zeros((mask.shape[0], 0), dtype=bool)
        return cols, empty.astype(np.int64), [empty] * len(fired)
    sub = mask[:, cols]
    run_sub, last_false = run_lengths(sub, run[cols])
    fires = []
    for trig, flags in zip(triggers(run_sub, cols), fired, strict=True):
        fire, flags_sub = onsets(sub, trig, last_false, flags[cols])
        flags[:] = False
        flags[cols] = flags_sub
        fires.append(fire)
    run[:] = 0
    if sub.shape[0]:
        run[cols] = run_sub[-1]
    return cols, run_sub, fires
