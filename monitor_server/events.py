"""In-process publish/subscribe for the server-sent event stream.

Publishers may be worker threads (ingest runs in the threadpool); delivery hops onto the event loop with
`call_soon_threadsafe`. Each subscriber's queue is bounded by count (a subscriber that falls behind loses its
oldest events) and by bytes: a subscriber holding more than `max_queue_bytes` of unsent events (a client
that stopped reading) is dropped, with a final `dropped` event saying why, and its queue freed.
`stream_events` turns a subscription into the frames of a streaming response.

Several server instances on one PostgreSQL database: a relay (`monitor_server.events_pg`) attached with
`attach` gets every published event to send to the other instances, and hands theirs to `deliver`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

QUEUE_SIZE = 1000
#: default byte bound of one subscriber's queue (`Settings.sse_queue_bytes`)
QUEUE_BYTES = 8 * 1024 * 1024
#: subscription key receiving every run's events (the dashboard's runs list); its events carry `run_id`
ALL_RUNS = 0
#: the events `ALL_RUNS` subscribers get (what a runs list shows); command and client events stay per run
ALL_RUNS_EVENTS = frozenset({"step", "alert", "incident", "run"})


@dataclass(frozen=True)
class Event:
    """One server-sent event: its `event` name and JSON-able `data`."""

    name: str
    data: Any

    def encode(self) -> bytes:
        """The SSE wire form (``event:`` and ``data:`` lines and a blank line)."""
        return b"event: " + self.name.encode() + b"\ndata: " + orjson.dumps(self.data) + b"\n\n"


CLOSED = Event("__closed__", None)


class Relay(Protocol):
    """Where a broker sends its events for the other server instances."""

    def send(self, run_id: int, name: str, data: Any) -> None: ...


class Subscription:
    """A subscriber's queue for one run; iterate with `get` (events come out encoded, as SSE frames)."""

    def __init__(self, broker: EventBroker, run_id: int, max_bytes: int = QUEUE_BYTES):
        self.run_id = run_id
        self.queue: asyncio.Queue[bytes | Event] = asyncio.Queue(maxsize=QUEUE_SIZE)
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self.dropped = False
        self._broker = broker

    def put(self, event: Event) -> None:
        """Enqueue on the loop thread: the oldest event goes when the queue is full by count; the whole
        subscription goes (a final `dropped` event, then the end of the stream) when full by bytes."""
        if self.dropped:
            return
        if event is CLOSED:
            self._put(CLOSED)
            return
        frame = event.encode()  # once per subscriber; its size is what the queue holds
        if self.queued_bytes + len(frame) > self.max_bytes:
            self._drop()
            return
        self._put(frame)

    def _put(self, item: bytes | Event) -> None:
        if self.queue.full():
            with contextlib.suppress(asyncio.QueueEmpty):
                old = self.queue.get_nowait()
                self.queued_bytes -= len(old) if isinstance(old, bytes) else 0
        self.queue.put_nowait(item)
        self.queued_bytes += len(item) if isinstance(item, bytes) else 0

    def _drop(self, reason: str | None = None) -> None:
        """Free the queue, leave a last word and the end of the stream, and stop receiving."""
        if self.dropped:
            return
        self.dropped = True
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queued_bytes = 0
        reason = reason or (
            f"this client fell behind by more than {self.max_bytes} bytes of events "
            "(sse_queue_bytes); reconnect and reload"
        )
        self.queue.put_nowait(Event("dropped", {"reason": reason}).encode())
        self.queue.put_nowait(CLOSED)
        self._broker.unsubscribe(self)

    async def get(self, timeout: float) -> bytes | Event | None:
        """The next SSE frame (or `CLOSED`), or None after `timeout` seconds without one."""
        try:
            item = await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None
        if isinstance(item, bytes):
            self.queued_bytes -= len(item)
        return item

    def close(self) -> None:
        """Stop receiving events."""
        self._broker.unsubscribe(self)


class EventBroker:
    """Fan-out of run events to SSE subscribers."""

    def __init__(self, max_queue_bytes: int = QUEUE_BYTES) -> None:
        self.max_queue_bytes = max_queue_bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subs: dict[int, set[Subscription]] = {}
        self._lock = threading.Lock()
        self._relay: Relay | None = None
        self.closed = False

    def attach(self, relay: Relay | None) -> None:
        """Also send every published event to `relay` (the other server instances); None detaches."""
        self._relay = relay

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Remember the event loop that subscribers live on (called at startup)."""
        self._loop = loop
        self.closed = False

    def has_subscribers(self, run_id: int) -> bool:
        """Whether anyone may listen to `run_id` (lets publishers skip building events): with a relay
        attached, someone on another instance may."""
        return self._relay is not None or self.has_local_subscribers(run_id)

    def has_local_subscribers(self, run_id: int) -> bool:
        """Whether a stream of this instance listens to `run_id`."""
        return bool(self._subs.get(run_id) or self._subs.get(ALL_RUNS))

    def subscribe(self, run_id: int) -> Subscription:
        """A new subscription to `run_id`'s events (`ALL_RUNS`: every run's); call from the event loop."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        sub = Subscription(self, run_id, self.max_queue_bytes)
        with self._lock:
            self._subs.setdefault(run_id, set()).add(sub)
        if self.closed:
            sub.put(CLOSED)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Remove a subscription (idempotent)."""
        with self._lock:
            subs = self._subs.get(sub.run_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.run_id]

    def publish(self, run_id: int, name: str, data: Any) -> None:
        """Send an event to `run_id`'s subscribers, here and (through the relay) on the other instances;
        safe to call from any thread."""
        self.deliver(run_id, name, data)
        relay = self._relay
        if relay is not None:
            relay.send(run_id, name, data)

    def deliver(self, run_id: int, name: str, data: Any) -> None:
        """Send an event to `run_id`'s subscribers of this instance; safe to call from any thread."""
        with self._lock:
            subs = list(self._subs.get(run_id, ()))
            everyone = list(self._subs.get(ALL_RUNS, ()))
        if not (subs or everyone) or self._loop is None or self._loop.is_closed():
            return
        if subs:
            self._loop.call_soon_threadsafe(self._deliver, subs, Event(name, data))
        if everyone and name in ALL_RUNS_EVENTS and isinstance(data, dict):
            self._loop.call_soon_threadsafe(self._deliver, everyone, Event(name, {**data, "run_id": run_id}))

    @staticmethod
    def _deliver(subs: list[Subscription], event: Event) -> None:
        for sub in subs:
            sub.put(event)

    def close(self) -> None:
        """End every open stream (server shutdown); call on the loop thread or via `close_threadsafe`."""
        self.closed = True
        with self._lock:
            subs = [s for group in self._subs.values() for s in group]
        for sub in subs:
            sub.put(CLOSED)

    def resync(self, reason: str) -> None:
        """End every open stream with a `dropped` event giving `reason` (events were missed: the clients
        reconnect and reload); call on the loop thread or via `resync_threadsafe`."""
        with self._lock:
            subs = [s for group in self._subs.values() for s in group]
        for sub in subs:
            sub._drop(reason)

    def resync_threadsafe(self, reason: str) -> None:
        """`resync` from any thread."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.resync, reason)

    def close_threadsafe(self) -> None:
        """`close` from any thread (e.g. a signal handler)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.close)
        else:
            self.closed = True


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
