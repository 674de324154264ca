"""uvicorn's httptools protocol with a bound on the request head: its size (431) and the time it may take
to arrive (408).

uvicorn with httptools has no header size limit, and httptools joins a header that arrives in pieces by
concatenation, so parsing one huge header costs time quadratic in its size, on the event loop, while every
other request waits. An ASGI middleware sees the request only after that parse. This protocol counts the
bytes of the request head before they reach the parser and answers 431 once the head outgrows the limit,
without parsing it; a head that dribbles in slower than the timeout (a slow-header client holding a
connection) gets 408. Both close the connection.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_END_OF_HEAD = b"\r\n\r\n"
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _Throttled:
    """A warning at most every `every_s` seconds, with the number left out since: a thousand slow clients
    timing out together must not cost a thousand log lines on the event loop."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0):
        self.logger, self.every_s = logger, every_s
        self.last, self.left_out = -math.inf, 0

    def warning(self, message: str) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.left_out += 1
            return
        more = f" (and {self.left_out} more refusals since the last report)" if self.left_out else ""
        self.logger.warning("refused a request: %s%s", message, more)
        self.last, self.left_out = now, 0


def bounded_protocol(max_header_bytes: int, header_timeout_s: float) -> type[asyncio.Protocol]:
    """An httptools protocol class for uvicorn's ``http=`` that enforces these two limits."""
    limits = {
        "max_header_bytes": max_header_bytes,
        "header_timeout_s": header_timeout_s,
        "refusals": _Throttled(logging.getLogger("uvicorn.error")),
    }
    return type("BoundedHttpToolsProtocol", (_BoundedHttpToolsProtocol,), limits)


class _BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that counts the request head's bytes and times its arrival; the limits
    are class attributes, set by `bounded_protocol` on a subclass (uvicorn builds one instance per
    connection from the class alone)."""

    max_header_bytes: int
    header_timeout_s: float
    refusals: _Throttled  # one per server: its refusals share the log throttle

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # between requests too: the next bytes start a head
        self._head_bytes = 0
        self._tail = b""  # the last bytes of the head so far: its end may straddle two reads
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # a client that connects and sends nothing holds a connection too
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the answer is sent and the connection closing: nothing more is parsed
        if self._in_head and not self._count_head(data):
            return
        super().data_received(data)

    def _count_head(self, data: bytes) -> bool:
        """Add the head's share of `data` to its size (up to its end, which may straddle two reads); False
        once the head outgrows the limit (answered with 431: `data` is not parsed)."""
        window = self._tail + data
        end = window.find(_END_OF_HEAD)
        added = end + len(_END_OF_HEAD) - len(self._tail) if end >= 0 else len(data)
        size = self._head_bytes + added
        if size > self.max_header_bytes:
            limit = f"the limit of {self.max_header_bytes} bytes (max_header_bytes)"
            self._refuse(431, f"request line and headers exceed {limit}")
            return False
        if end < 0:
            self._head_bytes = size
            self._tail = window[-(len(_END_OF_HEAD) - 1) :]
        if self._head_timer is None:
            self._arm_head_timer()
        return True

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes, self._tail = True, 0, b""

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        # up to 10 % later at random: a thousand slow clients that connected together time out spread
        # over a while, between other requests, not all in one turn of the event loop
        delay = self.header_timeout_s * random.uniform(1.0, 1.1)
        self._head_timer = self.loop.call_later(delay, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            limit = f"{self.header_timeout_s:g} s (header_timeout_seconds)"
            self._refuse(408, f"request line and headers not received within {limit}")

    def _refuse(self, status: int, detail: str) -> None:
        self._cancel_head_timer()
        self._refused = True
        self.refusals.warning(detail)
        body = orjson.dumps({"detail": detail})
        head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])
        head += b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
        self.transport.write(head + b"connection: close\r\n\r\n" + body)
        # a lingering close: closing with the client's bytes still unread would reset the connection
        # and could destroy the answer before the client reads it, so end our side, discard what
        # still arrives (data_received returns at once), and close when the client does or after 2 s
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(2.0, self.transport.close)

    def eof_received(self) -> bool | None:
        if self._refused:
            self.transport.close()
        return super().eof_received()
