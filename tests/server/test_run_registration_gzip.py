"""Run registration (idempotent with `client_key`; baselines without FP8 tensors) and gzip telemetry."""

from __future__ import annotations

import gzip

import numpy as np
import orjson

from tests.support.server import API, STATS, batch_body, decode, random_stats, run_body


def test_client_key_registers_once(client):
    first = client.post(f"{API}/runs", json=run_body(2, client_key="job-7f3a"))
    assert first.status_code == 201, first.text
    again = client.post(f"{API}/runs", json=run_body(2, client_key="job-7f3a"))
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    other = client.post(f"{API}/runs", json=run_body(2, client_key="job-other"))
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
    plain = [client.post(f"{API}/runs", json=run_body(2)).json()["id"] for _ in range(2)]
    assert plain[0] != plain[1]  # without a key every registration is a new run
    assert len(client.get(f"{API}/runs").json()) == 4
    clash = client.post(f"{API}/runs", json=run_body(3, client_key="job-7f3a"))
    assert clash.status_code == 409 and "client_key" in clash.json()["detail"]


def test_gzip_telemetry_is_stored_like_plain(client):
    run = client.post(f"{API}/runs", json=run_body(2)).json()
    stats = random_stats(np.random.default_rng(1), 3, 6)
    body = gzip.compress(orjson.dumps(batch_body("gz-1", [1, 2, 3], stats, encoding="float64")))
    url = f"{API}/runs/{run['id']}/telemetry"
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    r = client.post(url, content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["stored_steps"] == 3
    amax = client.get(f"{API}/runs/{run['id']}/heatmap", params={"metric": "amax"}).json()["values"]
    np.testing.assert_array_equal(np.array(amax, dtype=np.float64), stats["amax"].T)
    bad = client.post(url, content=body[:-9], headers=headers)
    assert bad.status_code == 400 and "gzip" in bad.json()["detail"]
    # a second gzip member (another batch) glued on would be silently dropped: refused instead
    glued = body + gzip.compress(b'{"idempotency_key": "gz-2"}')
    trailing = client.post(url, content=glued, headers=headers)
    assert trailing.status_code == 400 and "data after the gzip stream" in trailing.json()["detail"]
    other = client.post(url, content=body, headers={**headers, "Content-Encoding": "br"})
    assert other.status_code == 415


GZIP_JSON = {"Content-Encoding": "gzip", "Content-Type": "application/json"}


def test_gzip_bomb_is_refused(make_client):
    client = make_client(max_body_bytes=100_000)
    run = client.post(f"{API}/runs", json=run_body(1)).json()
    bomb = gzip.compress(b" " * 1_000_000)  # ~1 kB compressed, 1 MB inflated
    r = client.post(f"{API}/runs/{run['id']}/telemetry", content=bomb, headers=GZIP_JSON)
    assert r.status_code == 413
    assert client.get(f"{API}/runs/{run['id']}").json()["steps_stored"] == 0


def test_run_without_fp8_tensors_stores_scalars(client):
    body = {**run_body(1), "tensors": [], "recipe": {}}
    run = client.post(f"{API}/runs", json=body)
    assert run.status_code == 201, run.text
    run_id = run.json()["id"]
    empty = {"dtype": "float64", "b64": ""}
    steps = [
        {"step": s, "scalars": {"loss": 3.0 - 0.01 * s}, "stats": dict.fromkeys(STATS, empty)} for s in (1, 2)
    ]
    steps.append({"step": 3, "scalars": {"loss": "NaN"}, "stats": {n: [] for n in STATS}})
    r = client.post(f"{API}/runs/{run_id}/telemetry", json={"idempotency_key": "b-1", "steps": steps})
    assert r.status_code == 200 and r.json()["stored_steps"] == 3, r.text
    series = client.get(f"{API}/runs/{run_id}/series", params={"name": "loss"}).json()
    assert series["steps"] == [1, 2, 3]
    np.testing.assert_array_equal(decode(series["values"]), [2.99, 2.98, np.nan])
    assert client.get(f"{API}/runs/{run_id}/tensors").json() == []
    # a column that is not empty is the wrong length for such a run
    steps[0]["stats"]["amax"] = [1.0]
    bad = client.post(f"{API}/runs/{run_id}/telemetry", json={"idempotency_key": "b-2", "steps": steps[:1]})
    assert bad.status_code == 422
    assert client.post(f"{API}/runs/999/telemetry", json={"idempotency_key": "x"}).status_code == 404
