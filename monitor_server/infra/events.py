"""In-process publish/subscribe for the server-sent event stream.

Publishers may be worker threads (ingest runs in the threadpool); an event is encoded once, in the
publisher's thread, and its bytes are shared by every subscriber's queue; delivery hops onto the event loop
with `call_soon_threadsafe`, once per publishing call: a batch's events (1,500 client events, the alerts of
a NaN in every tensor) go as one `publish_many`, one hop onto the loop and one hand-over to the relay, not
one per event, their frames joined into writes of up to `WRITE_BYTES` (a queue item each). A subscriber
that falls behind, by count (`QUEUE_SIZE` queue items: events published one by one, or a batch's joined
writes) or by bytes (`max_queue_bytes` of unsent events: a client that stopped reading), or while all
subscribers together hold more than `max_total_bytes`, is dropped: its queue is freed and it gets a final
`dropped` event saying why, then the end of its stream, so that the page reconnects and reloads instead of
silently missing events.
One token holds at most `max_streams_per_token` streams (`StreamLimit` beyond).
`stream_events` turns a subscription into the frames of a streaming response, the frames waiting in its
queue joined into one write (up to `WRITE_BYTES`).

Several server instances on one PostgreSQL database: a relay (`monitor_server.infra.events_pg`) attached with
`attach` gets every published event to send to the other instances, and hands theirs to `deliver`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

#: queue items (single events, or the joined writes of a batch's events) one subscriber may have waiting;
#: one more and it is dropped (told to reload)
QUEUE_SIZE = 1000
#: default byte bound of one subscriber's queue (`Settings.sse_queue_bytes`)
QUEUE_BYTES = 8 * 1024 * 1024
#: default bound of all subscribers' queues together, as each counts its frames (`Settings.sse_total_bytes`)
TOTAL_BYTES = 256 * 1024 * 1024
#: default bound of the streams one token holds open (`Settings.sse_streams_per_token`)
STREAMS_PER_TOKEN = 100
#: subscription key receiving every run's events (the dashboard's runs list); its events carry `run_id`
ALL_RUNS = 0
#: frames joined into one write of a stream when several wait in its queue
WRITE_BYTES = 64 * 1024
#: the events `ALL_RUNS` subscribers get (what a runs list shows); command and client events stay per run
ALL_RUNS_EVENTS = frozenset({"step", "alert", "incident", "run"})


@dataclass(frozen=True)
class Event:
    """One server-sent event: its `event` name and `data`, JSON-able but for datetimes. `encode` is the
    one place events are serialised (publishers hand over their dicts as they are): datetimes become
    ISO-8601 strings there (orjson's encoding is `datetime.isoformat`'s), as the relay's payloads do."""

    name: str
    data: Any

    def encode(self) -> bytes:
        """The SSE wire form (``event:`` and ``data:`` lines and a blank line)."""
        return b"event: " + self.name.encode() + b"\ndata: " + orjson.dumps(self.data) + b"\n\n"


CLOSED = Event("__closed__", None)


def joined(frames: list[bytes], limit: int = WRITE_BYTES) -> list[bytes]:
    """`frames` joined in order into pieces of at most `limit` bytes (a larger frame is a piece of its own):
    each piece is one queue item and one write of a stream, so a subscriber's count bound (`QUEUE_SIZE`)
    counts writes, and a burst of a thousand small events is not a thousand."""
    if len(frames) == 1:
        return frames
    pieces: list[bytes] = []
    group: list[bytes] = []
    size = 0
    for frame in frames:
        if group and size + len(frame) > limit:
            pieces.append(b"".join(group))
            group, size = [], 0
        group.append(frame)
        size += len(frame)
    if group:
        pieces.append(b"".join(group))
    return pieces


class Relay(Protocol):
    """Where a broker sends its events for the other server instances (a relay may also have
    ``send_many(run_id, name, items)``, taking several events of one name at once)."""

    def send(self, run_id: int, name: str, data: Any) -> None: ...


class StreamLimit(Exception):
    """The token holds `EventBroker.max_streams_per_token` streams already (the route answers 429)."""


class Subscription:
    """A subscriber's queue for one run; iterate with `get` (events come out encoded, as SSE frames)."""

    def __init__(
        self, broker: EventBroker, run_id: int, max_bytes: int = QUEUE_BYTES, owner: str | None = None
    ):
        self.run_id = run_id
        self.owner = owner
        # one place more than QUEUE_SIZE: the last word of a subscriber dropped for its count
        self.queue: asyncio.Queue[bytes | Event] = asyncio.Queue(maxsize=QUEUE_SIZE + 2)
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self.dropped = False
        self.created = time.time()  # wall clock: compared with when another instance lost events
        self._broker = broker

    def put(self, item: bytes | Event) -> None:
        """Enqueue an encoded frame (shared with the other subscribers) or `CLOSED` on the loop thread. A
        subscriber that falls behind by count, by bytes, or while every subscriber together holds more than
        the broker's total, is dropped: a final `dropped` event, then the end of the stream."""
        if self.dropped:
            return
        if not isinstance(item, bytes):  # CLOSED: there is always room for it
            with contextlib.suppress(asyncio.QueueFull):
                self.queue.put_nowait(item)
            return
        size = len(item)
        if self.queue.qsize() >= QUEUE_SIZE:
            self._drop(
                f"this client fell behind by more than {QUEUE_SIZE} events; reconnect and reload",
            )
        elif self.queued_bytes + size > self.max_bytes:
            self._drop()
        elif self.queued_bytes and self._broker.total_bytes + size > self._broker.max_total_bytes:
            self._drop(
                f"the server holds more than {self._broker.max_total_bytes} bytes of events for slow"
                " clients (sse_total_bytes); reconnect and reload"
            )
        else:
            self.queue.put_nowait(item)
            self._count(size)

    def _count(self, size: int) -> None:
        self.queued_bytes += size
        self._broker.total_bytes += size

    def _drop(self, reason: str | None = None) -> None:
        """Free the queue, leave a last word and the end of the stream, and stop receiving."""
        if self.dropped:
            return
        self.dropped = True
        while not self.queue.empty():
            self.queue.get_nowait()
        self._count(-self.queued_bytes)
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
        if isinstance(item, bytes) and self.queued_bytes:
            self._count(-len(item))
        return item

    def get_nowait(self) -> bytes | Event | None:
        """The next SSE frame (or `CLOSED`) if one waits, else None."""
        try:
            item = self.queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        if isinstance(item, bytes) and self.queued_bytes:
            self._count(-len(item))
        return item

    def close(self) -> None:
        """Stop receiving events (on the loop thread); what waits in the queue no longer counts."""
        self._broker.unsubscribe(self)
        self.dropped = True
        self._count(-self.queued_bytes)


class EventBroker:
    """Fan-out of run events to SSE subscribers."""

    def __init__(
        self,
        max_queue_bytes: int = QUEUE_BYTES,
        max_total_bytes: int = TOTAL_BYTES,
        max_streams_per_token: int = STREAMS_PER_TOKEN,
    ) -> None:
        self.max_queue_bytes = max_queue_bytes
        self.max_total_bytes = max_total_bytes
        self.max_streams_per_token = max_streams_per_token
        #: bytes of frames waiting in every subscriber's queue, each counting its own (changed on the loop)
        self.total_bytes = 0
        self._streams: dict[str, int] = {}  # open subscriptions per token name
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

    def subscribe(self, run_id: int, owner: str | None = None) -> Subscription:
        """A new subscription to `run_id`'s events (`ALL_RUNS`: every run's) for the token named `owner`;
        call from the event loop.

        Raises:
            StreamLimit: `owner` holds `max_streams_per_token` subscriptions already.
        """
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        sub = Subscription(self, run_id, self.max_queue_bytes, owner)
        with self._lock:
            if owner is not None:
                held = self._streams.get(owner, 0)
                if held >= self.max_streams_per_token:
                    raise StreamLimit(
                        f"token {owner!r} holds {held} event streams, the limit (sse_streams_per_token);"
                        " close one first"
                    )
                self._streams[owner] = held + 1
            self._subs.setdefault(run_id, set()).add(sub)
        if self.closed:
            sub.put(CLOSED)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Remove a subscription (idempotent)."""
        with self._lock:
            subs = self._subs.get(sub.run_id)
            if subs is not None and sub in subs:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.run_id]
                if sub.owner is not None:
                    left = self._streams.get(sub.owner, 1) - 1
                    if left > 0:
                        self._streams[sub.owner] = left
                    else:
                        self._streams.pop(sub.owner, None)

    def publish(self, run_id: int, name: str, data: Any) -> None:
        """Send an event to `run_id`'s subscribers, here and (through the relay) on the other instances;
        safe to call from any thread."""
        self.publish_many(run_id, name, [data])

    def publish_many(self, run_id: int, name: str, items: list[Any]) -> None:
        """Send several events of one name to `run_id`'s subscribers, in order, here and on the other
        instances, at the cost of one: one hop onto the event loop, one hand-over to the relay. Safe to
        call from any thread."""
        if not items:
            return
        self.deliver_many(run_id, name, items)
        relay = self._relay
        if relay is not None:
            send_many = getattr(relay, "send_many", None)
            if send_many is not None:
                send_many(run_id, name, items)
            else:
                for data in items:
                    relay.send(run_id, name, data)

    def deliver(self, run_id: int, name: str, data: Any) -> None:
        """Send an event to `run_id`'s subscribers of this instance; safe to call from any thread."""
        self.deliver_many(run_id, name, [data])

    def deliver_many(self, run_id: int, name: str, items: list[Any]) -> None:
        """Send events of one name to `run_id`'s subscribers of this instance, in order, with one hop onto
        the event loop; safe to call from any thread."""
        with self._lock:
            subs = list(self._subs.get(run_id, ()))
            everyone = list(self._subs.get(ALL_RUNS, ()))
        if not (subs or everyone) or self._loop is None or self._loop.is_closed():
            return
        # encoded once, here in the publisher's thread, and joined into writes: every subscriber's queue
        # holds the same bytes, a batch's events as a few queue items of up to WRITE_BYTES each
        if subs:
            chunks = joined([Event(name, data).encode() for data in items])
            self._loop.call_soon_threadsafe(self._deliver, subs, chunks)
        if everyone and name in ALL_RUNS_EVENTS:
            frames = [Event(name, {**d, "run_id": run_id}).encode() for d in items if isinstance(d, dict)]
            if frames:
                self._loop.call_soon_threadsafe(self._deliver, everyone, joined(frames))

    @staticmethod
    def _deliver(subs: list[Subscription], frames: list[bytes]) -> None:
        for sub in subs:
            for frame in frames:
                sub.put(frame)

    def close(self) -> None:
        """End every open stream (server shutdown); call on the loop thread or via `close_threadsafe`."""
        self.closed = True
        with self._lock:
            subs = [s for group in self._subs.values() for s in group]
        for sub in subs:
            sub.put(CLOSED)

    def resync(self, reason: str, before: float | None = None) -> None:
        """End every open stream (with `before`, a wall-clock time: those opened before it) with a `dropped`
        event giving `reason` (events were missed: the clients reconnect and reload); call on the loop
        thread or via `resync_threadsafe`."""
        with self._lock:
            subs = [s for group in self._subs.values() for s in group]
        for sub in subs:
            if before is None or sub.created < before:
                sub._drop(reason)

    def resync_threadsafe(self, reason: str, before: float | None = None) -> None:
        """`resync` from any thread."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.resync, reason, before)

    def close_threadsafe(self) -> None:
        """`close` from any thread (e.g. a signal handler)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.close)
        else:
            self.closed = True


async def stream_events(sub: Subscription, keepalive_s: float) -> AsyncIterator[bytes]:
    """Yield SSE frames until the broker closes (shutdown); the response cancels us on disconnect. Frames
    that wait in the queue together go out as one write (up to `WRITE_BYTES`): a burst of a thousand
    events costs the event loop a few dozen writes, not a thousand."""
    try:
        # a first event: a client (or a test) knows from it that it is subscribed and will miss nothing
        yield b"retry: 2000\nevent: subscribed\ndata: {}\n\n"
        while True:
            event = await sub.get(keepalive_s)
            if event is None:
                yield b": keep-alive\n\n"
                continue
            if event is CLOSED:
                return
            frames, size, closed = [event], len(event), False
            while size < WRITE_BYTES:
                more = sub.get_nowait()
                if more is None:
                    break
                if more is CLOSED:
                    closed = True
                    break
                frames.append(more)
                size += len(more)
            yield frames[0] if len(frames) == 1 else b"".join(frames)
            if closed:
                return
    finally:
        sub.close()
