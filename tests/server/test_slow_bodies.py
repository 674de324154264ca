"""A body that trickles in, each piece well within the per-piece timeout, is refused once it falls below
the minimum rate: 408 naming ``body_min_bytes_per_second``, within the grace period plus what its bytes
bought, and nothing stored. Against a real `fp8-monitor serve` process (uvicorn reads the body)."""

from __future__ import annotations

import socket
import time

import httpx
import orjson
import pytest

from tests.support.server import API, ServerProcess, run_body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    where = tmp_path_factory.mktemp("slow-bodies")
    env = {
        "FP8SCOPE_BODY_TIMEOUT_SECONDS": "5",  # per piece: a piece every 0.2 s is always in time
        "FP8SCOPE_BODY_MIN_BYTES_PER_SECOND": "1000",
        "FP8SCOPE_BODY_RATE_GRACE_SECONDS": "1",
    }
    with ServerProcess(f"sqlite:///{where / 'm.db'}", log_path=where / "s.log", env=env) as srv:
        srv.run_id = httpx.post(f"{srv.url}{API}/runs", json=run_body(1), timeout=30).json()["id"]
        yield srv


def trickle(port: int, path: str, length: int, piece: bytes, every: float, give_up: float) -> tuple:
    """Announce a `length`-byte JSON body and send `piece` every `every` seconds until an answer comes or
    `give_up` seconds pass: (status or None, seconds to the answer, bytes sent, the answer's body)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=give_up)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()
    sent = 0
    t0 = time.monotonic()
    try:
        sock.sendall(head)
        sock.setblocking(False)
        while time.monotonic() - t0 < give_up:
            try:
                answer = sock.recv(4096)
            except BlockingIOError:
                answer = None
            if answer is not None:
                line = answer.split(b"\r\n", 1)[0].split()
                status = int(line[1]) if len(line) > 1 else None
                body = answer.split(b"\r\n\r\n", 1)[-1]
                return status, time.monotonic() - t0, sent, body
            try:
                sock.sendall(piece)
                sent += len(piece)
            except OSError:
                pass
            time.sleep(every)  # the trickle itself, not a wait on the server
        return None, time.monotonic() - t0, sent, b""
    finally:
        sock.close()


def test_a_trickled_body_is_refused_below_the_minimum_rate(server):
    path = f"{API}/runs/{server.run_id}/telemetry"
    # 100 bytes every 0.2 s: 500 bytes/s, half the minimum rate, each piece 25 times faster than needed
    status, seconds, sent, body = trickle(server.port, path, 1_000_000, b" " * 100, 0.2, give_up=15)
    assert status == 408, f"no answer after {seconds:.1f} s and {sent} bytes"
    assert "(body_min_bytes_per_second)" in orjson.loads(body)["detail"]
    # due at grace + sent / rate: 1 + ~0.5 s; allow the loaded machine a few seconds more
    assert seconds < 6
    run = httpx.get(f"{server.url}{API}/runs/{server.run_id}", timeout=30).json()
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
