"""One heatmap answer for what a view draws: several metrics of the same buckets (`metrics`), only some
tensors' rows (`tensors`, `layer`), and for a live refresh only the buckets after those held (`after_step`,
with the `bucket_width` held). Each is checked against the one-metric, all-tensor answers it replaces; bad
parameters are a 422 that names them."""

from __future__ import annotations

import numpy as np
import pytest

from fp8_protocol.packed import unpack_matrix
from tests.support.server import API, batch_body, create_run, random_stats

WIRE = {"NaN": np.nan, "Infinity": np.inf, "-Infinity": -np.inf, None: np.nan}


def packed(client, rid: int, **params) -> tuple[dict, np.ndarray]:
    r = client.get(f"{API}/runs/{rid}/heatmap/packed", params=params)
    assert r.status_code == 200, r.text
    return unpack_matrix(r.content)


def post(client, rid: int, key: str, steps: list[int], stats: dict[str, np.ndarray]) -> None:
    body = batch_body(key, steps, {k: v[: len(steps)] for k, v in stats.items()}, encoding="float64")
    assert client.post(f"{API}/runs/{rid}/telemetry", json=body).status_code == 200


@pytest.fixture
def run(client) -> int:
    """Three layers (9 tensors), 300 steps with a gap (empty buckets), a NaN and an infinity."""
    rid = create_run(client, n_layers=3)["id"]
    stats = random_stats(np.random.default_rng(7), 300, 9)
    stats["amax"][40, 4] = np.nan
    stats["amax"][41, 5] = np.inf
    post(client, rid, "a", [s for s in range(300) if not 100 <= s < 164], stats)
    return rid


def test_several_metrics_of_some_tensors_equal_the_single_answers(client, run):
    singles = {m: packed(client, run, metric=m, max_cols=40) for m in ("amax", "headroom", "sqnr")}
    # sqnr needs the quality columns, which this run does not send: its buckets are all empty
    assert not any(singles["sqnr"][0]["bucket_steps"]) and any(singles["amax"][0]["bucket_steps"])
    for params, rows in (({"tensors": "1,4-5"}, [1, 4, 5]), ({"layer": "blocks.1.mlp.fc"}, [3, 4, 5])):
        head, matrix = packed(client, run, metrics="amax,headroom,sqnr", max_cols=40, **params)
        assert head["metrics"] == ["amax", "headroom", "sqnr"] and head["metric"] == "amax"
        assert head["aggregations"] == ["max", "min", "min"]
        assert [t["index"] for t in head["tensors"]] == rows
        assert head["tensors"] == [singles["amax"][0]["tensors"][i] for i in rows]
        assert head["rows"] == 9 and matrix.shape == (9, len(head["bucket_start"]))
        for k, m in enumerate(head["metrics"]):
            single_head, single = singles[m]
            assert head["metric_steps"][k] == single_head["bucket_steps"]
            assert head["bucket_start"] == single_head["bucket_start"]
            np.testing.assert_array_equal(matrix[3 * k : 3 * k + 3], single[rows])
        # the JSON answer holds the same cells, null where a metric's bucket is empty
        js = client.get(
            f"{API}/runs/{run}/heatmap", params={"metrics": "amax,headroom,sqnr", "max_cols": 40, **params}
        ).json()
        assert {k: v for k, v in js.items() if k != "values"} == {
            k: v for k, v in head.items() if k not in ("rows", "cols", "dtype")
        }
        values = np.array(
            [[WIRE[v] if v is None or isinstance(v, str) else v for v in r] for r in js["values"]]
        )
        np.testing.assert_array_equal(values.astype(float), matrix)
        assert all(v is None for row in js["values"][6:] for v in row)


def test_a_live_refresh_gets_only_the_buckets_after_those_held(client):
    rid = create_run(client, n_layers=2)["id"]
    stats = random_stats(np.random.default_rng(8), 400, 6)
    stats["nonfinite"][300, 2] = 5
    post(client, rid, "a", list(range(298)), stats)
    held_head, held = packed(client, rid, metrics="amax,nonfinite", max_cols=64)
    width = held_head["bucket_width"]
    assert width == 5 and held_head["bucket_end"][-1] == 297  # the last bucket is not full yet
    assert held_head["after_step"] is None

    # nothing new: no bucket
    head, matrix = packed(client, rid, metrics="amax,nonfinite", max_cols=64, after_step=297, bucket_width=5)
    assert head["after_step"] == 297 and matrix.shape == (12, 0)

    body = batch_body("b", range(298, 320), {k: v[298:320] for k, v in stats.items()}, encoding="float64")
    assert client.post(f"{API}/runs/{rid}/telemetry", json=body).status_code == 200
    head, tail = packed(client, rid, metrics="amax,nonfinite", max_cols=64, after_step=297, bucket_width=5)
    assert head["after_step"] == 297 and head["bucket_width"] == 5
    assert head["bucket_start"] == [295, 300, 305, 310, 315]  # the held last bucket again, then the new ones
    whole_head, whole = packed(client, rid, metrics="amax,nonfinite", max_cols=64)
    keep = held_head["bucket_start"].index(295)
    np.testing.assert_array_equal(np.hstack([held[:, :keep], tail]), whole)
    assert held_head["bucket_start"][:keep] + head["bucket_start"] == whole_head["bucket_start"]
    assert held_head["bucket_steps"][:keep] + head["bucket_steps"] == whole_head["bucket_steps"]
    assert tail[6 + 2, 1] == 5  # the non-finite count of step 300, tensor 2

    # the run outgrew the held width: the whole range comes back, in its new layout
    post_rest = batch_body(
        "c", range(320, 400), {k: v[320:400] for k, v in stats.items()}, encoding="float64"
    )
    assert client.post(f"{API}/runs/{rid}/telemetry", json=post_rest).status_code == 200
    head, matrix = packed(client, rid, metrics="amax,nonfinite", max_cols=64, after_step=319, bucket_width=5)
    whole_head, whole = packed(client, rid, metrics="amax,nonfinite", max_cols=64)
    assert head["after_step"] is None and head["bucket_width"] == whole_head["bucket_width"] != 5
    assert head == whole_head
    np.testing.assert_array_equal(matrix, whole)


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"metrics": "amax,bogus"}, "metrics: 'bogus' is not a heatmap metric"),
        ({"metrics": "amax,"}, "metrics: '' is not a heatmap metric"),
        ({"metric": "scale", "metrics": "amax"}, "metrics: give metric or metrics, not both"),
        ({"tensors": "9"}, "tensors: '9' is not within the run's tensors 0-8"),
        ({"tensors": "2-1"}, "tensors: '2-1' is not within"),
        ({"tensors": "1-"}, "tensors: '1-' is not a tensor index or a range a-b"),
        ({"tensors": "x"}, "tensors: 'x' is not a tensor index"),
        ({"tensors": "0-99999999999999999999"}, "tensors: '0-99999999999999999999' is not within"),
        ({"tensors": "1", "layer": "blocks.0.mlp.fc"}, "tensors: give tensors or layer, not both"),
        ({"layer": "blocks.9.mlp.fc"}, "layer: run"),
    ],
)
def test_bad_selections_are_422_naming_the_parameter(client, run, params, named):
    for path in ("heatmap", "heatmap/packed"):
        r = client.get(f"{API}/runs/{run}/{path}", params=params)
        assert r.status_code == 422, r.text
        assert r.json()["detail"].startswith(named), r.json()["detail"]


def test_out_of_range_parameters_are_422(client, run):
    for params, field in (
        ({"after_step": -1}, "after_step"),
        ({"bucket_width": 0}, "bucket_width"),
        ({"metrics": ",".join(["amax"] * 100)}, "metrics"),
    ):
        r = client.get(f"{API}/runs/{run}/heatmap/packed", params=params)
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["query", field]


def test_the_cell_limit_counts_every_metric_and_tensor_asked(make_client):
    client = make_client(max_heatmap_cells=1024)
    rid = create_run(client, n_layers=2)["id"]  # 6 tensors
    post(client, rid, "a", list(range(100)), random_stats(np.random.default_rng(9), 100, 6))
    assert client.get(f"{API}/runs/{rid}/heatmap/packed", params={"max_cols": 100}).status_code == 200
    r = client.get(f"{API}/runs/{rid}/heatmap/packed", params={"max_cols": 100, "metrics": "amax,scale"})
    assert r.status_code == 422
    assert r.json()["detail"].startswith("a heatmap of 12 rows (2 metrics x 6 tensors) x 100 columns")
    # one layer's rows of the same two metrics fit
    r = client.get(
        f"{API}/runs/{rid}/heatmap/packed",
        params={"max_cols": 100, "metrics": "amax,scale", "layer": "blocks.0.mlp.fc"},
    )
    assert r.status_code == 200
