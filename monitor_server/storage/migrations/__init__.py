"""Alembic migrations, applied programmatically on start (no alembic.ini needed)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, text

try:
    import fcntl
except ImportError:  # not on Windows: there two servers must not start at the same moment
    fcntl = None  # type: ignore[assignment]

#: key of the PostgreSQL advisory lock held while migrating ("fp8s")
PG_MIGRATION_LOCK = 0x66703873

MIGRATIONS_DIR = Path(__file__).resolve().parent


def alembic_config(db_url: str | None = None) -> Config:
    """An Alembic Config pointing at this package's scripts."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if db_url:
        cfg.set_main_option("sqlalchemy.url", db_url.replace("%", "%%"))
    return cfg


def upgrade_to_head(engine: Engine) -> None:
    """Apply every pending migration to the database behind `engine`.

    Several servers may start together on one database: each migrates under a lock (on SQLite a file lock
    on the database file, on PostgreSQL a transaction-scoped advisory lock), so the first migrates and the
    others find the schema at head when they get the lock.
    """
    cfg = alembic_config()
    sqlite = engine.dialect.name == "sqlite"
    with _sqlite_file_lock(engine), engine.connect() as connection:
        if sqlite:
            # SQLite's table rebuilds (a new table copied, the old dropped) must run with foreign keys off,
            # else dropping `runs` deletes every row that references it; the pragma is a no-op inside a
            # transaction, so it is set on the bare connection before the migration's transaction begins
            connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")
        try:
            with connection.begin():
                if engine.dialect.name == "postgresql":
                    key = {"key": PG_MIGRATION_LOCK}
                    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), key)
                cfg.attributes["connection"] = connection
                command.upgrade(cfg, "head")
        finally:
            if sqlite:
                connection.connection.driver_connection.execute("PRAGMA foreign_keys=ON")


@contextlib.contextmanager
def _sqlite_file_lock(engine: Engine) -> Iterator[None]:
    """An exclusive flock on a file beside the SQLite file, ``<database>.migrate-lock``. Not on the database
    file itself: closing a descriptor of a file drops every fcntl lock the process holds on it (POSIX), the
    locks SQLite keeps on the database included, and another process on the file would then take itself for
    its only user and checkpoint the write-ahead log away under this one."""
    path = engine.url.database if engine.dialect.name == "sqlite" else None
    if not path or path == ":memory:" or path.startswith("file:") or fcntl is None:
        yield
        return
    with open(f"{path}.migrate-lock", "ab") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
