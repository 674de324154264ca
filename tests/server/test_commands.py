"""Command lifecycle: validation, delivery in telemetry responses, acks, the effective recipe, rollback."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.server import API, batch_body, create_run, random_stats

LAYER0 = "blocks.0.mlp.fc"


def _telemetry(client, run_id, key, steps, acks=None):
    stats = random_stats(np.random.default_rng(len(key)), len(steps), 6)
    r = client.post(f"{API}/runs/{run_id}/telemetry", json=batch_body(key, steps, stats, acks=acks or []))
    assert r.status_code == 200, r.text
    return r.json()


def test_lifecycle_recipe_follows_and_rollback(client):
    run = create_run(client)
    rid = run["id"]
    assert run["effective_recipe"]["model"]["margin"] == 0
    r = client.post(
        f"{API}/runs/{rid}/commands", json={"target": LAYER0, "changes": {"margin": 2, "amax_history_len": 4}}
    )
    assert r.status_code == 201, r.text
    cmd = r.json()
    assert cmd["state"] == "pending" and cmd["kind"] == "recipe_change" and cmd["created_by"] == "anonymous"
    assert cmd["changes"] == {"margin": 2, "amax_history_len": 4} and cmd["previous"] is None

    delivered = _telemetry(client, rid, "t1", [0, 1])["commands"]
    assert [c["id"] for c in delivered] == [cmd["id"]] and delivered[0]["state"] == "delivered"
    # not acknowledged yet: sent again (a lost response must not lose it), still delivered
    again = _telemetry(client, rid, "t2", [2])["commands"]
    assert [c["id"] for c in again] == [cmd["id"]]
    assert again[0]["delivered_at"] == delivered[0]["delivered_at"]
    listed = client.get(f"{API}/runs/{rid}/commands").json()
    assert listed[0]["state"] == "delivered" and listed[0]["delivered_at"]

    _telemetry(client, rid, "t3", [3], acks=[{"command_id": cmd["id"], "state": "applied", "step": 3}])
    assert _telemetry(client, rid, "t3b", [30])["commands"] == []  # acknowledged: no longer sent
    applied = client.get(f"{API}/runs/{rid}/commands").json()[0]
    assert applied["state"] == "applied" and applied["applied_step"] == 3 and applied["resolved_at"]
    assert applied["previous"] == {"margin": 0, "amax_history_len": 16}
    eff = client.get(f"{API}/runs/{rid}").json()["effective_recipe"]
    assert eff["layers"][LAYER0]["margin"] == 2 and eff["layers"][LAYER0]["amax_history_len"] == 4
    assert eff["model"]["margin"] == 0

    # a repeated ack is ignored
    _telemetry(
        client, rid, "t4", [4], acks=[{"command_id": cmd["id"], "state": "rejected", "reason": "late"}]
    )
    assert client.get(f"{API}/runs/{rid}/commands").json()[0]["state"] == "applied"

    rb = client.post(f"{API}/runs/{rid}/commands", json={"rollback": cmd["id"]})
    assert rb.status_code == 201, rb.text
    rb = rb.json()
    assert rb["kind"] == "rollback" and rb["target"] == LAYER0 and rb["rollback_of"] == cmd["id"]
    assert rb["changes"] == {"margin": 0, "amax_history_len": 16}
    got = _telemetry(client, rid, "t5", [5])["commands"]
    assert got[0]["id"] == rb["id"]
    _telemetry(client, rid, "t6", [6], acks=[{"command_id": rb["id"], "state": "applied", "step": 6}])
    eff = client.get(f"{API}/runs/{rid}").json()["effective_recipe"]
    assert eff["layers"][LAYER0]["margin"] == 0 and eff["layers"][LAYER0]["amax_history_len"] == 16


def test_model_change_rejected_ack_and_rollback_rules(client):
    rid = create_run(client)["id"]
    cmd = client.post(
        f"{API}/runs/{rid}/commands", json={"target": "model", "changes": {"fp8_enabled": False}}
    ).json()
    other = client.post(f"{API}/runs/{rid}/commands", json={"changes": {"scaling": "current"}}).json()
    assert other["target"] == "model"
    # rolling back a command that is not applied
    r = client.post(f"{API}/runs/{rid}/commands", json={"rollback": cmd["id"]})
    assert r.status_code == 409 and "only an applied command" in r.json()["detail"]
    assert client.post(f"{API}/runs/{rid}/commands", json={"rollback": 99999}).status_code == 404
    _telemetry(
        client,
        rid,
        "a",
        [0],
        acks=[
            {"command_id": cmd["id"], "state": "applied", "step": 0},
            {"command_id": other["id"], "state": "rejected", "reason": "current scaling unsupported"},
        ],
    )
    cmds = {c["id"]: c for c in client.get(f"{API}/runs/{rid}/commands").json()}
    assert (
        cmds[other["id"]]["state"] == "rejected"
        and cmds[other["id"]]["reason"] == "current scaling unsupported"
    )
    assert client.get(f"{API}/runs/{rid}").json()["effective_recipe"]["model"]["fp8_enabled"] is False
    assert client.post(f"{API}/runs/{rid}/commands", json={"rollback": other["id"]}).status_code == 409
    assert [
        c["state"] for c in client.get(f"{API}/runs/{rid}/commands", params={"state": "applied"}).json()
    ] == ["applied"]


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"target": "model", "changes": {}}, "at least one"),
        ({"target": "model", "changes": {"margin": -1}}, "margin"),
        ({"target": "model", "changes": {"margin": "2"}}, "margin"),
        ({"target": "model", "changes": {"amax_history_len": 0}}, "amax_history_len"),
        ({"target": "model", "changes": {"amax_compute_algo": "mean"}}, "amax_compute_algo"),
        ({"target": "model", "changes": {"interval": 0}}, "interval"),
        ({"target": "model", "changes": {"scaling": "static"}}, "scaling"),
        ({"target": "model", "changes": {"fp8_enabled": "yes"}}, "fp8_enabled"),
        ({"target": "model", "changes": {"learning_rate": 1}}, "learning_rate"),
        ({"target": "blocks.9.attn", "changes": {"margin": 1}}, "neither 'model' nor a layer"),
        ({"target": "model", "changes": {"margin": 1}, "rollback": 1}, "not both"),
        ({}, "not both or neither"),
    ],
)
def test_invalid_commands_422(client, body, needle):
    rid = create_run(client)["id"]
    r = client.post(f"{API}/runs/{rid}/commands", json=body)
    assert r.status_code == 422, r.text
    assert needle in r.text
    assert client.get(f"{API}/runs/{rid}/commands").json() == []


def test_duplicate_batch_still_returns_pending_commands(client):
    rid = create_run(client)["id"]
    _telemetry(client, rid, "k", [0])
    cmd = client.post(f"{API}/runs/{rid}/commands", json={"changes": {"margin": 1}}).json()
    again = _telemetry(client, rid, "k", [0])
    assert again["duplicate"] and [c["id"] for c in again["commands"]] == [cmd["id"]]
    assert client.post(f"{API}/runs/424242/commands", json={"changes": {"margin": 1}}).status_code == 404


@pytest.mark.parametrize("final", ["finished", "crashed", "interrupted", "halted"])
def test_a_run_that_ended_refuses_commands_and_rejects_its_open_ones(client, final):
    rid = create_run(client)["id"]
    pending = client.post(f"{API}/runs/{rid}/commands", json={"changes": {"margin": 1}}).json()
    delivered = client.post(f"{API}/runs/{rid}/commands", json={"changes": {"margin": 2}}).json()
    _telemetry(client, rid, "t1", [1], acks=[])  # both delivered
    third = client.post(f"{API}/runs/{rid}/commands", json={"changes": {"margin": 3}}).json()
    assert third["state"] == "pending"
    r = client.patch(f"{API}/runs/{rid}", json={"status": final})
    assert r.status_code == 200, r.text
    listed = {c["id"]: c for c in client.get(f"{API}/runs/{rid}/commands").json()}
    for cmd in (pending, delivered, third):  # none stays pending forever
        assert listed[cmd["id"]]["state"] == "rejected"
        assert listed[cmd["id"]]["reason"] == f"the run ended ({final}) before the job applied it"
    r = client.post(f"{API}/runs/{rid}/commands", json={"changes": {"margin": 4}})
    assert r.status_code == 409
    assert r.json()["detail"] == (
        f"run {rid} is {final}: recipe changes go to running jobs only (none would apply it)"
    )
    assert len(client.get(f"{API}/runs/{rid}/commands").json()) == 3  # nothing stored


@pytest.mark.parametrize("mode", ["mxfp8", "block"])
def test_a_layer_switches_to_block_scaling_and_back(client, mode):
    """A layer goes from per-tensor to block scaling at run time with the usual acknowledgement, and a
    rollback returns it to per-tensor scaling."""
    rid = create_run(client)["id"]
    r = client.post(f"{API}/runs/{rid}/commands", json={"target": LAYER0, "changes": {"scaling": mode}})
    assert r.status_code == 201, r.text
    cmd = r.json()
    assert [c["changes"] for c in _telemetry(client, rid, "a", [0])["commands"]] == [{"scaling": mode}]
    _telemetry(client, rid, "b", [1], acks=[{"command_id": cmd["id"], "state": "applied", "step": 1}])
    applied = client.get(f"{API}/runs/{rid}/commands").json()[0]
    assert applied["state"] == "applied" and applied["applied_step"] == 1
    assert applied["previous"] == {"scaling": "delayed"}
    eff = client.get(f"{API}/runs/{rid}").json()["effective_recipe"]
    assert eff["layers"][LAYER0]["scaling"] == mode and eff["model"]["scaling"] == "delayed"
    back = client.post(f"{API}/runs/{rid}/commands", json={"rollback": cmd["id"]}).json()
    _telemetry(client, rid, "c", [2], acks=[{"command_id": back["id"], "state": "applied", "step": 2}])
    assert (
        client.get(f"{API}/runs/{rid}").json()["effective_recipe"]["layers"][LAYER0]["scaling"] == "delayed"
    )
