"""Cached, immutable facts about a run: its tensors, their FP8 maxima and its layers."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from fp8_protocol.stats import FP8_MAX
from monitor_server.detectors.types import TensorMeta
from monitor_server.models import Run, TensorRow


@dataclass(frozen=True)
class RunMeta:
    """A run's registered tensors (sorted by index), per-tensor FP8 max and layer names in layer order."""

    run_id: int
    tensors: tuple[TensorMeta, ...]
    fp8_max: np.ndarray
    layers: tuple[str, ...]
    #: the token name that registered the run (see `Run.owner`)
    owner: str | None = None

    @property
    def num_tensors(self) -> int:
        """T, the number of tensors (and the length of every statistic column)."""
        return len(self.tensors)


def build_meta(run_id: int, tensors: list[TensorMeta], owner: str | None = None) -> RunMeta:
    """RunMeta from a tensor list (any order)."""
    ordered = tuple(sorted(tensors, key=lambda t: t.index))
    layers = tuple(dict.fromkeys(t.layer for t in ordered))
    fp8_max = np.array([FP8_MAX[t.format] for t in ordered], dtype=np.float64)
    return RunMeta(run_id, ordered, fp8_max, layers, owner)


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

    def get(self, session: Session, run_id: int) -> RunMeta | None:
        """The run's meta, loading it once; None when the run does not exist. A run without FP8 (a
        baseline) has no tensors: its columns are empty and only its scalars are stored."""
        with self._lock:
            meta = self._cache.get(run_id)
            if meta is not None:
                self._cache.move_to_end(run_id)
                return meta
        rows = session.execute(
            select(TensorRow).where(TensorRow.run_id == run_id).order_by(TensorRow.index)
        ).scalars()
        tensors = [
            TensorMeta(index=r.index, name=r.name, layer=r.layer, role=r.role, format=r.format) for r in rows
        ]
        owner = session.execute(select(Run.id, Run.owner).where(Run.id == run_id)).first()
        if owner is None:
            return None
        meta = build_meta(run_id, tensors, owner[1])
        with self._lock:
            self._cache[run_id] = meta
            while len(self._cache) > self.max_runs:
                self._cache.popitem(last=False)  # the run used longest ago
        return meta
