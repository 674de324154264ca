"""Loss-spike detector: robust z-score of the loss against its trend (a short EMA), over a rolling window."""

from __future__ import annotations

import json

import numpy as np
import pytest

from monitor_server.detectors.engine import DetectorConfig, DetectorEngine
from tests.server.detectors.runs import flat_loss_run, healthy_run, keys, of_kind, run_engine


def test_noisy_decaying_loss_raises_nothing():
    for seed in range(3):
        run = healthy_run(600, n_layers=1, seed=seed)
        run.loss *= 1 + 0.05 * np.random.default_rng(seed).standard_normal(600)  # 5% extra noise
        assert of_kind(run_engine(run, cuts=[50, 300]), "loss_spike") == []


def test_large_spike_is_critical_at_its_step():
    run = flat_loss_run(300)
    run.loss[200] = 3.0  # +1.0 over a 2.0 +- 0.02 loss: z ~ 50
    found = of_kind(run_engine(run, cuts=[150]), "loss_spike")
    assert keys(found) == [("loss_spike", None, 200, "critical")]
    ev = found[0].evidence
    assert abs(ev["expected"] - 2.0) < 0.01 and ev["z"] > 30 and ev["window_len"] == 50
    assert ev["tail_steps"][-1] == 199 and len(ev["tail_loss"]) == 10
    assert "step 200" in found[0].message


def test_moderate_spike_is_a_warning_and_a_small_one_is_ignored():
    run = flat_loss_run(300)
    run.loss[120] = 2.0 + 8 * 0.02  # ~8 sigma: above 6, below 12
    run.loss[220] = 2.0 + 3 * 0.02  # ~3 sigma: noise
    found = of_kind(run_engine(run), "loss_spike")
    assert keys(found) == [("loss_spike", None, 120, "warning")]
    assert 6 <= found[0].evidence["z"] < 12


def test_needs_min_history():
    run = flat_loss_run(100)
    run.loss[10] = 10.0  # only 10 previous losses < loss_min_history (20)
    run.loss[30] = 10.0
    assert [f.step for f in of_kind(run_engine(run), "loss_spike")] == [30]


def test_consecutive_spike_steps_are_one_finding():
    run = flat_loss_run(200)
    run.loss[100:104] = 5.0
    run.loss[150] = 5.0
    found = of_kind(run_engine(run, cuts=[102]), "loss_spike")
    assert [f.step for f in found] == [100, 150]


def test_threshold_is_configurable():
    run = flat_loss_run(300)
    run.loss[120] = 2.0 + 8 * 0.02
    config = DetectorConfig(loss_z_threshold=10.0, loss_z_critical=20.0)
    assert of_kind(run_engine(run, config=config), "loss_spike") == []


def test_constant_loss_does_not_divide_by_zero():
    run = flat_loss_run(100, noise=0.0)  # MAD 0: the relative floor keeps z finite
    run.loss[80] = 2.0 + 1e-6
    run.loss[90] = 2.5
    assert [f.step for f in of_kind(run_engine(run), "loss_spike")] == [90]


def decaying_run(seed: int, jump_at: int | None = None, factor: float = 1.57):
    """A steep, then flattening loss (5.2 -> 2.2, time constant 25 steps) with 3% noise; optionally one
    step multiplied by `factor` (an lr spike's +57%: 2.41 -> 3.79 in the issue)."""
    run = flat_loss_run(300, seed=seed)
    rng = np.random.default_rng(seed + 1000)
    t = np.arange(300)
    run.loss = (2.2 + 3.0 * np.exp(-t / 25.0)) * (1 + 0.03 * rng.standard_normal(300))
    if jump_at is not None:
        run.loss[jump_at] *= factor
    return run


@pytest.mark.parametrize("seed", range(8))
def test_a_jump_while_the_loss_still_falls_steeply_is_caught(seed):
    # step 50: the 50-step window still holds the steep start, which hid the jump from a raw-window z-score
    found = of_kind(run_engine(decaying_run(seed, jump_at=50), cuts=[30, 51]), "loss_spike")
    assert [f.step for f in found] == [50]
    assert found[0].evidence["z"] >= 6 and found[0].evidence["expected"] < 2.8


@pytest.mark.parametrize("seed", range(8))
def test_the_same_noisy_falling_loss_without_the_jump_is_quiet(seed):
    assert of_kind(run_engine(decaying_run(seed), cuts=[30, 51]), "loss_spike") == []


def test_a_lasting_level_shift_is_one_finding():
    run = flat_loss_run(300)
    run.loss[150:] += 0.5  # 25 sigma, and it stays: the baseline follows, the spike does not repeat
    assert [f.step for f in of_kind(run_engine(run), "loss_spike")] == [150]


def test_state_saved_by_the_raw_window_detector_still_loads():
    run = flat_loss_run(200)
    run.loss[150] = 3.0
    engine = DetectorEngine(DetectorConfig(), run.tensors, None)
    engine.process(run.batch(0, 100))
    state = json.loads(json.dumps(engine.state_dict(), allow_nan=False))
    window = run.loss[50:100]
    state["loss"] = {"steps": list(range(50, 100)), "loss": window.tolist(), "active": False}  # old layout
    restored = DetectorEngine(DetectorConfig(), run.tensors, None, state=state)
    assert [f.step for f in of_kind(restored.process(run.batch(100, 200)), "loss_spike")] == [150]
