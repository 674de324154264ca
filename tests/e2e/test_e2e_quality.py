"""A real FP8 run streams the quantization-quality columns into a real server: every step's sum_sq, err_sq,
subnormal and min_abs are stored, equal to what the job computed, and say what FP8 costs each tensor."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import create_engine, select

from fp8_protocol.stats import (
    ERR_SQ,
    MIN_ABS,
    NUMEL,
    QUALITY_COLUMNS,
    STAT_COLUMNS,
    SUBNORMAL,
    SUM_SQ,
    sqnr_db,
)
from monitor_server.storage.models import StepStat
from monitor_server.storage.stat_rows import STAT_IDS, unpack_rows
from tests.e2e.e2e_utils import run_by_name

pytestmark = pytest.mark.slow


def _stored(db_url: str, run_id: int, name: str, num_tensors: int) -> tuple[list[int], np.ndarray]:
    """``(steps, (S, T) values)`` of one statistic as the service stored it."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(StepStat.step, StepStat.values)
                .where(StepStat.run_id == run_id, StepStat.metric == STAT_IDS[name])
                .order_by(StepStat.step)
            ).all()
    finally:
        engine.dispose()
    return [r.step for r in rows], unpack_rows([r.values for r in rows], num_tensors)


def test_quality_columns_stored_and_plausible(server, api, train, tmp_path):
    steps = 12
    train("--steps", str(steps), "--monitor-url", server.url, "--run-name", "e2e-quality",
          "--stats-dump", "stats.npz")  # fmt: skip
    dump = np.load(tmp_path / "stats.npz")["stats"]  # (steps, tensors, columns)
    assert dump.shape[2] == len(STAT_COLUMNS)
    run = run_by_name(api, "e2e-quality")
    assert (run["status"], run["steps_stored"]) == ("finished", steps)
    tensors = api.get(f"/runs/{run['id']}/tensors").json()

    stored = {}
    for name in QUALITY_COLUMNS:
        got_steps, values = _stored(server.db_url, run["id"], name, len(tensors))
        assert got_steps == list(range(1, steps + 1)), name
        np.testing.assert_array_equal(values, dump[:, :, STAT_COLUMNS.index(name)], err_msg=name)
        stored[name] = values

    db = sqnr_db(stored["sum_sq"], stored["err_sq"])  # (S, T)
    forward = [t["index"] for t in tensors if t["role"] in ("input", "weight")]
    assert {tensors[i]["format"] for i in forward} == {"e4m3"}
    # E4M3 keeps 3 mantissa bits: a well-scaled tensor's SQNR is about 31 dB; below 20 dB something is badly
    # scaled, above 40 dB the values were not really rounded to FP8
    assert np.all((db[:, forward] > 20.0) & (db[:, forward] < 40.0)), db[:, forward]
    grads = [t["index"] for t in tensors if t["role"] == "grad_output"]
    assert np.all(db[:, grads] < db[:, forward].max())  # E5M2 (2 mantissa bits) loses more
    # the counts and the smallest value are consistent with the base columns
    numel = dump[:, :, NUMEL]
    assert np.all((stored["subnormal"] >= 0) & (stored["subnormal"] <= numel))
    amax = dump[:, :, 0]
    assert np.all((stored["min_abs"] > 0) & (stored["min_abs"] <= amax))
    assert np.all(dump[:, :, SUM_SQ] > 0) and np.all(dump[:, :, ERR_SQ] > 0)
    assert np.array_equal(dump[:, :, SUBNORMAL], stored["subnormal"])
    assert np.array_equal(dump[:, :, MIN_ABS], stored["min_abs"])
