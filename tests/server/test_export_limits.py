"""What one export may cost the server (issue 38, item 5): a column budget for wide Parquet files, events
read in byte-bounded chunks and written from their stored JSON, scalars built column-wise in chunks of
bounded cells, and a bound on the exports streaming at once (429)."""

from __future__ import annotations

import io

import httpx
import numpy as np
import orjson
import pyarrow.parquet as pq

from fp8_trainer.monitor.read import Reader
from monitor_server.services import export_tables
from tests.server.test_export_cut_off import LAYERS, _fill
from tests.support.http import loopback
from tests.support.polling import wait_for
from tests.support.server import (
    API,
    batch_body,
    create_run,
    quiet_stats,
    run_body,
    running_server,
    slow_reader,
)


def _parquet(client, run_id: int, **params) -> pq.ParquetFile:
    r = client.get(f"{API}/runs/{run_id}/export", params={"format": "parquet", **params})
    assert r.status_code == 200, r.text
    return pq.ParquetFile(io.BytesIO(r.content))


def test_a_wide_parquet_file_over_the_column_budget_is_refused_naming_it(db_url, tmp_path):
    """The refusal names the way out, the same values stay available (long Parquet, wide CSV), and the
    Python reader, which asks for wide Parquet, falls back to CSV by itself."""
    with (
        running_server(db_url, log_path=tmp_path / "server.log") as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        run = client.post(f"{API}/runs", json=run_body(171)).json()  # T = 513: 3,078 base columns
        stats = quiet_stats(2, 513)
        body = batch_body("two", [0, 1], stats, encoding="float32")
        assert client.post(f"{API}/runs/{run['id']}/telemetry", json=body).status_code == 200
        r = client.get(f"{API}/runs/{run['id']}/export", params={"format": "parquet", "layout": "wide"})
        assert r.status_code == 422
        assert "3078 columns" in r.json()["detail"] and "layout=long" in r.json()["detail"]
        assert _parquet(client, run["id"], layout="long").metadata.num_rows == 2 * 513
        csv = client.get(f"{API}/runs/{run['id']}/export", params={"format": "csv", "layout": "wide"})
        assert csv.status_code == 200 and csv.text.count("\n") == 3
        with Reader(server.url) as reader:
            got = reader.stats(run["id"])
        np.testing.assert_array_equal(got["amax"], stats["amax"].astype(np.float32))


def test_events_export_in_chunks_bounded_by_bytes_from_the_stored_json(client, monkeypatch):
    run = create_run(client, n_layers=1)
    events = [
        {"kind": "custom", "step": i, "details": {"i": i, "blob": chr(97 + i) * 1_000_000, "x": "NaN"}}
        for i in range(6)
    ]
    body = batch_body("ev", [0], quiet_stats(1, 3), events=events)
    assert client.post(f"{API}/runs/{run['id']}/telemetry", json=body).status_code == 200
    monkeypatch.setattr(export_tables, "CHUNK_BYTES", 2_500_000)  # two events of 1 MB a chunk
    table = _parquet(client, run["id"], table="events")
    assert [table.metadata.row_group(g).num_rows for g in range(table.num_row_groups)] == [2, 2, 2]
    got = table.read()
    assert got.column("step").to_pylist() == list(range(6))
    assert [orjson.loads(d) for d in got.column("details").to_pylist()] == [e["details"] for e in events]


def test_scalars_export_in_chunks_of_bounded_cells(client, monkeypatch):
    run = create_run(client, n_layers=1)
    names = [f"metric/{j:04d}" for j in range(1000)]
    rng = np.random.default_rng(3)
    values = rng.normal(size=(40, len(names)))
    steps = [
        {"step": i, "scalars": {n: float(values[i, j]) for j, n in enumerate(names) if (i + j) % 7}}
        for i in range(40)
    ]
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json={"idempotency_key": "s", "steps": steps})
    assert r.status_code == 200, r.text
    monkeypatch.setattr(export_tables, "SCALAR_CHUNK_CELLS", 10_000)  # 10 steps of 1,000 names a chunk
    table = _parquet(client, run["id"], table="scalars")
    assert [table.metadata.row_group(g).num_rows for g in range(table.num_row_groups)] == [10, 10, 10, 10]
    got = table.read()
    for j in (0, 1, 999):
        column = got.column(names[j]).to_pylist()
        assert column == [None if not (i + j) % 7 else float(values[i, j]) for i in range(40)]


def test_exports_over_the_concurrency_bound_get_429_until_one_ends(db_url, tmp_path):
    env = {"FP8SCOPE_EXPORT_CONCURRENCY": "1"}
    with running_server(db_url, log_path=tmp_path / "server.log", env=env) as server:
        run_id = loopback.post(f"{server.url}{API}/runs", json=run_body(LAYERS)).json()["id"]
        _fill(server.url, run_id)
        url = f"{server.url}{API}/runs/{run_id}/export"
        # CSV: tens of MB, more than the server's send buffer and this reader's 64 KiB receive buffer
        # hold, so the first export is still streaming (its slot held) while this reader reads no further;
        # the default Parquet of these quiet statistics compresses to a size the kernel's buffers can take
        # whole, and its slot came back at once
        csv = {"format": "csv"}
        with slow_reader() as reader, reader.stream("GET", url, params=csv) as first:
            assert first.status_code == 200
            # the iterator is kept: a generator dropped after its first piece closes the connection (the
            # client's stream ends with it), and the server then gives the slot back at any moment
            pieces = first.iter_raw()
            next(pieces)
            second = loopback.get(url, params={"table": "scalars"}, timeout=60)
            assert second.status_code == 429 and second.headers["retry-after"] == "5"
            assert "export_concurrency" in second.json()["detail"]
            # a refusal is said as such while the slots are taken (it holds none)
            wide = loopback.post(f"{server.url}{API}/runs", json=run_body(171), timeout=60).json()["id"]
            body = batch_body("one", [0], quiet_stats(1, 513), encoding="float32")
            assert (
                loopback.post(f"{server.url}{API}/runs/{wide}/telemetry", json=body, timeout=60).status_code
                == 200
            )
            too_wide = {"format": "parquet", "layout": "wide"}
            assert (
                loopback.get(f"{server.url}{API}/runs/{wide}/export", params=too_wide, timeout=60).status_code
                == 422
            )
        # the first reader went away: its slot comes back
        wait_for(lambda: loopback.get(url, params={"table": "events"}, timeout=60).status_code == 200, 30)
