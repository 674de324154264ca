"""The detection side of the alert service (`monitor_server.services.alerting`): the detector engines of
the runs used last, each rebuilt when needed from the state checkpointed in `runs.detector_state`.

An engine is rebuilt after a restart, after eviction, or when `runs.detector_version` (bumped by every
batch) says another server instance sharing the database has run the detectors since; a rebuilt engine
runs the steps stored after its checkpoint again (`monitor_server.services.detector_replay`). The state
is written back every few batches (`CHECKPOINT_BATCHES`, ...), not after every one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from monitor_server.core.db import Database
from monitor_server.detectors.engine import DetectorConfig, DetectorEngine
from monitor_server.services import commands as command_ops
from monitor_server.services.detector_replay import stored_batches
from monitor_server.services.incidents import TensorOrder
from monitor_server.storage.models import Run
from monitor_server.storage.run_meta import RunMeta, RunMetaCache

log = logging.getLogger("fp8scope.monitor")

#: A run's detector state is written back (checkpointed) once this many batches, steps or seconds have
#: gone by since it last was; `detector_version` is bumped after every batch. An engine restored from an
#: older checkpoint runs the steps stored since again (`monitor_server.services.detector_replay`). A
#: 512-tensor state is ~0.5 MB: written after every batch, it was the largest single cost of ingesting a
#: one-step batch.
CHECKPOINT_BATCHES = 16
CHECKPOINT_STEPS = 32
CHECKPOINT_SECONDS = 10.0
#: the key of a checkpoint that holds the `detector_version` it was written at (a state without it was
#: written after every batch, by an older version of this code: it is current)
CHECKPOINT_VERSION_KEY = "checkpoint_version"


@dataclass
class _CachedEngine:
    """A run's engine, the `detector_version` it stands at, its recipe, and what of it is not written back:
    batches and steps processed, and the time, since its last checkpoint."""

    engine: DetectorEngine
    version: int
    recipe: dict[str, Any]
    unsaved_batches: int = 0
    saved_step: int | None = None
    saved_at: float = 0.0

    def checkpoint_due(self, now: float, every: tuple[int, int, float]) -> bool:
        """Whether its state should be written back with the batch it just processed; `every`: (batches,
        steps, seconds) since the last write, that batch included."""
        batches, steps, seconds = every
        step = self.engine.last_step
        return (
            self.unsaved_batches + 1 >= batches
            or now - self.saved_at >= seconds
            or (step is not None and (self.saved_step is None or step - self.saved_step >= steps))
        )


def run_recipe(base: dict[str, Any] | None, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The recipe an engine runs with: the run's effective model recipe (every applied command) and its
    per-layer overrides."""
    effective = command_ops.effective_recipe(Run(recipe=base, recipe_overrides=overrides))
    layers: dict[str, Any] = (overrides or {}).get("layers", {})
    return {**effective["model"], "overrides": layers}


class EngineCache:
    """The engines of the runs used last (each holds per-tensor state, ~1 KB per tensor), at most
    `max_runs`; an evicted one is rebuilt from the last checkpoint and the steps stored since. Also caches
    each run's forward-then-backward tensor order (dropped with its engine)."""

    def __init__(self, config: DetectorConfig, run_meta: RunMetaCache, *, max_runs: int) -> None:
        self.config = config
        self.run_meta = run_meta
        self.max_runs = max_runs
        #: when a run's detector state is written back: (batches, steps, seconds) since it last was
        self.checkpoint_every: tuple[int, int, float] = (
            CHECKPOINT_BATCHES,
            CHECKPOINT_STEPS,
            CHECKPOINT_SECONDS,
        )
        self._engines: OrderedDict[int, _CachedEngine] = OrderedDict()
        self._orders: dict[int, tuple[RunMeta, TensorOrder]] = {}
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._engines)

    def runs(self) -> list[int]:
        """The runs whose engine is cached."""
        with self.lock:
            return list(self._engines)

    def engine_for(self, session: Session, run_id: int) -> DetectorEngine | None:
        """The engine of a run as its persisted state stands: the cached one when it was built from the
        current `detector_version` and recipe, else one built from the state; None for no run."""
        found = self.engine(session, run_id, lock=False)
        return None if found is None else found[0]

    def engine(
        self, session: Session, run_id: int, *, lock: bool, replay_to: int | None = None
    ) -> tuple[DetectorEngine, int] | None:
        """`engine_for` and the version it stands at; `lock` takes the run's row lock while reading (the
        caller advances the state and writes it back in the same transaction). An engine restored from a
        checkpoint older than the run's `detector_version` runs the steps stored since again, up to
        `replay_to` (default: the run's last step; a caller about to process stored steps stops before
        them)."""
        query = select(Run.detector_version, Run.recipe, Run.recipe_overrides, Run.last_step).where(
            Run.id == run_id
        )
        if lock:
            query = query.with_for_update()
        row = session.execute(query).first()
        if row is None:
            return None
        version: int = row[0]
        base, overrides, last_step = row[1], row[2], row[3]
        recipe = run_recipe(base, overrides)
        with self.lock:
            cached = self._engines.get(run_id)
            if cached is not None and cached.version == version:
                if cached.recipe != recipe:  # a recipe change was applied: the database's recipe is the truth
                    cached.engine.set_recipe(recipe)
                    cached.recipe = recipe
                self._engines.move_to_end(run_id)
                return cached.engine, version
        meta = self.run_meta.get(session, run_id)
        if meta is None:
            return None
        entry, behind = self._restore(session, run_id, meta, recipe, version)
        if behind:  # behind the batches processed since the checkpoint
            upto = last_step if replay_to is None or last_step is None else min(last_step, replay_to)
            if upto is not None:
                engine = entry.engine
                after, num_tensors = engine.last_step, len(meta.tensors)
                batches = stored_batches(
                    session, run_id=run_id, after=after, upto=upto, num_tensors=num_tensors
                )
                for batch in batches:
                    engine.process(batch)  # findings dropped: recorded when these steps first came
        with self.lock:
            self._engines[run_id] = entry
            self._engines.move_to_end(run_id)
            while len(self._engines) > self.max_runs:
                evicted, _ = self._engines.popitem(last=False)
                self._orders.pop(evicted, None)
        return entry.engine, version

    def _restore(
        self, session: Session, run_id: int, meta: RunMeta, recipe: dict[str, Any], version: int
    ) -> tuple[_CachedEngine, bool]:
        """An engine built from the run's checkpoint, and whether that checkpoint is older than `version`
        (then the steps since must be run again, and the state written back soon)."""
        state = session.scalar(select(Run.detector_state).where(Run.id == run_id))
        saved_version = version
        if isinstance(state, dict) and CHECKPOINT_VERSION_KEY in state:
            state = dict(state)
            saved = state.pop(CHECKPOINT_VERSION_KEY)
            saved_version = saved if isinstance(saved, int) else -1
        try:
            engine = DetectorEngine(self.config, list(meta.tensors), recipe, state)
        except ValueError:
            log.exception("run %s: persisted detector state unusable; starting afresh", run_id)
            engine = DetectorEngine(self.config, list(meta.tensors), recipe, None)
            saved_version = -1
        # the database's recipe (with every applied command) is the truth, also over a restored state
        engine.set_recipe(recipe)
        entry = _CachedEngine(engine, version, recipe, saved_step=engine.last_step, saved_at=time.monotonic())
        behind = saved_version != version
        if behind:
            entry.saved_step, entry.unsaved_batches = None, self.checkpoint_every[0]  # write it back soon
        return entry, behind

    def checkpoint_due(self, run_id: int) -> bool:
        """Whether the run's engine, about to be recorded with one more batch, should be written back."""
        with self.lock:
            cached = self._engines.get(run_id)
        return cached is None or cached.checkpoint_due(time.monotonic(), self.checkpoint_every)

    def advanced(self, run_id: int, engine: DetectorEngine, version: int, saved: bool) -> None:
        """The engine processed a batch now recorded as `version`: it stays the cached one (unless dropped
        meanwhile); `saved`: its state was written back with it."""
        with self.lock:
            cached = self._engines.get(run_id)
            if cached is not None and cached.engine is engine:
                cached.version = version
                if saved:
                    cached.unsaved_batches, cached.saved_step = 0, engine.last_step
                    cached.saved_at = time.monotonic()
                else:
                    cached.unsaved_batches += 1

    def flush(self, db: Database, run_id: int) -> bool:
        """Write back a cached engine's state if it has batches not written yet (and still stands at the
        run's `detector_version`); True if it wrote. Never raises: a failed write only means a longer replay
        on the next use."""
        with self.lock:
            cached = self._engines.get(run_id)
        if cached is None or not cached.unsaved_batches:
            return False
        try:
            with db.run_lock(run_id), db.write() as session:
                query = select(Run.detector_version).where(Run.id == run_id).with_for_update()
                if session.scalar(query) != cached.version:
                    return False
                state = {**cached.engine.state_dict(), CHECKPOINT_VERSION_KEY: cached.version}
                session.execute(update(Run).where(Run.id == run_id).values(detector_state=state))
        except Exception:
            log.warning("run %s: writing back the detector state failed", run_id, exc_info=True)
            return False
        self.advanced(run_id, cached.engine, cached.version, True)
        return True

    def forget(self, run_id: int) -> None:
        """Drop a cached engine (it is rebuilt from the persisted state on next use)."""
        with self.lock:
            self._engines.pop(run_id, None)
            self._orders.pop(run_id, None)

    def tensor_order(self, meta: RunMeta | None) -> TensorOrder:
        """The run's forward-then-backward positions (cached with its meta)."""
        if meta is None:
            return TensorOrder.of(None)
        cached = self._orders.get(meta.run_id)
        if cached is None or cached[0] is not meta:
            cached = (meta, TensorOrder.of(meta))
            self._orders[meta.run_id] = cached
        return cached[1]
