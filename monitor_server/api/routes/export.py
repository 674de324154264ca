"""Data out: a run's statistics, scalars, events or alerts as a CSV or Parquet download."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import StreamingResponse

from monitor_server import export
from monitor_server.api.deps import CtxDep, FromQ, ReadDep, RunDep, RunId, SessionDep, ToQ, check_order

router = APIRouter(prefix="/runs", tags=["export"])

#: the last step a range may name (as the other step queries)
_MAX_STEP = 2**62


@router.get(
    "/{run_id}/export",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/csv": {}, "application/vnd.apache.parquet": {}}}},
)
def export_run(
    run_id: RunId,
    _run: RunDep,
    ctx: CtxDep,
    session: SessionDep,
    _principal: ReadDep,
    format_: Annotated[Literal["csv", "parquet"], Query(alias="format", description="file format")] = "csv",
    table: Annotated[
        Literal["stats", "scalars", "events", "alerts"], Query(description="which table of the run")
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
    steps overlap the range). NaN and infinities are carried natively (CSV: `nan`, `inf`, `-inf`).
    """
    check_order(from_, to)
    if layout is not None and table != "stats":
        raise HTTPException(422, f"layout: only table=stats has a layout (long or wide), got table={table!r}")
    meta = ctx.run_meta.get(session, run_id)
    if meta is None:
        raise HTTPException(404, f"run {run_id} not found")
    lo = 0 if from_ is None else from_
    hi = _MAX_STEP if to is None else to
    body = export.export(ctx.db.read_session, meta, table, layout or "long", format_, lo, hi)
    name = export.filename(run_id, table, format_)
    return StreamingResponse(
        body,
        media_type=export.MEDIA_TYPES[format_],
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )
