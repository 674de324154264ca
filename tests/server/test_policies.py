"""Remediation policies: a replay that says fp8-caused turns into a recipe command for the culprit layer
(queued, or proposed for a person to apply), capped per hour, checked against the loss after it was applied
and rolled back when the loss got worse. Real app, both database backends; the rules themselves as a
function."""

from __future__ import annotations

import numpy as np

from monitor_server.services.policies import SQNR_FLOOR_DB, RemediationConfig, _layer_recipe, propose
from monitor_server.storage.models import Run
from tests.server.test_incident_replay import LAYER, T, incident_with_bundles, report
from tests.support.server import API, post_batch, quiet_stats

LAYERS = {"blocks.0.mlp.fc", LAYER}
DELAYED = {"scaling": "delayed", "margin": 0, "amax_history_len": 16}


def remediation(mode: str, **extra) -> dict:
    return {"config": {"model": "gpt-tiny", "remediation": {"mode": mode, "check_steps": 5, **extra}}}


def _actions(client, rid: int) -> list[dict]:
    r = client.get(f"{API}/runs/{rid}/policy-actions")
    assert r.status_code == 200, r.text
    return r.json()


def _replay(client, rid: int, iid: int, body: dict | None = None) -> None:
    r = client.put(f"{API}/runs/{rid}/incidents/{iid}/replay", json=body or report())
    assert r.status_code == 200, r.text


def _ack_and_train(client, rid: int, command_id: int, applied: int, before: float, after: float) -> dict:
    """The job applies the command at step `applied` (steps 10..applied-1 at loss `before`, then five more
    at `after`); returns the last telemetry answer."""
    post_batch(client, rid, "pre", 10, quiet_stats(applied - 10, T), losses=[before] * (applied - 10))
    ack = [{"command_id": command_id, "state": "applied", "step": applied}]
    post_batch(client, rid, "ack", applied, quiet_stats(1, T), losses=[after], acks=ack)
    return post_batch(client, rid, "post", applied + 1, quiet_stats(5, T), losses=[after] * 5)


def test_act_queues_the_command_and_rolls_it_back_when_the_loss_got_worse(client):
    rid, iid = incident_with_bundles(client, **remediation("act"))  # a non-finite input at step 4
    _replay(client, rid, iid)
    (action,) = _actions(client, rid)
    assert action["rule"] == "nonfinite" and action["state"] == "queued" and action["incident_id"] == iid
    assert action["target"] == LAYER and action["changes"] == {"fp8_enabled": False}
    (command,) = client.get(f"{API}/runs/{rid}/commands").json()
    assert command["id"] == action["command_id"] and command["created_by"] == "policy:nonfinite"
    assert command["target"] == LAYER and command["changes"] == {"fp8_enabled": False}

    answer = _ack_and_train(client, rid, command["id"], applied=12, before=2.0, after=2.5)
    (action,) = _actions(client, rid)
    assert action["state"] == "rolled_back" and action["loss_before"] == 2.0 and action["loss_after"] == 2.5
    rollback = next(c for c in client.get(f"{API}/runs/{rid}/commands").json() if c["kind"] == "rollback")
    assert rollback["id"] == action["rollback_id"] and rollback["rollback_of"] == command["id"]
    assert rollback["created_by"] == "policy:rollback" and rollback["changes"] == {"fp8_enabled": True}
    assert [c["id"] for c in answer["commands"]] == [rollback["id"]]  # on its way to the job at once


def test_a_change_that_helped_is_kept(client):
    rid, iid = incident_with_bundles(client, **remediation("act"))
    _replay(client, rid, iid)
    (action,) = _actions(client, rid)
    _ack_and_train(client, rid, action["command_id"], applied=12, before=2.0, after=1.9)
    (action,) = _actions(client, rid)
    assert action["state"] == "kept" and action["rollback_id"] is None and action["checked_at"] is not None
    assert all(c["kind"] == "recipe_change" for c in client.get(f"{API}/runs/{rid}/commands").json())


def test_the_check_waits_for_its_steps(client):
    rid, iid = incident_with_bundles(client, **remediation("act", check_steps=50))
    _replay(client, rid, iid)
    (action,) = _actions(client, rid)
    _ack_and_train(client, rid, action["command_id"], applied=12, before=2.0, after=9.0)
    assert _actions(client, rid)[0]["state"] == "queued"  # 5 steps after it of the 50 it waits for


def test_actions_per_hour_are_capped(client):
    rid, iid = incident_with_bundles(client, **remediation("act", max_actions_per_hour=1))
    _replay(client, rid, iid)
    other = "blocks.0.mlp.fc"  # a second report, on another layer: the policy would act again
    _replay(client, rid, iid, report(culprits=[f"{other}.input"]))
    second, first = _actions(client, rid)
    assert first["state"] == "queued" and second["state"] == "capped" and second["command_id"] is None
    assert second["target"] == other
    assert len(client.get(f"{API}/runs/{rid}/commands").json()) == 1


def test_a_second_report_of_the_same_fault_asks_for_nothing_new(client):
    """The job replays every bundle it writes: a second report naming the same layer neither queues the
    change again while the first is on its way, nor once it is in force."""
    rid, iid = incident_with_bundles(client, **remediation("act", max_actions_per_hour=10))
    _replay(client, rid, iid)
    _replay(client, rid, iid)  # the first command not applied yet
    (action,) = _actions(client, rid)
    _ack_and_train(client, rid, action["command_id"], applied=12, before=2.0, after=1.9)
    assert _actions(client, rid)[0]["state"] == "kept"
    _replay(client, rid, iid)  # FP8 is off for the layer already
    assert len(_actions(client, rid)) == 1 and len(client.get(f"{API}/runs/{rid}/commands").json()) == 1
    fine = report()  # but a different change for another layer is asked for
    fine["configs"][0]["sqnr_db"]["blocks.0.mlp.fc"] = 31.0
    _replay(client, rid, iid, {**fine, "culprits": ["blocks.0.mlp.fc.input"]})
    assert [a["target"] for a in _actions(client, rid)] == ["blocks.0.mlp.fc", LAYER]


def test_a_current_scaled_run_gets_a_margin_not_current_scaling(client):
    """The run registers its recipe as ``{"type": "current"}``: the scaling in force is current (the run's
    effective recipe says so), so a saturation under it asks for one more bit of margin."""
    rid, _ = incident_with_bundles(client, recipe={"type": "current", "margin": 0})
    assert client.get(f"{API}/runs/{rid}").json()["effective_recipe"]["model"]["scaling"] == "current"
    recipe = _layer_recipe(Run(recipe={"type": "current", "margin": 0}), LAYER)
    fine = report()
    fine["configs"][0]["sqnr_db"][LAYER] = 31.0  # a scale problem, not precision
    proposal = propose(fine, LAYERS, recipe, {"overflow_burst"}, "overflow_burst")
    assert (proposal.rule, proposal.changes) == ("stale_scale", {"margin": 1})
    delayed = _layer_recipe(Run(recipe={"type": "delayed"}), LAYER)  # what the default scaling gets
    assert propose(fine, LAYERS, delayed, {"overflow_burst"}, "overflow_burst").changes == {
        "scaling": "current"
    }


def test_propose_waits_for_a_person_to_apply(client):
    rid, iid = incident_with_bundles(client, **remediation("propose"))
    _replay(client, rid, iid)
    (action,) = _actions(client, rid)
    assert action["state"] == "proposed" and action["command_id"] is None
    assert client.get(f"{API}/runs/{rid}/commands").json() == []
    r = client.post(f"{API}/runs/{rid}/policy-actions/{action['id']}/apply")
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "queued"
    (command,) = client.get(f"{API}/runs/{rid}/commands").json()
    assert command["id"] == r.json()["command_id"] and command["created_by"] == "anonymous"
    again = client.post(f"{API}/runs/{rid}/policy-actions/{action['id']}/apply")
    assert again.status_code == 409 and "only a proposed one is applied" in again.json()["detail"]
    missing = client.post(f"{API}/runs/{rid}/policy-actions/{action['id'] + 99}/apply")
    assert missing.status_code == 404


def test_no_policy_no_action_and_not_fp8_no_action(client):
    rid, iid = incident_with_bundles(client)  # no remediation in the run's config
    _replay(client, rid, iid)
    assert _actions(client, rid) == [] and client.get(f"{API}/runs/{rid}/commands").json() == []
    rid, iid = incident_with_bundles(client, **remediation("act"))
    _replay(client, rid, iid, report("not-fp8"))
    assert _actions(client, rid) == [] and client.get(f"{API}/runs/{rid}/commands").json() == []


def test_the_rules_in_order():
    spike = report()  # fp8-caused, LAYER.input, LAYER's SQNR -3.5 dB in the FP8 replay
    assert propose(spike, LAYERS, DELAYED, {"nonfinite"}, "nonfinite").rule == "nonfinite"
    low = propose(spike, LAYERS, DELAYED, {"overflow_burst"}, "overflow_burst")
    assert (low.rule, low.changes) == ("low_sqnr", {"fp8_enabled": False})
    assert SQNR_FLOOR_DB > -3.5  # the report's SQNR of LAYER
    fine = report()
    fine["configs"][0]["sqnr_db"][LAYER] = 31.0
    stale = propose(fine, LAYERS, DELAYED, {"overflow_burst"}, "overflow_burst")
    assert (stale.rule, stale.target, stale.changes) == ("stale_scale", LAYER, {"scaling": "current"})
    current = propose(fine, LAYERS, {**DELAYED, "scaling": "current", "margin": 1}, set(), "overflow_burst")
    assert current.changes == {"margin": 2}
    under = propose(fine, LAYERS, DELAYED, {"underflow"}, "underflow")
    assert (under.rule, under.changes) == ("persistent_underflow", {"amax_history_len": 4})
    assert propose(report("not-fp8"), LAYERS, DELAYED, set(), None) is None
    assert propose({**fine, "culprits": ["lm_head.input"]}, LAYERS, DELAYED, set(), None) is None
    pair = propose({**spike, "culprits": [f"{LAYER}.input+{LAYER}.weight"]}, LAYERS, DELAYED, set(), None)
    assert pair is not None and pair.rule == "low_sqnr" and pair.target == LAYER  # lowprec names a pair
    mixed = {**spike, "culprits": [f"{LAYER}.input+blocks.0.mlp.fc.weight"]}  # two layers: no one target
    assert propose(mixed, LAYERS, DELAYED, set(), None) is None


def test_malformed_settings_read_as_off():
    assert RemediationConfig.of({"remediation": {"mode": "act", "check_steps": "x"}}).mode == "off"
    assert RemediationConfig.of({"remediation": {"mode": "sometimes"}}).mode == "off"
    assert RemediationConfig.of(None).mode == "off"
    assert RemediationConfig.of({"remediation": "act"}).mode == "act"  # fp8-train's: the flag's value
    cfg = RemediationConfig.of({"remediation": {"mode": "propose", "max_actions_per_hour": 5}})
    assert (cfg.mode, cfg.max_actions_per_hour, cfg.check_steps) == ("propose", 5, 20)
    assert np.isclose(cfg.worse_by, 0.02)
