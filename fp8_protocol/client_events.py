"""The events a training job sends beside its steps (a telemetry batch's ``"events"``), as both sides
build and read them.

An event is ``{"kind": KIND, "step": STEP, "details": {...}}`` (`ClientEvent`), ``details`` free-form JSON
with non-finite floats spelled as on the wire (`fp8_protocol.codec`). The kinds:

* ``loss_spike``: the client's loss-spike rule fired (`fp8_protocol.loss_spike`), details with its flight
  recorder;
* ``nonfinite``: a non-finite loss or statistic, seen first by the client;
* ``rank_amax``: every data-parallel rank's own amax of every tensor at a sampled step (`rank_amax_details`,
  read back by `parse_rank_amax`);
* ``custom``: anything else the job sends (``Monitor.event``), with ``details["name"]`` the job's own kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

import numpy as np

from fp8_protocol.codec import decode_float, encode_float

LOSS_SPIKE_EVENT = "loss_spike"
NONFINITE_EVENT = "nonfinite"
RANK_AMAX_EVENT = "rank_amax"
CUSTOM_EVENT = "custom"
#: The kinds of client events, the only ones the service accepts.
EVENT_KINDS: tuple[str, ...] = (LOSS_SPIKE_EVENT, NONFINITE_EVENT, RANK_AMAX_EVENT, CUSTOM_EVENT)
#: The fields of an event; ``details`` may be left out (an empty object).
EVENT_FIELDS: frozenset[str] = frozenset({"kind", "step", "details"})


class ClientEvent(TypedDict):
    """One client event as it travels."""

    kind: str
    step: int
    details: dict[str, Any]


def rank_amax_details(amax: Sequence[Sequence[float]]) -> dict[str, Any]:
    """The details of a ``rank_amax`` event: ``{"world_size": W, "amax": [[T wire floats] x W]}``, one row
    per rank (each rank's own amax of every tensor, before any reduction)."""
    return {"world_size": len(amax), "amax": [[encode_float(v) for v in row] for row in amax]}


def parse_rank_amax(details: dict[str, Any], n_tensors: int) -> np.ndarray:
    """The (W, T) float64 amax matrix of a ``rank_amax`` event; ValueError if it is malformed."""
    rows = details.get("amax")
    if not isinstance(rows, list) or len(rows) < 2:
        raise ValueError("rank_amax: 'amax' must be a list of at least two per-rank lists")
    world = details.get("world_size", len(rows))
    if isinstance(world, bool) or not isinstance(world, int) or world != len(rows):
        raise ValueError(f"rank_amax: world_size {world} but {len(rows)} rows")
    out = np.empty((len(rows), n_tensors), dtype=np.float64)
    for r, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != n_tensors:
            raise ValueError(f"rank_amax: row {r} must hold {n_tensors} values")
        try:
            out[r] = [decode_float(v) for v in row]  # null and booleans are no amax: refused
        except ValueError:
            raise ValueError(f"rank_amax: row {r} holds a value that is not a number") from None
    return out
