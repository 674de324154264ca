"""Data out: a run's statistics, scalars, events or alerts as a CSV or Parquet download."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from monitor_server.api.deps import CtxDep, FromQ, ReadRunDep, RunId, SessionDep, ToQ, check_order
from monitor_server.services import export

router = APIRouter(prefix="/runs", tags=["export"])

#: the last step a range may name (as the other step queries)
_MAX_STEP = 2**62


class ExportSlot:
    """One of the app's `export_concurrency` export slots, held from the answer's start until its body is
    done (sent, failed or abandoned by the client); releasing twice is harmless."""

    def __init__(self, slots: threading.BoundedSemaphore) -> None:
        self._slots = slots
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            if self._held:
                self._held = False
                self._slots.release()

    def guard(self, body: Iterator[bytes]) -> Iterator[bytes]:
        """`body`, releasing the slot when it ends."""
        try:
            yield from body
        finally:
            self.release()


def export_slot(request: Request, limit: int) -> ExportSlot:
    """A free export slot of this app, or 429 with Retry-After when all `limit` are streaming."""
    state = request.app.state
    slots = getattr(state, "export_slots", None)
    if slots is None:
        slots = state.export_slots = threading.BoundedSemaphore(limit)
    if not slots.acquire(blocking=False):
        raise HTTPException(
            429,
            f"{limit} exports are streaming already (export_concurrency); try again shortly",
            headers={"Retry-After": "5"},
        )
    return ExportSlot(slots)


@router.get(
    "/{run_id}/export",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/csv": {}, "application/vnd.apache.parquet": {}}},
        422: {"description": "bad parameters, or a wide Parquet file over its column budget"},
        429: {"description": "export_concurrency exports are streaming already (Retry-After)"},
    },
)
def export_run(
    request: Request,
    run_id: RunId,
    _run: ReadRunDep,
    ctx: CtxDep,
    session: SessionDep,
    format_: Annotated[Literal["csv", "parquet"], Query(alias="format", description="file format")] = "csv",
    table: Annotated[
        Literal["stats", "scalars", "events", "alerts", "replays"],
        Query(description="which table of the run"),
    ] = "stats",
    layout: Annotated[
        Literal["long", "wide"] | None,
        Query(description="stats only: one row per (step, tensor) (long, the default) or per step (wide)"),
    ] = None,
    from_: FromQ = None,
    to: ToQ = None,
) -> StreamingResponse:
    """One table of the run as a file (``run-<id>-<table>.<format>``), streamed a chunk of steps at a time.

    Columns are listed in docs/wire-format.md (*Export*). `from`/`to` bound the steps (alerts: those whose
    steps overlap the range; replays: those whose incident's do). NaN and infinities are carried natively
    (CSV: `nan`, `inf`, `-inf`).
    """
    check_order(from_, to)
    if layout is not None and table != "stats":
        raise HTTPException(422, f"layout: only table=stats has a layout (long or wide), got table={table!r}")
    meta = ctx.run_meta.get(session, run_id)
    if meta is None:
        raise HTTPException(404, f"run {run_id} not found")
    lo = 0 if from_ is None else from_
    hi = _MAX_STEP if to is None else to
    try:  # a refusal is said as such, also while every export slot is taken
        export.refusal(ctx.db.read_session, meta, table, layout or "long", format_, lo, hi)
    except export.ExportTooWide as exc:
        raise HTTPException(422, str(exc)) from None
    slot = export_slot(request, ctx.settings.export_concurrency)
    try:
        body = export.export(ctx.db.read_session, meta, table, layout or "long", format_, lo, hi)
    except BaseException:
        slot.release()
        raise
    name = export.filename(run_id, table, format_)
    return StreamingResponse(
        slot.guard(body),
        media_type=export.MEDIA_TYPES[format_],
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
        background=BackgroundTask(slot.release),  # also when the client went away mid-file
    )
