"""Managing runs through the API: tags, rename, search and filters, cursor paging, delete, and the
service's upkeep (abandoned runs closed, old runs deleted)."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

from monitor_server.services import run_admin
from monitor_server.storage.models import utcnow
from tests.support.server import API, batch_body, create_run, random_stats

AUTH = {"tokens": ["job:ingest:ingest-secret", "dash:read:read-secret", "ops:read+control:control-secret"]}


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _names(client, **params) -> list[str]:
    r = client.get(f"{API}/runs", params=params)
    assert r.status_code == 200, r.text
    return [run["name"] for run in r.json()]


def test_tags_from_registration_and_from_the_page(client):
    run = create_run(client, name="a", tags=["baseline", "sweep-3", "baseline"])
    assert run["tags"] == ["baseline", "sweep-3"]
    create_run(client, name="b", tags=["sweep-3"])
    create_run(client, name="c")
    assert _names(client, tag="sweep-3") == ["b", "a"]
    assert _names(client, tag=["sweep-3", "baseline"]) == ["a"]
    r = client.patch(f"{API}/runs/{run['id']}", json={"tags": ["lr=3e-4"], "name": "a-renamed"})
    assert r.status_code == 200, r.text
    assert r.json()["tags"] == ["lr=3e-4"] and r.json()["name"] == "a-renamed"
    got = client.get(f"{API}/runs/{run['id']}").json()
    assert got["tags"] == ["lr=3e-4"] and got["name"] == "a-renamed" and got["status"] == "running"
    assert _names(client, tag="baseline") == []
    assert [r["tags"] for r in client.get(f"{API}/runs").json()] == [[], ["sweep-3"], ["lr=3e-4"]]


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"tags": ["has space"]}, '"loc":["body","tags",0]'),
        ({"tags": ["x" * 65]}, '"loc":["body","tags",0]'),
        ({"tags": [f"t{i}" for i in range(33)]}, '"loc":["body","tags"]'),
        ({"name": ""}, '"loc":["body","name"]'),
        ({}, "nothing to change"),
    ],
)
def test_bad_updates_are_422_naming_the_field(client, body, needle):
    run = create_run(client)
    r = client.patch(f"{API}/runs/{run['id']}", json=body)
    assert r.status_code == 422 and needle in r.text, r.text
    assert client.get(f"{API}/runs/{run['id']}").json()["name"] == "test-run"


def test_search_status_and_config_filters(client):
    create_run(
        client, name="GPT small 50%", config={"lr": 0.001, "model": {"n_layer": 2}, "recipe": "delayed"}
    )
    b = create_run(
        client, name="gpt_large", config={"lr": 0.0003, "model": {"n_layer": 8}, "recipe": "current"}
    )
    create_run(client, name="bert", config={"lr": 0.001, "recipe": "delayed"})
    client.patch(f"{API}/runs/{b['id']}", json={"status": "finished"})
    assert _names(client, q="gpt") == ["gpt_large", "GPT small 50%"]
    assert _names(client, q="50%") == ["GPT small 50%"]  # % and _ are literal, not wildcards
    assert _names(client, q="t_l") == ["gpt_large"]
    assert _names(client, q="gpt", status="running") == ["GPT small 50%"]
    assert _names(client, config="lr=0.001") == ["bert", "GPT small 50%"]
    assert _names(client, config=["lr=0.001", "model.n_layer=2"]) == ["GPT small 50%"]
    assert _names(client, config="recipe=current") == ["gpt_large"]
    r = client.get(f"{API}/runs", params={"config": "lr"})
    assert r.status_code == 422 and "KEY=VALUE" in r.text


@pytest.mark.parametrize("with_config_filter", [False, True])
def test_cursor_paging_visits_every_run_once(client, with_config_filter):
    ids = [create_run(client, name=f"r{i}", config={"k": i % 2})["id"] for i in range(9)]
    params = {"limit": 2, **({"config": "k=1"} if with_config_filter else {})}
    want = [i for n, i in enumerate(ids) if not with_config_filter or n % 2 == 1][::-1]
    seen, cursor, pages = [], None, 0
    while True:
        r = client.get(f"{API}/runs", params={**params, **({"before": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        seen += [run["id"] for run in r.json()]
        pages += 1
        cursor = r.headers.get("X-Next-Cursor")
        if cursor is None:
            break
    assert seen == want
    assert pages == (len(want) + 1) // 2


def test_delete_needs_control_and_takes_the_telemetry_with_it(make_client):
    client = make_client(**AUTH)
    run = create_run(client, headers=_bearer("ingest-secret"))
    rid = run["id"]
    stats = random_stats(np.random.default_rng(0), 3, 6)
    stats["nonfinite"][2, 1] = 5  # an alert to go with it
    r = client.post(
        f"{API}/runs/{rid}/telemetry",
        json=batch_body("k", [1, 2, 3], stats),
        headers=_bearer("ingest-secret"),
    )
    assert r.status_code == 200, r.text
    assert client.get(f"{API}/runs/{rid}/alerts", headers=_bearer("read-secret")).json()
    assert client.delete(f"{API}/runs/{rid}", headers=_bearer("read-secret")).status_code == 403
    assert client.delete(f"{API}/runs/{rid}", headers=_bearer("ingest-secret")).status_code == 403
    assert client.delete(f"{API}/runs/{rid}").status_code == 401
    assert client.delete(f"{API}/runs/{rid}", headers=_bearer("control-secret")).status_code == 204
    read = _bearer("read-secret")
    assert client.get(f"{API}/runs/{rid}", headers=read).status_code == 404
    assert client.get(f"{API}/runs/{rid}/series", params={"name": "loss"}, headers=read).status_code == 404
    assert client.delete(f"{API}/runs/{rid}", headers=_bearer("control-secret")).status_code == 404
    # the database holds nothing of it any more
    ctx = client.app.state.ctx
    from sqlalchemy import func, select

    from monitor_server.storage.models import Alert, StepRow, StepStat, TensorRow

    with ctx.db.read_session() as session:
        for table in (StepRow, StepStat, TensorRow, Alert):
            assert session.scalar(select(func.count()).select_from(table).where(table.run_id == rid)) == 0


def test_abandoned_runs_are_closed_and_reopen_when_their_client_returns(client):
    ctx = client.app.state.ctx
    quiet = create_run(client, name="quiet")
    busy = create_run(client, name="busy")
    pending = client.post(f"{API}/runs/{quiet['id']}/commands", json={"changes": {"margin": 1}}).json()
    later = utcnow() + timedelta(seconds=7200)
    stats = random_stats(np.random.default_rng(1), 1, 6)
    assert run_admin.close_abandoned(ctx.db, later, 3600) == [quiet["id"], busy["id"]]
    got = client.get(f"{API}/runs/{quiet['id']}").json()
    assert got["status"] == "crashed"
    (cmd,) = client.get(f"{API}/runs/{quiet['id']}/commands").json()
    assert cmd["id"] == pending["id"] and cmd["state"] == "rejected"
    assert run_admin.close_abandoned(ctx.db, utcnow(), 3600) == []  # recent runs are left alone
    r = client.post(f"{API}/runs/{busy['id']}/telemetry", json=batch_body("k", [1], stats))
    assert r.status_code == 200
    assert client.get(f"{API}/runs/{busy['id']}").json()["status"] == "running"


def test_retention_deletes_only_runs_that_ended_long_ago(client):
    ctx = client.app.state.ctx
    old_done = create_run(client, name="old-done")
    client.patch(f"{API}/runs/{old_done['id']}", json={"status": "finished"})
    create_run(client, name="old-running")
    now = utcnow()
    assert run_admin.apply_retention(ctx.db, now + timedelta(days=31), 0) == []  # 0: keep everything
    assert run_admin.apply_retention(ctx.db, now + timedelta(days=29), 30) == []
    assert run_admin.apply_retention(ctx.db, now + timedelta(days=31), 30) == [old_done["id"]]
    assert _names(client) == ["old-running"]


def test_the_run_lists_the_scalars_it_sent(client):
    rid = create_run(client)["id"]
    stats = random_stats(np.random.default_rng(2), 2, 6)
    body = batch_body("k1", [1, 2], stats, losses=[2.0, 1.9])
    body["steps"][1]["scalars"]["accuracy"] = 0.5
    assert client.post(f"{API}/runs/{rid}/telemetry", json=body).status_code == 200
    assert client.get(f"{API}/runs/{rid}").json()["scalar_names"] == ["accuracy", "loss", "lr"]
    body = batch_body("k2", [3], random_stats(np.random.default_rng(3), 1, 6))
    body["steps"][0]["scalars"] = {"tokens_per_s": 1000.0}
    assert client.post(f"{API}/runs/{rid}/telemetry", json=body).status_code == 200
    names = client.get(f"{API}/runs").json()[0]["scalar_names"]
    assert names == ["accuracy", "loss", "lr", "tokens_per_s"]


def test_maintenance_closes_after_the_stall_period_by_default(make_client):
    client = make_client(stall_seconds=30, stall_check_seconds=3600)
    ctx = client.app.state.ctx
    run = create_run(client)
    ctx.maintain(utcnow() + timedelta(seconds=20))
    assert client.get(f"{API}/runs/{run['id']}").json()["status"] == "running"
    ctx.maintain(utcnow() + timedelta(seconds=40))
    assert client.get(f"{API}/runs/{run['id']}").json()["status"] == "crashed"
    never = make_client(stall_seconds=30, stall_check_seconds=3600, close_after_seconds=0)
    other = create_run(never)
    never.app.state.ctx.maintain(utcnow() + timedelta(days=30))
    assert never.get(f"{API}/runs/{other['id']}").json()["status"] == "running"
