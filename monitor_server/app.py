"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.concurrency import run_in_threadpool

from fp8_protocol.api import API_PREFIX
from monitor_server.api.context import AppContext
from monitor_server.api.routes import (
    alerts,
    blocks,
    commands,
    dashboard,
    export,
    health,
    incidents,
    policies,
    queries,
    replay_requests,
    replays,
    runs,
    stream,
    telemetry,
)
from monitor_server.core.config import Settings
from monitor_server.core.db import LockTimeout
from monitor_server.infra.api_docs import mount_api_docs
from monitor_server.infra.guard import RequestGuard
from monitor_server.infra.web import mount_dashboard
from monitor_server.services.alerting import MAINTENANCE_JOB
from monitor_server.storage.migrations import upgrade_to_head
from monitor_server.storage.models import utcnow
from monitor_server.storage.schemas import TelemetryBatch

log = logging.getLogger("fp8scope.monitor")


def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """A database that fails (unreachable, locked, read-only, out of space) is a JSON 503 with a short
    reason, never a plain-text 500: the client retries later (the training client spools meanwhile)."""
    log.warning(
        "database error on %s %s: %s", request.method, request.url.path, str(exc).splitlines()[0][:300]
    )
    reason = type(getattr(exc, "orig", None) or exc).__name__
    return JSONResponse(
        {"detail": f"database unavailable ({reason}); retry later"},
        status_code=503,
        headers={"Retry-After": "1"},
    )


def _maintain(ctx: AppContext) -> None:
    # several instances on one database: one at a time does the round (the others skip it)
    with ctx.db.exclusive_job(MAINTENANCE_JOB) as mine:
        if mine:
            ctx.maintain(utcnow())


async def _stall_checker(ctx: AppContext) -> None:
    """Periodically raise `stalled` alerts for running runs that went quiet, close abandoned runs and
    delete those past the retention period."""
    while True:
        await asyncio.sleep(ctx.settings.stall_check_seconds)
        try:
            await run_in_threadpool(ctx.detection.check_stalled_runs)
        except Exception:
            log.exception("stall check failed")
        try:
            await run_in_threadpool(_maintain, ctx)
        except Exception:
            log.exception("runs maintenance failed")


def _start_relay(ctx: AppContext) -> Any:
    """On PostgreSQL, the LISTEN/NOTIFY link that carries live events between the instances sharing the
    database; None on SQLite (one process: the in-process broker is all there is)."""
    if ctx.db.sqlite:
        return None
    from monitor_server.infra.events_pg import PgEventRelay

    relay = PgEventRelay(ctx.db.engine, ctx.broker, resolve=ctx.detection.event_data)
    relay.start()
    return relay


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the monitor service for `settings` (default: from the environment).

    The schema is migrated to the latest Alembic revision at startup.
    """
    settings = settings or Settings()
    ctx = AppContext.create(settings)
    app = FastAPI(
        title="fp8scope monitor",
        version="0.1.0",
        description="Telemetry ingest, heatmaps, alerts and the recipe-command channel of fp8scope. "
        "Wire format: docs/wire-format.md.",
        lifespan=_lifespan(ctx),
        docs_url=None,  # served by mount_api_docs, with security headers (or not at all)
        redoc_url=None,
    )
    app.state.ctx = ctx
    app.add_exception_handler(DBAPIError, _database_unavailable)
    app.add_exception_handler(PoolTimeout, _database_unavailable)
    app.add_exception_handler(LockTimeout, _database_unavailable)
    app.add_middleware(RequestGuard, settings=settings, routes=_include_routes(app))
    mount_dashboard(app)
    mount_api_docs(app, settings.api_docs)
    app.openapi = _openapi_with_batch_schema(app)  # type: ignore[method-assign]
    return app


def _lifespan(ctx: AppContext) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's startup and shutdown: migrate the schema, bind the broker to the event loop, start the
    PostgreSQL relay and the stall checker; on the way out stop them and release the database."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(upgrade_to_head, ctx.db.engine)
        ctx.broker.bind(asyncio.get_running_loop())
        relay = _start_relay(ctx)
        if relay is not None:  # serve once listening (or after a few seconds without: it keeps trying)
            await run_in_threadpool(relay.listening.wait, 5.0)
        if not ctx.settings.auth_enabled:
            log.warning("no tokens configured: authentication is off; only loopback listening is allowed")
        checker = asyncio.create_task(_stall_checker(ctx))
        try:
            yield
        finally:
            checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checker
            if relay is not None:
                await run_in_threadpool(relay.close)
            ctx.broker.close()
            ctx.detection.close()
            ctx.db.dispose()

    return lifespan


#: the routers served under the API prefix (the health probes are served at the root)
_API_ROUTES = (
    runs,
    telemetry,
    queries,
    blocks,
    export,
    alerts,
    incidents,
    replays,
    replay_requests,
    commands,
    policies,
    stream,
    dashboard,
)


def _include_routes(app: FastAPI) -> list[tuple[str, Any]]:
    """Mount every router and return (full path, route) for each route: the request guard applies each
    route's own limits by its path."""
    app.include_router(health.router)
    guarded = [(route.path, route) for route in health.router.routes]
    for module in _API_ROUTES:
        app.include_router(module.router, prefix=API_PREFIX)
        guarded += [(API_PREFIX + route.path, route) for route in module.router.routes]
    return guarded


def _openapi_with_batch_schema(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """The app's OpenAPI document, built once, with the telemetry batch's schema among its components: the
    telemetry route reads its body itself (for speed), so FastAPI cannot derive that schema from it."""

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

    return openapi
