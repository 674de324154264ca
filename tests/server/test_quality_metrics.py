"""The quantization-quality heatmap metrics (sqnr, subnormal, dynamic_range, outlier_ratio): each bucket
equals a numpy computation from the raw posted columns, at every width (buckets made of rollup blocks and of
raw steps at the range's ends), with steps sent without the quality columns left out of them."""

from __future__ import annotations

import itertools
import struct

import numpy as np
import orjson
import pytest

from fp8_protocol.stats import BASE_COLUMNS, QUALITY_COLUMNS
from tests.support.server import API, col, create_run, decode, random_stats

T = 9  # create_run(n_layers=3)


def quality_stats(rng: np.random.Generator, steps: int, tensors: int) -> dict[str, np.ndarray]:
    """Base and quality columns that agree with each other: Σx² from an RMS below amax, Σ(q(x)−x)² a
    tensor-dependent SQNR of 15..40 dB, subnormal counts and the smallest non-zero |x| below amax."""
    stats = random_stats(rng, steps, tensors)
    numel = stats["numel"]
    rms = stats["amax"] / rng.uniform(3.0, 300.0, size=(steps, tensors))
    sum_sq = rms**2 * numel
    sqnr = rng.uniform(15.0, 40.0, size=(1, tensors)) + rng.normal(0.0, 1.5, size=(steps, tensors))
    return stats | {
        "sum_sq": sum_sq,
        "err_sq": sum_sq * 10.0 ** (-sqnr / 10.0),
        "subnormal": rng.poisson(20.0, size=(steps, tensors)).astype(np.float64),
        "min_abs": stats["amax"] * 2.0 ** -rng.uniform(4.0, 30.0, size=(steps, tensors)),
    }


def expected_per_step(stats: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The four metrics per step, written out here from their definitions (not the service's functions)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        finite = stats["numel"] - stats["nonfinite"]
        return {
            # nothing lost (all zero): the neutral value, which a bucket's worst-of never picks; nothing
            # measured (no finite element): undefined, NaN, never the perfect +inf
            "sqnr": np.where(
                finite <= 0,
                np.nan,
                np.where(
                    (stats["sum_sq"] == 0) & (stats["err_sq"] == 0),
                    np.inf,
                    10.0 * np.log10(stats["sum_sq"] / stats["err_sq"]),
                ),
            ),
            "subnormal": stats["subnormal"] / stats["numel"],
            "dynamic_range": np.where(
                np.isinf(stats["min_abs"]), 0.0, np.log2(stats["amax"] / stats["min_abs"])
            ),
            "outlier_ratio": stats["amax"] / np.sqrt(stats["sum_sq"] / finite),
        }


AGGREGATION = {"sqnr": "min", "subnormal": "max", "dynamic_range": "max", "outlier_ratio": "max"}


def telemetry(key: str, steps, stats: dict[str, np.ndarray], quality: bool = True) -> dict:
    names = (*BASE_COLUMNS, *QUALITY_COLUMNS) if quality else BASE_COLUMNS
    return {
        "idempotency_key": key,
        "steps": [
            {
                "step": int(s),
                "scalars": {"loss": 2.0},
                "stats": {n: col(stats[n][i], "float64") for n in names},
            }
            for i, s in enumerate(steps)
        ],
    }


def post(client, run_id: int, body: dict) -> None:
    r = client.post(f"{API}/runs/{run_id}/telemetry", json=body)
    assert r.status_code == 200, r.text


def heatmap(client, run_id: int, **params) -> tuple[dict, np.ndarray]:
    r = client.get(f"{API}/runs/{run_id}/heatmap", params=params)
    assert r.status_code == 200, r.text
    hm = r.json()
    return hm, np.array([decode(row) for row in hm["values"]]).reshape(T, -1)


def reference(steps: np.ndarray, per_step: np.ndarray, hm: dict, how: str) -> tuple[np.ndarray, list[int]]:
    """numpy's aggregate of per-step values (S, T) over the server's buckets, and the steps in each."""
    out = np.full((per_step.shape[1], len(hm["bucket_start"])), np.nan)
    counts = []
    for c, (a, b) in enumerate(zip(hm["bucket_start"], hm["bucket_end"], strict=True)):
        rows = per_step[(steps >= a) & (steps <= b)]
        counts.append(len(rows))
        if len(rows):
            out[:, c] = {"max": np.max, "min": np.min}[how](rows, axis=0)
    return out, counts


RANGES = (
    {"max_cols": 1000},
    {"max_cols": 37},
    {"max_cols": 7},
    {"from": 100, "to": 2900, "max_cols": 50},
    {"from": 1230, "to": 1240, "max_cols": 3},
    {"from": 1500, "to": 2100, "max_cols": 4},  # inside the steps sent without quality columns
    {"max_cols": 1},
)


def test_quality_heatmaps_match_numpy_at_every_width(client):
    run = create_run(client, n_layers=3)
    S = 3001
    rng = np.random.default_rng(17)
    stats = quality_stats(rng, S, T)
    stats["sum_sq"][400, 2] = stats["err_sq"][400, 2] = 0.0  # an all-zero tensor: SQNR +inf (nothing lost)
    stats["min_abs"][401, 3] = np.inf  # no non-zero value: dynamic range 0
    stats["err_sq"][402, 4] = np.nan  # a real NaN: it shows
    # a tensor without a finite element (all NaN/Inf): its sums are zero because nothing was measured
    stats["nonfinite"][403, 7] = stats["numel"][403, 7]
    stats["sum_sq"][403, 7] = stats["err_sq"][403, 7] = 0.0
    stats["err_sq"][2500, 5] = stats["sum_sq"][2500, 5] * 1e-1  # a one-step SQNR dip to 10 dB
    stats["amax"][2700, 6] *= 1e4  # a one-step outlier
    steps = np.arange(S) + 5
    # steps 1603..2002 come from an older sender, without the quality columns; batches out of order and
    # straddling the rollup blocks
    without = (steps >= 1603) & (steps <= 2002)
    edges = [0, 1598, 1998, 3001, 999, 50]
    for i, (a, b) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        sel = np.arange(min(a, b), max(a, b))
        for quality in (True, False):
            part = sel[without[sel] != quality]
            if len(part):
                post(
                    client,
                    run["id"],
                    telemetry(f"b{i}{quality}", steps[part], {k: v[part] for k, v in stats.items()}, quality),
                )
    per_step = expected_per_step(stats)
    with_quality = ~without
    for (metric, how), params in itertools.product(AGGREGATION.items(), RANGES):
        hm, got = heatmap(client, run["id"], metric=metric, **params)
        assert hm["metric"] == metric and hm["aggregation"] == how
        assert 1 <= len(hm["bucket_start"]) <= params["max_cols"]
        expected, counts = reference(steps[with_quality], per_step[metric][with_quality], hm, how)
        assert hm["bucket_steps"] == counts  # the steps without quality columns count in no bucket
        np.testing.assert_allclose(got, expected, rtol=1e-12, equal_nan=True)
        empty = [c for c, n in enumerate(counts) if n == 0]
        assert all(hm["values"][t][c] is None for t in range(T) for c in empty)
    # the marked cells survive the coarsest bucketing: NaN propagates, the dip and the outlier stay, and a
    # step with nothing to measure neither hides the tensor's worst step nor shows as a fault
    _, sqnr = heatmap(client, run["id"], metric="sqnr", max_cols=1)
    assert np.isnan(sqnr[4, 0]) and sqnr[5, 0] == pytest.approx(10.0, abs=1e-9)
    assert np.isnan(sqnr[7, 0])  # the all-non-finite step shows, as undefined (not a perfect +inf)
    assert sqnr[2, 0] == pytest.approx(
        np.min(np.delete(per_step["sqnr"][with_quality][:, 2], 400)), rel=1e-12
    )
    _, dyn = heatmap(client, run["id"], metric="dynamic_range", max_cols=1)
    assert np.isfinite(dyn[:, 0]).all()
    assert dyn[3, 0] == pytest.approx(np.max(per_step["dynamic_range"][with_quality][:, 3]), rel=1e-12)
    _, outlier = heatmap(client, run["id"], metric="outlier_ratio", max_cols=1)
    assert outlier[6, 0] == pytest.approx(per_step["outlier_ratio"][2700, 6], rel=1e-12)
    assert outlier[6, 0] > 1e5


def test_packed_quality_heatmap_holds_the_json_cells(client):
    run = create_run(client, n_layers=3)
    rng = np.random.default_rng(5)
    stats = quality_stats(rng, 600, T)
    post(client, run["id"], telemetry("a", np.arange(600), stats))
    for metric in AGGREGATION:
        params = {"metric": metric, "from": 3, "to": 590, "max_cols": 13}
        hm, matrix_json = heatmap(client, run["id"], **params)
        raw = client.get(f"{API}/runs/{run['id']}/heatmap/packed", params=params).content
        (n,) = struct.unpack("<I", raw[:4])
        head = orjson.loads(raw[4 : 4 + n])
        matrix = np.frombuffer(raw[4 + n + (-(4 + n) % 8) :], "<f8").reshape(head["rows"], head["cols"])
        assert head["metric"] == metric and head["aggregation"] == AGGREGATION[metric]
        assert head["bucket_start"] == hm["bucket_start"] and head["bucket_steps"] == hm["bucket_steps"]
        np.testing.assert_array_equal(matrix, matrix_json)


def test_a_run_without_quality_columns_has_empty_quality_heatmaps(client):
    run = create_run(client, n_layers=3)
    stats = random_stats(np.random.default_rng(2), 100, T)
    post(client, run["id"], telemetry("old", np.arange(100), stats, quality=False))
    for metric in AGGREGATION:
        for max_cols in (100, 3):  # raw steps, and rollup blocks
            hm, values = heatmap(client, run["id"], metric=metric, max_cols=max_cols)
            assert sum(hm["bucket_steps"]) == 0 and np.isnan(values).all()
            assert all(v is None for row in hm["values"] for v in row)
    hm, amax = heatmap(client, run["id"], metric="amax", max_cols=100)
    np.testing.assert_array_equal(amax, stats["amax"].T)


def test_an_unknown_heatmap_metric_is_refused(client):
    run = create_run(client, n_layers=1)
    r = client.get(f"{API}/runs/{run['id']}/heatmap", params={"metric": "snr"})
    assert r.status_code == 422 and "sqnr" in r.text
