"""Overflow-burst and excess-underflow detectors."""

from __future__ import annotations

import pytest

from monitor_server.detectors.engine import DetectorConfig
from tests.server.detectors.runs import NUMEL, healthy_run, index_of, keys, of_kind, run_engine


def test_sustained_overflow_fires_once_at_the_third_step():
    run = healthy_run(300, n_layers=3)
    w1 = index_of(run.tensors, 1, "weight")
    run.stats["overflow"][100:120, w1] = 2e-3 * NUMEL  # 0.2% saturated for 20 steps
    found = of_kind(run_engine(run, cuts=[101]), "overflow_burst")  # the episode spans a batch boundary
    assert keys(found) == [("overflow_burst", w1, 102, "warning")]
    ev = found[0].evidence
    assert ev["consecutive_steps"] == 3 and abs(ev["fraction"] - 2e-3) < 1e-9
    assert ev["fraction_tail"]["steps"] == list(range(95, 103))  # crosses the batch boundary
    assert ev["fraction_tail"]["values"][-4:] == pytest.approx([0.0, 2e-3, 2e-3, 2e-3], rel=1e-6)
    assert "blocks.1.fc.weight" in found[0].message and "102" in found[0].message


def test_jump_fires_critical_at_once_and_escalation_fires_again():
    run = healthy_run(300, n_layers=3)
    i0, g2 = index_of(run.tensors, 0, "input"), index_of(run.tensors, 2, "grad_output")
    run.stats["overflow"][150, i0] = 0.05 * NUMEL  # a one-step jump to 5%
    run.stats["overflow"][200:210, g2] = 2e-3 * NUMEL  # a warning-level burst...
    run.stats["overflow"][206, g2] = 0.5 * NUMEL  # ...that later jumps
    found = of_kind(run_engine(run), "overflow_burst")
    assert keys(found) == [
        ("overflow_burst", i0, 150, "critical"),
        ("overflow_burst", g2, 202, "warning"),
        ("overflow_burst", g2, 206, "critical"),
    ]
    assert found[2].evidence["escalation"] is True


def test_short_or_tiny_overflow_is_normal():
    run = healthy_run(300, n_layers=3)
    w0 = index_of(run.tensors, 0, "weight")
    run.stats["overflow"][:, :] = 1e-5 * NUMEL  # delayed scaling clips a few elements now and then
    for start in range(50, 250, 10):
        run.stats["overflow"][start : start + 2, w0] = 5e-3 * NUMEL  # 2 steps < 3 consecutive
    assert of_kind(run_engine(run), "overflow_burst") == []


def test_a_new_episode_fires_again():
    run = healthy_run(200, n_layers=1)
    run.stats["overflow"][50:55, 0] = 2e-3 * NUMEL
    run.stats["overflow"][100:105, 0] = 2e-3 * NUMEL
    assert [f.step for f in of_kind(run_engine(run), "overflow_burst")] == [52, 102]


def test_missing_numel_does_not_fire():
    run = healthy_run(100, n_layers=1)
    run.stats["overflow"][50:60, 0] = 1e6
    run.stats["numel"][:, 0] = 0.0
    assert of_kind(run_engine(run), "overflow_burst") == []


def test_normal_gradient_underflow_is_ignored():
    run = healthy_run(400, n_layers=4)  # grad_output underflow 15-20% every step, forward 1%
    assert of_kind(run_engine(run, cuts=[100, 200]), "underflow_excess") == []


def test_forward_underflow_above_threshold_for_ten_steps_is_info():
    run = healthy_run(300, n_layers=3)
    i2 = index_of(run.tensors, 2, "input")
    run.stats["underflow"][100:140, i2] = 0.12 * NUMEL
    found = of_kind(run_engine(run, cuts=[105]), "underflow_excess")
    assert keys(found) == [("underflow_excess", i2, 109, "info")]
    assert found[0].evidence["threshold"] == 0.05


def test_gradient_underflow_fires_only_above_its_own_threshold():
    run = healthy_run(300, n_layers=3)
    g0, g1 = index_of(run.tensors, 0, "grad_output"), index_of(run.tensors, 1, "grad_output")
    run.stats["underflow"][100:140, g0] = 0.22 * NUMEL  # normal for gradients
    run.stats["underflow"][100:140, g1] = 0.60 * NUMEL  # most of the gradient flushed to zero
    found = of_kind(run_engine(run), "underflow_excess")
    assert keys(found) == [("underflow_excess", g1, 109, "info")]


def test_underflow_interrupted_streaks_do_not_fire():
    run = healthy_run(300, n_layers=1)
    for start in range(50, 250, 10):
        run.stats["underflow"][start : start + 9, 0] = 0.5 * NUMEL  # 9 steps < 10
    assert of_kind(run_engine(run), "underflow_excess") == []
    config = DetectorConfig(underflow_consecutive=5)
    assert len(of_kind(run_engine(run, config=config), "underflow_excess")) == 20


def test_a_hard_batch_clipping_a_few_percent_of_a_gradient_is_no_alert():
    run = healthy_run(300, n_layers=3)
    g0, w1 = index_of(run.tensors, 0, "grad_output"), index_of(run.tensors, 1, "weight")
    run.stats["overflow"][100, g0] = 0.08 * NUMEL  # one step: the gradient outgrew its history 30x
    run.stats["overflow"][150, w1] = 0.02 * NUMEL  # a weight does not jump on its own: critical
    assert keys(of_kind(run_engine(run), "overflow_burst")) == [("overflow_burst", w1, 150, "critical")]
    run.stats["overflow"][200, g0] = 0.4 * NUMEL  # most of a gradient saturating is still critical
    assert ("overflow_burst", g0, 200, "critical") in keys(run_engine(run))
    run.stats["overflow"][250:254, g0] = 0.002 * NUMEL  # and a lasting burst is a warning
    assert ("overflow_burst", g0, 252, "warning") in keys(run_engine(run))
