"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, HTTPException
from fastapi.openapi.utils import get_openapi
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from monitor_server.api.routes import (
    alerts,
    commands,
    dashboard,
    export,
    health,
    incidents,
    queries,
    runs,
    stream,
    telemetry,
)
from monitor_server.context import AppContext
from monitor_server.core.config import Settings
from monitor_server.migrations import upgrade_to_head
from monitor_server.schemas import TelemetryBatch
from monitor_server.web import mount_dashboard

log = logging.getLogger("fp8scope.monitor")
API_PREFIX = "/api/v1"


class BodySizeLimit:
    """Answer 413 for bodies over `max_bytes`: by Content-Length up front, or while the body streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await _json_response(send, 400, "invalid Content-Length header")
                return
            if declared > self.max_bytes:
                await _json_response(
                    send, 413, f"request body of {declared} bytes exceeds the limit of {self.max_bytes} bytes"
                )
                return
        received = 0
        limit = self.max_bytes

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


async def _json_response(send: Send, status_code: int, detail: str) -> None:
    body = orjson.dumps({"detail": detail})
    await send(
        {
            "type": "http.response.start",
            "status": status_code,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _stall_checker(ctx: AppContext) -> None:
    """Periodically raise `stalled` alerts for running runs that went quiet."""
    while True:
        await asyncio.sleep(ctx.settings.stall_check_seconds)
        try:
            await run_in_threadpool(ctx.detection.check_stalled_runs)
        except Exception:
            log.exception("stall check failed")


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the monitor service for `settings` (default: from the environment).

    The schema is migrated to the latest Alembic revision at startup.
    """
    settings = settings or Settings()
    ctx = AppContext.create(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(upgrade_to_head, ctx.db.engine)
        ctx.broker.bind(asyncio.get_running_loop())
        if not settings.auth_enabled:
            log.warning("no tokens configured: authentication is off; only loopback listening is allowed")
        checker = asyncio.create_task(_stall_checker(ctx))
        try:
            yield
        finally:
            checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checker
            ctx.broker.close()
            ctx.detection.close()
            ctx.db.dispose()

    app = FastAPI(
        title="fp8scope monitor",
        version="0.1.0",
        description="Telemetry ingest, heatmaps, alerts and the recipe-command channel of fp8scope. "
        "Wire format: docs/wire-format.md.",
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.include_router(health.router)
    for module in (runs, telemetry, queries, export, alerts, incidents, commands, stream, dashboard):
        app.include_router(module.router, prefix=API_PREFIX)
    mount_dashboard(app)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            batch = TelemetryBatch.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in batch.pop("$defs", {}).items():
                components.setdefault(name, definition)
            components["TelemetryBatch"] = batch
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
