"""POST /runs/{id}/telemetry: the ingest endpoint (decoded by hand for speed; see docs/wire-format.md)."""

from __future__ import annotations

import logging
import time
import zlib
from typing import Any

import numpy as np
from fastapi import APIRouter, HTTPException, Request, Response, status
from starlette.concurrency import run_in_threadpool

from monitor_server.api.deps import CtxDep, IngestDep, RunId
from monitor_server.commands import CommandError, command_public
from monitor_server.context import AppContext
from monitor_server.ingest import UnknownRun, decode_batch, parse_json, store_batch
from monitor_server.schemas import TelemetryResult
from monitor_server.wire import WireError, dumps, encode_float, iso_dates, jsonable

log = logging.getLogger("fp8scope.monitor")
router = APIRouter(prefix="/runs", tags=["telemetry"])

TELEMETRY_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TelemetryBatch"}}},
    }
}


def _step_summaries(batch: Any) -> list[dict[str, Any]]:
    """Per stored step: loss, max amax over tensors and total overflow / nonfinite counts (for SSE); the
    statistics are None for a step that carried none (no FP8 layer ran in it, or a run without tensors)."""
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
        }
        for i, s in enumerate(batch.steps.tolist())
    ]


def gunzip_body(body: bytes, max_bytes: int) -> bytes:
    """Decompress a `Content-Encoding: gzip` body, refusing more than `max_bytes` decompressed (413)."""
    d = zlib.decompressobj(wbits=31)
    try:
        out = d.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"malformed gzip body: {exc}") from None
    if len(out) > max_bytes or d.unconsumed_tail:
        raise HTTPException(
            413,
            f"decompressed request body exceeds the limit of {max_bytes} bytes",
        )
    if not d.eof:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "malformed gzip body: truncated")
    if d.unused_data:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "malformed gzip body: data after the gzip stream")
    return out


def ingest(ctx: AppContext, run_id: RunId, body: bytes) -> dict[str, Any]:
    """Decode, store and post-process one batch; runs in a worker thread.

    Raises:
        HTTPException: 400 malformed JSON, 404 unknown run, 422 invalid content (nothing written).
    """
    started = time.perf_counter()
    try:
        payload = parse_json(body)
    except WireError as exc:
        ctx.metrics.batches.labels("rejected").inc()
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from None
    with ctx.db.read_session() as session:
        meta = ctx.run_meta.get(session, run_id)
    if meta is None:
        ctx.metrics.batches.labels("rejected").inc()
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found")
    try:
        batch = decode_batch(payload, meta.num_tensors)
    except WireError as exc:
        ctx.metrics.batches.labels("rejected").inc()
        raise HTTPException(422, str(exc)) from None
    with ctx.db.run_lock(run_id):
        try:
            with ctx.db.write() as session:
                result = store_batch(session, run_id, batch, meta.fp8_max)
                delivered = [command_public(c) for c in result.commands]
                changed = [command_public(c) for c in result.changed_commands]
        except UnknownRun:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found") from None
        except CommandError as exc:
            ctx.metrics.batches.labels("rejected").inc()
            raise HTTPException(exc.status, exc.message) from None
        stored = len(result.new_steps.steps)
        ctx.metrics.batches.labels("duplicate" if result.duplicate else "stored").inc()
        ctx.metrics.steps.inc(stored)
        has_stats = result.new_steps.has_stats
        with_stats = stored if has_stats is None else int(np.sum(has_stats))
        ctx.metrics.values.inc(with_stats * meta.num_tensors * len(result.new_steps.stats))
        ctx.metrics.latency.observe(time.perf_counter() - started)
        if ctx.broker.has_subscribers(run_id):
            for summary in _step_summaries(result.new_steps):
                ctx.broker.publish(run_id, "step", summary)
            for command in changed:
                ctx.broker.publish(run_id, "command", iso_dates(command))
            if not result.duplicate:
                for event in batch.events:
                    ctx.broker.publish(run_id, "event", event)
        if any(c["state"] == "applied" for c in changed):
            ctx.detection.forget(run_id)  # rebuilt with the new recipe
        if not result.duplicate:
            try:
                ctx.detection.after_ingest(run_id, result.new_steps, batch.events)
            except Exception:  # the batch is stored; a detector fault must not fail the ingest
                log.exception("detectors failed on run %s", run_id)
    return {"stored_steps": stored, "duplicate": result.duplicate, "commands": delivered}


@router.post(
    "/{run_id}/telemetry",
    response_model=TelemetryResult,
    openapi_extra=TELEMETRY_BODY,
    responses={
        400: {"description": "malformed JSON or gzip"},
        413: {"description": "body too large"},
        415: {"description": "unsupported Content-Encoding"},
    },
)
async def post_telemetry(run_id: RunId, request: Request, ctx: CtxDep, _principal: IngestDep) -> Response:
    """Store a batch of steps (statistics as columns), client events and command acks.

    The body may be gzip-compressed (`Content-Encoding: gzip`). Returns how many steps were newly stored,
    whether the idempotency key was seen before, and the run's unacknowledged commands (pending ones become
    delivered; delivered ones are sent again until acknowledged).
    """
    body = await request.body()
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding == "gzip":
        # up to max_body_bytes of inflating: off the event loop, like the decoding
        body = await run_in_threadpool(gunzip_body, body, ctx.settings.max_body_bytes)
    elif encoding != "identity":
        raise HTTPException(
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, f"Content-Encoding {encoding!r}: expected gzip or none"
        )
    result = await run_in_threadpool(ingest, ctx, run_id, body)
    result["commands"] = [jsonable(iso_dates(c)) for c in result["commands"]]
    return Response(dumps(result), media_type="application/json")
