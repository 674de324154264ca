"""Incidents: findings that share a cause become one incident with the root cause first, one webhook message,
one acknowledgement; unrelated faults stay apart. Real detector engine, both database backends."""

from __future__ import annotations

import json

import pytest

from monitor_server.services.incidents import title
from tests.support.polling import wait_until
from tests.support.server import API, create_run, post_batch, quiet_stats

N_LAYERS = 4
T = 3 * N_LAYERS  # layer k owns 3k (input), 3k+1 (weight), 3k+2 (grad_output)
NUMEL = 4096.0


def nan_in_layer(stats: dict, row: int, layer: int) -> None:
    """A NaN in layer `layer`'s input at `row`: every forward tensor downstream and every gradient go
    non-finite in that step; in the next, every tensor (the weights were updated with NaN)."""
    t = stats["nonfinite"].shape[1]
    downstream = [3 * k for k in range(layer, N_LAYERS)]
    grads = [3 * k + 2 for k in range(N_LAYERS)]
    stats["nonfinite"][row, downstream + grads] = 7
    stats["nonfinite"][row + 1, :t] = 9


def incidents(client, rid: int, **params) -> list[dict]:
    r = client.get(f"{API}/runs/{rid}/incidents", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def one_incident(client, nonfinite: list[int]) -> tuple[int, dict]:
    """A run of 10 quiet steps with a non-finite value in each of the tensors `nonfinite` at step 4: its id
    and its one incident."""
    rid = create_run(client, n_layers=N_LAYERS)["id"]
    s = quiet_stats(10, T)
    s["nonfinite"][4, nonfinite] = 1
    post_batch(client, rid, "a", 0, s)
    (incident,) = incidents(client, rid)
    return rid, incident


class Recorder:
    """Stands in for the webhook notifier: keeps (key, message) and builds the messages when `sent` is read,
    as the notifier does after its settle delay."""

    def __init__(self) -> None:
        self.submitted: list[tuple[int, object]] = []

    def submit(self, message, key=None) -> None:
        self.submitted.append((key, message))

    @property
    def sent(self) -> list[tuple[int, dict]]:
        return [(key, message()) for key, message in self.submitted]

    def close(self) -> None:
        pass


@pytest.fixture
def recorded(client):
    client.app.state.ctx.detection.notifier = Recorder()
    return client


def test_a_nan_that_spreads_is_one_incident_with_its_root_first(recorded):
    client = recorded
    rid = create_run(client, n_layers=N_LAYERS)["id"]
    s = quiet_stats(20, T)
    nan_in_layer(s, 10, layer=1)
    losses = [2.0] * 20
    losses[10] = losses[11] = float("nan")
    # step 11 in the next batch
    post_batch(client, rid, "a", 0, {k: v[:11] for k, v in s.items()}, losses[:11])
    post_batch(client, rid, "b", 11, {k: v[11:] for k, v in s.items()}, losses[11:])

    alerts = client.get(f"{API}/runs/{rid}/alerts").json()
    assert len(alerts) == 13  # 12 tensors + the loss: the detectors still say what each tensor did
    (incident,) = incidents(client, rid)
    assert (
        incident["alert_count"] == 13 and incident["state"] == "open" and incident["severity"] == "critical"
    )
    assert incident["root"]["tensor_name"] == "blocks.1.mlp.fc.input" and incident["root"]["onset_step"] == 10
    assert incident["kind"] == "nonfinite"
    assert incident["title"] == "non-finite values in blocks.1.mlp.fc.input at step 10 (12 tensors affected)"
    # forward-then-backward at step 10 (downstream inputs, the loss, gradients last layer first), then step 11
    order = [(a["first_step"], a["tensor_name"] or "loss") for a in incident["alerts"]]
    assert order[:9] == [
        (10, "blocks.1.mlp.fc.input"), (10, "blocks.2.mlp.fc.input"), (10, "blocks.3.mlp.fc.input"),
        (10, "loss"), (10, "blocks.3.mlp.fc.grad_output"), (10, "blocks.2.mlp.fc.grad_output"),
        (10, "blocks.1.mlp.fc.grad_output"), (10, "blocks.0.mlp.fc.grad_output"),
        (11, "blocks.0.mlp.fc.input"),
    ]  # fmt: skip
    assert incident["tensors"][0] == "blocks.1.mlp.fc.input" and len(incident["tensors"]) == 12
    assert {a["incident_id"] for a in alerts} == {incident["id"]}

    sent = client.app.state.ctx.detection.notifier.sent
    assert len(sent) == 1  # one incident, one message
    key, message = sent[0]
    assert key == rid and message["incident_id"] == incident["id"]
    assert message["tensor_name"] == "blocks.1.mlp.fc.input" and message["step"] == 10
    assert len(message["affected"]) == 12 and message["severity"] == "critical"

    run = client.get(f"{API}/runs/{rid}").json()
    assert run["open_incidents"] == 1 and run["open_alerts"] == 13


def test_the_layers_table_ranks_the_layer_a_nan_started_in_first(client):
    # every layer ends up critical with the same alerts; the user looks at the top row for where it began:
    # the onset's step, then the forward-then-backward order (blocks.0 went bad only in the backward pass)
    rid = create_run(client, n_layers=N_LAYERS)["id"]
    s = quiet_stats(20, T)
    nan_in_layer(s, 10, layer=1)
    post_batch(client, rid, "a", 0, s)
    r = client.get(f"{API}/runs/{rid}/layers")
    assert r.status_code == 200, r.text
    layers = r.json()
    assert [x["layer"] for x in layers] == [f"blocks.{k}.mlp.fc" for k in (1, 2, 3, 0)], layers
    assert {x["severity"] for x in layers} == {"critical"}


def test_an_earlier_onset_found_later_becomes_the_root(recorded):
    client = recorded
    rid = create_run(client, n_layers=N_LAYERS)["id"]
    s = quiet_stats(30, T)
    w1 = 4  # blocks.1 weight
    s["overflow"][20:30, w1] = 0.005 * NUMEL  # above 0.1%: a warning once it lasted 3 steps (step 22)
    s["nonfinite"][21, 9] = 1  # blocks.3 input at step 21: found first, but began after the overflow
    post_batch(client, rid, "a", 0, s)
    (incident,) = incidents(client, rid)
    assert (
        incident["root"]["kind"] == "overflow_burst"
        and incident["root"]["tensor_name"] == "blocks.1.mlp.fc.weight"
    )
    assert incident["root"]["onset_step"] == 20 and incident["root"]["first_step"] == 22
    assert [a["kind"] for a in incident["alerts"]] == ["overflow_burst", "nonfinite"]


def test_faults_far_apart_are_separate_incidents(recorded):
    client = recorded
    rid = create_run(client, n_layers=N_LAYERS)["id"]
    s = quiet_stats(200, T)
    s["nonfinite"][20, 3] = 1
    s["nonfinite"][40, 9] = 1  # within the 50-step window of the first: same incident
    s["nonfinite"][150, 6] = 1  # far later: a new one
    post_batch(client, rid, "a", 0, s)
    found = incidents(client, rid)
    assert [(i["root"]["onset_step"], i["alert_count"]) for i in found] == [(150, 1), (20, 2)]  # newest first
    assert len(client.app.state.ctx.detection.notifier.sent) == 2


def test_acknowledging_an_incident_acknowledges_its_alerts(recorded):
    client = recorded
    rid = create_run(client, n_layers=N_LAYERS)["id"]
    s = quiet_stats(20, T)
    nan_in_layer(s, 5, layer=2)
    post_batch(client, rid, "a", 0, s)
    (incident,) = incidents(client, rid)
    r = client.post(f"{API}/runs/{rid}/incidents/{incident['id']}/ack")
    assert r.status_code == 200 and r.json()["state"] == "acknowledged" and r.json()["open_alerts"] == 0
    assert r.json()["acknowledged_by"] == "anonymous"
    assert client.get(f"{API}/runs/{rid}/alerts", params={"state": "open"}).json() == []
    assert client.post(f"{API}/runs/{rid}/incidents/{incident['id']}/ack").status_code == 200  # idempotent
    # the same tensors going bad again later: a new incident, a new message
    s2 = quiet_stats(5, T)
    s2["nonfinite"][2, 6] = 1
    post_batch(client, rid, "b", 20, s2)
    fresh = incidents(client, rid, state="open")
    assert len(fresh) == 1 and fresh[0]["id"] != incident["id"] and fresh[0]["alert_count"] == 1
    assert len(client.app.state.ctx.detection.notifier.sent) == 2
    other = create_run(client, n_layers=1)["id"]
    assert client.post(f"{API}/runs/{other}/incidents/{incident['id']}/ack").status_code == 404
    assert client.get(f"{API}/runs/{other}/incidents/{incident['id']}").status_code == 404


def test_acknowledging_its_last_open_alert_acknowledges_the_incident(client):
    rid, incident = one_incident(client, nonfinite=[0, 3])
    first, second = (a["id"] for a in incident["alerts"])
    client.post(f"{API}/runs/{rid}/alerts/{first}/ack")
    assert incidents(client, rid)[0]["state"] == "open"
    client.post(f"{API}/runs/{rid}/alerts/{second}/ack")
    assert incidents(client, rid)[0]["state"] == "acknowledged"


def test_acknowledge_all(client):
    rid = create_run(client, n_layers=N_LAYERS)["id"]
    s = quiet_stats(200, T)
    s["nonfinite"][20, 3] = 1
    s["nonfinite"][150, [6, 9]] = 1
    post_batch(client, rid, "a", 0, s)
    assert len(incidents(client, rid, state="open")) == 2
    assert all(i["notified_at"] is None for i in incidents(client, rid))  # no webhook configured
    r = client.post(f"{API}/runs/{rid}/incidents/ack")
    assert r.status_code == 200 and sorted(r.json()["incidents"]) == sorted(
        i["id"] for i in incidents(client, rid)
    )
    assert r.json()["alerts"] == 3
    assert (
        incidents(client, rid, state="open") == []
        and client.get(f"{API}/runs/{rid}").json()["open_alerts"] == 0
    )
    assert client.post(f"{API}/runs/{rid}/incidents/ack").json() == {"incidents": [], "alerts": 0}


def test_an_info_incident_sends_nothing_until_it_escalates(recorded):
    client = recorded
    rid = create_run(client, n_layers=N_LAYERS)["id"]
    s = quiet_stats(40, T)
    s["underflow"][5:40, 3] = 0.3 * NUMEL  # excess underflow: info after 10 steps
    post_batch(client, rid, "a", 0, s)
    (incident,) = incidents(client, rid)
    assert incident["severity"] == "info" and incident["notified_at"] is None
    assert client.app.state.ctx.detection.notifier.sent == []
    s2 = quiet_stats(5, T)
    s2["nonfinite"][1, 6] = 1
    post_batch(client, rid, "b", 40, s2)
    (incident,) = incidents(client, rid)
    assert incident["severity"] == "critical" and incident["notified_at"] is not None
    assert incident["root"]["kind"] == "underflow_excess"  # began first
    assert len(client.app.state.ctx.detection.notifier.sent) == 1


def test_incident_in_full_carries_the_evidence_root_first(client):
    rid, incident = one_incident(client, nonfinite=[6, 0])
    full = client.get(f"{API}/runs/{rid}/incidents/{incident['id']}").json()
    assert [a["tensor_name"] for a in full["alerts_full"]] == [
        "blocks.0.mlp.fc.input",
        "blocks.2.mlp.fc.input",
    ]
    assert full["alerts_full"][0]["evidence"]["first_in_run"] is True
    assert all(a["incident_id"] == incident["id"] for a in full["alerts_full"])


def test_the_webhook_gets_one_message_per_incident_with_the_run_link(hook, make_client):
    # (hook first: it is torn down after the service, which delivers the held message as it stops)
    client = make_client(
        webhook_url=hook.url,
        public_url="https://fp8.example/monitor/",
        webhook_settle_seconds=0,
        webhook_min_interval_seconds=600,
    )
    rid = create_run(client, n_layers=N_LAYERS, name="nan-run")["id"]
    s = quiet_stats(20, T)
    nan_in_layer(s, 10, layer=1)
    post_batch(client, rid, "a", 0, s)
    assert wait_until(lambda: len(hook.accepted) == 1, timeout=5.0)
    (incident,) = incidents(client, rid)
    link = f"https://fp8.example/monitor/#/runs/{rid}?incident={incident['id']}"
    assert incident["url"] == link
    text = hook.accepted[0]["text"]
    assert f"incident #{incident['id']}" in text and "nan-run" in text and "blocks.1.mlp.fc.input" in text
    assert link in text and "(12 tensors affected)" in text
    assert link in json.dumps(hook.accepted[0]["blocks"])
    # a second incident of the same run within the interval waits (rate limit per run) ...
    s2 = quiet_stats(5, T)
    s2["overflow"][1, 6] = 0.5 * NUMEL
    post_batch(client, rid, "b", 200, s2)
    notifier = client.app.state.ctx.detection.notifier
    assert wait_until(lambda: notifier.stats["queued"] == 1, timeout=5.0)
    # ... while another run's incident goes out at once
    other = create_run(client, n_layers=N_LAYERS, name="other-run")["id"]
    s3 = quiet_stats(5, T)
    s3["nonfinite"][1, 6] = 1
    post_batch(client, other, "c", 0, s3)
    assert wait_until(lambda: len(hook.accepted) == 2, timeout=5.0)
    assert "other-run" in hook.accepted[1]["text"] and len(incidents(client, rid)) == 2


def test_an_alert_stored_before_incidents_existed_joins_one_when_it_is_updated(client):
    from sqlalchemy import delete, update

    from monitor_server.storage.models import Alert, Incident

    rid = create_run(client, n_layers=N_LAYERS)["id"]
    s = quiet_stats(10, T)
    s["nonfinite"][3, 0] = 1
    post_batch(client, rid, "a", 0, s)
    with client.app.state.ctx.db.write() as session:  # as an upgraded database holds it
        session.execute(update(Alert).values(incident_id=None, onset_step=None))
        session.execute(delete(Incident))
    assert incidents(client, rid) == []
    s2 = quiet_stats(10, T)
    s2["nonfinite"][2, 0] = 1  # the same tensor again: the open alert is updated
    post_batch(client, rid, "b", 10, s2)
    (incident,) = incidents(client, rid)
    assert incident["alert_count"] == 1 and incident["root"]["first_step"] == 3
    assert incident["root"]["last_step"] == 12 and incident["last_step"] == 12


def test_titles_name_where_the_fault_is_once():
    def root(kind: str, tensor: str | None) -> dict:
        return {"kind": kind, "tensor_name": tensor, "onset_step": 221}

    assert title(root("loss_spike", None), 0) == "loss spike at step 221"
    assert title(root("nonfinite", None), 0) == "non-finite values in the loss at step 221"
    assert title(root("overflow_burst", "blocks.0.mlp.fc.weight"), 2).endswith(
        " in blocks.0.mlp.fc.weight at step 221 (2 tensors affected)"
    )
