"""The open (token-less) server against another site's page in a browser on the same machine: JSON bodies
must say `application/json` (415 otherwise: a cross-site form or `text/plain` post cannot), the `Host` must
be a name of this server (DNS rebinding) and an `Origin`, when sent, this server's. With tokens configured
none of this applies (a browser page has no token to send)."""

from __future__ import annotations

import numpy as np
import orjson

from tests.support.server import API, batch_body, create_run, random_stats

TEXT = {"Content-Type": "text/plain"}


def test_cross_site_ack_and_alert_refused_415(client):
    """The attack: a page on another origin posts `text/plain` (no preflight) to ack a pending command as
    applied and to plant a critical alert. Both are refused and nothing changes."""
    rid = create_run(client, 1)["id"]
    cmd = client.post(f"{API}/runs/{rid}/commands", json={"changes": {"fp8_enabled": False}}).json()
    ack = {"idempotency_key": "x", "acks": [{"command_id": cmd["id"], "state": "applied", "step": 1}]}
    r = client.post(f"{API}/runs/{rid}/telemetry", content=orjson.dumps(ack), headers=TEXT)
    assert r.status_code == 415 and "expected application/json" in r.json()["detail"]
    stats = random_stats(np.random.default_rng(0), 1, 3)
    stats["nonfinite"][0, 0] = 5
    fake = batch_body("y", [1], stats)
    r = client.post(f"{API}/runs/{rid}/telemetry", content=orjson.dumps(fake), headers=TEXT)
    assert r.status_code == 415
    assert client.get(f"{API}/runs/{rid}/commands").json()[0]["state"] == "pending"
    assert client.get(f"{API}/runs/{rid}").json()["effective_recipe"]["model"].get("fp8_enabled") is not False
    assert client.get(f"{API}/runs/{rid}/alerts").json() == []
    r = client.post(
        f"{API}/runs", content=b'{"name": "x"}', headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert r.status_code == 415


def test_host_and_origin_checked_without_tokens(client):
    rid = create_run(client, 1)["id"]
    r = client.get(f"{API}/runs", headers={"Host": "attacker.example:8000"})
    assert (
        r.status_code == 400 and "'attacker.example:8000' is not a name of this server" in r.json()["detail"]
    )
    assert client.get("/healthz", headers={"Host": "attacker.example"}).status_code == 400
    for host in ("127.0.0.1:8000", "localhost", "[::1]:8000"):
        assert client.get(f"{API}/runs", headers={"Host": host}).status_code == 200, host
    r = client.patch(
        f"{API}/runs/{rid}", json={"status": "crashed"}, headers={"Origin": "https://evil.example"}
    )
    assert r.status_code == 403 and "cross-origin request from 'https://evil.example'" in r.json()["detail"]
    assert (
        client.patch(f"{API}/runs/{rid}", json={"status": "crashed"}, headers={"Origin": "null"}).status_code
        == 403
    )
    assert client.get(f"{API}/runs/{rid}").json()["status"] == "running"
    same = {"Origin": "http://127.0.0.1:8000"}
    assert client.patch(f"{API}/runs/{rid}", json={"status": "finished"}, headers=same).status_code == 200


def test_allow_list_adds_names(make_client):
    client = make_client(allowed_hosts=["testserver", "monitor.lan"])
    assert client.get(f"{API}/runs", headers={"Host": "monitor.lan:8000"}).status_code == 200
    assert client.get(f"{API}/runs", headers={"Origin": "http://monitor.lan:8000"}).status_code == 200


def test_with_tokens_nothing_changes(make_client):
    client = make_client(tokens=["t:ingest+read:trainer-secret-1"])
    auth = {"Authorization": "Bearer trainer-secret-1"}
    rid = create_run(client, 1, headers=auth)["id"]
    body = batch_body("z", [1], random_stats(np.random.default_rng(0), 1, 3))
    r = client.post(f"{API}/runs/{rid}/telemetry", content=orjson.dumps(body), headers={**auth, **TEXT})
    assert r.status_code == 200
    assert client.get(f"{API}/runs", headers={**auth, "Host": "monitor.example.com"}).status_code == 200
