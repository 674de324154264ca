"""POST /runs/{id}/telemetry: the ingest endpoint. The body is inflated, counted and decoded here (by hand
for speed; see docs/wire-format.md); storing it and what follows is
`monitor_server.services.telemetry_service`."""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, HTTPException, Request, Response, status
from starlette.concurrency import run_in_threadpool

from fp8_protocol.codec import WireError
from monitor_server.api.context import AppContext
from monitor_server.api.deps import CtxDep, IngestDep, RunId
from monitor_server.api.responses import json_response
from monitor_server.core.db import LockTimeout
from monitor_server.core.security import check_owner
from monitor_server.infra.wire import JsonValueBudget
from monitor_server.services.commands import CommandError
from monitor_server.services.ingest import DecodedBatch, EventLimits, UnknownRun, decode_batch, parse_json
from monitor_server.services.telemetry_service import ingest_batch
from monitor_server.storage.run_meta import RunMeta
from monitor_server.storage.schemas import CommandPublic, TelemetryResult

router = APIRouter(prefix="/runs", tags=["telemetry"])

TELEMETRY_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TelemetryBatch"}}},
    }
}


def run_meta(ctx: AppContext, run_id: int) -> RunMeta | None:
    """The run's cached meta (None: no such run)."""
    with ctx.db.read_session() as session:
        return ctx.run_meta.get(session, run_id)


def decode_slots(ctx: AppContext) -> asyncio.Semaphore:
    """The app's semaphore bounding concurrent telemetry decoding (`decode_concurrency`)."""
    if ctx.decode_slots is None:
        ctx.decode_slots = asyncio.Semaphore(ctx.settings.decode_concurrency)
    return ctx.decode_slots


@asynccontextmanager
async def run_admission(ctx: AppContext, run_id: int) -> AsyncIterator[asyncio.Lock]:
    """Admit one telemetry request of `run_id` on this instance, from its arrival to its answer: at most
    ``run_batches_in_flight`` at once; one more gets 429 with Retry-After at once, before its body is read
    or parsed. A training job sends its batches one at a time, so only a flood (or a job sending in
    parallel) meets the bound; without it every batch of the flood would be read, parsed and queued, each
    costing the event loop and the worker threads that every other run and `/healthz` need. Yields the
    run's lock (its turn to store, `run_turn`)."""
    lock, admitted = ctx.run_turns.get(run_id) or (asyncio.Lock(), 0)
    limit = ctx.settings.run_batches_in_flight
    if admitted >= limit:
        raise HTTPException(
            429,
            f"run {run_id} has {admitted} telemetry batches in flight on this server, the limit"
            " (run_batches_in_flight); send them one at a time",
            headers={"Retry-After": "1"},
        )
    ctx.run_turns[run_id] = (lock, admitted + 1)
    try:
        yield lock
    finally:
        lock, admitted = ctx.run_turns[run_id]
        if admitted > 1:
            ctx.run_turns[run_id] = (lock, admitted - 1)
        else:
            del ctx.run_turns[run_id]


@asynccontextmanager
async def run_turn(ctx: AppContext, run_id: int, lock: asyncio.Lock) -> AsyncIterator[None]:
    """This instance's turn to store a batch of `run_id` (`lock`, from `run_admission`): batches of one
    run wait for each other here, on the event loop, at most ``run_lock_wait_seconds`` (then 503 with
    Retry-After), so that a run flooded with batches holds one worker thread, not every one of them."""
    wait = ctx.settings.run_lock_wait_seconds
    try:
        await asyncio.wait_for(lock.acquire(), wait)
    except TimeoutError:
        raise HTTPException(
            503, f"run {run_id} is busy (run_lock_wait_seconds={wait:g})", headers={"Retry-After": "1"}
        ) from None
    try:
        yield
    finally:
        lock.release()


#: inflating and counting go in pieces of this size, so a refused body is never held whole inflated
PIECE = 1 << 20


def over_budget(limit: int) -> HTTPException:
    """413 for a body with more JSON values than `limit` (the parse budget)."""
    return HTTPException(
        413,
        f"the body holds more JSON values than the parse budget of {limit} (max_json_elements); "
        "send smaller batches, or statistics as packed columns",
    )


def gunzip_body(body: bytes, max_bytes: int, max_values: int) -> bytearray:
    """Inflate a `Content-Encoding: gzip` body piece by piece, refusing (413) more than `max_bytes` inflated
    or more JSON values than `max_values` as soon as the pieces so far show it; 400 when malformed."""
    d = zlib.decompressobj(wbits=31)
    budget = JsonValueBudget(max_values)
    out = bytearray()
    data = body
    try:
        while not d.eof:
            piece = d.decompress(data, PIECE)
            data = d.unconsumed_tail
            if not piece and not data:
                break  # all input used and no end of stream: truncated
            out += piece
            if len(out) > max_bytes:
                raise HTTPException(
                    413, f"decompressed request body exceeds the limit of {max_bytes} bytes (max_body_bytes)"
                )
            if budget.over(piece):
                raise over_budget(max_values)
    except zlib.error as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"malformed gzip body: {exc}") from None
    if not d.eof:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "malformed gzip body: truncated")
    if d.unused_data:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "malformed gzip body: data after the gzip stream")
    return out


def check_budget(body: bytes, max_values: int) -> None:
    """413 when a plain body holds more JSON values than `max_values` (counted a piece at a time)."""
    budget = JsonValueBudget(max_values)
    view = memoryview(body)
    for start in range(0, len(body), PIECE):
        if budget.over(view[start : start + PIECE]):
            raise over_budget(max_values)


def decode(ctx: AppContext, run_id: RunId, body: bytes | bytearray) -> tuple[RunMeta, DecodedBatch]:
    """Parse and validate one batch against its run (its JSON values counted already); runs in a worker
    thread, inside a decode slot.

    Raises:
        HTTPException: 400 malformed JSON, 404 unknown run, 413 over the parse budget, 422 invalid
            content.
    """
    settings = ctx.settings
    try:
        payload = parse_json(body)
    except WireError as exc:
        ctx.metrics.batches.labels("rejected").inc()
        if "depth limit exceeded" in str(exc):  # orjson stops at 1024 levels: far past our own limit
            limit = settings.max_json_depth
            detail = f"body: nested deeper than the limit of {limit} levels (max_json_depth)"
            raise HTTPException(422, detail) from None
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from None
    with ctx.db.read_session() as session:
        meta = ctx.run_meta.get(session, run_id)
    if meta is None:
        ctx.metrics.batches.labels("rejected").inc()
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found")
    limits = EventLimits(
        settings.max_json_depth,
        settings.max_event_detail_bytes,
        settings.max_scalar_names_per_batch,
        settings.max_scalar_name_chars,
    )
    try:
        return meta, decode_batch(payload, meta.num_tensors, limits)
    except WireError as exc:
        ctx.metrics.batches.labels("rejected").inc()
        raise HTTPException(422, str(exc)) from None


@router.post(
    "/{run_id}/telemetry",
    response_model=TelemetryResult,
    openapi_extra=TELEMETRY_BODY,
    responses={
        400: {"description": "malformed JSON or gzip"},
        403: {"description": "the token lacks the ingest scope, or the run belongs to another token"},
        408: {"description": "the body stalled (body_timeout_seconds)"},
        413: {"description": "body too large (max_body_bytes) or over the parse budget (max_json_elements)"},
        415: {"description": "unsupported Content-Encoding, or (without tokens) not application/json"},
        422: {"description": "invalid content or over a named limit; nothing is stored"},
        429: {
            "description": "the run has run_batches_in_flight batches in flight here (Retry-After); "
            "nothing is stored"
        },
        503: {"description": "the run stayed busy (run_lock_wait_seconds; Retry-After); nothing is stored"},
    },
)
async def post_telemetry(run_id: RunId, request: Request, ctx: CtxDep, principal: IngestDep) -> Response:
    """Store a batch of steps (statistics as columns), client events and command acks.

    The body may be gzip-compressed (`Content-Encoding: gzip`). Returns how many steps were newly stored,
    whether the idempotency key was seen before, and the run's unacknowledged commands (pending ones become
    delivered; delivered ones are sent again until acknowledged).
    """
    started = time.perf_counter()
    auth = ctx.settings.auth_enabled
    if auth:  # the run's owner before the body is read: from the cache as it stands, else from the database
        meta = ctx.run_meta.peek(run_id) or await run_in_threadpool(run_meta, ctx, run_id)
        if meta is not None:
            check_owner(principal, meta.owner, run_id)
    # admitted after the owner check: another token's requests never take this run's places
    async with run_admission(ctx, run_id) as turn:
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("gzip", "identity"):
            raise HTTPException(
                status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                f"Content-Encoding {encoding!r}: expected gzip or none",
            )
        body = await request.body()
        # inflating and parsing cost memory in proportion to the body: a few batches at a time, the others
        # wait their turn (holding only their compressed body), off the event loop
        async with decode_slots(ctx):
            settings = ctx.settings
            try:
                if encoding == "gzip":
                    body = await run_in_threadpool(
                        gunzip_body, body, settings.max_body_bytes, settings.max_json_elements
                    )
                else:
                    await run_in_threadpool(check_budget, body, settings.max_json_elements)
            except HTTPException:
                ctx.metrics.batches.labels("rejected").inc()
                raise
            meta, batch = await run_in_threadpool(decode, ctx, run_id, body)
            del body
        if auth:  # again on the meta `decode` checked against the database (a cached one may be stale)
            check_owner(principal, meta.owner, run_id)
        try:
            async with run_turn(ctx, run_id, turn):
                outcome = await run_in_threadpool(
                    ingest_batch,
                    db=ctx.db,
                    metrics=ctx.metrics,
                    broker=ctx.broker,
                    detection=ctx.detection,
                    max_scalar_names=ctx.settings.max_scalar_names_per_run,
                    run_id=run_id,
                    meta=meta,
                    batch=batch,
                    started=started,
                )
        except UnknownRun:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found") from None
        except CommandError as exc:
            raise HTTPException(exc.status, exc.message) from None
        except WireError as exc:  # past a limit only the stored run shows (max_scalar_names_per_run)
            raise HTTPException(422, str(exc)) from None
        except LockTimeout as exc:  # the run stays busy: the client sends the batch again
            raise HTTPException(503, str(exc), headers={"Retry-After": "1"}) from None
    commands = [CommandPublic(**c) for c in outcome.commands]
    return json_response(
        TelemetryResult(stored_steps=outcome.stored_steps, duplicate=outcome.duplicate, commands=commands)
    )
