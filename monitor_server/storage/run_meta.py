"""Cached, immutable facts about a run: its tensors, their FP8 maxima and its layers.

A cached entry is keyed by the run's id *and* its creation stamp, checked against the database on every
use: a run deleted (here or by another process on the same database) is never served from the cache, and a
row that comes back under the same id (a database restored or recreated under a running server) never
matches the meta of the run that had the id before.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from fp8_protocol.stats import FP8_MAX
from fp8_protocol.tensors import TensorInfo
from monitor_server.storage.models import Run, TensorRow, as_utc


@dataclass(frozen=True)
class RunMeta:
    """A run's registered tensors (sorted by index), per-tensor FP8 max and layer names in layer order."""

    run_id: int
    tensors: tuple[TensorInfo, ...]
    fp8_max: np.ndarray
    layers: tuple[str, ...]
    #: the token name that registered the run (see `Run.owner`)
    owner: str | None = None
    #: the run's `created_at`: with the id, what names this run and no other that may get its id
    created_at: datetime | None = None

    @property
    def num_tensors(self) -> int:
        """T, the number of tensors (and the length of every statistic column)."""
        return len(self.tensors)


def build_meta(
    run_id: int, tensors: list[TensorInfo], owner: str | None = None, created_at: datetime | None = None
) -> RunMeta:
    """RunMeta from a tensor list (any order)."""
    ordered = tuple(sorted(tensors, key=lambda t: t.index))
    layers = tuple(dict.fromkeys(t.layer for t in ordered))
    fp8_max = np.array([FP8_MAX[t.format] for t in ordered], dtype=np.float64)
    return RunMeta(run_id, ordered, fp8_max, layers, owner, as_utc(created_at))


def _stamp(session: Session, run_id: int) -> tuple[str | None, datetime | None] | None:
    """(owner, created_at) of the run as the database has it now; None when there is no such run."""
    row = session.execute(select(Run.owner, Run.created_at).where(Run.id == run_id)).first()
    return None if row is None else (row[0], as_utc(row[1]))


def is_current(session: Session, meta: RunMeta) -> bool:
    """True when `meta` describes the run that has its id in the database now (for a write transaction
    about to store rows shaped by it)."""
    found = _stamp(session, meta.run_id)
    return found is not None and found[1] == meta.created_at


class RunMetaCache:
    """Process-wide cache of `RunMeta` (tensors never change after a run is created), of the `max_runs`
    runs used last: a server that sees many runs over its life holds only the active ones."""

    def __init__(self, max_runs: int = 256) -> None:
        self._cache: OrderedDict[int, RunMeta] = OrderedDict()
        self._lock = threading.Lock()
        self.max_runs = max_runs

    def __len__(self) -> int:
        return len(self._cache)

    def forget(self, run_id: int) -> None:
        """Drop a run's meta (a finished run; it is loaded again if still asked for)."""
        with self._lock:
            self._cache.pop(run_id, None)

    def peek(self, run_id: int) -> RunMeta | None:
        """The run's cached meta as it was last validated, without reading the database (None: not cached).
        For a check that `get` repeats before anything is stored: the owner check that admits a request
        before its body is read costs no database round trip while the run is cached."""
        with self._lock:
            return self._cache.get(run_id)

    def get(self, session: Session, run_id: int) -> RunMeta | None:
        """The run's meta, its tensors loaded once per run; None when the run does not exist. The run's
        row is read on every call (one primary-key lookup): a cached entry serves only the run created at
        the stamp it was built from. A run without FP8 (a baseline) has no tensors: its columns are empty
        and only its scalars are stored."""
        found = _stamp(session, run_id)
        with self._lock:
            meta = self._cache.get(run_id)
            if meta is not None and found is not None and meta.created_at == found[1]:
                self._cache.move_to_end(run_id)
                return meta
            if meta is not None:  # deleted, or another run now has the id: never serve it again
                del self._cache[run_id]
        if found is None:
            return None
        rows = session.execute(
            select(TensorRow).where(TensorRow.run_id == run_id).order_by(TensorRow.index)
        ).scalars()
        tensors = [
            TensorInfo(index=r.index, name=r.name, layer=r.layer, role=r.role, format=r.format) for r in rows
        ]
        meta = build_meta(run_id, tensors, found[0], found[1])
        with self._lock:
            self._cache[run_id] = meta
            while len(self._cache) > self.max_runs:
                self._cache.popitem(last=False)  # the run used longest ago
        return meta
