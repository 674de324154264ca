"""GET /runs/{id}/stream: server-sent events (step, alert, command, run) with keep-alive comments."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from monitor_server.api.deps import CtxDep, ReadDep, RunId, run_or_404
from monitor_server.events import stream_events

router = APIRouter(prefix="/runs", tags=["stream"])


@router.get(
    "/{run_id}/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}},
)
async def stream(run_id: RunId, ctx: CtxDep, _principal: ReadDep) -> StreamingResponse:
    """Live events of a run: `step` (summary of each stored step), `alert`, `command` and `run` (status)."""

    # not `RunDep`: its session would stay open as long as the stream (a dependency's cleanup runs after
    # the response), holding a database connection per open dashboard
    def check() -> None:
        with ctx.db.read_session() as session:
            run_or_404(session, run_id)

    await run_in_threadpool(check)
    sub = ctx.broker.subscribe(run_id)
    return StreamingResponse(
        stream_events(sub, ctx.settings.sse_keepalive_seconds),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
