"""Detector wiring: findings become alerts (one open per kind and tensor), ack, layers, stall, metrics.

Runs with the real detector engine (monitor_server.detectors.engine).
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np

from monitor_server.storage.models import utcnow
from tests.support.server import API, create_run, post_batch, quiet_stats


def test_nonfinite_alert_updated_not_duplicated_then_ack(client):
    rid = create_run(client)["id"]  # 2 layers, T = 6
    s = quiet_stats(10, 6)
    s["nonfinite"][5, 4] = 3  # layer 1 weight goes non-finite at step 5
    s["amax"][5, 4] = np.nan
    post_batch(client, rid, "a", 0, s)
    alerts = client.get(f"{API}/runs/{rid}/alerts").json()
    nonfinite = [a for a in alerts if a["kind"] == "nonfinite"]
    assert len(nonfinite) == 1
    a = nonfinite[0]
    assert (
        a["tensor_index"] == 4
        and a["tensor_name"] == "blocks.1.mlp.fc.weight"
        and a["layer"] == "blocks.1.mlp.fc"
    )
    assert a["first_step"] == 5 and a["state"] == "open" and a["severity"] == "critical" and a["evidence"]

    s2 = quiet_stats(10, 6)
    s2["nonfinite"][5, 4] = 1  # a second episode at step 15
    post_batch(client, rid, "b", 10, s2)
    nonfinite = [x for x in client.get(f"{API}/runs/{rid}/alerts").json() if x["kind"] == "nonfinite"]
    assert len(nonfinite) == 1 and nonfinite[0]["id"] == a["id"]
    assert nonfinite[0]["count"] == 2 and nonfinite[0]["first_step"] == 5 and nonfinite[0]["last_step"] == 15

    run = client.get(f"{API}/runs/{rid}").json()
    assert run["open_alerts"] >= 1
    text = client.get("/metrics").text
    assert 'fp8scope_open_alerts{kind="nonfinite"} 1.0' in text

    r = client.post(f"{API}/runs/{rid}/alerts/{a['id']}/ack")
    assert (
        r.status_code == 200
        and r.json()["state"] == "acknowledged"
        and r.json()["acknowledged_by"] == "anonymous"
    )
    assert client.get(f"{API}/runs/{rid}/alerts", params={"state": "open", "kind": "nonfinite"}).json() == []
    assert client.post(f"{API}/runs/{rid}/alerts/999999/ack").status_code == 404

    s3 = quiet_stats(10, 6)
    s3["nonfinite"][2, 4] = 1  # after the ack, a new episode opens a new alert
    post_batch(client, rid, "c", 20, s3)
    fresh = client.get(f"{API}/runs/{rid}/alerts", params={"state": "open", "kind": "nonfinite"}).json()
    assert len(fresh) == 1 and fresh[0]["id"] != a["id"] and fresh[0]["first_step"] == 22

    layers = client.get(f"{API}/runs/{rid}/layers").json()
    assert layers[0]["layer"] == "blocks.1.mlp.fc"
    assert {x["layer"] for x in layers} == {"blocks.0.mlp.fc", "blocks.1.mlp.fc"}


def test_client_events_and_detector_state_persisted(client):
    rid = create_run(client)["id"]
    events = [{"kind": "loss_spike", "step": 5, "details": {"loss": 40.0, "z": 9.0}}]  # no loss of its own
    post_batch(client, rid, "a", 0, quiet_stats(5, 6), events=events)
    kinds = [a["kind"] for a in client.get(f"{API}/runs/{rid}/alerts").json()]
    assert "loss_spike" in kinds
    from sqlalchemy import select

    from monitor_server.storage.models import Run

    with client.app.state.ctx.db.read_session() as session:
        state = session.scalar(select(Run.detector_state).where(Run.id == rid))
    assert state and state["last_step"] == 4


def test_stalled_run_alert(make_client):
    client = make_client(stall_seconds=30, stall_check_seconds=3600)
    rid = create_run(client)["id"]
    post_batch(client, rid, "a", 0, quiet_stats(3, 6))
    detection = client.app.state.ctx.detection
    assert detection.check_stalled_runs(now=utcnow()) == 0
    assert detection.check_stalled_runs(now=utcnow() + timedelta(seconds=60)) == 1
    # the same stall, seen again by the next check, is not counted twice
    assert detection.check_stalled_runs(now=utcnow() + timedelta(seconds=90)) == 0
    stalled = [a for a in client.get(f"{API}/runs/{rid}/alerts").json() if a["kind"] == "stalled"]
    assert len(stalled) == 1 and stalled[0]["tensor_index"] is None and stalled[0]["count"] == 1
    assert stalled[0]["severity"] == "warning" and stalled[0]["last_step"] == 2
    # ten times the threshold escalates the same alert to critical
    assert detection.check_stalled_runs(now=utcnow() + timedelta(seconds=301)) == 1
    stalled = [a for a in client.get(f"{API}/runs/{rid}/alerts").json() if a["kind"] == "stalled"]
    assert len(stalled) == 1 and stalled[0]["count"] == 2 and stalled[0]["severity"] == "critical"
    client.patch(f"{API}/runs/{rid}", json={"status": "finished"})
    assert detection.check_stalled_runs(now=utcnow() + timedelta(seconds=120)) == 0


def test_new_alerts_go_to_the_webhook_once(client):
    class Recorder:
        def __init__(self):
            self.sent = []

        def submit(self, message, key=None):
            self.sent.append((key, message()))

        def close(self):
            pass

    detection = client.app.state.ctx.detection
    detection.notifier = Recorder()
    rid = create_run(client)["id"]
    s = quiet_stats(10, 6)
    s["nonfinite"][3, 1] = 1
    s["nonfinite"][7, 1] = 1  # second episode: the open alert is updated, not re-sent
    post_batch(client, rid, "a", 0, s)
    assert len(detection.notifier.sent) == 1
    key, sent = detection.notifier.sent[0]
    assert key == rid and sent["kind"] == "nonfinite" and sent["run_name"] == "test-run"
    assert sent["tensor_name"] == "blocks.0.mlp.fc.weight" and sent["step"] == 3
    assert sent["url"] is None  # no public URL configured: no link
