"""What happens to a telemetry batch once it is decoded: it is stored in one transaction under the run's
lock (`monitor_server.services.ingest.store_batch`), counted in the metrics, published to the run's stream (a
summary per new step, the commands whose state changed, the client events) and handed to the alert service
(`monitor_server.services.alerting`), which runs the detectors on the new steps.

The route (`monitor_server/api/routes/telemetry.py`) reads, inflates and decodes the body and turns the
outcome, or the errors below, into the HTTP answer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8_protocol.codec import WireError, encode_float
from monitor_server.core.db import Database
from monitor_server.detectors.types import StepBatch
from monitor_server.infra.events import EventBroker
from monitor_server.infra.metrics import Metrics
from monitor_server.services.alerting import AlertService
from monitor_server.services.client_events import event_light
from monitor_server.services.commands import CommandError, command_public
from monitor_server.services.ingest import DecodedBatch, UnknownRun, store_batch
from monitor_server.storage.run_meta import RunMeta, is_current

log = logging.getLogger("fp8scope.monitor")


@dataclass(frozen=True)
class IngestOutcome:
    """What storing a batch did, as the telemetry answer reports it."""

    #: steps newly stored (those stored before are skipped)
    stored_steps: int
    #: the batch's idempotency key was seen before: nothing was stored
    duplicate: bool
    #: the run's unacknowledged commands (`command_public`), for the training job to apply
    commands: list[dict[str, Any]]


def step_summaries(batch: StepBatch, steps_stored: int) -> list[dict[str, Any]]:
    """Per stored step: loss, max amax over tensors and total overflow / nonfinite counts (for SSE); the
    statistics are None for a step that carried none (no FP8 layer ran in it, or a run without tensors).
    `steps_stored` (the run's count with the whole batch) gives each its count once it was stored."""
    S = len(batch.steps)
    if not S:
        return []
    amax = batch.stats.get("amax")
    with_stats = np.ones(S, bool) if batch.has_stats is None else np.asarray(batch.has_stats, bool)
    if amax is None or amax.shape[1] == 0:
        with_stats = np.zeros(S, bool)
        max_amax = overflow = nonfinite = np.zeros(S)
    else:
        max_amax = np.max(amax, axis=1)
        overflow = np.sum(batch.stats["overflow"], axis=1)
        nonfinite = np.sum(batch.stats["nonfinite"], axis=1)
    loss = batch.scalars.get("loss")
    return [
        {
            "step": int(s),
            "loss": encode_float(loss[i]) if loss is not None else None,
            "max_amax": encode_float(max_amax[i]) if with_stats[i] else None,
            "overflow": encode_float(overflow[i]) if with_stats[i] else None,
            "nonfinite": encode_float(nonfinite[i]) if with_stats[i] else None,
            "steps_stored": steps_stored - (S - 1 - i),
        }
        for i, s in enumerate(batch.steps.tolist())
    ]


def ingest_batch(
    *,
    db: Database,
    metrics: Metrics,
    broker: EventBroker,
    detection: AlertService,
    max_scalar_names: int,
    run_id: int,
    meta: RunMeta,
    batch: DecodedBatch,
    started: float,
) -> IngestOutcome:
    """Store one decoded batch and post-process it (metrics, stream, detectors); runs in a worker thread.

    Args:
        detection: the alert service, handed the new steps and events.
        max_scalar_names: the most distinct scalar names the run may have (``max_scalar_names_per_run``).
        started: `time.perf_counter()` when the request arrived (for the ingest latency metric).

    Raises:
        monitor_server.services.ingest.UnknownRun: no such run (nothing written).
        CommandError: an ack names an unknown command (nothing written; counted as a rejected batch).
        WireError: the batch would take the run past ``max_scalar_names_per_run`` (nothing written).
        monitor_server.core.db.LockTimeout: the run (or SQLite's write lock) stayed busy for
            ``run_lock_wait_seconds`` (nothing written; the client sends the batch again).
    """
    with db.run_lock(run_id):
        try:
            with db.write(bounded=True) as session:
                if not is_current(session, meta):  # deleted, or the id names another run since decoding
                    raise UnknownRun(run_id)
                result = store_batch(session, run_id, batch, meta.fp8_max, max_scalar_names=max_scalar_names)
                delivered = [command_public(c) for c in result.commands]
                changed = [command_public(c) for c in result.changed_commands]
        except (CommandError, WireError):
            metrics.batches.labels("rejected").inc()
            raise
        stored = len(result.new_steps.steps)
        metrics.batches.labels("duplicate" if result.duplicate else "stored").inc()
        metrics.steps.inc(stored)
        has_stats = result.new_steps.has_stats
        with_stats = stored if has_stats is None else int(np.sum(has_stats))
        metrics.values.inc(with_stats * meta.num_tensors * len(result.new_steps.stats))
        metrics.latency.observe(time.perf_counter() - started)
        if broker.has_subscribers(run_id):
            # one publication per kind: a batch of 1,500 events is one hop onto the event loop, not 1,500
            broker.publish_many(run_id, "step", step_summaries(result.new_steps, result.steps_stored))
            broker.publish_many(run_id, "command", changed)
            if not result.duplicate:  # light, as lists show them: a stream never carries megabytes
                broker.publish_many(run_id, "event", [event_light(e) for e in result.events])
        if not result.duplicate:
            try:
                # the events as stored: a client alert's evidence names its event by id
                detection.after_ingest(run_id, result.new_steps, result.events)
            except Exception:  # the batch is stored; a detector fault must not fail the ingest
                log.exception("detectors failed on run %s; the batch is run again with the next one", run_id)
    return IngestOutcome(stored, result.duplicate, delivered)
