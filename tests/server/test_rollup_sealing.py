"""Rollup blocks are written once, when the run moves past them; the block a live run is in is read from the
finer levels. The heatmap of a live run answers as numpy does over the raw steps at every moment: right after
a block boundary, in the middle of an open 8-, 64- and 512-step block, after late steps into sealed blocks,
and after a batch of steps without statistics that moves the run past a boundary."""

from __future__ import annotations

import numpy as np
from sqlalchemy import func, select

from monitor_server.storage.models import Rollup
from monitor_server.storage.rollups import HEATMAP_METRICS, LEVELS, headroom
from monitor_server.storage.stat_rows import STAT_IDS
from tests.support.server import API, batch_body, create_run, decode, random_stats

T = 6
FP8_MAX = np.array([448.0, 448.0, 57344.0] * 2)  # input and weight E4M3, grad_output E5M2, per layer
HOW = {"amax": "max", "overflow": "sum", "headroom": "min"}
WIDTHS = ({"max_cols": 1000}, {"max_cols": 40}, {"max_cols": 5}, {"max_cols": 1})


def _post(client, run_id: int, key: str, steps, stats: dict[str, np.ndarray] | None) -> None:
    if stats is None:  # steps in which no FP8 layer ran: scalars only
        body = {"idempotency_key": key, "steps": [{"step": int(s), "scalars": {"loss": 2.0}} for s in steps]}
    else:
        body = batch_body(key, steps, stats)
    r = client.post(f"{API}/runs/{run_id}/telemetry", json=body)
    assert r.status_code == 200, r.text


def _check(client, run_id: int, steps: np.ndarray, per_step: dict[str, np.ndarray], last: int) -> None:
    """Every metric's heatmap of the whole run, at several widths, equals numpy's over the stored steps."""
    for metric, how in HOW.items():
        for params in WIDTHS:
            r = client.get(f"{API}/runs/{run_id}/heatmap", params={"metric": metric, "to": last, **params})
            assert r.status_code == 200, r.text
            hm = r.json()
            got = np.array([decode(row) for row in hm["values"]]).reshape(T, -1)
            for c, (a, b) in enumerate(zip(hm["bucket_start"], hm["bucket_end"], strict=True)):
                inside = (steps >= a) & (steps <= b)
                assert hm["bucket_steps"][c] == int(inside.sum()), (metric, params, c)
                if inside.any():
                    want = {"max": np.max, "min": np.min, "sum": np.sum}[how](
                        per_step[metric][inside], axis=0
                    )
                    np.testing.assert_array_equal(got[:, c], want, err_msg=f"{metric} {params} bucket {c}")


def _rollup_blocks(client, run_id: int) -> dict[int, int]:
    """level -> how many blocks of the amax metric are stored."""
    with client.app.state.ctx.db.read_session() as session:
        rows = session.execute(
            select(Rollup.level, func.count())
            .where(Rollup.run_id == run_id, Rollup.metric == STAT_IDS["amax"])
            .group_by(Rollup.level)
        ).all()
    return {int(level): int(n) for level, n in rows}


def test_live_run_heatmap_matches_numpy_with_open_blocks(client):
    run = create_run(client, n_layers=2)
    S = 1100
    stats = random_stats(np.random.default_rng(5), S, T)
    stats["amax"][300, 2] = np.nan  # NaN shows through every level
    stats["overflow"][520, 1] = 9000.0  # a spike is never averaged away
    per_step = {
        "amax": stats["amax"],
        "overflow": stats["overflow"],
        "headroom": headroom(stats["amax"], stats["scale"], FP8_MAX),
    }
    # one or a few steps a batch, as a live job posts; the run is checked right after crossing block
    # boundaries of every level and in the middle of open blocks
    checkpoints = {0, 7, 8, 9, 63, 64, 70, 511, 512, 515, 1023, 1024, 1099}
    i = 0
    rng = np.random.default_rng(6)
    while i < S:
        n = int(min(rng.integers(1, 4), S - i))
        sel = np.arange(i, i + n)
        _post(client, run["id"], f"live{i}", sel, {k: v[sel] for k, v in stats.items()})
        i += n
        if any(c < i for c in checkpoints):
            done = {c for c in checkpoints if c < i}
            checkpoints -= done
            last = i - 1
            _check(client, run["id"], np.arange(i), {k: v[:i] for k, v in per_step.items()}, last)
            # written once: exactly the blocks before the one holding the last step, none for that one
            assert _rollup_blocks(client, run["id"]) == {lv: last // lv for lv in LEVELS if last >= lv}


def test_late_steps_and_steps_without_statistics(client):
    run = create_run(client, n_layers=2)
    stats = random_stats(np.random.default_rng(8), 200, T)
    per_step = {
        "amax": stats["amax"],
        "overflow": stats["overflow"],
        "headroom": headroom(stats["amax"], stats["scale"], FP8_MAX),
    }
    sent = np.zeros(200, dtype=bool)

    def send(key: str, sel: np.ndarray) -> None:
        _post(client, run["id"], key, sel, {k: v[sel] for k, v in stats.items()})
        sent[sel] = True

    send("a", np.arange(0, 130))
    send("b", np.array([131, 133]))  # gaps in the open block
    # steps 134..149 carry no statistics, yet they take the run past two 8-step blocks and a 64-step one
    _post(client, run["id"], "c", range(134, 150), None)
    # sealed: blocks 0..16 of 8 steps (block 17, steps 136..143, has no statistics: no row) and 0..1 of 64
    assert _rollup_blocks(client, run["id"]) == {8: 17, 64: 2}
    sent_steps = np.flatnonzero(sent)
    _check(client, run["id"], sent_steps, {k: v[sent] for k, v in per_step.items()}, 149)
    # late steps into blocks sealed long ago (and into the gap left in the one just sealed)
    stats["overflow"][130, 3] = 7777.0  # a late spike must show in its sealed blocks
    send("late", np.array([130, 132]))
    send("next", np.array([150, 151]))
    sent_steps = np.flatnonzero(sent)
    _check(client, run["id"], sent_steps, {k: v[sent] for k, v in per_step.items()}, 151)


def test_every_heatmap_metric_is_sealed(client):
    """Each heatmap metric (derived ones included) gets its sealed blocks, at every level the run passed."""
    run = create_run(client, n_layers=2)
    stats = random_stats(np.random.default_rng(9), 520, T)
    for i in range(0, 520, 40):
        sel = np.arange(i, min(i + 40, 520))
        _post(client, run["id"], f"m{i}", sel, {k: v[sel] for k, v in stats.items()})
    with client.app.state.ctx.db.read_session() as session:
        rows = set(
            session.execute(
                select(Rollup.level, Rollup.metric).where(Rollup.run_id == run["id"]).distinct()
            ).all()
        )
    base = {
        m
        for name, (m, _) in HEATMAP_METRICS.items()
        if name in ("amax", "scale", "overflow", "underflow", "nonfinite", "headroom")
    }
    assert {(lv, m) for lv in (8, 64, 512) for m in base} <= rows
    assert not any(lv == 4096 for lv, _ in rows)
