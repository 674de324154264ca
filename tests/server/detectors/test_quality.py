"""The SQNR-drop detector: one finding per episode for a tensor whose SQNR falls far below its own recent
level, nothing for a healthy run however it is batched, nothing without the quality columns, and a state
saved before the detector existed starts it fresh."""

from __future__ import annotations

import json

import numpy as np
import pytest

from monitor_server.core.detector_config import DetectorConfig
from monitor_server.detectors.engine import DetectorEngine
from monitor_server.detectors.quality import rolling_median
from tests.server.detectors.runs import add_quality, healthy_run, index_of, of_kind, run_engine, set_sqnr


def dropping_run(seed: int = 0):
    """24 tensors at ~30 dB; layer 5's weight falls to ~12 dB from step 150 on."""
    run = add_quality(healthy_run(200, n_layers=8, seed=seed), seed=seed)
    t = index_of(run.tensors, 5, "weight")
    set_sqnr(run, slice(150, None), t, level_db=12.0, noise_db=1.0, seed=seed)
    return run, t


@pytest.mark.parametrize("cuts", [[], [1, 2, 3, 64, 65, 151, 152], list(range(5, 200, 7))])
def test_a_drop_raises_one_finding_naming_the_tensor_level_and_drop(cuts):
    run, t = dropping_run()
    found = run_engine(run, cuts=cuts, reload_state=bool(cuts))
    assert [(f.kind, f.tensor_index) for f in found] == [("sqnr_drop", t)]
    f = found[0]
    # fires at the third consecutive dropping step (sqnr_consecutive), the episode began at 150
    assert (f.step, f.onset, f.severity) == (152, 150, "warning")
    ev = f.evidence
    assert 10.0 < ev["level_db"] - 12.0 < 26.0 and ev["drop_db"] > DetectorConfig().sqnr_drop_db
    assert ev["drop_db"] == pytest.approx(ev["level_db"] - ev["sqnr_db"])
    assert ev["sqnr_tail"]["steps"][-1] == 152 and len(ev["sqnr_tail"]["values"]) == 8
    assert "blocks.5.fc.weight" in f.message
    assert f"{ev['sqnr_db']:.1f} dB" in f.message and f"{ev['drop_db']:.1f} dB below" in f.message
    json.dumps(f.evidence, allow_nan=False)


def test_a_healthy_run_with_quality_columns_raises_nothing_however_batched():
    run = add_quality(healthy_run(500, n_layers=6, seed=7), seed=7, noise_db=2.0)
    assert run_engine(run) == []
    assert run_engine(run, cuts=[1, 2, 3, 64, 65, 300], reload_state=True) == []


def test_a_drop_smaller_than_the_threshold_or_too_short_raises_nothing():
    run = add_quality(healthy_run(200, n_layers=4, seed=2), seed=2)
    t = index_of(run.tensors, 1, "input")
    level = 10.0 * np.log10(run.stats["sum_sq"][:150, t] / run.stats["err_sq"][:150, t])
    set_sqnr(run, slice(150, None), t, level_db=float(np.median(level[-32:])) - 7.0, noise_db=0.5)
    assert run_engine(run) == []
    set_sqnr(run, slice(150, 152), t, level_db=5.0, noise_db=0.5)  # two steps: under sqnr_consecutive
    assert run_engine(run) == []
    set_sqnr(run, slice(150, 153), t, level_db=5.0, noise_db=0.5)  # three: fires, critical (> 2 x 10 dB)
    assert [(f.kind, f.tensor_index, f.step, f.severity) for f in run_engine(run)] == [
        ("sqnr_drop", t, 152, "critical")
    ]


def test_a_tensor_that_settles_at_its_new_level_fires_again_only_when_it_falls_further():
    run, t = dropping_run(seed=3)
    assert len(of_kind(run_engine(run), "sqnr_drop")) == 1
    longer = add_quality(healthy_run(400, n_layers=8, seed=3), seed=3)
    set_sqnr(longer, slice(150, None), t, level_db=12.0, noise_db=1.0)
    set_sqnr(longer, slice(300, None), t, level_db=-2.0, noise_db=1.0)
    assert [(f.tensor_index, f.onset) for f in run_engine(longer)] == [(t, 150), (t, 300)]


def test_undefined_and_exact_sqnr_neither_drop_nor_count():
    run, t = dropping_run(seed=4)
    other = index_of(run.tensors, 2, "input")
    # an all-zero tensor (NaN SQNR) every other step, exact round trips (+inf) of the dropping tensor
    # before its drop (they would make its level +inf if they entered it)
    run.stats["sum_sq"][::2, other] = run.stats["err_sq"][::2, other] = 0.0
    run.stats["err_sq"][:148:3, t] = 0.0
    found = run_engine(run)
    assert [(f.kind, f.tensor_index) for f in found] == [("sqnr_drop", t)]
    assert np.isfinite(found[0].evidence["level_db"])


def test_no_quality_columns_no_findings_and_no_sqnr_in_layer_health():
    run = healthy_run(200, n_layers=3, seed=5)
    engine = DetectorEngine(DetectorConfig(warmup_steps=0), run.tensors, None)
    assert engine.process(run.batch()) == []
    layers = engine.layer_health([])
    assert all(layer["sqnr_db"] is None for layer in layers)
    assert all(t["sqnr_db"] is None for layer in layers for t in layer["tensors"])


def test_layer_health_carries_each_tensors_latest_sqnr_and_the_layers_worst():
    run, t = dropping_run(seed=6)
    engine = DetectorEngine(DetectorConfig(warmup_steps=0), run.tensors, None)
    engine.process(run.batch())
    sqnr = 10.0 * np.log10(run.stats["sum_sq"][-1] / run.stats["err_sq"][-1])
    by_name = {layer["layer"]: layer for layer in engine.layer_health([])}
    for k in range(8):
        layer = by_name[f"blocks.{k}.fc"]
        idx = [3 * k, 3 * k + 1, 3 * k + 2]
        assert layer["sqnr_db"] == pytest.approx(sqnr[idx].min(), rel=1e-12)
        assert [e["sqnr_db"] for e in layer["tensors"]] == pytest.approx(sqnr[idx].tolist(), rel=1e-12)
    assert by_name["blocks.5.fc"]["sqnr_db"] < 20.0


def test_a_state_saved_before_the_detector_existed_starts_it_fresh():
    run, t = dropping_run(seed=8)
    config = DetectorConfig(warmup_steps=0)
    engine = DetectorEngine(config, run.tensors, None)
    engine.process(run.batch(0, 100))
    state = json.loads(json.dumps(engine.state_dict(), allow_nan=False))
    del state["sqnr_drop"]
    again = DetectorEngine(config, run.tensors, None, state=state)
    fresh = DetectorEngine(config, run.tensors, None).detectors["sqnr_drop"]
    assert np.isnan(again.detectors["sqnr_drop"].ring).all() and np.isnan(fresh.ring).all()
    assert again.last_step == 99  # the other detectors' state is kept
    found = again.process(run.batch(100, 200))
    assert [(f.kind, f.tensor_index, f.onset) for f in found] == [("sqnr_drop", t, 150)]


def test_rolling_median_matches_numpy():
    rng = np.random.default_rng(0)
    w, rows, n = 7, 40, 5
    ext = rng.normal(size=(w + rows, n))
    ext[rng.random(ext.shape) < 0.4] = np.nan
    ext[:, 0] = np.nan  # a column without values
    median, count = rolling_median(ext, w, rows)
    for i in range(rows):
        window = ext[i : i + w]
        np.testing.assert_array_equal(count[i], np.sum(~np.isnan(window), axis=0))
        with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
            expected = np.nanmedian(window.astype(np.float32).astype(np.float64), axis=0)
        np.testing.assert_allclose(median[i], expected, rtol=1e-15, equal_nan=True)


def test_the_window_settings_are_checked():
    with pytest.raises(ValueError, match="sqnr_min_history must be <= sqnr_window"):
        DetectorConfig(sqnr_window=8, sqnr_min_history=9)
