"""Amax-divergence and scale-collapse detectors, and how the recipe (margin, history, algo) moves them."""

from __future__ import annotations

import numpy as np

from monitor_server.detectors.engine import DetectorConfig, DetectorEngine
from tests.server.detectors.runs import healthy_run, index_of, keys, of_kind, run_engine


def ramp(run, t: int, start: int, rate: float) -> None:
    """Tensor t: amax 1.0 until `start`, then 2**(rate * k) k steps later (noise-free)."""
    k = np.clip(np.arange(len(run.steps)) - start, 0, None)
    run.stats["amax"][:, t] = 2.0 ** (rate * k)
    run.rescale()


def test_exponential_amax_growth_beyond_margin_fires():
    run = healthy_run(300, n_layers=3)
    w1 = index_of(run.tensors, 1, "weight")
    ramp(run, w1, start=200, rate=0.3)
    # growth over the 32-step window at k steps into the ramp: 0.3k - 0.3k(k-1)/64 -> > 2 from k = 8;
    # the third such step (k = 10, growth 2.58) fires
    found = of_kind(run_engine(run, cuts=[205]), "amax_divergence")
    assert keys(found) == [("amax_divergence", w1, 210, "warning")]
    ev = found[0].evidence
    assert abs(ev["growth_log2"] - 2.578125) < 1e-4 and ev["window"] == 32 and ev["margin"] == 0
    assert ev["amax_tail"]["steps"][-1] == 210 and "blocks.1.fc.weight" in found[0].message


def test_growth_the_margin_covers_does_not_fire():
    run = healthy_run(400, n_layers=3)
    w1 = index_of(run.tensors, 1, "weight")
    ramp(run, w1, start=200, rate=0.3)  # steady-state growth 0.3 * 33 / 2 = 4.95 < margin 3 + 2
    assert of_kind(run_engine(run, recipe={"margin": 3}), "amax_divergence") == []
    assert len(of_kind(run_engine(run, recipe={"margin": 2}), "amax_divergence")) == 1


def test_fast_growth_is_critical():
    run = healthy_run(300, n_layers=2)
    ramp(run, 0, start=200, rate=1.0)
    found = of_kind(run_engine(run), "amax_divergence")
    # growth k - k(k-1)/64 exceeds 2 from k = 3; the third step (k = 5) has growth 4.69 > 2 * 2: critical
    assert keys(found) == [("amax_divergence", 0, 205, "critical")]


def test_most_recent_algo_judges_step_to_step_growth():
    run = healthy_run(300, n_layers=2)
    ramp(run, 0, start=200, rate=0.3)
    recipe = {"amax_compute_algo": "most_recent"}
    assert of_kind(run_engine(run, recipe=recipe), "amax_divergence") == []
    ramp(run, 0, start=200, rate=2.5)  # 5.7x per step: beyond what one step of margin 0 covers
    assert keys(of_kind(run_engine(run, recipe=recipe), "amax_divergence"))[0][1:3] == (0, 203)


def test_short_history_shrinks_the_window():
    run = healthy_run(300, n_layers=2)
    ramp(run, 0, start=200, rate=0.3)
    found = of_kind(run_engine(run, recipe={"amax_history_len": 4}), "amax_divergence")
    assert found == []  # steady-state growth over 4 steps: 0.3 * 5 / 2 = 0.75


def test_per_layer_override_and_mid_run_recipe_change():
    run = healthy_run(400, n_layers=2)
    i0, i1 = index_of(run.tensors, 0, "input"), index_of(run.tensors, 1, "input")
    ramp(run, i0, start=200, rate=0.3)
    run.stats["amax"][:, i1] = run.stats["amax"][:, i0]
    run.rescale()
    engine = DetectorEngine(DetectorConfig(), run.tensors, {"margin": 0, "amax_history_len": 1024})
    engine.update_recipe({"overrides": {"blocks.1.fc": {"margin": 3}}})
    found = of_kind(engine.process(run.batch(0, 300)), "amax_divergence")
    assert keys(found) == [("amax_divergence", i0, 210, "warning")]
    assert engine.recipe == {
        "margin": 0,
        "amax_history_len": 1024,
        "overrides": {"blocks.1.fc": {"margin": 3}},
    }
    engine.update_recipe({"overrides": {"blocks.1.fc": None}})  # back to margin 0: layer 1 now diverges
    found = of_kind(engine.process(run.batch(300, 400)), "amax_divergence")
    assert keys(found) == [("amax_divergence", i1, 302, "critical")]  # steady growth 4.95 > 2 * 2


def test_set_recipe_replaces_and_update_recipe_merges():
    run = healthy_run(10, n_layers=2)
    engine = DetectorEngine(
        DetectorConfig(), run.tensors, {"margin": 2, "overrides": {"blocks.1.fc": {"margin": 4}}}
    )
    assert engine.margin.tolist() == [2, 2, 2, 4, 4, 4]
    engine.update_recipe({"amax_history_len": 4})
    assert engine.margin.tolist() == [2, 2, 2, 4, 4, 4] and engine.window.tolist() == [4] * 6
    engine.set_recipe({"margin": 1, "amax_compute_algo": "most_recent", "overrides": {}})  # a rollback
    assert engine.margin.tolist() == [1] * 6 and engine.window.tolist() == [1] * 6
    engine.set_recipe({"type": "current", "overrides": {"blocks.0.fc": {"fp8_enabled": False}}})
    assert engine.window.tolist() == [32] * 6 and engine.enabled.tolist() == [False] * 3 + [True] * 3
    # block scaling (MXFP8, FP8 blocks) has no amax history either: judged over the divergence window
    engine.set_recipe({"amax_history_len": 4, "overrides": {"blocks.1.fc": {"scaling": "mxfp8"}}})
    assert engine.window.tolist() == [4] * 3 + [32] * 3
    engine.set_recipe({"amax_history_len": 4, "scaling": "block"})
    assert engine.window.tolist() == [32] * 6
    engine.set_recipe(None)
    assert (
        engine.margin.tolist() == [0] * 6
        and engine.window.tolist() == [32] * 6
        and engine.recipe == {"overrides": {}}
    )


def test_healthy_drift_and_jitter_do_not_fire():
    for seed in range(3):
        run = healthy_run(500, n_layers=4, seed=seed)
        found = run_engine(run, cuts=[40, 41, 250])
        assert of_kind(found, "amax_divergence") == [] and of_kind(found, "scale_collapse") == []


def test_scale_drop_after_an_amax_spike_collapses_the_scale():
    run = healthy_run(300, n_layers=3)
    g1 = index_of(run.tensors, 1, "grad_output")
    run.stats["amax"][150, g1] *= 2.0**12  # one spike enters the max-history
    run.rescale()  # ...so from step 151 the scale is 2^12 smaller, for amax_history_len steps
    found = of_kind(run_engine(run, cuts=[151]), "scale_collapse")
    assert keys(found) == [("scale_collapse", g1, 151, "warning")]
    ev = found[0].evidence
    assert 11.5 < ev["drop_log2"] < 12.5 and ev["scale_tail"]["steps"] == list(range(144, 152))


def test_small_scale_drop_is_fine_and_threshold_configurable():
    run = healthy_run(300, n_layers=3)
    run.stats["amax"][150, 0] *= 2.0**6
    run.rescale()
    assert of_kind(run_engine(run), "scale_collapse") == []
    found = of_kind(run_engine(run, config=DetectorConfig(scale_drop_log2=4.0)), "scale_collapse")
    assert keys(found) == [("scale_collapse", 0, 151, "warning")]


def test_non_finite_zero_or_tiny_scale_is_critical():
    run = healthy_run(300, n_layers=2)
    run.stats["scale"][100, 0] = np.nan
    run.stats["scale"][120:125, 1] = 0.0
    run.stats["scale"][200, 2] = 1e-20
    found = of_kind(run_engine(run), "scale_collapse")
    assert keys(found) == [
        ("scale_collapse", 0, 100, "critical"),
        ("scale_collapse", 1, 120, "critical"),
        ("scale_collapse", 2, 200, "critical"),
    ]
    assert found[0].evidence["scale"] == "NaN"


def test_collapse_episode_escalates_once_when_scale_goes_non_finite():
    run = healthy_run(300, n_layers=1)
    run.stats["amax"][150, 0] *= 2.0**12
    run.rescale()
    run.stats["scale"][160, 0] = np.inf
    found = of_kind(run_engine(run), "scale_collapse")
    assert keys(found) == [("scale_collapse", 0, 151, "warning"), ("scale_collapse", 0, 160, "critical")]


def test_gradient_amax_gets_a_wider_tolerance_than_forward_tensors():
    run = healthy_run(300, n_layers=3)
    g1, i1 = index_of(run.tensors, 1, "grad_output"), index_of(run.tensors, 1, "input")
    run.stats["amax"][200:206, g1] *= 2.0**2.6  # six hard batches: the gradient 6x larger, then back
    run.stats["amax"][200:206, i1] *= 2.0**2.6  # the same on an activation is a divergence
    run.rescale()
    found = of_kind(run_engine(run), "amax_divergence")
    assert [(f.tensor_index, f.step) for f in found] == [(i1, 202)]
    assert found[0].evidence["tolerance_log2"] == 2.0 and found[0].onset == 200
    run.stats["amax"][200:206, g1] *= 2.0**1.0  # 12x for the gradient is beyond its 2^3
    run.rescale()
    grads = [f for f in of_kind(run_engine(run), "amax_divergence") if f.tensor_index == g1]
    assert [(f.step, f.evidence["tolerance_log2"]) for f in grads] == [(202, 3.0)]
