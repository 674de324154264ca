"""Engine, sessions and write serialisation for SQLite and PostgreSQL.

SQLite: WAL journal, ``busy_timeout``, foreign keys, ``synchronous=NORMAL``; write transactions start with
``BEGIN IMMEDIATE`` and are serialised by one in-process lock, so concurrent writers wait instead of seeing
"database is locked" (SQLite's write lock also orders several processes on one file).

PostgreSQL, where several server instances may share the database: the work on one run (store a batch, then
run the detectors on it) is ordered by a per-run in-process lock plus a per-run advisory lock held on a
connection of its own for the whole section, so a run's batches reach its detectors in the order they were
stored whichever instance received them; `exclusive_job` lets one instance at a time run a periodic sweep.
The run's advisory lock is a transaction-level lock on a connection whose transaction may stay idle for
at most the lease (``idle_in_transaction_session_timeout``): an instance that freezes while holding it (a
stopped process, whose kernel still answers keepalives) loses it when the lease runs out, and a wait for
it is short (``lock_timeout``), so a frozen instance blocks a run for one lease at most, never for as long
as it stays frozen.
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
#: PostgreSQL's SQLSTATE for a lock wait past lock_timeout
LOCK_NOT_AVAILABLE = "55P03"
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
#: holds) of an instance that vanished within ~25 s rather than the operating system's two hours (a wait
#: for a run's lock is bounded as well: `Database.lock_wait_seconds`)
LOCK_SESSION_SETTINGS = {
    "tcp_keepalives_idle": "10",
    "tcp_keepalives_interval": "5",
    "tcp_keepalives_count": "3",
}
#: the default bound on a wait for a run's lock (the ``run_lock_wait_seconds`` setting)
LOCK_WAIT_SECONDS = 5.0
#: the default lease of a run's advisory lock (the ``run_lock_lease_seconds`` setting): its holder's
#: transaction may stay idle this long, then PostgreSQL ends the session and the lock goes with it
LOCK_LEASE_SECONDS = 30.0

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


class LockTimeout(TimeoutError):
    """A run's lock (or SQLite's write lock) was not free within `Database.lock_wait_seconds`: the request
    is answered 503 with Retry-After and the client sends it again, instead of a worker thread waiting for
    as long as another request holds the lock."""


class Database:
    """The engine plus the session factories and the write locks of one app instance.

    Args:
        lock_wait_seconds: the longest a thread waits for a run's lock (`run_lock`) or, with a bound asked
            for, SQLite's write lock (`write`); then `LockTimeout`.
        lock_lease_seconds: on PostgreSQL, how long a run's advisory lock outlives a holder that stopped
            (see the module docstring); work under the lock must take less.
    """

    def __init__(
        self,
        db_url: str,
        lock_wait_seconds: float = LOCK_WAIT_SECONDS,
        lock_lease_seconds: float = LOCK_LEASE_SECONDS,
    ):
        self.url = db_url
        self.lock_wait_seconds = lock_wait_seconds
        self.lock_lease_seconds = lock_lease_seconds
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
                timeouts = {
                    "lock_timeout": str(max(1, round(lock_wait_seconds * 1000))),
                    "idle_in_transaction_session_timeout": str(max(1, round(lock_lease_seconds * 1000))),
                }
                with dbapi_connection.cursor() as cursor:
                    for name, value in {**LOCK_SESSION_SETTINGS, **timeouts}.items():
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
        if not lock.acquire(timeout=self.lock_wait_seconds):
            raise LockTimeout(f"run {run_id} is busy (run_lock_wait_seconds={self.lock_wait_seconds:g})")
        try:
            if self._lock_engine is None:
                yield
                return
            with self._advisory(PG_RUN_LOCK_CLASS, run_id, wait=True):
                yield
        finally:
            lock.release()

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
        """An advisory lock on a connection of its own, released (or, when the release fails, dropped with
        its connection, which releases it too) on exit; yields whether it was taken. Waiting (a run's
        lock): a transaction-level lock, held under the lease; a try (a periodic job): session-level."""
        assert self._lock_engine is not None
        keys = {"c": classid, "k": objid}
        conn: Connection = self._lock_engine.connect()
        try:
            if wait:  # bounded by the connection's lock_timeout, held under its idle-in-transaction lease
                conn.exec_driver_sql("BEGIN")
                conn.execute(text("SELECT pg_advisory_xact_lock(:c, :k)"), keys)
                held = True
            else:
                held = bool(conn.scalar(text("SELECT pg_try_advisory_lock(:c, :k)"), keys))
        except BaseException as exc:
            conn.invalidate()
            conn.close()
            if getattr(getattr(exc, "orig", None), "sqlstate", None) == LOCK_NOT_AVAILABLE:
                raise LockTimeout(
                    f"run {objid} is busy on another instance"
                    f" (run_lock_wait_seconds={self.lock_wait_seconds:g})"
                ) from None
            raise
        try:
            yield held
        finally:
            try:
                if wait:
                    conn.exec_driver_sql("COMMIT")  # ends the transaction, and its lock with it
                elif held:
                    conn.execute(text("SELECT pg_advisory_unlock(:c, :k)"), keys)
            except Exception:
                log.warning(
                    "could not release advisory lock (%d, %d) (held past run_lock_lease_seconds=%g?);"
                    " dropping its connection",
                    classid,
                    objid,
                    self.lock_lease_seconds,
                )
                conn.invalidate()
            finally:
                conn.close()

    @contextmanager
    def write(self, bounded: bool = False) -> Iterator[Session]:
        """A write transaction, committed on success and rolled back on error.

        SQLite has one writer at a time: the transaction is serialised by a process-wide lock and starts with
        BEGIN IMMEDIATE so it never has to upgrade a read snapshot (which fails without waiting).

        Args:
            bounded: on SQLite, wait at most `lock_wait_seconds` for the process-wide lock (then
                `LockTimeout`); ingest asks for it, so one slow writer never holds every worker thread.
        """
        if self.sqlite:
            if not self._global_lock.acquire(timeout=self.lock_wait_seconds if bounded else -1):
                raise LockTimeout(f"the database is busy (run_lock_wait_seconds={self.lock_wait_seconds:g})")
            try:
                with self._write() as session, session.begin():
                    yield session
            finally:
                self._global_lock.release()
        else:
            with self._write() as session, session.begin():
                yield session

    def ping(self) -> None:
        """Raise unless the database answers a query."""
        with self.read_session() as session:
            session.execute(text("SELECT 1"))

    def probe_write(self) -> None:
        """Raise unless the database takes a write: a real row is written and rolled back (into
        `alembic_version`: no sequence to advance, nothing that references it)."""
        with self.write() as session:
            session.execute(text("INSERT INTO alembic_version (version_num) VALUES ('readyz-probe')"))
            session.rollback()

    def dispose(self) -> None:
        """Close all pooled connections."""
        self.engine.dispose()
        if self._lock_engine is not None:
            self._lock_engine.dispose()
