"""GET /runs/{id}/export: every table in CSV and Parquet, both statistics layouts, exact values with NaN and
infinities, steps with scalars only, chunked streaming, the file name, and the answers to bad requests."""

from __future__ import annotations

import csv
import io
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from monitor_server.services import export, export_tables, ingest_columns
from tests.support.server import API, STATS, batch_body, col, create_run, make_tensors, random_stats


def _stats_run(client, steps=(1, 2, 3, 5, 8), n_layers=2, chunk_cells=None):
    """A run whose stored statistics hold a NaN, +inf and -inf, with a scalars-only step between."""
    run = create_run(client, n_layers)
    T = 3 * n_layers
    stats = random_stats(np.random.default_rng(7), len(steps), T)
    stats["amax"][1, 1] = np.nan
    stats["amax"][2, 0] = np.inf
    stats["scale"][3, T - 1] = -np.inf
    stats["amax"][0, 2] = 0.1 + 0.2  # no short decimal: the CSV text must still read back exactly
    losses = [2.5, math.nan, 2.25, math.inf, 2.0][: len(steps)]
    body = batch_body("k1", list(steps), stats, encoding="float64", losses=losses)
    body["steps"].append({"step": 4, "scalars": {"loss": 2.1, "tokens_per_s": 1000.0}})  # no FP8 layer ran
    body["events"] = [{"kind": "custom", "step": 3, "details": {"name": "eval", "val_loss": "NaN"}}]
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json=body)
    assert r.status_code == 200, r.text
    return run, stats, losses


def _get(client, run_id, **params):
    r = client.get(f"{API}/runs/{run_id}/export", params=params)
    assert r.status_code == 200, r.text
    return r


def _table(r, fmt):
    """Rows of an export as a list of dicts of strings (CSV) or Python values (Parquet)."""
    if fmt == "csv":
        return list(csv.DictReader(io.StringIO(r.text)))
    return pq.read_table(io.BytesIO(r.content)).to_pylist()


def _f(value) -> float:
    # CSV text ("nan", "inf", "-inf", shortest repr) and Parquet floats and integers alike; a Parquet null (a
    # count a step did not carry) as the NaN the CSV writes there
    return math.nan if value is None else float(value)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_stats_long_exact_with_nonfinite(client, fmt):
    run, stats, _ = _stats_run(client)
    r = _get(client, run["id"], format=fmt, table="stats", layout="long")
    assert r.headers["content-disposition"] == f'attachment; filename="run-{run["id"]}-stats.{fmt}"'
    assert r.headers["content-type"].startswith(
        {"csv": "text/csv", "parquet": "application/vnd.apache.parquet"}[fmt]
    )
    rows = _table(r, fmt)
    tensors = make_tensors(2)
    assert list(rows[0]) == ["step", "tensor", "layer", "role", *STATS]
    # one row per (step, tensor), step-major; step 4 (scalars only) has none
    assert [(int(x["step"]), x["tensor"]) for x in rows] == [
        (s, t["name"]) for s in (1, 2, 3, 5, 8) for t in tensors
    ]
    assert [(x["layer"], x["role"]) for x in rows[:6]] == [(t["layer"], t["role"]) for t in tensors]
    for name in STATS:
        got = np.array([_f(x[name]) for x in rows]).reshape(5, 6)
        np.testing.assert_array_equal(got, stats[name], err_msg=name)  # NaN == NaN, bit for bit otherwise
    if fmt == "csv":
        assert "nan" in r.text.split("\n")[8] and ",inf," in r.text and ",-inf," in r.text


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_stats_wide_columns_per_tensor_and_statistic(client, fmt):
    run, stats, _ = _stats_run(client)
    rows = _table(_get(client, run["id"], format=fmt, layout="wide"), fmt)
    names = [t["name"] for t in make_tensors(2)]
    assert list(rows[0]) == ["step"] + [f"{n}.{s}" for n in names for s in STATS]
    assert [int(x["step"]) for x in rows] == [1, 2, 3, 5, 8]
    for name in STATS:
        got = np.array([[_f(x[f"{n}.{name}"]) for n in names] for x in rows])
        np.testing.assert_array_equal(got, stats[name], err_msg=name)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_scalars_events_alerts(client, fmt):
    run, _, losses = _stats_run(client)
    rows = _table(_get(client, run["id"], format=fmt, table="scalars"), fmt)
    assert list(rows[0]) == ["step", "loss", "lr", "tokens_per_s"]
    assert [int(x["step"]) for x in rows] == [1, 2, 3, 4, 5, 8]
    got = [_f(x["loss"]) for x in rows]
    np.testing.assert_array_equal(got, losses[:3] + [2.1] + losses[3:])
    # a scalar a step did not carry is empty (CSV) / null (Parquet), not NaN
    absent = "" if fmt == "csv" else None
    assert [x["tokens_per_s"] for x in rows] == [absent] * 3 + [1000.0 if fmt == "parquet" else "1000"] + [
        absent
    ] * 2

    events = _table(_get(client, run["id"], format=fmt, table="events"), fmt)
    assert [(int(e["step"]), e["kind"], e["details"]) for e in events] == [
        (3, "custom", '{"name":"eval","val_loss":"NaN"}')
    ]
    alerts = _table(_get(client, run["id"], format=fmt, table="alerts"), fmt)
    api = client.get(f"{API}/runs/{run['id']}/alerts").json()
    assert api and sorted(int(a["id"]) for a in alerts) == sorted(a["id"] for a in api)
    by_id = {a["id"]: a for a in api}
    for a in alerts:
        want = by_id[int(a["id"])]
        # CSV writes a null (a run-level alert's tensor) as an empty cell
        assert (a["kind"], a["tensor_name"] or None, int(a["first_step"])) == (
            want["kind"],
            want["tensor_name"],
            want["first_step"],
        )


def test_step_range_and_empty_tables(client):
    run, stats, _ = _stats_run(client)
    rows = _table(_get(client, run["id"], format="parquet", layout="wide", **{"from": 2, "to": 5}), "parquet")
    assert [x["step"] for x in rows] == [2, 3, 5]
    # a run with nothing stored: a header (CSV) / a schema (Parquet) and no rows
    empty = create_run(client, 1)
    r = _get(client, empty["id"], format="csv")
    assert r.text.strip() == ",".join(f'"{c}"' for c in ["step", "tensor", "layer", "role", *STATS])
    table = pq.read_table(io.BytesIO(_get(client, empty["id"], format="parquet", table="scalars").content))
    assert table.num_rows == 0 and table.column_names == ["step"]


def test_many_chunks_give_the_same_table(client, monkeypatch):
    """A run read in several chunks (one per 2 steps here) exports the same rows as in one."""
    steps = list(range(0, 40, 3))
    run = create_run(client, 3)
    stats = random_stats(np.random.default_rng(1), len(steps), 9)
    stats["overflow"][4, 2] = np.nan
    r = client.post(
        f"{API}/runs/{run['id']}/telemetry", json=batch_body("k", steps, stats, encoding="float64")
    )
    assert r.status_code == 200, r.text
    whole = {fmt: _get(client, run["id"], format=fmt, layout="wide").content for fmt in ("csv", "parquet")}
    long = _get(client, run["id"], format="csv", layout="long").content
    monkeypatch.setattr(export, "CHUNK_CELLS", 18)
    monkeypatch.setattr(export_tables, "CHUNK_ROWS", 2)
    assert _get(client, run["id"], format="csv", layout="long").content == long  # the long layout too
    csv_chunked = _get(client, run["id"], format="csv", layout="wide").content
    assert csv_chunked == whole["csv"]
    chunked = pq.ParquetFile(io.BytesIO(_get(client, run["id"], format="parquet", layout="wide").content))
    assert chunked.num_row_groups == math.ceil(len(steps) / 2)  # one row group per chunk
    a, b = chunked.read(), pq.read_table(io.BytesIO(whole["parquet"]))
    assert a.schema == b.schema
    for name in a.column_names:  # NaN == NaN here (Arrow's `equals` says no)
        np.testing.assert_array_equal(a.column(name).to_numpy(), b.column(name).to_numpy(), err_msg=name)
    rows = _table(_get(client, run["id"], format="csv", table="scalars"), "csv")
    assert [int(x["step"]) for x in rows] == steps
    # wide Parquet caps its row groups (writer metadata grows per column per row group): larger tables,
    # each filled from several reads
    monkeypatch.setattr(export, "WIDE_PARQUET_ROW_GROUPS", 3)
    capped = pq.ParquetFile(io.BytesIO(_get(client, run["id"], format="parquet", layout="wide").content))
    assert [capped.metadata.row_group(i).num_rows for i in range(capped.num_row_groups)] == [6, 6, 2]
    a = capped.read()
    for name in a.column_names:
        np.testing.assert_array_equal(a.column(name).to_numpy(), b.column(name).to_numpy(), err_msg=name)


def test_bad_parameters_are_422_naming_them(client):
    run = create_run(client, 1)
    url = f"{API}/runs/{run['id']}/export"
    for params, name in (
        ({"format": "xlsx"}, "format"),
        ({"table": "tensors"}, "table"),
        ({"layout": "tall"}, "layout"),
    ):
        r = client.get(url, params=params)
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["query", name]
    r = client.get(url, params={"table": "scalars", "layout": "wide"})
    assert r.status_code == 422 and r.json()["detail"].startswith("layout: only table=stats")
    r = client.get(url, params={"from": 9, "to": 3})
    assert r.status_code == 422 and "to (3) is before from (9)" in r.json()["detail"]
    r = client.get(f"{API}/runs/999/export", params={"format": "parquet"})
    assert r.status_code == 404 and r.json()["detail"] == "run 999 not found"


def test_read_scope_required(make_client):
    client = make_client(tokens=["trainer:ingest:ingest-secret-1", "dash:read:read-secret-1"])
    run = create_run(client, 1, headers={"Authorization": "Bearer ingest-secret-1"})
    url = f"{API}/runs/{run['id']}/export"
    assert client.get(url).status_code == 401
    assert client.get(url, headers={"Authorization": "Bearer ingest-secret-1"}).status_code == 403
    assert client.get(url, headers={"Authorization": "Bearer read-secret-1"}).status_code == 200


def test_file_name():
    assert export.filename(12, "alerts", "parquet") == "run-12-alerts.parquet"


QUALITY = ("sum_sq", "err_sq", "subnormal", "min_abs")
BLOCK = ("blocks", "blocks_at_limit", "blocks_overflow", "blocks_underflow", "block_range", "blocks_zero")


def _mixed_run(client, n_layers=1):
    """Steps 0-1 base columns only, 2-3 with the quality columns, 4-5 with the quality and block columns,
    6 with the block columns only."""
    run = create_run(client, n_layers)
    T = 3 * n_layers
    rng = np.random.default_rng(11)
    stats = random_stats(rng, 7, T) | {
        "sum_sq": rng.uniform(1, 100, (7, T)),
        "err_sq": rng.uniform(0, 0.1, (7, T)),
        "subnormal": rng.integers(0, 9, (7, T)).astype(float),
        "min_abs": rng.uniform(1e-6, 1e-3, (7, T)),
        "blocks": np.full((7, T), 128.0),
        "blocks_at_limit": rng.integers(0, 3, (7, T)).astype(float),
        "blocks_overflow": rng.integers(0, 2, (7, T)).astype(float),
        "blocks_underflow": rng.integers(0, 20, (7, T)).astype(float),
        "block_range": rng.uniform(2, 14, (7, T)),
        "blocks_zero": rng.integers(0, 40, (7, T)).astype(float),
    }
    stats["min_abs"][3, 0] = np.nan  # a NaN sent stays a NaN
    groups = [(), (), QUALITY, QUALITY, QUALITY + BLOCK, QUALITY + BLOCK, BLOCK]
    for part in ([0, 1], [2, 3], [4, 5], [6]):  # every step of a batch carries the same statistics
        steps = [
            {"step": s, "stats": {n: col(stats[n][s], "float64") for n in (*STATS, *groups[s])}} for s in part
        ]
        body = {"idempotency_key": f"m{part[0]}", "steps": steps}
        r = client.post(f"{API}/runs/{run['id']}/telemetry", json=body)
        assert r.status_code == 200, r.text
    expected = {}
    for name in (*STATS, *QUALITY, *BLOCK):
        carried = np.array([name in (*STATS, *groups[s]) for s in range(7)])
        expected[name] = np.where(carried[:, None], stats[name], np.nan)
    return run, expected


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_stats_carry_the_quality_and_block_columns_where_stored(client, fmt):
    run, expected = _mixed_run(client)
    names = [t["name"] for t in make_tensors(1)]
    rows = _table(_get(client, run["id"], format=fmt, table="stats", layout="long"), fmt)
    assert list(rows[0]) == ["step", "tensor", "layer", "role", *STATS, *QUALITY, *BLOCK]
    assert [int(x["step"]) for x in rows] == [s for s in range(7) for _ in names]
    for name in (*STATS, *QUALITY, *BLOCK):
        got = np.array([_f(x[name]) for x in rows]).reshape(7, 3)
        np.testing.assert_array_equal(got, expected[name], err_msg=name)  # NaN where not carried
    wide = _table(_get(client, run["id"], format=fmt, layout="wide"), fmt)
    assert list(wide[0]) == ["step"] + [f"{n}.{s}" for n in names for s in (*STATS, *QUALITY, *BLOCK)]
    for name in (*STATS, *QUALITY, *BLOCK):
        got = np.array([[_f(x[f"{n}.{name}"]) for n in names] for x in wide])
        np.testing.assert_array_equal(got, expected[name], err_msg=name)
    # a range whose steps carried only the base columns exports only those; one with the block columns
    # only adds those
    assert list(_table(_get(client, run["id"], format=fmt, to=1), fmt)[0]) == [
        "step",
        "tensor",
        "layer",
        "role",
        *STATS,
    ]
    only_block = _table(_get(client, run["id"], format=fmt, **{"from": 6}), fmt)
    assert list(only_block[0]) == ["step", "tensor", "layer", "role", *STATS, *BLOCK]


def test_mixed_columns_read_in_chunks_give_the_same_table(client, monkeypatch):
    run, _ = _mixed_run(client)
    whole = {fmt: _get(client, run["id"], format=fmt, layout="wide").content for fmt in ("csv", "parquet")}
    monkeypatch.setattr(export, "CHUNK_CELLS", 4)  # one step a chunk: each chunk's own columns
    assert _get(client, run["id"], format="csv", layout="wide").content == whole["csv"]
    a = pq.read_table(io.BytesIO(_get(client, run["id"], format="parquet", layout="wide").content))
    b = pq.read_table(io.BytesIO(whole["parquet"]))
    assert a.schema == b.schema
    for name in a.column_names:
        np.testing.assert_array_equal(a.column(name).to_numpy(), b.column(name).to_numpy(), err_msg=name)


COUNTS = ("overflow", "underflow", "nonfinite", "numel", "subnormal", *BLOCK[:4], "blocks_zero")


def test_counts_are_integers_in_parquet_null_where_not_carried(client):
    run, expected = _mixed_run(client)
    names = [t["name"] for t in make_tensors(1)]
    for layout in ("long", "wide"):
        body = _get(client, run["id"], format="parquet", layout=layout).content
        table = pq.read_table(io.BytesIO(body))
        for name in (*STATS, *QUALITY, *BLOCK):
            columns = [name] if layout == "long" else [f"{n}.{name}" for n in names]
            for column in columns:
                field = table.schema.field(column)
                assert str(field.type) == ("int64" if name in COUNTS else "double"), (layout, column)
            if name not in COUNTS:
                continue
            # the values as sent (Python ints); null, not NaN, at the steps that did not carry the column
            values = [table.column(c).to_pylist() for c in columns]
            got = [v for step in zip(*values, strict=True) for v in step]  # step-major, tensors in order
            want = expected[name].reshape(-1).tolist()
            assert [v is None for v in got] == [math.isnan(w) for w in want], (layout, name)
            assert all(type(v) is int and v == w for v, w in zip(got, want, strict=True) if v is not None)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_an_all_nan_tensor_has_amax_nan_not_zero(client, monkeypatch, fmt):
    # the runtime's amax ignores NaN (as Transformer Engine's: fmaxf from 0), so a tensor gone all NaN is
    # sent with amax 0, the amax of a tensor of zeros; stored and exported it is NaN, so that the largest
    # amax of a step where the run went NaN is NaN, not 0
    run = create_run(client, 2)
    stats = random_stats(np.random.default_rng(5), 4, 6)
    stats["nonfinite"][2:, :] = stats["numel"][2:, :]  # steps 2-3: every tensor all NaN
    stats["amax"][2:, :] = 0.0
    stats["nonfinite"][1, 0] = 7.0  # a few NaN elements: the amax of the others, as sent
    stats["amax"][1, 3] = 0.0  # a tensor of zeros: amax 0
    stats["amax"][1, 4], stats["nonfinite"][1, 4] = np.inf, 4096.0  # all Inf: amax Inf
    body = batch_body("k", [1, 2, 3, 4], stats, encoding="float64")
    assert client.post(f"{API}/runs/{run['id']}/telemetry", json=body).status_code == 200
    want = stats["amax"].copy()
    want[2:, :] = np.nan

    def exported(run_id):
        rows = _table(_get(client, run_id, format=fmt, table="stats"), fmt)
        return np.array([_f(x["amax"]) for x in rows]).reshape(4, 6)

    amax = exported(run["id"])
    np.testing.assert_array_equal(amax, want)
    assert np.isnan(amax[2:].max(axis=1)).all() and np.isfinite(amax[:2, [0, 1, 2, 5]]).all()
    # the dashboard's JSON reads the same stored value
    heat = client.get(f"{API}/runs/{run['id']}/heatmap", params={"metric": "amax"}).json()
    assert heat["bucket_width"] == 1 and all(row[2:] == ["NaN", "NaN"] for row in heat["values"])
    # a run stored before the service stored it so (0 in its rows) is exported with NaN as well
    monkeypatch.setattr(ingest_columns, "stored_amax", lambda amax, numel, nonfinite: amax)
    old = create_run(client, 2)
    assert client.post(f"{API}/runs/{old['id']}/telemetry", json=body).status_code == 200
    stored = client.get(f"{API}/runs/{old['id']}/heatmap", params={"metric": "amax"}).json()
    assert all(row[2:] == [0.0, 0.0] for row in stored["values"])
    np.testing.assert_array_equal(exported(old["id"]), want)
