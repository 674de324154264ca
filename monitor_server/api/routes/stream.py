"""GET /runs/{id}/stream: server-sent events (step, alert, command, run) with keep-alive comments."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from monitor_server.api.deps import CtxDep, ReadDep, RunId
from monitor_server.api.routes.runs import get_run_or_404
from monitor_server.events import CLOSED, Subscription

router = APIRouter(prefix="/runs", tags=["stream"])


async def stream_events(sub: Subscription, keepalive_s: float) -> AsyncIterator[bytes]:
    """Yield SSE frames until the broker closes (shutdown); the response cancels us on disconnect."""
    try:
        # a first event: a client (or a test) knows from it that it is subscribed and will miss nothing
        yield b"retry: 2000\nevent: subscribed\ndata: {}\n\n"
        while True:
            event = await sub.get(keepalive_s)
            if event is None:
                yield b": keep-alive\n\n"
            elif event is CLOSED:
                return
            else:
                yield event
    finally:
        sub.close()


@router.get(
    "/{run_id}/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}},
)
async def stream(run_id: RunId, ctx: CtxDep, _principal: ReadDep) -> StreamingResponse:
    """Live events of a run: `step` (summary of each stored step), `alert`, `command` and `run` (status)."""

    def check() -> None:
        with ctx.db.read_session() as session:
            get_run_or_404(session, run_id)

    await run_in_threadpool(check)
    sub = ctx.broker.subscribe(run_id)
    return StreamingResponse(
        stream_events(sub, ctx.settings.sse_keepalive_seconds),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
