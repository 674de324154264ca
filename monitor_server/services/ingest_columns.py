"""The statistics columns of a telemetry batch as its steps are decoded: which columns a step may carry
(every base column; the quality and the block columns each all or none) and the (S, T) matrices they fill.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fp8_protocol.codec import WireError, decode_column
from fp8_protocol.stats import (
    BASE_COLUMNS,
    BLOCK_COLUMNS,
    LEGACY_BLOCK_COLUMNS,
    QUALITY_COLUMNS,
    stored_amax,
)
from monitor_server.storage.block_hist import HistEntry, decode_block_hist

_BASE_SET = frozenset(BASE_COLUMNS)
_QUALITY_SET = frozenset(QUALITY_COLUMNS)
_BLOCK_SET = frozenset(BLOCK_COLUMNS)
_LEGACY_BLOCK_SET = frozenset(LEGACY_BLOCK_COLUMNS)  # an older sender's block columns (no blocks_zero)
_ALL_COLUMNS = _BASE_SET | _QUALITY_SET | _BLOCK_SET


class StatsTable:
    """The batch's statistics as its steps are decoded: one (S, T) float64 matrix per column the steps
    carry (NaN where a step carries none), which steps carried statistics, which the quality columns, and
    the block histograms by step number.

    Every step with statistics carries the same columns, the quality columns aside: a step may leave them
    out (a sampling schedule), and the first step that carries them adds their matrices."""

    def __init__(self, num_steps: int, num_tensors: int) -> None:
        self.shape = (num_steps, num_tensors)
        self.columns: frozenset[str] | None = None  # the statistics the batch's steps carry
        self.stats: dict[str, np.ndarray] = {}
        self.has_stats = np.ones(num_steps, dtype=bool)
        self.carried_quality = np.zeros(num_steps, dtype=bool)  # per step: it carried the quality columns
        self.block_hist: dict[int, list[HistEntry]] = {}

    def add_step(self, i: int, step: int, entry: dict[str, Any], where: str) -> None:
        """Decode step `i`'s ``stats`` (and ``block_hist``) into row `i`; a step without them is one in
        which no FP8 layer ran: its scalars only."""
        if "stats" not in entry:
            if "block_hist" in entry:
                raise WireError(f"{where}.block_hist: sent without the step's stats")
            self.has_stats[i] = False
            return
        st = entry["stats"]
        if not isinstance(st, dict):
            raise WireError(f"{where}.stats: an object with columns {list(BASE_COLUMNS)} (or left out)")
        keys = stat_columns(frozenset(st), where)
        columns = self._admit(keys, where)
        self.carried_quality[i] = bool(keys & _QUALITY_SET)
        for name in keys:
            self.stats[name][i] = decode_column(st[name], self.shape[1], f"{where}.stats.{name}")
        if "block_hist" in entry:
            self._add_block_hist(step, entry["block_hist"], columns, where)

    def _admit(self, keys: frozenset[str], where: str) -> frozenset[str]:
        """Check a step's columns against the batch's so far, adding matrices for the columns new in it;
        the batch's columns, this step's included."""
        columns = self.columns
        if columns is None:
            columns = self.columns = keys
            self.stats = {name: np.full(self.shape, np.nan) for name in keys}
        elif keys - _QUALITY_SET != columns - _QUALITY_SET:
            raise WireError(
                f"{where}.stats: columns {sorted(keys)} differ from the batch's first step {sorted(columns)}"
                " (every step of a batch carries the same statistics, the quality columns aside: a step"
                " may leave them out, e.g. on a sampling schedule)"
            )
        elif not keys <= columns:  # the quality columns, first in this step: NaN (absent) in the earlier ones
            columns = self.columns = columns | keys
            self.stats.update({name: np.full(self.shape, np.nan) for name in keys - set(self.stats)})
        return columns

    def _add_block_hist(self, step: int, value: Any, columns: frozenset[str], where: str) -> None:
        """A step's block scale histograms, sent only where the batch carries the block statistics."""
        if not columns >= _LEGACY_BLOCK_SET:
            raise WireError(
                f"{where}.block_hist: sent without the block statistics {list(BLOCK_COLUMNS)}"
                " in the step's stats"
            )
        entries = decode_block_hist(value, self.shape[1], f"{where}.block_hist")
        if entries:
            self.block_hist[step] = entries

    def finish(self) -> None:
        """The base columns' NaN matrices when no step carried statistics; otherwise the amax as stored: a
        tensor gone all NaN has no amax (NaN, not the 0 of an amax that ignores NaN)."""
        if self.columns is None:
            self.stats = {name: np.full(self.shape, np.nan) for name in BASE_COLUMNS}
        else:
            self.stats["amax"] = stored_amax(self.stats["amax"], self.stats["numel"], self.stats["nonfinite"])

    def reorder(self, order: np.ndarray) -> None:
        """Put the rows in the order of the batch's sorted steps."""
        self.stats = {name: m[order] for name, m in self.stats.items()}
        self.has_stats = self.has_stats[order]
        self.carried_quality = self.carried_quality[order]

    def quality_present(self) -> np.ndarray | None:
        """Per step, whether it carried the quality columns, when some steps with statistics did and others
        did not; None when they all carried the same columns."""
        carried = self.carried_quality
        return carried if carried.any() and not carried[self.has_stats].all() else None


def stat_columns(keys: frozenset[str], where: str) -> frozenset[str]:
    """The statistics a step carries: every base column, and the quality and the block columns each all or
    none."""
    unknown = sorted(keys - _ALL_COLUMNS)
    if unknown:
        raise WireError(f"{where}.stats: unknown statistic(s) {unknown}")
    missing = sorted(_BASE_SET - keys)
    if missing:
        raise WireError(f"{where}.stats: missing statistic(s) {missing}")
    for kind, group in (("quality", QUALITY_COLUMNS), ("block", BLOCK_COLUMNS)):
        present = keys & frozenset(group)
        if present == _LEGACY_BLOCK_SET:  # an older sender's: every block column but blocks_zero
            continue
        if present and len(present) != len(group):
            raise WireError(
                f"{where}.stats: the {kind} statistics {list(group)} come all together or not at all;"
                f" missing {sorted(frozenset(group) - keys)}"
            )
    return keys
