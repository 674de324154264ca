"""Ingest -> query round trips: values, NaN/Inf in both encodings, heatmaps against numpy, series."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.support.server import API, batch_body, create_run, decode, random_stats

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def _heatmap(client, run_id: int, **params) -> dict:
    r = client.get(f"{API}/runs/{run_id}/heatmap", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def _matrix(hm: dict) -> np.ndarray:
    return np.array([decode(row) for row in hm["values"]])


def _reference(steps: np.ndarray, values: np.ndarray, hm: dict, how: str) -> np.ndarray:
    """Aggregate per-step `values` (S, T) over the server's buckets with numpy, independently."""
    out = np.full((values.shape[1], len(hm["bucket_start"])), np.nan)
    for c, (a, b) in enumerate(zip(hm["bucket_start"], hm["bucket_end"], strict=True)):
        rows = values[(steps >= a) & (steps <= b)]
        if len(rows):
            out[:, c] = {"max": np.max, "min": np.min, "sum": np.sum}[how](rows, axis=0)
    return out


@pytest.mark.parametrize("encoding", ["json", "float64", "float32"])
def test_values_round_trip_with_nonfinite(client, encoding):
    run = create_run(client, n_layers=2)
    T = 6
    rng = np.random.default_rng(1)
    stats = random_stats(rng, 3, T)
    stats["amax"][0, 1] = np.nan
    stats["amax"][1, 2] = np.inf
    stats["scale"][2, 3] = -np.inf
    stats["nonfinite"][0, 1] = 17
    if encoding == "float32":
        stats = {k: v.astype(np.float32).astype(np.float64) for k, v in stats.items()}
    body = batch_body("k", [10, 11, 12], stats, encoding, losses=[2.0, np.nan, np.inf])
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == {"stored_steps": 3, "duplicate": False, "commands": []}
    for metric in ("amax", "scale", "overflow", "underflow", "nonfinite"):
        hm = _heatmap(client, run["id"], metric=metric, max_cols=100)
        assert hm["bucket_width"] == 1 and hm["bucket_start"] == [10, 11, 12]
        np.testing.assert_array_equal(_matrix(hm), stats[metric].T)
    hm = _heatmap(client, run["id"], metric="amax", max_cols=100)
    assert hm["values"][1][0] == "NaN" and hm["values"][2][1] == "Infinity"
    series = client.get(f"{API}/runs/{run['id']}/series", params={"name": "loss"}).json()
    assert series["steps"] == [10, 11, 12] and series["values"] == [2.0, "NaN", "Infinity"]
    got = client.get(f"{API}/runs/{run['id']}").json()
    assert got["last_step"] == 12 and got["last_loss"] == "Infinity" and got["steps_stored"] == 3


def test_heatmap_matches_numpy_reference_across_rollup_levels(client):
    run = create_run(client, n_layers=3)
    T, S = 9, 5003
    rng = np.random.default_rng(7)
    stats = random_stats(rng, S, T)
    stats["amax"][1234, 4] = np.nan  # must survive any bucketing
    stats["amax"][4321, 7] = np.inf
    stats["amax"][777, 0] = 1e6  # a one-step spike
    steps = np.arange(S) + 3
    # out of order, and split into odd-sized batches that straddle rollup blocks
    edges = [0, 1777, 50, 999, 3000, 4000, S]
    chunks = sorted(
        {(min(a, b), max(a, b)) for a, b in zip(edges[:-1], edges[1:], strict=True)}, key=lambda c: -c[0]
    )
    stored = np.zeros(S, dtype=bool)
    for i, (a, b) in enumerate(chunks):
        sel = np.arange(a, b)
        body = batch_body(f"b{i}", steps[sel], {k: v[sel] for k, v in stats.items()}, "float64")
        r = client.post(f"{API}/runs/{run['id']}/telemetry", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["stored_steps"] == int((~stored[sel]).sum())
        stored[sel] = True
    assert stored.all()
    fp8_max = np.array([448.0, 448.0, 57344.0] * 3)
    with np.errstate(divide="ignore", invalid="ignore"):
        headroom = np.log2(fp8_max / (stats["amax"] * stats["scale"]))
    cases = [
        ("amax", "max", stats["amax"]),
        ("scale", "max", stats["scale"]),
        ("overflow", "sum", stats["overflow"]),
        ("underflow", "sum", stats["underflow"]),
        ("headroom", "min", headroom),
    ]
    ranges = (
        {"max_cols": 1000},
        {"max_cols": 37},
        {"max_cols": 7},
        {"from": 100, "to": 4700, "max_cols": 50},
        {"from": 1230, "to": 1240, "max_cols": 3},
        {"max_cols": 1},
    )
    for (metric, how, per_step), params in itertools.product(cases, ranges):
        hm = _heatmap(client, run["id"], metric=metric, **params)
        n_cols = len(hm["bucket_start"])
        assert 1 <= n_cols <= params["max_cols"]
        lo, hi = params.get("from", 3), params.get("to", S + 2)
        assert hm["bucket_start"][0] == lo and hm["bucket_end"][-1] == hi
        assert sum(hm["bucket_steps"]) == hi - lo + 1
        expected = _reference(steps, per_step, hm, how)
        np.testing.assert_allclose(_matrix(hm), expected, rtol=1e-12, equal_nan=True)
    hm = _heatmap(client, run["id"], metric="amax", max_cols=10)
    amax = _matrix(hm)
    assert np.isnan(amax[4]).sum() == 1 and np.isinf(amax[7]).sum() == 1
    assert amax[0].max() == 1e6  # the spike is not averaged away


def test_heatmap_empty_run_and_bad_range(client):
    run = create_run(client)
    hm = _heatmap(client, run["id"])
    assert hm["bucket_start"] == [] and len(hm["values"]) == 6
    r = client.get(f"{API}/runs/{run['id']}/heatmap", params={"from": 10, "to": 5})
    assert r.status_code == 422
    r = client.get(f"{API}/runs/{run['id']}/heatmap", params={"metric": "bogus"})
    assert r.status_code == 422


def test_series_downsampling_keeps_min_max_and_nan(client):
    run = create_run(client, n_layers=1)
    S = 1000
    loss = np.linspace(5.0, 1.0, S)
    loss[333] = 50.0  # spike
    loss[600] = -3.0  # dip
    loss[900] = np.nan
    stats = random_stats(np.random.default_rng(0), S, 3)
    r = client.post(
        f"{API}/runs/{run['id']}/telemetry", json=batch_body("a", range(S), stats, "float64", losses=loss)
    )
    assert r.status_code == 200
    s = client.get(f"{API}/runs/{run['id']}/series", params={"name": "loss", "max_points": 40}).json()
    assert s["downsampled"] and len(s["steps"]) <= 40
    values = dict(zip(s["steps"], s["values"], strict=True))
    assert values[333] == 50.0 and values[600] == -3.0 and values[900] == "NaN"
    assert s["steps"] == sorted(s["steps"])
    lr = client.get(f"{API}/runs/{run['id']}/series", params={"name": "lr", "from": 10, "to": 19}).json()
    assert lr["steps"] == list(range(10, 20)) and lr["values"] == [3e-4] * 10
    missing = client.get(f"{API}/runs/{run['id']}/series", params={"name": "nope"}).json()
    assert missing["steps"] == []


def test_idempotency_and_resent_steps(client):
    run = create_run(client, n_layers=1)
    stats = random_stats(np.random.default_rng(2), 10, 3)
    body = batch_body("same-key", range(10), stats, "json")
    first = client.post(f"{API}/runs/{run['id']}/telemetry", json=body).json()
    again = client.post(f"{API}/runs/{run['id']}/telemetry", json=body).json()
    assert first["stored_steps"] == 10 and not first["duplicate"]
    assert again == {"stored_steps": 0, "duplicate": True, "commands": []}
    # a new key re-sending steps 5..9 with different values: those steps are ignored
    changed = {k: v[5:] * 2 + 1 for k, v in stats.items()}
    overlap = client.post(
        f"{API}/runs/{run['id']}/telemetry", json=batch_body("other", range(5, 10), changed)
    ).json()
    assert overlap["stored_steps"] == 0 and not overlap["duplicate"]
    hm = _heatmap(client, run["id"], metric="underflow", max_cols=1000)
    np.testing.assert_array_equal(_matrix(hm), stats["underflow"].T)
    got = client.get(f"{API}/runs/{run['id']}").json()
    assert got["steps_stored"] == 10


def test_runs_listing_tensors_and_status(client):
    a = create_run(client, name="first")
    b = create_run(client, name="second", n_layers=3)
    runs = client.get(f"{API}/runs").json()
    assert [r["id"] for r in runs][:2] == [b["id"], a["id"]]
    assert runs[0]["num_tensors"] == 9 and runs[0]["open_alerts"] == 0
    tensors = client.get(f"{API}/runs/{b['id']}/tensors").json()
    assert [t["index"] for t in tensors] == list(range(9)) and tensors[2]["role"] == "grad_output"
    r = client.patch(f"{API}/runs/{a['id']}", json={"status": "finished"})
    assert r.status_code == 200 and r.json()["status"] == "finished"
    assert [r["id"] for r in client.get(f"{API}/runs", params={"status": "finished"}).json()] == [a["id"]]
    assert client.patch(f"{API}/runs/{a['id']}", json={"status": "exploded"}).status_code == 422
    assert client.get(f"{API}/runs/999999").status_code == 404


def test_healthz_and_metrics(client):
    assert client.get("/healthz").json()["status"] == "ok"
    run = create_run(client, n_layers=1)
    stats = random_stats(np.random.default_rng(3), 4, 3)
    client.post(
        f"{API}/runs/{run['id']}/telemetry", json=batch_body("m", range(4), stats, losses=[1, 2, 3, 4.5])
    )
    text = client.get("/metrics").text
    assert 'fp8scope_ingest_batches_total{result="stored"} 1.0' in text
    assert "fp8scope_ingest_steps_total 4.0" in text
    assert "fp8scope_ingest_values_total 72.0" in text
    assert "fp8scope_ingest_seconds_count 1.0" in text
    assert f'fp8scope_run_last_loss{{run="test-run",run_id="{run["id"]}"}} 4.5' in text
    assert f'fp8scope_run_last_step{{run="test-run",run_id="{run["id"]}"}} 3.0' in text
    assert client.get("/docs").status_code == 200


def test_steps_without_statistics_store_their_scalars_only(client):
    """A step in which no FP8 layer ran is sent without `stats`: its loss is stored and charted, no values are
    invented for it (the heatmap has no column there), and the loss detectors still see it."""
    run = create_run(client, n_layers=2)
    T = 6
    rng = np.random.default_rng(4)
    steps = list(range(1, 41))
    stats = random_stats(rng, len(steps), T)
    stats["amax"][:] = 1.0
    stats["scale"][:] = 448.0
    stats["overflow"][:] = 0
    losses = [2.0 + 0.001 * (i % 3) for i in range(len(steps))]
    losses[29] = 9.0  # a loss spike at step 30, a step without statistics
    body = batch_body("k", steps, stats, losses=losses)
    without = {5, 6, 30, 31, 32}
    for entry in body["steps"]:
        if entry["step"] in without:
            del entry["stats"]
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["stored_steps"] == 40
    series = client.get(f"{API}/runs/{run['id']}/series", params={"name": "loss"}).json()
    assert series["steps"] == steps
    hm = _heatmap(client, run["id"], metric="amax", max_cols=100)
    assert hm["bucket_width"] == 1
    with_stats = [s for s in steps if s not in without]
    assert [
        s for s in hm["bucket_start"] if not np.isnan(_matrix(hm)[:, hm["bucket_start"].index(s)]).all()
    ] == (with_stats)
    alerts = client.get(f"{API}/runs/{run['id']}/alerts").json()
    assert [(a["kind"], a["first_step"]) for a in alerts] == [("loss_spike", 30)]


def test_stats_must_be_an_object_or_left_out(client):
    run = create_run(client, n_layers=1)
    body = {"idempotency_key": "k", "steps": [{"step": 1, "scalars": {"loss": 1.0}, "stats": None}]}
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json=body)
    assert r.status_code == 422 and "steps[0].stats" in r.text and "left out" in r.text
