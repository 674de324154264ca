"""Data passed between the ingest path and the detectors.

The ingest path (monitor_server's API layer) decodes a telemetry batch into a `StepBatch` and hands it to
a `DetectorEngine` (``monitor_server.detectors.engine``); the engine returns `Finding`s, which the API
layer turns into alerts (one open alert per kind and tensor, updated rather than duplicated).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Alert kinds the detectors raise.
ALERT_KINDS: tuple[str, ...] = (
    "nonfinite",
    "loss_spike",
    "overflow_burst",
    "underflow_excess",
    "amax_divergence",
    "scale_collapse",
    "stalled",
    "rank_divergence",
    "sqnr_drop",
)

SEVERITIES: tuple[str, ...] = ("info", "warning", "critical")


@dataclass
class StepBatch:
    """A run of consecutive telemetry steps, decoded.

    Attributes:
        steps: (S,) int64 step numbers, ascending.
        scalars: name -> (S,) float64 (loss, lr, grad_norm, tokens_per_s, ...); NaN where a step lacks it.
        stats: one of `fp8_protocol.stats.STAT_COLUMNS` -> (S, T) float64 indexed by tensor index; NaN and
            ±inf are real values.
        present: optional, scalar name -> (S,) bool, True where the step carried that scalar. It tells a real
            NaN (e.g. a NaN loss, reported as non-finite) from a missing value; without it a NaN scalar is
            taken as missing.
        has_stats: optional (S,) bool, False for a step that carried scalars only (no FP8 layer ran in it:
            its `stats` rows are NaN placeholders, not values); None: every step carried statistics.
    """

    steps: np.ndarray
    scalars: dict[str, np.ndarray] = field(default_factory=dict)
    stats: dict[str, np.ndarray] = field(default_factory=dict)
    present: dict[str, np.ndarray] = field(default_factory=dict)
    has_stats: np.ndarray | None = None

    def segments(self) -> list[StepBatch]:
        """The batch cut into runs of consecutive steps that all carry statistics or all do not (the
        latter with no `stats`), in step order; the batch itself when every step carries them."""
        if self.has_stats is None or bool(np.all(self.has_stats)):
            return [self]
        flags = np.asarray(self.has_stats, dtype=bool)
        cuts = np.flatnonzero(flags[1:] != flags[:-1]) + 1
        out = []
        for lo, hi in zip(np.r_[0, cuts].tolist(), np.r_[cuts, flags.size].tolist(), strict=True):
            out.append(
                StepBatch(
                    steps=self.steps[lo:hi],
                    scalars={k: v[lo:hi] for k, v in self.scalars.items()},
                    stats={k: v[lo:hi] for k, v in self.stats.items()} if flags[lo] else {},
                    present={k: v[lo:hi] for k, v in self.present.items()},
                )
            )
        return out


@dataclass(frozen=True)
class Finding:
    """Something a detector saw. The API layer stores it as an alert keyed by (run, kind, tensor_index).

    `evidence` must be JSON-serialisable with non-finite floats spelled as the strings "NaN",
    "Infinity" and "-Infinity" (see `fp8_protocol.codec.encode_float`). `onset` is the step the condition
    began when a rule waited for several consecutive steps before firing at `step` (None: the same as
    `step`).
    """

    kind: str
    step: int
    severity: str
    message: str
    tensor_index: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    onset: int | None = None

    @property
    def onset_step(self) -> int:
        """The step the condition began."""
        return self.step if self.onset is None else self.onset


#: Where a scaled value stops rounding to the FP8 max and saturates (the runtime's overflow threshold):
#: above 464 for e4m3 (464 ties to even, 448), at or above 61440 for e5m2 (ties to 65536). Up to there
#: ``amax * scale`` above FP8_MAX loses nothing: a headroom in [log2(FP8_MAX / threshold), 0) is no
#: saturation.
FP8_ROUNDING_THRESHOLD: dict[str, float] = {"e4m3": 464.0, "e5m2": 61440.0}
