"""Statistics are stored as float32 where every value of a row survives that exactly, float64 otherwise:
half the bytes for nearly every row, and nothing read back differs from what was sent."""

from __future__ import annotations

import numpy as np
from sqlalchemy import func, select

from monitor_server.storage.models import Rollup, StepStat
from monitor_server.storage.stat_rows import STAT_IDS
from tests.support.server import API, batch_body, create_run, decode, random_stats

T = 6


def _widths(client, run_id: int, table, metric: int) -> set[int]:
    with client.app.state.ctx.db.read_session() as session:
        return set(
            session.scalars(
                select(func.length(table.values)).where(table.run_id == run_id, table.metric == metric)
            )
        )


def test_float32_exact_rows_take_half_the_bytes_and_read_back_exactly(client):
    run = create_run(client, n_layers=2)  # T = 6
    rng = np.random.default_rng(5)
    stats = random_stats(rng, 40, T)
    stats["amax"] = stats["amax"].astype(np.float32).astype(np.float64)  # as a float32 tensor gives it
    stats["amax"][7, 2] = np.nan
    stats["amax"][8, 3] = np.inf
    stats["amax"][9, 1] = 0.1  # a float64 that float32 would round: this row stays float64
    stats["overflow"][20, 0] = 2.0**24 + 1  # a count beyond float32's exact integers: float64
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json=batch_body("w", np.arange(40), stats))
    assert r.status_code == 200, r.text

    assert _widths(client, run["id"], StepStat, STAT_IDS["scale"]) == {4 * T}
    assert _widths(client, run["id"], StepStat, STAT_IDS["amax"]) == {4 * T, 8 * T}
    assert _widths(client, run["id"], StepStat, STAT_IDS["overflow"]) == {4 * T, 8 * T}
    assert 4 * T in _widths(client, run["id"], Rollup, STAT_IDS["amax"])

    # raw reads (one bucket per step) and rollup reads (8-step buckets) give back exactly what was sent
    for metric, how in (("amax", np.fmax), ("overflow", np.add)):
        raw = client.get(f"{API}/runs/{run['id']}/heatmap", params={"metric": metric, "max_cols": 40}).json()
        got = np.array([decode(row) for row in raw["values"]])
        want = stats[metric].T
        np.testing.assert_array_equal(got, want)
        coarse = client.get(
            f"{API}/runs/{run['id']}/heatmap", params={"metric": metric, "max_cols": 5}
        ).json()
        got = np.array([decode(row) for row in coarse["values"]])
        blocks = stats[metric].reshape(5, 8, T)
        want = (blocks.max(axis=1) if how is np.fmax else blocks.sum(axis=1)).T
        np.testing.assert_array_equal(got, want)  # NaN and inf kept (max propagates NaN)
