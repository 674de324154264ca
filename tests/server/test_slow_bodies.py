"""A body that trickles in, each piece well within the per-piece timeout, is refused once it falls below
the minimum rate: 408 naming ``body_min_bytes_per_second``, within the grace period plus what its bytes
bought, the connection closed after the answer, and nothing stored. The rate's clock runs only while the
server waits for the client: a server busy before it reads does not refuse a body already sent. Against a
real `fp8-monitor serve` process, and a real uvicorn for the guard on its own (uvicorn reads the body)."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time

import orjson
import pytest
import uvicorn

from monitor_server.core.config import Settings
from monitor_server.infra.guard import RequestGuard
from tests.support.http import loopback
from tests.support.polling import wait_until
from tests.support.server import API, ServerProcess, free_port, run_body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    where = tmp_path_factory.mktemp("slow-bodies")
    env = {
        "FP8SCOPE_BODY_TIMEOUT_SECONDS": "5",  # per piece: a piece every 0.2 s is always in time
        "FP8SCOPE_BODY_MIN_BYTES_PER_SECOND": "1000",
        "FP8SCOPE_BODY_RATE_GRACE_SECONDS": "1",
    }
    with ServerProcess(f"sqlite:///{where / 'm.db'}", log_path=where / "s.log", env=env) as srv:
        srv.run_id = loopback.post(f"{srv.url}{API}/runs", json=run_body(1), timeout=30).json()["id"]
        yield srv


def trickle(port: int, path: str, length: int, piece: bytes, every: float, give_up: float) -> tuple:
    """Announce a `length`-byte JSON body and send `piece` every `every` seconds until an answer comes or
    `give_up` seconds pass: (status or None, seconds to the answer, bytes sent, the answer's body, whether
    the server then closed the connection within 8 s while this client went on sending)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=give_up)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()
    sent = 0
    t0 = time.monotonic()
    try:
        sock.sendall(head)
        while time.monotonic() - t0 < give_up:
            try:
                sock.sendall(piece)
                sent += len(piece)
            except OSError:
                pass
            # the trickle itself: the next piece after `every` seconds, unless the answer comes first
            if select.select([sock], [], [], every)[0]:
                seconds = time.monotonic() - t0
                status, body = read_answer(sock)
                return status, seconds, sent, body, closed_by_server(sock, piece, min(every, 0.5), 8.0)
        return None, time.monotonic() - t0, sent, b"", False
    finally:
        sock.close()


def read_answer(sock: socket.socket) -> tuple[int | None, bytes]:
    """The status and body of an HTTP answer (its head and body may come in separate segments)."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(4096)
        if not chunk:
            break
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    length = next(
        (
            int(v)
            for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
            if k.lower() == b"content-length"
        ),
        0,
    )
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    line = head.split(b"\r\n", 1)[0].split()
    return (int(line[1]) if len(line) > 1 else None), body


def closed_by_server(sock: socket.socket, piece: bytes, every: float, within: float) -> bool:
    """Whether the server closes `sock` within `within` seconds while the client goes on sending `piece`
    every `every` seconds (uvicorn's keep-alive timer is disarmed by every byte that arrives, so a
    connection left open would stay open for as long as the trickle goes on)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            sock.sendall(piece)
            if select.select([sock], [], [], every)[0] and not sock.recv(4096):
                return True  # end of stream
        except OSError:  # reset, or a broken pipe: closed
            return True
    return False


def test_a_trickled_body_is_refused_below_the_minimum_rate(server):
    path = f"{API}/runs/{server.run_id}/telemetry"
    # 100 bytes every 0.2 s: 500 bytes/s, half the minimum rate, each piece 25 times faster than needed
    status, seconds, sent, body, closed = trickle(server.port, path, 1_000_000, b" " * 100, 0.2, give_up=15)
    assert status == 408, f"no answer after {seconds:.1f} s and {sent} bytes"
    assert "(body_min_bytes_per_second)" in orjson.loads(body)["detail"]
    # due at grace + sent / rate: 1 + ~0.5 s; allow the loaded machine a few seconds more
    assert seconds < 6
    # the rest of the body is never read: the server closes the connection instead of keeping it open
    assert closed, "the connection stayed open after the 408"
    run = loopback.get(f"{server.url}{API}/runs/{server.run_id}", timeout=30).json()
    assert run["steps_stored"] == 0


def test_a_body_at_the_minimum_rate_is_read(server):
    """A slow but steady sender (4,000 bytes/s) is not cut off."""
    body = orjson.dumps({"idempotency_key": "slow", "steps": [{"step": 1, "scalars": {"pad": 1.0}}]})
    body = body[:-1] + b" " * (12_000 - len(body)) + b"}"
    path = f"{API}/runs/{server.run_id}/telemetry"
    pieces = [body[i : i + 400] for i in range(0, len(body), 400)]
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.1)  # the slow sender itself
        answer = sock.recv(4096)
    finally:
        sock.close()
    assert answer.split(b"\r\n", 1)[0].split()[1] == b"200", answer[:300]


def test_the_default_rate_refuses_a_trickle_of_1000_bytes_every_5_s_within_5_s(tmp_path):
    """The defaults (1 KiB/s after 2 s): a body sending 1,000 bytes every 5 s is refused before its second
    piece, about 3 s in (grace + what its first 1,000 bytes bought), not after the next piece."""
    with ServerProcess(f"sqlite:///{tmp_path / 'd.db'}", log_path=tmp_path / "s.log") as srv:
        run_id = loopback.post(f"{srv.url}{API}/runs", json=run_body(1), timeout=30).json()["id"]
        path = f"{API}/runs/{run_id}/telemetry"
        status, seconds, sent, body, closed = trickle(srv.port, path, 1_000_000, b" " * 1000, 5.0, give_up=20)
        assert status == 408 and "(body_min_bytes_per_second)" in orjson.loads(body)["detail"]
        assert sent == 1000, f"answered only after {sent} bytes"
        assert 2.0 <= seconds < 4.5
        assert closed
        assert loopback.get(f"{srv.url}{API}/runs/{run_id}", timeout=30).json()["steps_stored"] == 0


class GuardedEcho:
    """A real uvicorn serving the request guard around an app that is busy for `busy_s` (other requests,
    a full thread pool) before it reads the body, then answers with the body's length."""

    def __init__(self, busy_s: float, **settings: float):
        self.busy_s = busy_s
        guard_settings = Settings(db_url="sqlite://", **settings)
        self.app = RequestGuard(self.echo, guard_settings, routes=[])
        self.port = free_port()
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def echo(self, scope, receive, send) -> None:
        await asyncio.sleep(self.busy_s)  # the server's own work before it gets to this body
        size, more = 0, True
        while more:
            message = await receive()
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        body = orjson.dumps({"size": size})
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def __enter__(self) -> GuardedEcho:
        self.thread.start()
        assert wait_until(lambda: self.server.started, timeout=15)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def test_time_the_server_spends_before_reading_does_not_count_against_the_client():
    """A client whose whole body is sent at once, to a server that gets to it only after the grace period:
    read (200), not refused as slow: the clock runs while the server waits for the client, not before."""
    with GuardedEcho(busy_s=1.5, body_rate_grace_seconds=0.5, body_min_bytes_per_second=1000) as echo:
        body = b'{"pad":"' + b"x" * 3000 + b'"}'
        r = loopback.post(
            f"http://127.0.0.1:{echo.port}/anything",
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert r.json() == {"size": len(body)}
