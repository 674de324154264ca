"""An export that loses rows while it runs (the run deleted, its statistics compacted) is cut off where the
reader can tell (issue 38, item 2): a real client of a real server sees an incomplete transfer, never a
well-formed shorter file."""

from __future__ import annotations

import httpx
import pytest

from monitor_server.core.db import Database
from monitor_server.services import export, export_tables
from monitor_server.storage import retention
from monitor_server.storage.run_meta import RunMetaCache
from tests.support.http import loopback
from tests.support.server import (
    API,
    batch_body,
    create_run,
    quiet_stats,
    run_body,
    running_server,
    slow_reader,
)

#: 10,240 steps of 66 tensors: 676k rows of the long layout, about 10 chunks (tens of MB of CSV), far more
#: than a connection's buffers hold while the reader waits
LAYERS, STEPS, PER_BATCH = 22, 10_240, 1_024


def _fill(url: str, run_id: int) -> None:
    stats = quiet_stats(PER_BATCH, 3 * LAYERS)
    with httpx.Client(base_url=url, timeout=120) as client:
        for first in range(0, STEPS, PER_BATCH):
            body = batch_body(f"k{first}", range(first, first + PER_BATCH), stats, encoding="float32")
            assert client.post(f"{API}/runs/{run_id}/telemetry", json=body).status_code == 200


def test_a_run_deleted_during_its_download_leaves_the_client_an_incomplete_transfer(db_url, tmp_path):
    with running_server(db_url, log_path=tmp_path / "server.log") as server:
        run_id = loopback.post(f"{server.url}{API}/runs", json=run_body(LAYERS)).json()["id"]
        _fill(server.url, run_id)
        with (
            slow_reader() as client,
            client.stream(
                "GET", f"{server.url}{API}/runs/{run_id}/export", params={"format": "csv"}
            ) as response,
        ):
            assert response.status_code == 200
            pieces = response.iter_raw()
            received = len(next(pieces))
            assert loopback.delete(f"{server.url}{API}/runs/{run_id}", timeout=60).status_code == 204
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete"):
                for piece in pieces:
                    received += len(piece)
        assert received < 30 * 1024 * 1024  # cut off well before the whole file (~50 MB)
        assert "deleted or compacted while exported" in server.log_text()  # the reason, in its log


def test_compaction_during_an_export_ends_it_with_an_error_not_a_shorter_file(
    make_client, db_url, monkeypatch
):
    """Statistics compacted while they are exported: the export raises before its last bytes. The scalars,
    which compaction keeps, export whole beside it."""
    client = make_client()
    run = create_run(client, n_layers=2)  # T = 6
    stats = quiet_stats(96, 6)
    body = batch_body("all", range(96), stats, encoding="float64", losses=[2.0] * 96)
    assert client.post(f"{API}/runs/{run['id']}/telemetry", json=body).status_code == 200
    monkeypatch.setattr(export, "CHUNK_CELLS", 60)  # 10 steps a chunk
    monkeypatch.setattr(export_tables, "CHUNK_ROWS", 10)
    db = Database(db_url)
    try:
        with db.read_session() as session:
            meta = RunMetaCache().get(session, run["id"])
        parts = {
            t: export.export(db.read_session, meta, t, "long", "csv", 0, 2**62) for t in ("stats", "scalars")
        }
        first = {t: next(body) for t, body in parts.items()}
        assert run["id"] in retention.compact(db, keep=16)  # steps 0-79 lose their statistics
        scalars = first["scalars"] + b"".join(parts["scalars"])
        assert scalars.count(b"\n") == 96 + 1  # header and every step
        with pytest.raises(export.ExportIncomplete, match="compacted"):
            for _ in parts["stats"]:
                pass
    finally:
        db.dispose()
