"""Lists that stay light whatever a token holder sends: event summaries bounded in keys and bytes, client
alerts with a small evidence summary (the whole details stay at /events/{id}) and a bounded message, one
encoding of each stream event shared by every subscriber, a bound on what all slow subscribers hold
together, and on the streams one token holds open."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import orjson
import pytest

from monitor_server.infra.events import EventBroker
from tests.support.http import loopback
from tests.support.polling import wait_until
from tests.support.server import API, ServerProcess, create_run

LONG_KEYS = {("k" * 5000) + str(j): "v" * 200 for j in range(32)}


def test_event_summaries_bound_their_keys_and_bytes(client):
    rid = create_run(client)["id"]
    body = {"idempotency_key": "keys", "events": [{"kind": "custom", "step": 1, "details": LONG_KEYS}]}
    assert client.post(f"{API}/runs/{rid}/telemetry", json=body).status_code == 200
    r = client.get(f"{API}/runs/{rid}/events")
    (event,) = r.json()
    assert event["details_complete"] is False and event["details_bytes"] > 160_000
    assert len(r.content) < 4096, f"a list of one event is {len(r.content)} bytes"
    whole = client.get(f"{API}/runs/{rid}/events/{event['id']}").json()
    assert whole["details"] == LONG_KEYS


def test_a_client_alert_keeps_a_small_evidence_and_a_bounded_message(client):
    rid = create_run(client)["id"]
    details = {
        "alert": True,
        "kind": "overflow_burst",
        "severity": "critical",
        "message": "m" * 100_000,
        "tensor_index": 1,
        "recorder": {"steps": list(range(20_000)), "amax": [1.5] * 20_000},
    }
    body = {"idempotency_key": "alert", "events": [{"kind": "custom", "step": 4, "details": details}]}
    assert client.post(f"{API}/runs/{rid}/telemetry", json=body).status_code == 200
    r = client.get(f"{API}/runs/{rid}/alerts")
    (alert,) = [a for a in r.json() if a["kind"] == "overflow_burst"]
    assert len(r.content) < 8192, f"the alerts list is {len(r.content)} bytes"
    assert alert["message"] == "m" * 500
    evidence = alert["evidence"]
    assert evidence["source"] == "client" and evidence["details_complete"] is False
    assert "recorder" not in evidence["details"] and evidence["details"]["kind"] == "overflow_burst"
    whole = client.get(f"{API}/runs/{rid}/events/{evidence['event_id']}").json()
    assert whole["details"] == details


def run_on_loop(scenario) -> object:
    # a loop of its own, in a thread: a Playwright test earlier in the same process leaves one running here
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, scenario()).result()


async def settle(predicate) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0)


def test_an_event_is_encoded_once_for_every_subscriber():
    async def scenario() -> list:
        broker = EventBroker()
        broker.bind(asyncio.get_running_loop())
        subs = [broker.subscribe(7) for _ in range(3)]
        broker.publish(7, "step", {"step": 1, "pad": "x" * 1000})
        await settle(lambda: all(s.queue.qsize() for s in subs))
        return [await s.get(1.0) for s in subs]

    frames = run_on_loop(scenario)
    assert frames[0].startswith(b"event: step\ndata: ")
    assert all(f is frames[0] for f in frames), "each subscriber holds a copy of its own"


def test_slow_subscribers_together_are_bounded():
    """Ten subscribers that never read, each under its own bound: together they pass the total bound, and
    those that hold events then are dropped (told to reload) until the total is under it again."""

    async def scenario() -> tuple:
        broker = EventBroker(max_queue_bytes=100_000, max_total_bytes=200_000)
        broker.bind(asyncio.get_running_loop())
        subs = [broker.subscribe(3) for _ in range(10)]
        for i in range(60):  # ~1 kB each: 60 kB per subscriber, 600 kB in all
            broker.publish(3, "step", {"step": i, "pad": "x" * 1000})
        await settle(lambda: False)
        reasons = []
        for s in subs:
            if s.dropped:
                reasons.append(orjson.loads((await s.get(1.0)).split(b"data: ", 1)[1]))
        total, held = broker.total_bytes, [s.queued_bytes for s in subs]
        for s in subs:  # the clients go away: what waited for them no longer counts
            s.close()
        return total, held, reasons, broker.total_bytes

    total, held, reasons, after = run_on_loop(scenario)
    assert total == sum(held) <= 200_000
    assert reasons and all("(sse_total_bytes)" in r["reason"] for r in reasons)
    assert after == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    where = tmp_path_factory.mktemp("streams")
    env = {
        "FP8SCOPE_TOKENS": "ops:read+control+ingest:ops-secret-1,other:read:other-secret-1",
        "FP8SCOPE_SSE_STREAMS_PER_TOKEN": "2",
        "FP8SCOPE_SSE_KEEPALIVE_SECONDS": "1",
    }
    with ServerProcess(f"sqlite:///{where / 'm.db'}", log_path=where / "s.log", env=env) as srv:
        yield srv


def test_a_token_holds_a_bounded_number_of_streams(server):
    ops = {"Authorization": "Bearer ops-secret-1"}
    other = {"Authorization": "Bearer other-secret-1"}
    rid = loopback.post(f"{server.url}{API}/runs", json={"name": "s", "tensors": []}, headers=ops).json()[
        "id"
    ]
    timeout = httpx.Timeout(10, read=30)
    with ExitStack() as stack:
        for path in (f"/runs/{rid}/stream", "/stream"):
            r = stack.enter_context(
                loopback.stream("GET", server.url + API + path, headers=ops, timeout=timeout)
            )
            assert r.status_code == 200
        third = loopback.get(f"{server.url}{API}/runs/{rid}/stream", headers=ops, timeout=timeout)
        assert third.status_code == 429 and "sse_streams_per_token" in third.json()["detail"]
        assert third.headers["retry-after"]
        with loopback.stream("GET", f"{server.url}{API}/stream", headers=other, timeout=timeout) as mine:
            assert mine.status_code == 200  # another token's streams are its own

    def reopened() -> bool:  # closed streams are given back once the server has seen them go
        with loopback.stream("GET", f"{server.url}{API}/stream", headers=ops, timeout=timeout) as again:
            return again.status_code == 200

    assert wait_until(reopened, timeout=15)


def test_a_large_config_is_refused_naming_the_setting(make_client):
    client = make_client(max_config_bytes=2048)
    r = client.post(f"{API}/runs", json={"name": "big", "tensors": [], "config": {"blob": "x" * 4096}})
    assert r.status_code == 422 and "max_config_bytes" in r.json()["detail"]
    assert client.get(f"{API}/runs").json() == []


def test_the_runs_list_carries_only_the_config_keys_it_asks_for(client):
    config = {"lr": 3e-4, "model": {"n_layer": 12, "d_model": 768}, "notes": "n" * 50_000}
    rid = create_run(client, config=config)["id"]
    plain = client.get(f"{API}/runs")
    assert plain.json()[0]["config"] == {} and len(plain.content) < 4096
    asked = client.get(f"{API}/runs", params={"config_keys": "lr,model.n_layer,missing"}).json()
    assert asked[0]["config"] == {"lr": 3e-4, "model": {"n_layer": 12}}
    # the keys a list is filtered or sorted by come with it
    by = client.get(f"{API}/runs", params={"config": "model.d_model=768", "sort": "-config:lr"}).json()
    assert by[0]["config"] == {"model": {"d_model": 768}, "lr": 3e-4}
    assert client.get(f"{API}/runs/{rid}").json()["config"] == config
    too_many = ",".join(f"k{i}" for i in range(33))
    assert client.get(f"{API}/runs", params={"config_keys": too_many}).status_code == 422
