"""The quantization-quality columns on the wire: accepted all together or not at all, stored under their own
metric ids, and an older sender that leaves them out is still served."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import select

from fp8_protocol.stats import BASE_COLUMNS, QUALITY_COLUMNS
from monitor_server.storage.models import StepStat
from monitor_server.storage.stat_rows import STAT_IDS, unpack
from tests.support.server import API, col, create_run, random_stats


def _quality(rng: np.random.Generator, steps: int, tensors: int) -> dict[str, np.ndarray]:
    sum_sq = rng.uniform(1.0, 100.0, size=(steps, tensors))
    return {
        "sum_sq": sum_sq,
        "err_sq": sum_sq * 1e-3,
        "subnormal": rng.poisson(5.0, size=(steps, tensors)).astype(np.float64),
        "min_abs": np.where(
            rng.random((steps, tensors)) < 0.2, np.inf, rng.uniform(1e-6, 1e-3, (steps, tensors))
        ),
    }


def _body(key: str, steps: list[int], stats: dict[str, np.ndarray], names_of_step) -> dict:
    return {
        "idempotency_key": key,
        "steps": [
            {"step": s, "stats": {n: col(stats[n][i]) for n in names_of_step(i)}} for i, s in enumerate(steps)
        ],
    }


def _stored(client, run_id: int, name: str) -> tuple[list[int], np.ndarray]:
    with client.app.state.ctx.db.read_session() as session:
        rows = session.execute(
            select(StepStat.step, StepStat.values)
            .where(StepStat.run_id == run_id, StepStat.metric == STAT_IDS[name])
            .order_by(StepStat.step)
        ).all()
    return [r.step for r in rows], np.array([unpack(r.values, 3) for r in rows])


def test_quality_columns_are_stored_with_their_values(client):
    run = create_run(client, n_layers=1)  # T = 3
    rng = np.random.default_rng(1)
    stats = random_stats(rng, 4, 3) | _quality(rng, 4, 3)
    body = _body("q1", [0, 1, 2, 3], stats, lambda i: (*BASE_COLUMNS, *QUALITY_COLUMNS))
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json=body)
    assert r.status_code == 200, r.text
    assert len(set(STAT_IDS.values())) == len(STAT_IDS) and 6 not in STAT_IDS.values()  # 6: headroom
    for name in (*BASE_COLUMNS, *QUALITY_COLUMNS):
        steps, values = _stored(client, run["id"], name)
        assert steps == [0, 1, 2, 3]
        np.testing.assert_array_equal(values, stats[name])  # +inf (no non-zero value) kept as sent


def test_a_sender_without_quality_columns_stores_none(client):
    run = create_run(client, n_layers=1)
    stats = random_stats(np.random.default_rng(2), 2, 3)
    r = client.post(
        f"{API}/runs/{run['id']}/telemetry", json=_body("b", [0, 1], stats, lambda i: BASE_COLUMNS)
    )
    assert r.status_code == 200, r.text
    assert _stored(client, run["id"], "amax")[0] == [0, 1]
    for name in QUALITY_COLUMNS:
        assert _stored(client, run["id"], name)[0] == []


@pytest.mark.parametrize("first_sampled", [True, False])
def test_a_batch_may_carry_the_quality_columns_in_some_steps_only(client, first_sampled):
    """A sampling schedule (``--quality-every``) sends them in every N-th step: each step stores what it
    carried, whichever step of the batch came first."""
    run = create_run(client, n_layers=1)
    rng = np.random.default_rng(4)
    stats = random_stats(rng, 4, 3) | _quality(rng, 4, 3)
    sampled = [i % 2 == (0 if first_sampled else 1) for i in range(4)]
    body = _body(
        "s", [0, 1, 2, 3], stats, lambda i: (*BASE_COLUMNS, *QUALITY_COLUMNS) if sampled[i] else BASE_COLUMNS
    )
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json=body)
    assert r.status_code == 200, r.text
    assert _stored(client, run["id"], "amax")[0] == [0, 1, 2, 3]
    for name in QUALITY_COLUMNS:
        steps, values = _stored(client, run["id"], name)
        assert steps == [i for i in range(4) if sampled[i]]
        np.testing.assert_array_equal(values, stats[name][sampled])


@pytest.mark.parametrize(
    "names_of_step,needle",
    [
        (
            lambda i: (*BASE_COLUMNS, "sum_sq", "err_sq"),
            "steps[0].stats: the quality statistics ['sum_sq', 'err_sq', 'subnormal', 'min_abs'] come"
            " all together or not at all; missing ['min_abs', 'subnormal']",
        ),
        (lambda i: (*BASE_COLUMNS[1:], *QUALITY_COLUMNS), "steps[0].stats: missing statistic(s) ['amax']"),
    ],
)
def test_quality_columns_half_sent_are_refused_whole(client, names_of_step, needle):
    run = create_run(client, n_layers=1)
    rng = np.random.default_rng(3)
    stats = random_stats(rng, 2, 3) | _quality(rng, 2, 3)
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json=_body("h", [0, 1], stats, names_of_step))
    assert r.status_code == 422 and needle in r.json()["detail"], r.text
    assert client.get(f"{API}/runs/{run['id']}").json()["steps_stored"] == 0
