"""Client events (loss spikes, non-finite values, custom, with flight-recorder details) are stored once
and read back in step order, filtered by kind and step range."""

from __future__ import annotations

import numpy as np

from tests.support.server import API, batch_body, create_run, random_stats


def _events(client, run_id: int, **params) -> list[dict]:
    r = client.get(f"{API}/runs/{run_id}/events", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_events_round_trip_once_in_step_order(client):
    run = create_run(client, n_layers=1)
    stats = random_stats(np.random.default_rng(0), 2, 3)
    flight = {"last_steps": [{"step": 19, "loss": 2.5}, {"step": 20, "loss": "NaN"}], "histogram": [0, 3, 9]}
    events = [
        {"kind": "nonfinite", "step": 20, "details": {"tensor": "blocks.0.mlp.fc.grad_output", **flight}},
        {"kind": "loss_spike", "step": 19, "details": {"z": 14.2}},
        {"kind": "custom", "step": 5, "details": {"note": "<b>checkpoint</b>"}},
    ]
    body = batch_body("ev-1", [19, 20], stats, events=events)
    assert client.post(f"{API}/runs/{run['id']}/telemetry", json=body).status_code == 200
    # the same batch again (a retry) stores nothing twice
    again = client.post(f"{API}/runs/{run['id']}/telemetry", json=body)
    assert again.json()["duplicate"] is True

    got = _events(client, run["id"])
    assert [(e["kind"], e["step"]) for e in got] == [("custom", 5), ("loss_spike", 19), ("nonfinite", 20)]
    assert got[2]["details"] == events[0]["details"] and got[0]["details"]["note"] == "<b>checkpoint</b>"
    assert all(e["run_id"] == run["id"] and e["created_at"] for e in got)

    assert [e["step"] for e in _events(client, run["id"], kind="loss_spike")] == [19]
    assert [e["step"] for e in _events(client, run["id"], **{"from": 6, "to": 19})] == [19]
    assert [e["step"] for e in _events(client, run["id"], limit=2)] == [5, 19]


def test_events_bad_requests(client):
    run = create_run(client, n_layers=1)
    assert client.get(f"{API}/runs/999999/events").status_code == 404
    r = client.get(f"{API}/runs/{run['id']}/events", params={"kind": "explosion"})
    assert r.status_code == 422
    r = client.get(f"{API}/runs/{run['id']}/events", params={"from": 10, "to": 2})
    assert r.status_code == 422 and "before" in r.text
    # a malformed event rejects the whole batch: neither its steps nor its events are stored
    stats = random_stats(np.random.default_rng(1), 1, 3)
    body = batch_body("ev-bad", [1], stats, events=[{"kind": "custom", "step": -1, "details": {}}])
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json=body)
    assert r.status_code == 422 and "events[0].step" in r.text
    assert _events(client, run["id"]) == []
    assert client.get(f"{API}/runs/{run['id']}").json()["steps_stored"] == 0
