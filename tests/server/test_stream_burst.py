"""A burst of stream events never silently loses the oldest: a real server stores a batch of 2,500 client
events while a real SSE reader is not reading; the reader then gets every event, or is told (a `dropped`
event, then the end of its stream) and reloads to find every stored one. On SQLite with one server, and on
PostgreSQL with the reader on a second instance (the events relayed by LISTEN/NOTIFY); client events too
large for a notification still reach the other instance."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.http import loopback
from tests.support.server import API, ServerProcess, pg_database_or_skip, run_body

#: events of ~4 KB (just under the size a list carries whole): more than the server's socket buffers (at
#: most 4 MiB here) and the 1,000 a stream may fall behind together, less than its 8 MiB byte bound
BURST = 2500
NOTE = "n" * 3900


class SlowReader:
    """A run's SSE stream on a socket with a small receive buffer, read only when asked (`read_until`)."""

    def __init__(self, server: ServerProcess, run_id: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
        # the small buffer is set before connecting, so that the window offered is small from the start
        # (shrunk later, data past it is dropped and resent after ever longer back-offs)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(20)
        sock.connect(("127.0.0.1", server.port))
        self.conn.sock = sock
        self.conn.request("GET", f"{API}/runs/{run_id}/stream", headers={"Accept": "text/event-stream"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.events: list[tuple[str, Any]] = []
        self.ended = False
        self.read_until(lambda: self.names()[:1] == ["subscribed"])

    def names(self) -> list[str]:
        return [name for name, _ in self.events]

    def of(self, name: str) -> list[Any]:
        return [data for n, data in self.events if n == name]

    def read_until(self, done, timeout: float = 60.0) -> None:
        """Read events until `done()` holds, the stream ends or `timeout` seconds pass (what the reader
        waits for was lost: keep-alive comments still come)."""
        name = None
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            line = self.resp.readline()
            if not line:
                self.ended = True
                return
            line = line.rstrip(b"\n")
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: ") and name is not None:
                self.events.append((name, json.loads(line[6:])))
                name = None

    def close(self) -> None:
        self.conn.close()


def post_events(server: ServerProcess, run_id: int, events: list[dict]) -> None:
    body = {"idempotency_key": f"burst-{len(events)}", "events": events}
    r = loopback.post(f"{server.url}{API}/runs/{run_id}/telemetry", json=body, timeout=120)
    assert r.status_code == 200, r.text


def stored_ids(server: ServerProcess, run_id: int) -> list[int]:
    r = loopback.get(f"{server.url}{API}/runs/{run_id}/events", params={"limit": 5000}, timeout=60)
    return [e["id"] for e in r.json()]


ENV = {"FP8SCOPE_SSE_KEEPALIVE_SECONDS": "1"}


@pytest.fixture(params=["sqlite", "postgresql"])
def writer_and_reader(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[ServerProcess, ...]]:
    """(the server a batch is posted to, the server the stream is read from): one SQLite server, or two
    instances on one PostgreSQL database."""
    if request.param == "sqlite":
        with ServerProcess(f"sqlite:///{tmp_path / 'm.db'}", log_path=tmp_path / "s.log", env=ENV) as one:
            yield one, one
        return
    with (
        pg_database_or_skip("fp8scope_burst") as url,
        ServerProcess(url, log_path=tmp_path / "a.log", env=ENV) as a,
        ServerProcess(url, log_path=tmp_path / "b.log", env=ENV) as b,
    ):
        yield a, b


def test_a_burst_of_events_reaches_the_reader_or_tells_it(writer_and_reader):
    writer, reader_on = writer_and_reader
    run_id = loopback.post(f"{writer.url}{API}/runs", json=run_body(1), timeout=30).json()["id"]
    reader = SlowReader(reader_on, run_id)
    try:
        events = [{"kind": "custom", "step": i, "details": {"i": i, "note": NOTE}} for i in range(BURST)]
        post_events(writer, run_id, events)
        got: list[int] = []

        def finished() -> bool:
            got[:] = [e["id"] for e in reader.of("event")]
            return len(got) == BURST or "dropped" in reader.names()

        reader.read_until(finished)
        stored = stored_ids(writer, run_id)
        assert len(stored) == BURST
        if "dropped" in reader.names():  # told: its stream ends, and a reload finds every event
            reader.read_until(lambda: False)
            assert reader.ended and reader.names()[-1] == "dropped"
            assert "reload" in reader.of("dropped")[0]["reason"]
            assert stored_ids(reader_on, run_id) == stored
        else:
            assert sorted(got) == sorted(stored), f"the reader got {len(got)} of {len(stored)} events"
    finally:
        reader.close()


def test_client_events_too_large_to_notify_reach_the_other_instance(tmp_path):
    """Details of 40 long fields: their summary in the light form must not make the event too large for a
    notification (or, if it were, the other instance must read it back)."""
    with (
        pg_database_or_skip("fp8scope_burst") as url,
        ServerProcess(url, log_path=tmp_path / "a.log", env=ENV) as a,
        ServerProcess(url, log_path=tmp_path / "b.log", env=ENV) as b,
    ):
        run_id = loopback.post(f"{a.url}{API}/runs", json=run_body(1), timeout=30).json()["id"]
        reader = SlowReader(b, run_id)
        try:
            details = {f"field_{'k' * 100}_{j}": "v" * 400 for j in range(40)}
            post_events(a, run_id, [{"kind": "custom", "step": 3, "details": details}])
            reader.read_until(lambda: bool(reader.of("event")))
            (event,) = reader.of("event")
            assert event["step"] == 3 and event["details_complete"] is False
            assert event["id"] == stored_ids(a, run_id)[0]
        finally:
            reader.close()


class ChunkCounter:
    """A run's SSE stream read straight off the socket: the HTTP chunks (one per write of the server) and
    the client events they carried."""

    def __init__(self, server: ServerProcess, run_id: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        self.sock.sendall(f"GET {API}/runs/{run_id}/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        self.buffer = b""
        head = self._until(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower()
        self.chunks: list[bytes] = []
        while b"event: subscribed" not in b"".join(self.chunks):
            self.chunks.append(self._chunk())
        self.chunks.clear()

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            data = self.sock.recv(65536)
            assert data, "the stream ended"
            self.buffer += data
        part, _, self.buffer = self.buffer.partition(marker)
        return part

    def _chunk(self) -> bytes:
        size = int(self._until(b"\r\n").split(b";")[0], 16)
        while len(self.buffer) < size + 2:
            data = self.sock.recv(65536)
            assert data, "the stream ended"
            self.buffer += data
        chunk, self.buffer = self.buffer[:size], self.buffer[size + 2 :]
        return chunk

    def read_events(self, n: int) -> int:
        """Read chunks until `n` client events came (keep-alive comments are chunks of their own and are
        not counted); the chunks that carried them."""
        carried = 0
        while sum(c.count(b"event: event\n") for c in self.chunks) < n:
            chunk = self._chunk()
            if b"event: " in chunk:
                self.chunks.append(chunk)
                carried += 1
        return carried

    def close(self) -> None:
        self.sock.close()


def test_a_burst_goes_out_in_few_writes(tmp_path):
    """A batch of 300 client events reaches a reading stream in a handful of writes (the frames waiting in
    the queue joined, up to 64 KiB a write), not one write per event: each write is a turn of the event
    loop that every other request waits for."""
    with ServerProcess(f"sqlite:///{tmp_path / 'm.db'}", log_path=tmp_path / "s.log", env=ENV) as server:
        run_id = loopback.post(f"{server.url}{API}/runs", json=run_body(1), timeout=30).json()["id"]
        reader = ChunkCounter(server, run_id)
        try:
            n = 300
            events = [{"kind": "custom", "step": i, "details": {"i": i, "note": "n" * 500}} for i in range(n)]
            post_events(server, run_id, events)
            writes = reader.read_events(n)
            steps = [
                json.loads(line[6:])["step"]
                for c in reader.chunks
                for line in c.split(b"\n")
                if line.startswith(b"data: ")
            ]
            assert steps == list(range(n))  # every event, in order
            assert writes <= 30, f"{n} events came in {writes} writes"
        finally:
            reader.close()
