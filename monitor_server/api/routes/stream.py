"""GET /runs/{id}/stream: server-sent events (step, alert, command, run) with keep-alive comments."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from monitor_server.api.deps import CtxDep, ReadDep, RunId, run_or_404
from monitor_server.api.responses import EVENT_STREAM, event_stream

router = APIRouter(prefix="/runs", tags=["stream"])


@router.get("/{run_id}/stream", **EVENT_STREAM)
async def stream(run_id: RunId, ctx: CtxDep, principal: ReadDep) -> StreamingResponse:
    """Live events of a run: `step` (summary of each stored step), `alert`, `command` and `run` (status)."""

    # not `RunDep`: its session would stay open as long as the stream (a dependency's cleanup runs after
    # the response), holding a database connection per open dashboard
    def check() -> None:
        with ctx.db.read_session() as session:
            run_or_404(session, run_id)

    await run_in_threadpool(check)
    return event_stream(ctx, run_id, principal.name)
