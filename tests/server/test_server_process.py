"""Against a real `fp8-monitor serve` subprocess: concurrent writers, restart, server-sent events."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from datetime import datetime

import httpx
import numpy as np
import pytest

from tests.support.http import loopback
from tests.support.server import API, batch_body, decode, random_stats, run_body, running_server

pytestmark = pytest.mark.slow

WRITERS = 16
DURATION_S = 20.0
STEPS_PER_BATCH = 5


def test_sixteen_concurrent_writers_lose_nothing(db_url, tmp_path):
    """16 writers post to the same run for 20 s (with retries of earlier batches): no 5xx, nothing lost. A
    run takes `run_batches_in_flight` (4) batches at once; a writer beyond them gets 429 with Retry-After,
    as a training client does, and sends the same batch again after it (nothing of a 429 is stored)."""
    with running_server(db_url, log_path=tmp_path / "server.log") as srv:
        rid = loopback.post(f"{srv.url}{API}/runs", json=run_body(4)).json()["id"]  # T = 12
        T = 12
        statuses: dict[int, int] = {}
        sent_steps: list[set[int]] = [set() for _ in range(WRITERS)]
        underflow_sum = [np.zeros(T) for _ in range(WRITERS)]
        errors: list[str] = []
        lock = threading.Lock()
        deadline = time.monotonic() + DURATION_S

        def post(client: httpx.Client, body: dict) -> httpx.Response:
            while True:
                r = client.post(f"{API}/runs/{rid}/telemetry", json=body)
                if r.status_code != 429:
                    return r
                with lock:
                    statuses[429] = statuses.get(429, 0) + 1
                time.sleep(float(r.headers["retry-after"]))  # the client's backoff, as the protocol says

        def writer(w: int) -> None:
            rng = np.random.default_rng(w)
            bodies = []
            with httpx.Client(base_url=srv.url, timeout=60) as client:
                k = 0
                while time.monotonic() < deadline:
                    # writer w owns steps [(k*WRITERS + w)*S, +S): interleaved with the other writers
                    first = (k * WRITERS + w) * STEPS_PER_BATCH
                    steps = list(range(first, first + STEPS_PER_BATCH))
                    stats = random_stats(rng, STEPS_PER_BATCH, T)
                    body = batch_body(f"w{w}-{k}", steps, stats, "float64" if k % 2 else "json")
                    if random.random() < 0.1 and bodies:
                        resend = random.choice(bodies)  # a client retry: must be a duplicate
                        r = post(client, resend)
                        with lock:
                            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                        if r.status_code != 200 or not r.json()["duplicate"]:
                            errors.append(f"resend: {r.status_code} {r.text[:200]}")
                    r = post(client, body)
                    with lock:
                        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    if r.status_code != 200 or r.json()["stored_steps"] != STEPS_PER_BATCH:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                        return
                    bodies.append(body)
                    sent_steps[w].update(steps)
                    underflow_sum[w] += stats["underflow"].sum(axis=0)
                    k += 1

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:5]
        assert set(statuses) <= {200, 429} and statuses[200] > 0, statuses  # no 5xx, no other refusal
        expected_steps = set().union(*sent_steps)
        assert len(expected_steps) > WRITERS * 5 * STEPS_PER_BATCH  # it really ran concurrently for a while
        run = loopback.get(f"{srv.url}{API}/runs/{rid}").json()
        assert run["steps_stored"] == len(expected_steps)
        assert run["last_step"] == max(expected_steps)
        # the rollups saw every step exactly once: one bucket summing the whole run
        hm = loopback.get(
            f"{srv.url}{API}/runs/{rid}/heatmap", params={"metric": "underflow", "max_cols": 1}
        ).json()
        assert sum(hm["bucket_steps"]) == len(expected_steps)
        np.testing.assert_allclose(decode([row[0] for row in hm["values"]]), sum(underflow_sum))
        assert "database is locked" not in srv.log_text()


def test_restart_keeps_data(db_url, tmp_path):
    """Kill -9 the server, start a new one on the same database: runs, steps, commands, keys survive."""
    stats = random_stats(np.random.default_rng(5), 20, 6)
    with running_server(db_url, log_path=tmp_path / "a.log") as srv:
        rid = loopback.post(f"{srv.url}{API}/runs", json=run_body(2)).json()["id"]
        body = batch_body("before", range(20), stats, "float64", losses=np.linspace(3, 2, 20))
        assert loopback.post(f"{srv.url}{API}/runs/{rid}/telemetry", json=body).json()["stored_steps"] == 20
        cmd = loopback.post(f"{srv.url}{API}/runs/{rid}/commands", json={"changes": {"margin": 3}}).json()
        delivered = loopback.post(
            f"{srv.url}{API}/runs/{rid}/telemetry", json=batch_body("deliver", [], stats)
        )
        assert [c["id"] for c in delivered.json()["commands"]] == [cmd["id"]]
        heatmap_before = loopback.get(f"{srv.url}{API}/runs/{rid}/heatmap", params={"max_cols": 7}).json()
        srv.stop(signal.SIGKILL)
    with running_server(db_url, log_path=tmp_path / "b.log") as srv:
        run = loopback.get(f"{srv.url}{API}/runs/{rid}").json()
        assert run["steps_stored"] == 20 and run["last_step"] == 19 and run["last_loss"] == 2.0
        assert (
            loopback.get(f"{srv.url}{API}/runs/{rid}/heatmap", params={"max_cols": 7}).json()
            == heatmap_before
        )
        again = loopback.post(f"{srv.url}{API}/runs/{rid}/telemetry", json=body).json()
        assert again["duplicate"] and again["stored_steps"] == 0
        ack = batch_body(
            "after",
            [20],
            {k: v[:1] for k, v in stats.items()},
            acks=[{"command_id": cmd["id"], "state": "applied", "step": 20}],
        )
        assert loopback.post(f"{srv.url}{API}/runs/{rid}/telemetry", json=ack).json()["stored_steps"] == 1
        run = loopback.get(f"{srv.url}{API}/runs/{rid}").json()
        assert run["effective_recipe"]["model"]["margin"] == 3 and run["steps_stored"] == 21


def _read_events(lines, want: str, timeout: float) -> tuple[list[tuple[str, str]], list[str]]:
    """Read SSE lines until an event named `want` arrives; returns (events, comments)."""
    events, comments, name = [], [], None
    deadline = time.monotonic() + timeout
    for line in lines:
        if line.startswith(":"):
            comments.append(line)
        elif line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: ") and name:
            events.append((name, line[len("data: ") :]))
            if name == want:
                break
        if time.monotonic() > deadline:
            break
    return events, comments


def _read_comment(lines, needle: str, timeout: float) -> bool:
    """Read SSE lines until a comment containing `needle` arrives (True) or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    for line in lines:
        if line.startswith(":") and needle in line:
            return True
        if time.monotonic() > deadline:
            return False
    return False


def _instant(iso: str) -> datetime:
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


def test_sse_step_event_keepalive_and_clean_shutdown(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'sse.db'}"
    env = {"FP8SCOPE_SSE_KEEPALIVE_SECONDS": "0.3"}
    with running_server(db_url, log_path=tmp_path / "sse.log", env=env) as server:
        rid = loopback.post(f"{server.url}{API}/runs", json=run_body(1)).json()["id"]
        stats = random_stats(np.random.default_rng(0), 1, 3)
        stats["amax"][0, 2] = 123.0
        with loopback.stream("GET", f"{server.url}{API}/runs/{rid}/stream", timeout=10) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            lines = resp.iter_lines()
            # the stream says it is subscribed, then, with nothing to send, keeps the connection alive
            events, comments = _read_events(lines, "subscribed", timeout=30)
            assert events == [("subscribed", "{}")]
            assert _read_comment(lines, "keep-alive", timeout=30)
            spike = {"kind": "loss_spike", "step": 41, "details": {"z": 9.5}}
            body = batch_body("s", [41], stats, losses=[1.5], events=[spike])
            assert loopback.post(f"{server.url}{API}/runs/{rid}/telemetry", json=body).status_code == 200
            events, comments = _read_events(lines, "event", timeout=30)
            step = [e for e in events if e[0] == "step"]
            assert step and '"step":41' in step[0][1] and '"max_amax":123.0' in step[0][1]
            assert '"loss":1.5' in step[0][1] and '"steps_stored":1' in step[0][1]
            # the client event follows its step on the stream (light: small details whole), as the list
            # shows it: under its stored id, which reads the event whole
            light = {**spike, "details_bytes": len(json.dumps(spike["details"], separators=(",", ":")))}
            (streamed,) = [json.loads(d) for n, d in events if n == "event"]
            (listed,) = loopback.get(f"{server.url}{API}/runs/{rid}/events").json()
            assert streamed == {
                **light,
                "details_complete": True,
                "id": listed["id"],
                "run_id": rid,
                "created_at": streamed["created_at"],
            }
            assert _instant(streamed["created_at"]) == _instant(listed["created_at"])
            whole = loopback.get(f"{server.url}{API}/runs/{rid}/events/{streamed['id']}").json()
            assert whole["details"] == spike["details"] and whole["step"] == 41
            # a command shows up as a `command` event
            loopback.post(f"{server.url}{API}/runs/{rid}/commands", json={"changes": {"margin": 1}})
            events, _ = _read_events(lines, "command", timeout=30)
            assert any(name == "command" and '"state":"pending"' in data for name, data in events)

            # shutdown with the stream still open: the server ends it and exits promptly
            t0 = time.monotonic()
            ended = threading.Event()

            def drain() -> None:
                try:
                    for _ in lines:
                        pass
                except httpx.HTTPError:
                    pass
                ended.set()

            reader = threading.Thread(target=drain, daemon=True)
            reader.start()
            code = server.stop(signal.SIGTERM, timeout=15)
            assert code in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a graceful shutdown
            assert ended.wait(5)
            assert time.monotonic() - t0 < 10


def test_sse_unknown_run_404(client):
    assert client.get(f"{API}/runs/987654/stream").status_code == 404
