"""Big events cost what their summary costs in lists and streams: `GET /runs/{id}/events` carries details
whole only when small (else the summary, `details_complete` false), one event is read whole on request,
and a stream client that stops reading is dropped once its queue holds more than its byte bound."""

from __future__ import annotations

import asyncio

import orjson

from monitor_server.events import EventBroker
from tests.support.server import API, create_run


def test_list_is_light_and_one_event_is_whole(client):
    rid = create_run(client, 1)["id"]
    flight = {
        "z": 11.5,
        "tensor": "blocks.0.mlp.fc.input",
        "last_steps": [{"step": s, "loss": 2.0} for s in range(500)],
    }
    events = [
        {"kind": "loss_spike", "step": 7, "details": flight},
        {"kind": "custom", "step": 8, "details": {"name": "ckpt", "scales": [2.0, "Infinity"]}},
    ]
    body = {"idempotency_key": "e", "events": events}
    assert client.post(f"{API}/runs/{rid}/telemetry", json=body).status_code == 200
    listed = client.get(f"{API}/runs/{rid}/events").json()
    big, small = listed
    size = len(orjson.dumps(flight))
    assert size > 4096
    assert big["details"] == {"z": 11.5, "tensor": "blocks.0.mlp.fc.input"}  # the summary: no flight recorder
    assert big["details_complete"] is False and big["details_bytes"] == size
    assert small["details"] == events[1]["details"] and small["details_complete"] is True
    whole = client.get(f"{API}/runs/{rid}/events/{big['id']}").json()
    assert whole["details"] == flight and whole["details_complete"] is True
    assert client.get(f"{API}/runs/{rid + 1}/events/{big['id']}").status_code == 404


def test_slow_stream_client_dropped_by_bytes():
    """A subscriber that never reads: its queue grows to the byte bound, then it gets a final `dropped`
    event and the end of its stream, and holds nothing more however much is published."""

    async def scenario() -> list:
        broker = EventBroker(max_queue_bytes=20_000)
        broker.bind(asyncio.get_running_loop())
        sub = broker.subscribe(5)
        for i in range(200):  # ~1 kB each: 200 kB published, ten times the bound
            broker.publish(5, "step", {"step": i, "pad": "x" * 1000})
        await asyncio.sleep(0)  # deliveries are scheduled on the loop: let them run
        for _ in range(400):
            if sub.dropped:
                break
            await asyncio.sleep(0)
        assert sub.dropped and sub.queued_bytes == 0
        assert not broker.has_subscribers(5)
        out = []
        while (item := await sub.get(1.0)) is not None:
            out.append(item)
            if not isinstance(item, bytes):
                break
        return out

    out = asyncio.run(scenario())
    assert len(out) == 2 and out[0].startswith(b"event: dropped\ndata: ")
    assert b"(sse_queue_bytes)" in out[0]
