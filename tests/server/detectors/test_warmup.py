"""Warm-up grace and saturation facts: the recipe starting up, or working as designed, raises nothing;
the same conditions after the warm-up, and non-finite values at any time, do."""

from __future__ import annotations

import json

import numpy as np

from monitor_server.detectors.engine import DetectorConfig, DetectorEngine
from monitor_server.detectors.health import saturation_state
from tests.server.detectors.runs import NUMEL, healthy_run, index_of, keys, of_kind, run_engine

HISTORY16 = {"margin": 0, "amax_history_len": 16, "amax_compute_algo": "max"}
DEFAULTS = DetectorConfig(warmup_steps=None)  # the shipped defaults (named: run_engine keeps the warm-up)


def test_scale_one_at_the_start_is_no_alert_but_the_same_later_is():
    run = healthy_run(120, n_layers=2, seed=1)
    w = index_of(run.tensors, 0, "weight")
    run.stats["overflow"][0:2, w] = 0.2 * NUMEL  # steps 0-1: scale still 1, a fifth of the weight saturates
    run.stats["scale"][0:2, w] = 1.0
    assert run_engine(run, recipe=HISTORY16, config=DEFAULTS) == []
    run.stats["overflow"][60, w] = 0.2 * NUMEL  # the same after the history filled: critical at once
    assert keys(run_engine(run, recipe=HISTORY16, config=DEFAULTS)) == [("overflow_burst", w, 60, "critical")]


def test_grace_lasts_until_the_history_has_filled_once():
    run = healthy_run(60, n_layers=1, seed=2)
    i = index_of(run.tensors, 0, "input")
    run.stats["overflow"][:, i] = 0.05 * NUMEL  # saturating from the first step on, and staying so
    found = of_kind(run_engine(run, recipe=HISTORY16, config=DEFAULTS), "overflow_burst")
    # steps 0..15 fill the 16-entry history; step 16 is the first whose scale came from a full history
    assert keys(found) == [("overflow_burst", i, 16, "critical")]
    found = of_kind(
        run_engine(run, recipe=HISTORY16, config=DetectorConfig(warmup_steps=5)), "overflow_burst"
    )
    assert [f.step for f in found] == [5]
    # the default history of 1024 is capped: the grace ends after warmup_max_steps
    found = of_kind(
        run_engine(run, recipe=None, config=DetectorConfig(warmup_steps=None, warmup_max_steps=30)),
        "overflow_burst",
    )
    assert [f.step for f in found] == [30]


def test_steps_a_layer_skips_do_not_count_towards_its_warm_up():
    run = healthy_run(200, n_layers=2, seed=3)
    layer1 = [index_of(run.tensors, 1, r) for r in ("input", "weight", "grad_output")]
    ran = np.zeros(200, dtype=bool)
    ran[::10] = True  # an MoE-style expert that runs every tenth step: zero amax in between
    for t in layer1:
        run.stats["amax"][~ran, t] = 0.0
        run.stats["overflow"][~ran, t] = 0.0
    x = layer1[0]
    run.stats["overflow"][100, x] = 0.2 * NUMEL  # its 11th step with data: still within its warm-up
    assert run_engine(run, recipe=HISTORY16, config=DEFAULTS) == []
    run.stats["overflow"][170, x] = 0.2 * NUMEL  # its 18th: alerts
    assert keys(run_engine(run, recipe=HISTORY16, config=DEFAULTS)) == [
        ("overflow_burst", x, 170, "critical")
    ]


def test_nonfinite_and_a_broken_scale_alert_during_the_warm_up():
    run = healthy_run(40, n_layers=1, seed=4)
    g = index_of(run.tensors, 0, "grad_output")
    w = index_of(run.tensors, 0, "weight")
    run.stats["nonfinite"][1, g] = 3
    run.stats["scale"][2, w] = np.nan
    found = keys(run_engine(run, recipe=HISTORY16, config=DEFAULTS))
    assert ("nonfinite", g, 1, "critical") in found and ("scale_collapse", w, 2, "critical") in found


def test_fast_early_growth_and_the_first_scale_drop_are_no_alerts():
    run = healthy_run(100, n_layers=1, seed=5)
    i = index_of(run.tensors, 0, "input")
    k = np.arange(100)
    run.stats["amax"][:, i] = 2.0 ** np.minimum(0.5 * k, 7.0)  # 128x in the first 14 steps, then flat
    run.rescale(history=16)
    run.stats["scale"][0] = 1.0  # the initial scale, then FP8_MAX / amax: a drop of up to 2^9
    assert run_engine(run, recipe=HISTORY16, config=DEFAULTS) == []
    run.stats["amax"][60:, i] *= 64.0  # the same growth later is a divergence
    found = run_engine(run, recipe=HISTORY16, config=DEFAULTS)
    assert [(f.kind, f.tensor_index) for f in found if f.severity != "info"] == [("amax_divergence", i)]


def test_warm_up_survives_a_state_round_trip():
    run = healthy_run(60, n_layers=1, seed=6)
    i = index_of(run.tensors, 0, "input")
    run.stats["overflow"][:, i] = 0.05 * NUMEL
    one_pass = run_engine(run, recipe=HISTORY16, config=DEFAULTS)
    cut = run_engine(run, cuts=[3, 10, 15, 16, 17], recipe=HISTORY16, config=DEFAULTS, reload_state=True)
    assert keys(cut) == keys(one_pass) == [("overflow_burst", i, 16, "critical")]


def test_old_state_without_warm_up_counts_is_past_its_warm_up():
    run = healthy_run(40, n_layers=1, seed=7)
    engine = DetectorEngine(DEFAULTS, run.tensors, HISTORY16)
    engine.process(run.batch(0, 2))
    state = json.loads(json.dumps(engine.state_dict()))
    del state["amax_seen"]  # as saved before warm-up grace existed
    restored = DetectorEngine(DEFAULTS, run.tensors, HISTORY16, state=state)
    batch = run.batch(2, 3)
    batch.stats["overflow"][0, 0] = 0.2 * NUMEL
    assert keys(restored.process(batch)) == [("overflow_burst", 0, 2, "critical")]


def test_saturation_states_use_the_rounding_thresholds():
    fp8_max = np.array([448.0] * 5 + [57344.0] * 3)
    rounding = np.array([464.0] * 5 + [61440.0] * 3)
    scaled = np.array([440.0, 448.0, 460.0, 470.0, 448 * 2.0, 57344.0, 61000.0, 62000.0])
    head = np.log2(fp8_max / scaled)
    states = saturation_state(head, fp8_max, rounding, 0.5).tolist()
    assert states == ["none", "none", "at_max", "clipping", "saturating", "none", "at_max", "clipping"]
    assert saturation_state(np.array([np.nan]), fp8_max[:1], rounding[:1], 0.5).tolist() == ["unknown"]


def test_margin_zero_at_the_fp8_max_is_a_fact_not_a_reason():
    run = healthy_run(120, n_layers=3, seed=8)
    t = run.tensors
    at_max, clip, sat = index_of(t, 0, "weight"), index_of(t, 1, "weight"), index_of(t, 2, "grad_output")
    scale = run.stats["scale"]
    run.stats["amax"][-1, at_max] = 460.0 / scale[-1, at_max]  # rounds to 448: lossless
    run.stats["amax"][-1, clip] = 480.0 / scale[-1, clip]
    run.stats["amax"][-1, sat] = 4 * 57344.0 / scale[-1, sat]
    engine = DetectorEngine(DEFAULTS, t, HISTORY16)
    engine.process(run.batch())
    health = {h["layer"]: h for h in engine.layer_health([])}
    tensor = {x["name"]: x for h in health.values() for x in h["tensors"]}
    assert tensor["blocks.0.fc.weight"]["saturation"] == "at_max"
    assert health["blocks.0.fc"]["reasons"] == [] and health["blocks.0.fc"]["severity"] == "ok"
    assert tensor["blocks.1.fc.weight"]["saturation"] == "clipping"
    assert health["blocks.1.fc"]["severity"] == "info" and not health["blocks.1.fc"]["diverging"]
    assert tensor["blocks.2.fc.grad_output"]["saturation"] == "saturating"
    assert health["blocks.2.fc"]["severity"] == "warning" and health["blocks.2.fc"]["diverging"]
    assert not any(x["warming_up"] for x in tensor.values())


def test_saturation_during_the_warm_up_is_info():
    run = healthy_run(5, n_layers=1, seed=9)
    w = index_of(run.tensors, 0, "weight")
    run.stats["amax"][-1, w] = 4 * 448.0 / run.stats["scale"][-1, w]
    engine = DetectorEngine(DEFAULTS, run.tensors, HISTORY16)
    engine.process(run.batch())
    (layer,) = engine.layer_health([])
    assert layer["severity"] == "info" and not layer["diverging"] and "warm-up" in layer["reasons"][0]
    assert layer["tensors"][1]["warming_up"] and layer["tensors"][1]["saturation"] == "saturating"
