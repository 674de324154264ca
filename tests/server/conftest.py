"""Fixtures of the monitor-service tests: every DB-backed test runs on SQLite and on PostgreSQL.

PostgreSQL: FP8SCOPE_TEST_PG_URL (default postgresql+psycopg://postgres@127.0.0.1:5432/test) names the
server; a fresh database is created per test session through the `postgres` maintenance database and
dropped at the end; each test gets its own schema in it. Unreachable server: the PostgreSQL variants skip,
unless FP8SCOPE_REQUIRE_PG=1 (CI), which makes them fail.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, make_url, text

from monitor_server.app import create_app
from monitor_server.core.config import Settings
from tests.server.webhook_receiver import Hook
from tests.support.server import pg_database_or_skip


def pytest_configure(config: pytest.Config) -> None:
    # starlette's TestClient warns that it would prefer httpx2; httpx is what the project depends on
    config.addinivalue_line("filterwarnings", "ignore:.*starlette.testclient.*:UserWarning")


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """URL of a fresh PostgreSQL database for this test session (dropped at the end)."""
    with pg_database_or_skip("fp8scope_test") as url:
        yield url


def _pg_schema_url(database_url: str) -> str:
    """A fresh schema in the session database, selected through the connection's search_path."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))  # generated name
    engine.dispose()
    url = make_url(database_url).update_query_dict({"options": f"-csearch_path={schema}"})
    return url.render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def new_pg_schema(pg_database: str) -> Callable[[], str]:
    """Factory of fresh schemas in the session's PostgreSQL database (for module-scoped servers)."""
    return lambda: _pg_schema_url(pg_database)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'monitor.db'}"
    return _pg_schema_url(request.getfixturevalue("pg_database"))


@pytest.fixture
def make_client(db_url: str) -> Iterator[Callable[..., Any]]:
    """Factory of in-process clients (lifespan run) on `db_url`; keyword arguments become Settings fields."""
    from fastapi.testclient import TestClient

    clients: list[Any] = []

    def factory(**settings: Any) -> Any:
        # the in-process client says "Host: testserver": a name the open server must be told about
        settings.setdefault("allowed_hosts", ["testserver"])
        app = create_app(Settings(db_url=db_url, **settings))
        client = TestClient(app)
        client.__enter__()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Callable[..., Any]) -> Any:
    """An in-process client without authentication."""
    return make_client()


@pytest.fixture
def hook(request: pytest.FixtureRequest) -> Iterator[Hook]:
    """A local webhook receiver; parametrized indirectly, the statuses its first POSTs get (then 200)."""
    server = Hook(getattr(request, "param", []))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()
