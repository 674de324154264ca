"""Bounded storage: per-step statistics older than the last `raw_steps_kept` steps are compacted into the
rollups; the heatmap of a compacted range answers as it did before (max-pooled, NaN kept), at 8-step
resolution or coarser."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from sqlalchemy import func, select

from monitor_server.storage import retention
from monitor_server.storage.models import StepStat
from monitor_server.storage.rollups import COMPACT_BLOCK, raw_kept_from
from monitor_server.storage.stat_rows import STAT_IDS
from tests.support.polling import wait_for
from tests.support.server import API, batch_body, create_run, decode, random_stats

T = 6
S = 700


def _heatmap(client, run_id: int, **params) -> dict:
    r = client.get(f"{API}/runs/{run_id}/heatmap", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def _post_run(client) -> tuple[int, dict[str, np.ndarray]]:
    run = create_run(client, n_layers=2)  # T = 6
    stats = random_stats(np.random.default_rng(11), S, T)
    stats["amax"][37, 1] = np.nan  # a NaN in what will be compacted: it must still show
    stats["overflow"][101, 4] = 5000.0  # a spike there: never averaged away
    steps = np.arange(S) + 3  # the run starts at step 3: its first block is partial
    for i in range(0, S, 50):
        body = batch_body(f"b{i}", steps[i : i + 50], {k: v[i : i + 50] for k, v in stats.items()})
        assert client.post(f"{API}/runs/{run['id']}/telemetry", json=body).status_code == 200
    return run["id"], stats


def _rows(client, run_id: int) -> tuple[int, int | None]:
    with client.app.state.ctx.db.read_session() as session:
        n, first = session.execute(
            select(func.count(), func.min(StepStat.step)).where(
                StepStat.run_id == run_id, StepStat.metric == STAT_IDS["amax"]
            )
        ).one()
    return n, first


# ranges whose ends fall on 8-step blocks (and the whole run), at several widths
RANGES = [
    {"max_cols": 1000},
    {"max_cols": 50},
    {"max_cols": 7},
    {"lo": 8, "hi": 199, "max_cols": 24},
    {"lo": 64, "hi": 703, "max_cols": 10},
    {"lo": 96, "hi": 607, "max_cols": 1000},
]


def test_compacted_heatmaps_answer_as_before(client):
    run_id, _ = _post_run(client)
    metrics = ("amax", "overflow", "headroom", "scale")
    before = {
        (m, i): _heatmap(client, run_id, metric=m, **p)
        for m, (i, p) in itertools.product(metrics, enumerate(RANGES))
    }
    # the same ranges at 8-step resolution: what a compacted range can give for the narrow widths
    before8 = {
        m: _heatmap(client, run_id, metric=m, lo=0, hi=S + 2, max_cols=(S + 3 + 7) // 8) for m in metrics
    }
    assert before8["amax"]["bucket_width"] == COMPACT_BLOCK

    done = retention.compact(client.app.state.ctx.db, keep=200)
    last = S + 2
    cut = (last + 1 - 200) // COMPACT_BLOCK * COMPACT_BLOCK
    assert done == {run_id: (cut - 3) * 6}  # the six base columns of each compacted step
    n, first = _rows(client, run_id)
    assert first == cut and n == last - cut + 1
    with client.app.state.ctx.db.read_session() as session:
        assert raw_kept_from(session, run_id) == cut
    assert retention.compact(client.app.state.ctx.db, keep=200) == {}  # nothing more to drop

    for (m, i), old in before.items():
        p = RANGES[i]
        new = _heatmap(client, run_id, metric=m, **p)
        if old["bucket_width"] >= COMPACT_BLOCK or p.get("lo", 0) >= cut:
            assert new["bucket_width"] == old["bucket_width"]
            assert new["bucket_start"] == old["bucket_start"] and new["bucket_steps"] == old["bucket_steps"]
            np.testing.assert_array_equal(
                np.array([decode(r) for r in new["values"]]), np.array([decode(r) for r in old["values"]])
            )
        else:  # asked finer than the compacted blocks: drawn at 8 steps, as the 8-step map of before
            assert new["bucket_width"] == COMPACT_BLOCK
    for m, old in before8.items():
        new = _heatmap(client, run_id, metric=m, lo=0, hi=S + 2, max_cols=1000)
        assert new["bucket_width"] == COMPACT_BLOCK and new["bucket_steps"] == old["bucket_steps"]
        got = np.array([decode(r) for r in new["values"]])
        np.testing.assert_array_equal(got, np.array([decode(r) for r in old["values"]]))
    # the NaN and the spike in the compacted part still show
    amax = np.array([decode(r) for r in _heatmap(client, run_id, metric="amax", max_cols=1)["values"]])
    assert np.isnan(amax[1, 0]) and np.isfinite(np.delete(amax[:, 0], 1)).all()
    over = np.array([decode(r) for r in _heatmap(client, run_id, metric="overflow", max_cols=3)["values"]])
    assert over[4, 0] >= 5000.0


def test_the_service_compacts_in_its_maintenance(make_client):
    client = make_client(raw_steps_kept=100, stall_check_seconds=0.05)
    run_id, _ = _post_run(client)
    cut = retention.compaction_cut(S + 2, 100)
    # the maintenance runs every 50 ms: poll for its result
    wait_for(lambda: _rows(client, run_id)[1] == cut, 60, f"compaction to step {cut}", interval=0.02)
    n, first = _rows(client, run_id)
    assert n == S + 3 - first


@pytest.mark.parametrize("keep,last,cut", [(100, 99, 0), (100, 107, 8), (200, 702, 496), (1, 7, 7 // 8 * 8)])
def test_the_cut_falls_on_a_block(keep, last, cut):
    assert retention.compaction_cut(last, keep) == cut
