"""What a request must pass before the server holds its body: the token (401/403 before the body is read),
per-route body limits (413 naming the limit), a bounded request head (431) and read timeouts (408).

The head-and-timing checks run against a real `fp8-monitor serve` process, since uvicorn parses the head
before any ASGI code runs."""

from __future__ import annotations

import threading
import time

import httpx
import orjson
import pytest

from tests.support.http import loopback
from tests.support.server import API, raw_exchange, run_body, running_server

TOKENS = "trainer:ingest:trainer-secret-1,ops:read+control:ops-secret-1"
TRAINER = {"Authorization": "Bearer trainer-secret-1"}
OPS = {"Authorization": "Bearer ops-secret-1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server with tokens and short read timeouts (1 s), on SQLite: these checks run before any query."""
    where = tmp_path_factory.mktemp("limits")
    env = {
        "FP8SCOPE_TOKENS": TOKENS,
        "FP8SCOPE_HEADER_TIMEOUT_SECONDS": "1",
        "FP8SCOPE_BODY_TIMEOUT_SECONDS": "1",
    }
    with running_server(f"sqlite:///{where / 'm.db'}", env=env, log_path=where / "server.log") as srv:
        rid = loopback.post(f"{srv.url}{API}/runs", json=run_body(1), headers=TRAINER).json()["id"]
        srv.run_id = rid  # type: ignore[attr-defined]
        yield srv


def head(method: str, path: str, length: int, *extra: str) -> bytes:
    """A request head announcing a `length`-byte JSON body (which is never sent)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/runs"),
        ("PATCH", "/runs/{rid}"),
        ("POST", "/runs/{rid}/commands"),
        ("POST", "/runs/{rid}/telemetry"),
    ],
)
def test_token_checked_before_the_body_is_read(server, method, path):
    """A 50 MB body is announced and never sent: the answer can only come before the body is read."""
    url = API + path.format(rid=server.run_id)
    status, headers, body = raw_exchange(server.port, head(method, url, 50_000_000))
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert orjson.loads(body)["detail"] == "missing bearer token"
    status, _, body = raw_exchange(
        server.port, head(method, url, 50_000_000, "Authorization: Bearer nope-nope")
    )
    assert status == 401 and orjson.loads(body)["detail"] == "unknown token"


def test_scope_checked_before_the_body_is_read(server):
    url = f"{API}/runs/{server.run_id}/commands"
    status, _, body = raw_exchange(
        server.port, head("POST", url, 50_000_000, "Authorization: Bearer trainer-secret-1")
    )
    assert status == 403 and "lacks the scope 'control'" in orjson.loads(body)["detail"]


def test_each_route_has_its_own_body_limit(server):
    """Announced sizes over the route's limit: 413 at once, naming the limit and its setting."""
    rid = server.run_id
    cases = [
        ("POST", f"{API}/runs", 2 * 1024 * 1024, TRAINER, "1048576 bytes (max_registration_bytes)"),
        ("PATCH", f"{API}/runs/{rid}", 100_000, OPS, "65536 bytes (max_control_bytes)"),
        ("POST", f"{API}/runs/{rid}/commands", 100_000, OPS, "65536 bytes (max_control_bytes)"),
        ("POST", f"{API}/runs/{rid}/telemetry", 100 * 2**20, TRAINER, "67108864 bytes (max_body_bytes)"),
    ]
    for method, url, size, token, limit in cases:
        auth = f"Authorization: {token['Authorization']}"
        status, headers, body = raw_exchange(server.port, head(method, url, size, auth))
        assert status == 413, (url, status, body)
        assert headers["content-type"] == "application/json"
        assert orjson.loads(body)["detail"] == f"request body of {size} bytes exceeds the limit of {limit}"
    # a telemetry batch far larger than a registration is still fine
    assert loopback.get(f"{server.url}{API}/runs", headers=OPS).json()[0]["id"] == rid


def test_streamed_body_over_the_route_limit(make_client):
    """Without Content-Length the size is counted as the body streams in; nothing is stored."""
    client = make_client(tokens=TOKENS.split(","))

    def chunks():
        for _ in range(40):
            yield b" " * 32768  # 1.25 MiB in all, over the registration limit

    r = client.post(f"{API}/runs", content=chunks(), headers={**TRAINER, "Content-Type": "application/json"})
    assert r.status_code == 413 and "(max_registration_bytes)" in r.json()["detail"]
    assert client.get(f"{API}/runs", headers=OPS).json() == []


def test_oversized_head_431_while_healthz_answers(server):
    """A 16 MiB header is refused after the first 64 KiB, and other requests are served meanwhile."""
    big = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * (16 * 2**20) + b"\r\n\r\n"
    result: dict[str, object] = {}

    def attack() -> None:
        result["answer"] = raw_exchange(server.port, big, timeout=30)

    thread = threading.Thread(target=attack)
    thread.start()
    worst = 0.0
    with httpx.Client(base_url=server.url, timeout=30) as client:
        while thread.is_alive():
            t0 = time.perf_counter()
            assert client.get("/healthz").status_code == 200
            worst = max(worst, time.perf_counter() - t0)
    thread.join()
    status, _, body = result["answer"]  # type: ignore[misc]
    assert status == 431
    assert "65536 bytes (max_header_bytes)" in orjson.loads(body)["detail"]
    assert worst < 2.0, worst  # generous for a loaded CI machine; the bench measures it properly


def test_slow_clients_get_408(server):
    """A head that stops half-way, and a body that never comes, are answered after the timeouts (1 s)."""
    t0 = time.monotonic()
    status, _, body = raw_exchange(server.port, b"POST /api/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert status == 408 and "(header_timeout_seconds)" in orjson.loads(body)["detail"]
    url = f"{API}/runs/{server.run_id}"
    status, _, body = raw_exchange(server.port, head("PATCH", url, 20, "Authorization: Bearer ops-secret-1"))
    assert status == 408 and "(body_timeout_seconds)" in orjson.loads(body)["detail"]
    assert time.monotonic() - t0 < 14  # each waited about one second, not forever
    assert loopback.get(f"{server.url}{API}/runs/{server.run_id}", headers=OPS).json()["status"] == "running"
