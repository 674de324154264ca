"""Live events across server instances that share a PostgreSQL database: LISTEN/NOTIFY.

Every event an instance's broker publishes is also sent, from a sender thread on a connection of its own, as
a NOTIFY on one channel (one per schema, so that deployments in separate schemas of one database stay
apart); several queued events go in one payload and one transaction, in order. A listener thread on another
connection LISTENs on that channel and hands what the *other* instances sent to the local broker
(`EventBroker.deliver`: delivery hops onto the event loop with `call_soon_threadsafe`); an instance skips
its own payloads (each names its origin), so a subscriber never gets an event twice.

NOTIFY payloads are limited to 8000 bytes: an event too large to travel (an incident of many tensors, an
alert with long evidence) goes as a reference, its run, name and row id, and the receiving instance reads
the row (`resolve`) when it has subscribers for it.

Neither thread ever blocks a publisher: `send` appends to a bounded queue (the oldest events go when it is
full) and returns. A connection that fails is dropped and made again with backoff; the events that failed to
go are lost (a live view, not a log: everything is in the tables), and the streams that may have missed
them are told to reconnect and reload (`EventBroker.resync`): on this instance after the listener lost its
connection, and on the others when this sender lost events (its next payload says so).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson
import psycopg
from psycopg import sql
from sqlalchemy import Engine

from monitor_server.infra.events import EventBroker

log = logging.getLogger("fp8scope.monitor")

CHANNEL_PREFIX = "fp8scope_events."
#: PostgreSQL's NOTIFY payload limit is 8000 bytes; the envelope takes a little
MAX_PAYLOAD_BYTES = 7800
#: events waiting for the sender beyond which the oldest are dropped
OUTBOX_SIZE = 10_000
#: the longest wait between two connection attempts
MAX_BACKOFF_S = 5.0
#: an idle listener checks its connection this often (a dead peer sends no error until asked)
HEALTH_CHECK_S = 5.0
APPLICATION_NAME = "fp8scope-events"

#: resolve(run_id, event name, row id) -> the event's data read from the tables (None: gone, or no such kind)
Resolver = Callable[[int, str, int], Any]


def connect_kwargs(engine: Engine) -> dict[str, Any]:
    """psycopg connection parameters of a SQLAlchemy PostgreSQL engine (host, database, user, options ...),
    with TCP keepalives so a connection to a vanished server fails instead of waiting forever."""
    _args, params = engine.dialect.create_connect_args(engine.url)
    params = {k: v for k, v in params.items() if k != "context"}
    return {
        **params,
        "autocommit": True,
        "application_name": APPLICATION_NAME,
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "connect_timeout": 10,
    }


def channel_of(conn: psycopg.Connection) -> str:
    """The channel of the connection's schema (names are cut at 63 bytes, as PostgreSQL cuts them)."""
    schema = conn.execute("SELECT current_schema()").fetchone()
    name = CHANNEL_PREFIX + (schema[0] if schema and schema[0] else "public")
    return name.encode()[:63].decode(errors="ignore")


def _head(origin: str, lost_at: float | None) -> bytes:
    lost = b"" if lost_at is None else b',"r":' + orjson.dumps(lost_at)
    return b'{"o":"' + origin.encode() + b'"' + lost + b',"e":['


def pack(origin: str, events: list[tuple[int, str, Any]], lost_at: float | None = None) -> list[bytes]:
    """Payloads of at most `MAX_PAYLOAD_BYTES` carrying `events` in order: each event as
    ``[run_id, name, data]``, or ``[run_id, name, null, row_id]`` when it is too large to travel (an event
    that is too large and names no row is left out, and logged). With `lost_at` (the wall-clock time this
    sender last lost events), payloads say ``"r": lost_at``: the receivers' streams opened before it
    reload."""
    head = _head(origin, lost_at)
    payloads: list[bytes] = []
    parts: list[bytes] = []
    size = len(head) + 2
    for run_id, name, data in events:
        part = orjson.dumps([run_id, name, data])
        if len(head) + len(part) + 2 > MAX_PAYLOAD_BYTES:
            ref = data.get("id") if isinstance(data, dict) else None
            if not isinstance(ref, int):
                log.warning("run %s: a %r event of %d bytes is too large to notify", run_id, name, len(part))
                lost_at = time.time()  # the payloads after it tell the other instances' streams to reload
                continue
            part = orjson.dumps([run_id, name, None, ref])
        if parts and size + len(part) + 1 > MAX_PAYLOAD_BYTES:
            payloads.append(head + b",".join(parts) + b"]}")
            parts, size = [], len(head) + 2
        if lost_at is not None and _head(origin, lost_at) != head:
            size += len(_head(origin, lost_at)) - len(head)
            head = _head(origin, lost_at)
        parts.append(part)
        size += len(part) + 1
    if parts:
        payloads.append(head + b",".join(parts) + b"]}")
    return payloads


class PgEventRelay:
    """The LISTEN/NOTIFY link of one server instance (see the module docstring).

    Args:
        engine: the instance's PostgreSQL engine (its URL gives the connections' parameters).
        broker: the instance's broker; `attach` makes it send what it publishes here.
        resolve: reads an event sent as a reference back from the tables.
    """

    def __init__(self, engine: Engine, broker: EventBroker, resolve: Resolver | None = None) -> None:
        self.origin = uuid.uuid4().hex[:16]
        self.broker = broker
        self.resolve = resolve
        self._params = connect_kwargs(engine)
        self._outbox: deque[tuple[int, str, Any]] = deque(maxlen=OUTBOX_SIZE)
        self._lost_at: float | None = None  # when events of ours last went missing, not yet said
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.listening = threading.Event()  # set while the listener holds a connection with LISTEN done
        self.stats = {"sent": 0, "received": 0, "dropped": 0, "reconnects": 0}
        self._threads = [
            threading.Thread(target=self._send_loop, name="fp8scope-notify", daemon=True),
            threading.Thread(target=self._listen_loop, name="fp8scope-listen", daemon=True),
        ]

    def start(self) -> None:
        """Attach to the broker and start both threads."""
        self.broker.attach(self)
        for thread in self._threads:
            thread.start()

    def send(self, run_id: int, name: str, data: Any) -> None:
        """Queue an event for the other instances; never blocks (called by `EventBroker.publish`)."""
        self.send_many(run_id, name, [data])

    def send_many(self, run_id: int, name: str, items: list[Any]) -> None:
        """Queue several events of one name, in order, with one wake-up of the sender (a batch's events go
        out in as few NOTIFY payloads as their size allows); never blocks."""
        with self._cond:
            overflow = len(self._outbox) + len(items) - OUTBOX_SIZE
            if overflow > 0:
                self.stats["dropped"] += overflow
                self._lost_at = time.time()
            self._outbox.extend((run_id, name, data) for data in items)
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Stop both threads (what is queued is sent first, if the connection allows)."""
        self.broker.attach(None)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout)

    # ---- sender ---------------------------------------------------------------------------------------
    def _take(self) -> tuple[list[tuple[int, str, Any]], float | None]:
        """The queued events, and when some last went missing before them (then cleared), or None."""
        with self._cond:
            while not self._outbox and not self._stop.is_set():
                self._cond.wait()
            taken = list(self._outbox)
            self._outbox.clear()
            lost_at, self._lost_at = self._lost_at, None
            return taken, lost_at

    def _send_loop(self) -> None:
        conn: psycopg.Connection | None = None
        channel = ""
        failures = 0
        lost_at: float | None = None  # when events last went missing, not yet told
        try:
            while True:
                events, dropped_at = self._take()
                lost_at = max(lost_at or 0.0, dropped_at or 0.0) or None
                if not events:
                    return  # stopped and drained
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(**self._params)
                        channel = channel_of(conn)
                    payloads = pack(self.origin, events, lost_at)
                    with conn.transaction(), conn.cursor() as cur:  # delivered together, in order
                        cur.executemany("SELECT pg_notify(%s, %s)", [(channel, p.decode()) for p in payloads])
                    self.stats["sent"] += len(events)
                    lost_at = None
                    if failures:
                        log.warning("live events to other instances: sending again")
                    failures = 0
                except (psycopg.Error, OSError) as exc:
                    self.stats["dropped"] += len(events)
                    lost_at = time.time()
                    if not failures:
                        log.warning("live events to other instances: cannot send (%s); retrying", exc)
                    failures += 1
                    conn = _close(conn)
                    if self._stop.wait(min(MAX_BACKOFF_S, 0.1 * 2**failures)):
                        return
        finally:
            _close(conn)

    # ---- listener -------------------------------------------------------------------------------------
    def _listen_loop(self) -> None:
        failures = 0
        lost = False
        while not self._stop.is_set():
            conn = None
            try:
                conn = psycopg.connect(**self._params)
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_of(conn))))
                self.listening.set()
                if lost:
                    self.stats["reconnects"] += 1
                    log.warning("live events from other instances: listening again")
                    # what arrived meanwhile is lost: the streams here reload rather than show a gap
                    self.broker.resync_threadsafe(
                        "live events from other server instances were interrupted; reconnect and reload"
                    )
                failures, lost = 0, False
                self._receive(conn)
            except Exception as exc:  # whatever went wrong, the listener lives on and reconnects
                self.listening.clear()
                if not lost:
                    log.warning("live events from other instances: connection lost (%s); reconnecting", exc)
                lost = True
                failures += 1
                self._stop.wait(min(MAX_BACKOFF_S, 0.1 * 2**failures))
            finally:
                self.listening.clear()
                _close(conn)

    def _receive(self, conn: psycopg.Connection) -> None:
        idle_since = time.monotonic()
        while not self._stop.is_set():
            got = False
            for notify in conn.notifies(timeout=0.5):
                got = True
                self._dispatch(notify.payload)
            if got:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > HEALTH_CHECK_S:
                conn.execute("SELECT 1")  # raises when the connection is gone
                idle_since = time.monotonic()

    def _dispatch(self, payload: str) -> None:
        try:
            message = orjson.loads(payload)
            if message.get("o") == self.origin:
                return  # our own: delivered here when it was published
            lost_at = message.get("r")
            if isinstance(lost_at, int | float):  # the sender lost events: streams open then reload
                self.broker.resync_threadsafe(
                    "live events from another server instance were lost; reconnect and reload", lost_at
                )
            # consecutive events of one run and name are delivered together (one hop onto the loop, their
            # frames joined), as their publisher sent them
            group: list[Any] = []
            key: tuple[int, str] | None = None
            for item in message["e"]:
                run_id, name, data = item[0], item[1], item[2]
                if len(item) > 3:
                    if not self.broker.has_local_subscribers(run_id) or self.resolve is None:
                        continue
                    data = self.resolve(run_id, name, item[3])
                    if data is None:
                        continue
                self.stats["received"] += 1
                if key is not None and key != (run_id, name):
                    self.broker.deliver_many(*key, group)
                    group = []
                key = (run_id, name)
                group.append(data)
            if key is not None:
                self.broker.deliver_many(*key, group)
        except Exception:  # a malformed payload (another version?) or a failed read must not stop listening
            log.exception("live events from other instances: could not deliver a notification")


def _close(conn: psycopg.Connection | None) -> None:
    if conn is not None:
        try:
            conn.close()
        except Exception:  # closing a broken connection may fail too; it is gone either way
            log.debug("closing an event connection failed", exc_info=True)
    return None
