"""Engine, sessions and write serialisation for SQLite and PostgreSQL.

SQLite: WAL journal, ``busy_timeout``, foreign keys, ``synchronous=NORMAL``; write transactions start with
``BEGIN IMMEDIATE`` and are serialised by one in-process lock, so concurrent writers wait instead of seeing
"database is locked" (SQLite's write lock also orders several processes on one file).

PostgreSQL, where several server instances may share the database: the work on one run (store a batch, then
run the detectors on it) is ordered by a per-run in-process lock plus a per-run advisory lock held on a
connection of its own for the whole section, so a run's batches reach its detectors in the order they were
stored whichever instance received them; `exclusive_job` lets one instance at a time run a periodic sweep.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import orjson
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000
_BEGIN_IMMEDIATE = "BEGIN IMMEDIATE"
_BEGIN = "BEGIN"
#: first key of the PostgreSQL advisory locks (two-int form) that order the work on one run ("fp8r");
#: the second key is the run id
PG_RUN_LOCK_CLASS = 0x66703872
#: first key of the advisory locks of periodic jobs that one instance at a time runs ("fp8j")
PG_JOB_LOCK_CLASS = 0x6670386A
#: connections for advisory locks (one is held per run being ingested, beside the session's own); a thread
#: that waits for one holds no other connection
LOCK_POOL_SIZE = 2
LOCK_POOL_OVERFLOW = 14
#: session settings of the lock connections: the server drops the connection (and with it the locks it
#: holds) of an instance that vanished within ~25 s rather than the operating system's two hours, and a
#: wait for a run's lock ends in an error (a 503: the client retries) instead of holding a thread for ever
LOCK_SESSION_SETTINGS = {
    "tcp_keepalives_idle": "10",
    "tcp_keepalives_interval": "5",
    "tcp_keepalives_count": "3",
    "lock_timeout": "60s",
}

log = logging.getLogger("fp8scope.monitor")


def _json_dumps(value: object) -> str:
    # orjson: fast, and it can never emit the NaN/Infinity tokens that PostgreSQL's json type rejects
    return orjson.dumps(value).decode()


def _json_loads(value: object) -> object:
    # SQLite's JSON columns have NUMERIC affinity: a JSON number comes back already as int/float
    return orjson.loads(value) if isinstance(value, str | bytes) else value


def is_sqlite(url_or_engine: str | Engine) -> bool:
    """True for a SQLite URL or engine."""
    name = url_or_engine.dialect.name if isinstance(url_or_engine, Engine) else str(url_or_engine)
    return name.startswith("sqlite")


def make_engine(db_url: str) -> Engine:
    """Create the engine for `db_url` with the pragmas / pool settings this service relies on."""
    if is_sqlite(db_url):
        engine = create_engine(
            db_url,
            json_serializer=_json_dumps,
            json_deserializer=_json_loads,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            pool_size=16,
            max_overflow=16,
        )

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection, _record):
            # take transaction control away from pysqlite so BEGIN IMMEDIATE can be issued (SQLAlchemy recipe)
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            # 16 KiB pages hold several 4 KiB statistic blobs each (with 4 KiB pages every blob spills into an
            # overflow page, doubling the I/O); only takes effect when the database file is created
            cursor.execute("PRAGMA page_size=16384")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")  # = SQLITE_BUSY_TIMEOUT_MS
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            immediate = conn.get_execution_options().get("fp8scope_write", False)
            conn.exec_driver_sql(_BEGIN_IMMEDIATE if immediate else _BEGIN)

        return engine
    return create_engine(
        db_url,
        json_serializer=_json_dumps,
        json_deserializer=_json_loads,
        pool_size=16,
        max_overflow=16,
        pool_pre_ping=True,
    )


class Database:
    """The engine plus the session factories and the write locks of one app instance."""

    def __init__(self, db_url: str):
        self.url = db_url
        self.engine = make_engine(db_url)
        self.sqlite = is_sqlite(self.engine)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(self.engine.execution_options(fp8scope_write=True), expire_on_commit=False)
        self._global_lock = threading.Lock()
        self._run_locks: dict[int, threading.Lock] = {}
        self._run_locks_guard = threading.Lock()
        # advisory locks live on connections of their own, from a pool of their own: a thread holding one
        # then takes a session connection, and the two pools never wait on each other
        self._lock_engine: Engine | None = None
        if not self.sqlite:
            self._lock_engine = create_engine(
                db_url,
                isolation_level="AUTOCOMMIT",
                pool_size=LOCK_POOL_SIZE,
                max_overflow=LOCK_POOL_OVERFLOW,
                pool_pre_ping=True,
                # and our side notices a vanished server
                connect_args={"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5},
            )

            @event.listens_for(self._lock_engine, "connect")
            def _on_lock_connect(dbapi_connection, _record):
                with dbapi_connection.cursor() as cursor:
                    for name, value in LOCK_SESSION_SETTINGS.items():
                        cursor.execute("SELECT set_config(%s, %s, false)", (name, value))
                dbapi_connection.commit()

    def read_session(self) -> Session:
        """A session for reads (and the occasional small write that needs no ordering)."""
        return self._read()

    @contextmanager
    def run_lock(self, run_id: int) -> Iterator[None]:
        """Order the work on one run (ingest, then its detectors; alert changes): an in-process lock, and on
        PostgreSQL also the run's advisory lock, which orders the instances sharing the database."""
        with self._run_locks_guard:
            lock = self._run_locks.get(run_id)
            if lock is None:
                lock = self._run_locks[run_id] = threading.Lock()
        with lock:
            if self._lock_engine is None:
                yield
                return
            with self._advisory(PG_RUN_LOCK_CLASS, run_id, wait=True):
                yield

    @contextmanager
    def exclusive_job(self, job: int) -> Iterator[bool]:
        """Yield whether this instance may run periodic job `job` now: on PostgreSQL only one instance at a
        time holds its advisory lock (the others get False at once and skip the round); on SQLite, True."""
        if self._lock_engine is None:
            yield True
            return
        with self._advisory(PG_JOB_LOCK_CLASS, job, wait=False) as held:
            yield held

    @contextmanager
    def _advisory(self, classid: int, objid: int, *, wait: bool) -> Iterator[bool]:
        """A session-level advisory lock on a connection of its own, released (or, when the release fails,
        dropped with its connection, which releases it too) on exit; yields whether it was taken."""
        assert self._lock_engine is not None
        keys = {"c": classid, "k": objid}
        conn: Connection = self._lock_engine.connect()
        try:
            if wait:
                conn.execute(text("SELECT pg_advisory_lock(:c, :k)"), keys)
                held = True
            else:
                held = bool(conn.scalar(text("SELECT pg_try_advisory_lock(:c, :k)"), keys))
        except BaseException:
            conn.invalidate()
            conn.close()
            raise
        try:
            yield held
        finally:
            try:
                if held:
                    conn.execute(text("SELECT pg_advisory_unlock(:c, :k)"), keys)
            except Exception:
                log.warning(
                    "could not release advisory lock (%d, %d); dropping its connection", classid, objid
                )
                conn.invalidate()
            finally:
                conn.close()

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A write transaction, committed on success and rolled back on error.

        SQLite has one writer at a time: the transaction is serialised by a process-wide lock and starts with
        BEGIN IMMEDIATE so it never has to upgrade a read snapshot (which fails without waiting).
        """
        if self.sqlite:
            with self._global_lock, self._write() as session, session.begin():
                yield session
        else:
            with self._write() as session, session.begin():
                yield session

    def dispose(self) -> None:
        """Close all pooled connections."""
        self.engine.dispose()
        if self._lock_engine is not None:
            self._lock_engine.dispose()
