"""Loss-spike detector: robust z-score over a rolling window of previous losses."""

from __future__ import annotations

import numpy as np
from detector_runs import flat_loss_run, healthy_run, keys, of_kind, run_engine

from monitor_server.detectors.engine import DetectorConfig


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
    assert abs(ev["median"] - 2.0) < 0.01 and ev["z"] > 30 and ev["window_len"] == 50
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
