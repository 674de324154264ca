"""The quality columns on the trainer side: the step buffer, merges over micro-steps and ranks (each column
as ``fp8_protocol.stats.MERGE`` says), and what goes on the wire: the quality columns where the block has
them, left out (never NaN placeholders) where a source has only the base columns."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import fp8_trainer
from fp8_protocol.stats import (
    AMAX,
    BASE_COLUMNS,
    ERR_SQ,
    MIN_ABS,
    NUMEL,
    QUALITY_COLUMNS,
    SCALE,
    STAT_COLUMNS,
    SUBNORMAL,
    SUM_SQ,
    sqnr_db,
)
from fp8_trainer.convert import get_fp8_state
from fp8_trainer.merge import merge_step_stats
from fp8_trainer.monitor.external import CallerStats
from fp8_trainer.monitor.ranks import reduce_rank_stats
from fp8_trainer.monitor.sender import StepRecord, step_body


def _model() -> nn.Module:
    torch.manual_seed(0)
    return fp8_trainer.convert_to_fp8(nn.Sequential(nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 16)))


def _step(model: nn.Module, x: torch.Tensor, *, boundary: bool = True) -> None:
    with fp8_trainer.fp8_autocast(step_boundary=boundary):
        loss = model(x).square().mean()
    loss.backward()


def test_step_stats_have_the_quality_columns():
    model = _model()
    _step(model, torch.randn(24, 32))
    s = fp8_trainer.step_stats(model).numpy()
    assert s.shape == (6, len(STAT_COLUMNS))
    db = sqnr_db(s[:, SUM_SQ], s[:, ERR_SQ])
    # E4M3 forward tensors (input, weight) of a first step scaled by 1: SQNR of a 3-bit mantissa, about
    # 30 dB; the E5M2 gradients (2 bits) lower
    fwd = [0, 1, 3, 4]
    assert np.all((db[fwd] > 20) & (db[fwd] < 40)), db
    assert np.all(db[[2, 5]] < db[fwd].min() + 6), db
    assert np.all((s[:, MIN_ABS] > 0) & (s[:, MIN_ABS] <= s[:, AMAX]))
    assert np.all(s[:, SUBNORMAL] <= s[:, NUMEL])


def test_micro_batches_merge_min_abs_as_a_min():
    model = _model()
    a, b = torch.randn(8, 32), torch.randn(8, 32)
    a[0, 0], b[0, 0] = 1e-3, 1e-5  # the second micro-batch holds the smaller input value
    _step(model, a, boundary=False)
    _step(model, b)
    merged = fp8_trainer.step_stats(model)
    assert merged[0, MIN_ABS].item() == pytest.approx(1e-5)
    assert merged[0, NUMEL].item() == 2 * 8 * 32
    one = _model()
    _step(one, a)
    assert merged[0, SUM_SQ].item() > fp8_trainer.step_stats(one)[0, SUM_SQ].item()  # summed


def test_merge_step_stats_and_rank_reduction_follow_merge():
    rng = np.random.default_rng(3)
    blocks = rng.uniform(1, 10, size=(3, 4, len(STAT_COLUMNS)))
    blocks[:, :, MIN_ABS] = rng.uniform(1e-6, 1e-3, size=(3, 4))
    blocks[1, 2, MIN_ABS] = math.inf  # a rank without any non-zero value in tensor 2
    out = reduce_rank_stats(blocks)
    np.testing.assert_array_equal(out[:, AMAX], blocks[:, :, AMAX].max(axis=0))
    np.testing.assert_array_equal(out[:, MIN_ABS], blocks[:, :, MIN_ABS].min(axis=0))
    for c in (SUM_SQ, ERR_SQ, SUBNORMAL, NUMEL):
        np.testing.assert_allclose(out[:, c], blocks[:, :, c].sum(axis=0), rtol=1e-15)
    assert reduce_rank_stats(blocks[:, :, : len(BASE_COLUMNS)]).shape == (4, len(BASE_COLUMNS))
    a, b = torch.from_numpy(blocks[0]), torch.from_numpy(blocks[1])
    m = merge_step_stats(a, b)
    assert torch.equal(m[:, MIN_ABS], torch.fmin(a[:, MIN_ABS], b[:, MIN_ABS]))
    assert torch.equal(m[:, SUM_SQ], a[:, SUM_SQ] + b[:, SUM_SQ])
    # a block without the quality columns and one with them: the base columns they share
    assert merge_step_stats(a[:, :6], b).shape == (4, 6)


def test_wire_step_carries_the_columns_the_block_has():
    full = np.ones((3, len(STAT_COLUMNS)))
    base = np.ones((3, len(BASE_COLUMNS)))
    assert list(step_body(StepRecord(1, full, {}))["stats"]) == list(STAT_COLUMNS)
    body = step_body(StepRecord(2, base, {}))
    assert list(body["stats"]) == list(BASE_COLUMNS)  # left out, not NaN placeholders
    assert not set(QUALITY_COLUMNS) & set(body["stats"])


def test_caller_blocks_with_or_without_quality_columns():
    src = CallerStats(["fc.input", "fc.weight", "fc.grad_output"])
    src.put(np.ones((3, 6)))
    src.put(np.ones((3, 6)))
    got, n = src.take()
    assert got.shape == (3, 6) and n == 2 and got[0, NUMEL].item() == 2
    src.put(np.ones((3, 10)))
    with pytest.raises(ValueError, match="same step"):
        src.put(np.ones((3, 6)))
    with pytest.raises(ValueError, match="expected shape"):
        src.put(np.ones((3, 8)))


def test_quality_statistics_can_be_switched_off_for_a_benchmark():
    model = _model()
    state = get_fp8_state(model)
    state.set_quality_stats(False)
    _step(model, torch.randn(8, 32))
    assert fp8_trainer.step_stats(model).shape == (6, len(BASE_COLUMNS))
    state.set_quality_stats(True)
    _step(model, torch.randn(8, 32))
    s = fp8_trainer.step_stats(model)
    assert s.shape == (6, len(STAT_COLUMNS)) and torch.all(s[:, SCALE] > 0)


def test_a_spike_under_a_stale_delayed_scale_has_a_finite_sqnr_on_the_dashboard(server, tmp_path):
    """Calm steps set a large delayed scale; then a spike far beyond it: |x * scale| above 1.8e19, whose
    float32 square overflowed, made both sums +inf and SQNR NaN ("no finite element") for a finite tensor,
    the run's worst quantization invisible to the SQNR view. Now its SQNR is about 0 dB, as everything
    saturates, and the stored heatmap and the layers table say so."""
    from tests.trainer.monitor_utils import FAST, decode, get

    model = _model()
    recipe = get_fp8_state(model).recipe
    with fp8_trainer.Monitor(
        server.url, "stale-spike", model, recipe, spool_path=tmp_path / "s.jsonl", **FAST
    ) as mon:
        for step in range(1, 5):
            x = torch.randn(8, 32) * 1e-3  # amax ~3e-3: a delayed scale of about 1.5e5
            if step == 4:
                x[0, 0] = 1e17  # the stale scale sends it to ~1.5e22
            _step(model, x)
            mon.step(step, loss=0.0)
    row = get_fp8_state(model).last_stats[0].tolist()
    assert row[NUMEL] == 8 * 32 and row[AMAX] == np.float32(1e17)
    assert math.isfinite(row[SUM_SQ]) and math.isfinite(row[ERR_SQ])
    assert -0.1 < sqnr_db(row[SUM_SQ], row[ERR_SQ]) < 0.1
    h = get(server.url, f"/runs/{mon.run_id}/heatmap", metric="sqnr", max_cols=1000)
    sqnr = decode(h["values"][0])
    assert sqnr[1:3].min() > 20 and -0.1 < sqnr[3] < 0.1  # calm steps (the first at scale 1), then the spike
    layers = get(server.url, f"/runs/{mon.run_id}/layers")
    tensor = next(t for layer in layers for t in layer["tensors"] if t["name"] == "0.input")
    assert -0.1 < float(tensor["sqnr_db"]) < 0.1


def test_quality_every_n_steps_reaches_the_dashboard_on_those_steps_only(server, tmp_path):
    """``set_quality_schedule(3)``: steps 0, 3, 6 record the quality columns (their quantize passes run the
    kernels with the quality terms), the others the base columns alone. The service stores SQNR for the
    sampled steps and none for the others, while amax and the counts are there for every step."""
    from tests.trainer.monitor_utils import FAST, decode, get

    model = _model()
    state = get_fp8_state(model)
    state.set_quality_schedule(3)
    widths = []
    with fp8_trainer.Monitor(
        server.url, "quality-every-3", model, state.recipe, spool_path=tmp_path / "s.jsonl", **FAST
    ) as mon:
        for step in range(1, 9):
            _step(model, torch.randn(8, 32))
            widths.append(fp8_trainer.step_stats(model).shape[1])
            mon.step(step, loss=0.0)
    sampled = [len(STAT_COLUMNS) if i % 3 == 0 else len(BASE_COLUMNS) for i in range(8)]
    assert widths == sampled
    sqnr = decode(get(server.url, f"/runs/{mon.run_id}/heatmap", metric="sqnr", max_cols=1000)["values"][0])
    amax = decode(get(server.url, f"/runs/{mon.run_id}/heatmap", metric="amax", max_cols=1000)["values"][0])
    assert len(sqnr) == len(amax) == 8
    assert [bool(np.isfinite(v)) for v in sqnr] == [w == len(STAT_COLUMNS) for w in sampled]
    assert np.isfinite(amax).all() and (amax > 0).all()
    # the layers table shows the latest SQNR there is (step 7's), though the last step (8) has none
    layers = get(server.url, f"/runs/{mon.run_id}/layers")
    tensor = next(t for layer in layers for t in layer["tensors"] if t["name"] == "0.input")
    assert float(tensor["sqnr_db"]) == pytest.approx(float(sqnr[6]), rel=1e-6)


def test_quality_schedule_is_refused_when_malformed():
    state = get_fp8_state(_model())
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="quality_every"):
            state.set_quality_schedule(bad)
