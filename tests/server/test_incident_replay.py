"""Incident replays: a replay report stored on its incident and read back, its verdict on the incident, the
job's bundles listed on the incident they belong to, bad reports refused with a clear message, the same
scopes as the other writes, the migration. Real app, both database backends."""

from __future__ import annotations

import csv
import io
import json

import pyarrow.parquet as pq
import pytest
from sqlalchemy import text

from monitor_server.core.db import make_engine
from monitor_server.storage.migrations import upgrade_to_head
from tests.server.test_migrations import at_revision, insert_run
from tests.support.server import API, create_run, post_batch, quiet_stats, run_body

T = 6  # two layers x (input, weight, grad_output)
LAYER = "blocks.1.mlp.fc"


def report(verdict: str = "fp8-caused", **extra) -> dict:
    """A replay report as `fp8-train replay` writes it (an FP8 saturation of LAYER's input)."""
    configs = [
        {"name": "fp8", "high_precision": [], "loss": 9.5, "losses": [2.0, 9.5], "fault": True,
         "sqnr_db": {"blocks.0.mlp.fc": 31.0, LAYER: -3.5}, "grad_sqnr_db_min": 12.0,
         "grad_sqnr_worst": f"{LAYER}.weight"},
        {"name": "high-precision", "high_precision": ["blocks.0.mlp.fc", LAYER], "loss": 2.01,
         "losses": [2.0, 2.01], "fault": False,
         "sqnr_db": {"blocks.0.mlp.fc": "Infinity", LAYER: "Infinity"}},
        {"name": f"cast {LAYER}.input", "high_precision": [f"{LAYER}.input"], "loss": 2.02,
         "losses": [2.0, 2.02], "fault": False},
        {"name": "nan", "high_precision": [], "loss": "NaN", "losses": ["NaN"], "fault": True},
    ]  # fmt: skip
    body = {
        "verdict": verdict,
        "reason": "the fault comes back in FP8 (loss 9.5) and is gone in high precision (loss 2.01)",
        "culprits": [f"{LAYER}.input"] if verdict == "fp8-caused" else [],
        "configs": configs,
        "bundle": "incidents/incident-step4.pt",
        "step": 4,
        "window": [2, 4],
        "bitwise": True,
        "trigger": {"kind": "loss_spike", "loss": 9.5, "expected": 2.0, "sigma": 0.01},
    }
    return {**body, **extra}


def incident_with_bundles(client, bundle_steps=(4,), **run_extra) -> tuple[int, int]:
    """A run with one incident (a non-finite input at step 4) and `incident_bundle` events at
    `bundle_steps`: (run id, incident id)."""
    rid = create_run(client, n_layers=2, **run_extra)["id"]
    s = quiet_stats(10, T)
    s["nonfinite"][4, 3] = 1
    events = [
        {"kind": "custom", "step": step, "details": {"name": "incident_bundle", "path": f"b/step{step}.pt"}}
        for step in bundle_steps
    ] + [{"kind": "custom", "step": 4, "details": {"name": "checkpoint", "path": "ckpt.pt"}}]
    post_batch(client, rid, "a", 0, s, events=events)
    (incident,) = client.get(f"{API}/runs/{rid}/incidents").json()
    return rid, incident["id"]


def test_a_replay_is_stored_on_its_incident_and_read_back(client):
    rid, iid = incident_with_bundles(client, bundle_steps=(4, 500))
    url = f"{API}/runs/{rid}/incidents/{iid}/replay"
    r = client.get(url)
    assert r.status_code == 404 and "no replay yet" in r.json()["detail"]
    incident = client.get(f"{API}/runs/{rid}/incidents/{iid}").json()
    # the bundle of its step, not the checkpoint nor the bundle of a later step
    assert incident["replay_verdict"] is None and incident["bundles"] == ["b/step4.pt"]

    r = client.put(url, json=report())
    assert r.status_code == 200, r.text
    stored = client.get(url).json()
    assert stored == r.json()
    assert stored["verdict"] == "fp8-caused" and stored["culprits"] == [f"{LAYER}.input"]
    assert stored["incident_id"] == iid and stored["run_id"] == rid and stored["updated_by"] == "anonymous"
    fp8, hp, _, nan = stored["configs"]
    assert fp8["sqnr_db"][LAYER] == -3.5 and hp["sqnr_db"][LAYER] == "Infinity"
    assert nan["loss"] == "NaN" and nan["losses"] == ["NaN"]
    assert client.get(f"{API}/runs/{rid}/incidents/{iid}").json()["replay_verdict"] == "fp8-caused"
    (listed,) = client.get(f"{API}/runs/{rid}/incidents").json()
    assert listed["replay_verdict"] == "fp8-caused" and listed["bundles"] == ["b/step4.pt"]

    # a second replay replaces the first
    assert client.put(url, json=report("not-fp8")).status_code == 200
    assert client.get(url).json()["verdict"] == "not-fp8"
    assert client.get(f"{API}/runs/{rid}/incidents").json()[0]["replay_verdict"] == "not-fp8"


def test_an_incident_of_another_run_or_none_is_404(client):
    rid, iid = incident_with_bundles(client)
    other = create_run(client, n_layers=2)["id"]
    r = client.put(f"{API}/runs/{other}/incidents/{iid}/replay", json=report())
    assert r.status_code == 404 and f"incident {iid} not found in run {other}" in r.json()["detail"]
    assert client.put(f"{API}/runs/{rid}/incidents/{iid + 1}/replay", json=report()).status_code == 404
    assert client.put(f"{API}/runs/999/incidents/{iid}/replay", json=report()).status_code == 404
    assert client.get(f"{API}/runs/{other}/incidents/{iid}/replay").status_code == 404


def test_bad_reports_are_refused_with_what_is_wrong(client):
    rid, iid = incident_with_bundles(client)
    url = f"{API}/runs/{rid}/incidents/{iid}/replay"

    def refusal(body) -> str:
        r = client.put(url, json=body)
        assert r.status_code == 422, r.text
        return str(r.json()["detail"])

    assert "fp8-caused" in refusal(report("maybe"))  # the verdicts it takes are named
    assert "configs" in refusal(report(configs=[{"name": "fp8"}]))  # no loss, no fault
    assert "surprise" in refusal(report(surprise=1))  # an undeclared field
    assert "nan" in refusal(report(configs=[{**report()["configs"][0], "loss": "nan"}])).lower()
    assert "culprits" in refusal(report(culprits=["x"] * 2000))
    assert client.get(url).status_code == 404  # nothing stored
    sqnr = {f"blocks.{i}.mlp.fc": 20.0 for i in range(64)}  # a model of 64 FP8 layers
    big = report(configs=[{**report()["configs"][0], "sqnr_db": sqnr}] * 1000)
    assert len(json.dumps(big)) > 1024 * 1024
    r = client.put(url, json=big)
    assert r.status_code == 413 and "max_replay_bytes" in r.json()["detail"]


def test_replays_take_the_scopes_of_the_other_writes(make_client):
    tokens = ["trainer:ingest:trainer-secret-1", "other:ingest:other-secret-1", "dash:read:dash-secret-1"]
    tokens.append("ops:read+control:ops-secret-1")
    client = make_client(tokens=tokens)
    trainer, other, dash, ops = ({"Authorization": f"Bearer {t.split(':')[0]}-secret-1"} for t in tokens)
    rid = client.post(f"{API}/runs", json=run_body(2), headers=trainer).json()["id"]
    s = quiet_stats(10, T)
    s["nonfinite"][4, 3] = 1
    client.headers.update(trainer)
    post_batch(client, rid, "a", 0, s)
    iid = client.get(f"{API}/runs/{rid}/incidents", headers=dash).json()[0]["id"]
    url = f"{API}/runs/{rid}/incidents/{iid}/replay"
    assert client.put(url, json=report(), headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.put(url, json=report(), headers=dash).status_code == 403
    r = client.put(url, json=report(), headers=other)
    assert r.status_code == 403 and "registered by another token" in r.json()["detail"]
    assert client.get(url, headers=dash).status_code == 404
    assert client.put(url, json=report(), headers=trainer).json()["updated_by"] == "trainer"
    assert client.put(url, json=report("not-fp8"), headers=ops).json()["updated_by"] == "ops"
    assert client.get(url, headers=dash).json()["verdict"] == "not-fp8"


def test_a_deleted_run_takes_its_replays_with_it(client):
    rid, iid = incident_with_bundles(client)
    assert client.put(f"{API}/runs/{rid}/incidents/{iid}/replay", json=report()).status_code == 200
    assert client.delete(f"{API}/runs/{rid}").status_code == 204
    with client.app.state.ctx.db.read_session() as session:
        assert session.execute(text("SELECT count(*) FROM incident_replays")).scalar() == 0


def test_the_replays_migration_adds_its_table_to_a_populated_database(db_url):
    engine = make_engine(db_url)
    try:
        with at_revision(engine, "0010") as connection:  # 0011 needs upgrade_to_head on SQLite
            insert_run(connection, "running", num_tensors=3, steps_stored=0)
            connection.execute(
                text(
                    "INSERT INTO incidents (run_id, state, severity, first_step, last_step, alert_count, "
                    "created_at, updated_at) VALUES (1, 'open', 'critical', 4, 4, 0, CURRENT_TIMESTAMP, "
                    "CURRENT_TIMESTAMP)"
                )
            )
        upgrade_to_head(engine)
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO incident_replays (incident_id, run_id, verdict, report, created_at, "
                    "updated_at, updated_by) VALUES (1, 1, 'not-fp8', '{}', CURRENT_TIMESTAMP, "
                    "CURRENT_TIMESTAMP, 'x')"
                )
            )
            assert conn.execute(text("SELECT count(*) FROM incidents")).scalar() == 1
            conn.execute(text("DELETE FROM incidents"))  # the replay goes with its incident
            assert conn.execute(text("SELECT count(*) FROM incident_replays")).scalar() == 0
    finally:
        engine.dispose()


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_the_export_has_the_replays_of_the_incidents_in_range(client, fmt):
    rid, iid = incident_with_bundles(client)
    assert client.put(f"{API}/runs/{rid}/incidents/{iid}/replay", json=report()).status_code == 200

    def rows(**params) -> list[dict]:
        r = client.get(f"{API}/runs/{rid}/export", params={"table": "replays", "format": fmt, **params})
        assert r.status_code == 200, r.text
        assert f'filename="run-{rid}-replays.{fmt}"' in r.headers["content-disposition"]
        if fmt == "csv":
            return list(csv.DictReader(io.StringIO(r.text)))
        return pq.read_table(io.BytesIO(r.content)).to_pylist()

    (row,) = rows()
    assert int(row["incident_id"]) == iid and row["verdict"] == "fp8-caused"
    assert row["culprits"] == f"{LAYER}.input" and row["updated_by"] == "anonymous"
    assert json.loads(row["report"])["configs"][3]["loss"] == "NaN"  # the report as stored
    assert rows(**{"from": 5}) == []  # the incident is at step 4


def test_a_long_bundle_path_is_listed_whole(client):
    """An event's summary keeps the first 200 characters of a text; the path is read from its details."""
    rid = create_run(client, n_layers=2)["id"]
    s = quiet_stats(10, T)
    s["nonfinite"][4, 3] = 1
    path = "/".join(["deep"] * 80) + "/incident-step4.pt"
    events = [{"kind": "custom", "step": 4, "details": {"name": "incident_bundle", "path": path}}]
    post_batch(client, rid, "a", 0, s, events=events)
    assert len(path) > 300 and client.get(f"{API}/runs/{rid}/incidents").json()[0]["bundles"] == [path]
