"""Ids are never reused (issue 38, item 1): a deleted run's id, and the ids of its alerts, incidents, events
and commands, never go to a later row, so a job still sending to a deleted run never writes into another;
and an instance's cached run meta never serves a run other than the one it was built from, whichever
instance on the same database deleted or (re)created the row."""

from __future__ import annotations

import numpy as np
from sqlalchemy import delete
from sqlalchemy.orm import Session

from monitor_server.core.db import make_engine
from monitor_server.storage.models import Run, TensorRow
from tests.support.server import API, batch_body, create_run, make_tensors, quiet_stats

JOB = {"Authorization": "Bearer ingest-secret"}
OPS = {"Authorization": "Bearer control-secret"}
AUTH = {"tokens": ["job:ingest:ingest-secret", "ops:ingest+read+control:control-secret"]}


def _send(client, run_id: int, key: str, first: int, tensors: int, loss: float, headers=None, **extra):
    stats = quiet_stats(3, tensors)
    body = batch_body(key, range(first, first + 3), stats, losses=[loss] * 3, **extra)
    return client.post(f"{API}/runs/{run_id}/telemetry", json=body, headers=headers or {})


def _with_findings(client, run_id: int, key: str) -> None:
    """A batch that stores an event and raises a non-finite alert (and its incident), then a command."""
    stats = quiet_stats(3, 6)
    stats["nonfinite"][1, 4] = 3
    stats["amax"][1, 4] = np.nan
    events = [{"kind": "custom", "step": 1, "details": {"note": key}}]
    body = batch_body(key, [0, 1, 2], stats, losses=[2.0] * 3, events=events)
    assert client.post(f"{API}/runs/{run_id}/telemetry", json=body, headers=OPS).status_code == 200
    target = "blocks.0.mlp.fc"
    r = client.post(
        f"{API}/runs/{run_id}/commands", json={"target": target, "changes": {"margin": 1}}, headers=OPS
    )
    assert r.status_code in (200, 201), r.text


def _ids(client, run_id: int) -> dict[str, list[int]]:
    out = {}
    for what in ("alerts", "incidents", "events", "commands"):
        r = client.get(f"{API}/runs/{run_id}/{what}", headers=OPS)
        assert r.status_code == 200, r.text
        out[what] = [row["id"] for row in r.json()]
    return out


def test_deleted_newest_run_keeps_its_id_and_its_job_cannot_write_into_the_next_run(make_client):
    client = make_client(**AUTH)
    old = create_run(client, headers=JOB)  # 2 layers: T = 6
    assert _send(client, old["id"], "old-1", 0, 6, loss=9.5, headers=JOB).status_code == 200
    assert client.delete(f"{API}/runs/{old['id']}", headers=OPS).status_code == 204

    new = create_run(client, headers=JOB, name="next")
    assert new["id"] > old["id"]
    # the deleted run's job sends its next batch with the same ingest token
    late = _send(client, old["id"], "old-2", 3, 6, loss=9.5, headers=JOB)
    assert late.status_code == 404, late.text
    got = client.get(f"{API}/runs/{new['id']}", headers=OPS).json()
    assert got["steps_stored"] == 0 and got["last_loss"] is None


def test_alert_incident_event_and_command_ids_of_a_deleted_run_are_not_reused(make_client):
    client = make_client(**AUTH)
    old = create_run(client, headers=OPS)
    _with_findings(client, old["id"], "a")
    before = _ids(client, old["id"])
    assert all(before.values()), before  # one of each
    assert client.delete(f"{API}/runs/{old['id']}", headers=OPS).status_code == 204

    new = create_run(client, headers=OPS)
    _with_findings(client, new["id"], "b")
    after = _ids(client, new["id"])
    for what, ids in after.items():
        assert ids and min(ids) > max(before[what]), (what, before[what], ids)


def test_two_instances_on_one_database_never_store_into_a_recycled_run(make_client):
    """Instance `ops` deletes the newest run and registers another; instance `ingest` had served the
    deleted run's batches (its meta cached): the old job's batch is refused, the new run's are stored."""
    ops = make_client(**AUTH)
    ingest = make_client(**AUTH)
    old = create_run(ops, headers=JOB, n_layers=2)  # T = 6
    assert _send(ingest, old["id"], "old-1", 0, 6, loss=9.5, headers=JOB).status_code == 200
    assert ops.delete(f"{API}/runs/{old['id']}", headers=OPS).status_code == 204
    new = create_run(ops, headers=JOB, n_layers=3, name="next")  # T = 9

    assert _send(ingest, old["id"], "old-2", 3, 6, loss=9.5, headers=JOB).status_code == 404
    stored = _send(ingest, new["id"], "new-1", 0, 9, loss=1.5, headers=JOB)
    assert stored.status_code == 200, stored.text
    wrong_shape = _send(ingest, new["id"], "new-2", 3, 6, loss=1.5, headers=JOB)
    assert wrong_shape.status_code == 422, wrong_shape.text
    got = ops.get(f"{API}/runs/{new['id']}", headers=OPS).json()
    assert got["steps_stored"] == 3 and got["last_loss"] == 1.5


def test_cached_meta_never_serves_a_row_recreated_under_the_same_id(make_client, db_url):
    """A run row that comes back under an id an instance has cached (a database restored from a backup
    under a running server): the instance serves the row's own tensors, not the ones it had cached."""
    client = make_client()
    run = create_run(client, n_layers=2)  # T = 6
    assert _send(client, run["id"], "before", 0, 6, loss=2.0).status_code == 200
    engine = make_engine(db_url)
    try:
        with Session(engine) as session, session.begin():
            old = session.get(Run, run["id"])
            columns = {c.key: getattr(old, c.key) for c in Run.__table__.columns if c.key != "created_at"}
            session.execute(delete(Run).where(Run.id == run["id"]))
            session.flush()
            session.add(Run(**{**columns, "num_tensors": 3, "steps_stored": 0, "last_step": None}))
            session.flush()
            for t in make_tensors(1):
                session.add(TensorRow(run_id=run["id"], **t))
    finally:
        engine.dispose()
    assert _send(client, run["id"], "old-shape", 3, 6, loss=2.0).status_code == 422
    assert _send(client, run["id"], "new-shape", 3, 3, loss=2.0).status_code == 200
