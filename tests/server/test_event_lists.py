"""Big events cost what their summary costs in lists and streams: `GET /runs/{id}/events` carries details
whole only when small (else the summary, `details_complete` false), one event is read whole on request,
and a stream client that stops reading is dropped once its queue holds more than its byte bound."""

from __future__ import annotations

import asyncio
import concurrent.futures

import orjson

from monitor_server.infra.events import EventBroker
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


class _Recorder:
    """A relay (as another server instance would be attached): records what the broker publishes."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str, dict]] = []

    def send(self, run_id: int, name: str, data: dict) -> None:
        self.sent.append((run_id, name, data))


def test_streamed_events_carry_their_stored_ids(client):
    """The stream names each client event by the id the list and `GET /runs/{id}/events/{event_id}` know:
    the dashboard fetches a big event's flight recorder by that id while the run is live."""
    rid = create_run(client, 1)["id"]
    recorder = _Recorder()
    client.app.state.ctx.broker.attach(recorder)
    flight = {"z": 8.0, "last_steps": [{"step": s, "loss": 2.0} for s in range(400)]}
    sent = [
        {"kind": "custom", "step": 9, "details": {"name": "late"}},
        {"kind": "loss_spike", "step": 5, "details": flight},
        {"kind": "custom", "step": 5, "details": {"name": "same step"}},
    ]
    for key, events in (("a", sent[:2]), ("b", sent[2:])):
        body = {"idempotency_key": key, "events": events}
        assert client.post(f"{API}/runs/{rid}/telemetry", json=body).status_code == 200
    streamed = [data for run, name, data in recorder.sent if name == "event" and run == rid]
    assert [(e["kind"], e["step"], e["details_complete"]) for e in streamed] == [
        ("custom", 9, True),
        ("loss_spike", 5, False),
        ("custom", 5, True),
    ]
    listed = {e["id"]: e for e in client.get(f"{API}/runs/{rid}/events").json()}
    assert sorted(listed) == sorted(e["id"] for e in streamed)
    for event, original in zip(streamed, sent, strict=True):
        same = listed[event["id"]]
        assert (same["kind"], same["step"], same["details"]) == (
            event["kind"],
            event["step"],
            event["details"],
        )
        whole = client.get(f"{API}/runs/{rid}/events/{event['id']}").json()
        assert whole["details"] == original["details"]
    # a repeated batch stores nothing and streams nothing
    client.post(f"{API}/runs/{rid}/telemetry", json={"idempotency_key": "b", "events": sent[2:]})
    assert len([1 for _, name, _ in recorder.sent if name == "event"]) == 3


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

    # a loop of its own, in a thread: a Playwright test earlier in the same process leaves one running here
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        out = pool.submit(asyncio.run, scenario()).result()
    assert len(out) == 2 and out[0].startswith(b"event: dropped\ndata: ")
    assert b"(sse_queue_bytes)" in out[0]
