"""Bounded heatmaps: tensors per run are capped at registration, tensors x columns per answer too (422 naming
the limit), and buckets without stored steps cost nothing but their cells in the answer."""

from __future__ import annotations

import struct
import typing

import numpy as np
import orjson

from monitor_server.storage.rollups import HEATMAP_METRICS
from monitor_server.storage.schemas import HeatmapMetric
from tests.support.server import API, batch_body, create_run, random_stats, run_body


def test_tensors_per_run_capped_at_registration(make_client):
    client = make_client(max_tensors=6)
    assert client.post(f"{API}/runs", json=run_body(2)).status_code == 201  # 6 tensors
    r = client.post(f"{API}/runs", json=run_body(3))  # 9 tensors
    assert r.status_code == 422
    assert r.json()["detail"] == "tensors: 9 tensors exceed the limit of 6 per run (max_tensors)"
    assert len(client.get(f"{API}/runs").json()) == 1


def test_heatmap_cells_capped(make_client):
    """Steps 0 and 2^40 with max_cols=10000: ten thousand columns of 6 tensors is over a 4096-cell cap."""
    client = make_client(max_heatmap_cells=4096)
    rid = create_run(client, n_layers=2)["id"]
    stats = random_stats(np.random.default_rng(3), 2, 6)
    body = batch_body("far", [0, 2**40], stats, "float64")
    assert client.post(f"{API}/runs/{rid}/telemetry", json=body).status_code == 200
    for path in ("heatmap", "heatmap/packed"):
        r = client.get(f"{API}/runs/{rid}/{path}", params={"max_cols": 10_000})
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert "exceeds the limit of 4096 cells (max_heatmap_cells)" in detail
        assert "at most 682 columns" in detail
    r = client.get(f"{API}/runs/{rid}/heatmap", params={"max_cols": 600})
    assert r.status_code == 200
    hm = r.json()
    filled = [c for c, n in enumerate(hm["bucket_steps"]) if n]
    assert len(filled) == 2 and filled[0] == 0 and filled[1] == len(hm["bucket_steps"]) - 1
    values = hm["values"]
    assert all(row[c] is None for row in values for c in range(1, len(hm["bucket_steps"]) - 1))
    np.testing.assert_array_equal([row[0] for row in values], stats["amax"][0])
    np.testing.assert_array_equal([row[-1] for row in values], stats["amax"][1])
    # the packed answer holds the same cells, NaN where the JSON has null
    raw = client.get(f"{API}/runs/{rid}/heatmap/packed", params={"max_cols": 600}).content
    (n,) = struct.unpack("<I", raw[:4])
    head = orjson.loads(raw[4 : 4 + n])
    matrix = np.frombuffer(raw[4 + n + (-(4 + n) % 8) :], "<f8").reshape(head["rows"], head["cols"])
    assert head["bucket_steps"] == hm["bucket_steps"]
    assert np.isnan(matrix[:, 1:-1]).all()
    np.testing.assert_array_equal(matrix[:, 0], stats["amax"][0])


def test_the_heatmap_metric_type_names_every_rollup_metric():
    assert set(typing.get_args(HeatmapMetric)) == set(HEATMAP_METRICS)
