"""Layer-health ranking: severity, score, reasons and per-tensor summaries."""

from __future__ import annotations

import json

import numpy as np

from monitor_server.detectors.engine import DetectorConfig, DetectorEngine
from monitor_server.detectors.health import findings_as_open_alerts
from tests.server.detectors.runs import healthy_run, index_of

TENSOR_KEYS = {"index", "name", "role", "last_amax", "last_scale", "headroom_log2", "amax_growth_log2",
               "overflow_total", "underflow_total", "nonfinite_total",
               "saturation", "warming_up", "sqnr_db", "sqnr_level_db"}  # fmt: skip


def troubled_engine():
    """Layer 2 went NaN, layer 3's amax diverges, layer 1 saturates at the last step, layer 0 is fine."""
    run = healthy_run(300, n_layers=4, seed=5)
    t = run.tensors
    run.stats["nonfinite"][150:153, index_of(t, 2, "grad_output")] = 9
    k = np.clip(np.arange(300) - 250, 0, None)
    run.stats["amax"][:, index_of(t, 3, "input")] = 2.0 ** (0.3 * k)
    run.rescale()
    run.stats["amax"][299, index_of(t, 1, "weight")] *= 4.0  # amax * scale ~ 4x the FP8 max
    engine = DetectorEngine(DetectorConfig(), t, None)
    findings = engine.process(run.batch(0, 200)) + engine.process(run.batch(200, 300))
    return engine, findings, run


def test_layers_ranked_worst_first_with_reasons():
    engine, findings, run = troubled_engine()
    alerts = findings_as_open_alerts(findings)
    alerts.append({"kind": "loss_spike", "tensor_index": None, "severity": "critical", "first_step": 5,
                   "last_step": 5, "count": 1, "message": "run-level"})  # belongs to no layer  # fmt: skip
    health = engine.layer_health(alerts)
    assert [h["layer"] for h in health] == ["blocks.2.fc", "blocks.3.fc", "blocks.1.fc", "blocks.0.fc"]
    assert [h["severity"] for h in health[:3]] == ["critical", "warning", "warning"]
    assert health[3]["severity"] in ("ok", "info") and not health[3]["diverging"]
    assert [h["diverging"] for h in health[:3]] == [True, True, True]
    scores = [h["score"] for h in health]
    assert scores == sorted(scores, reverse=True)

    nan_layer, diverging, saturating = health[0], health[1], health[2]
    assert any("blocks.2.fc.grad_output" in r and "27 non-finite" in r for r in nan_layer["reasons"])
    assert any("open nonfinite alert" in r for r in nan_layer["reasons"])
    assert any("amax of blocks.3.fc.input grew" in r for r in diverging["reasons"])
    assert any("open amax_divergence alert" in r for r in diverging["reasons"])
    assert any("blocks.1.fc.weight saturates" in r for r in saturating["reasons"])

    g2 = nan_layer["tensors"][2]
    assert set(g2) == TENSOR_KEYS and g2["name"] == "blocks.2.fc.grad_output" and g2["nonfinite_total"] == 27
    w1 = saturating["tensors"][1]
    assert -2.01 < w1["headroom_log2"] < -1.0 and w1["overflow_total"] == 0
    json.dumps(health, allow_nan=False)


def test_open_alert_alone_sets_the_layer_severity():
    run = healthy_run(100, n_layers=2, seed=2)
    run.rescale(margin=1)
    engine = DetectorEngine(DetectorConfig(), run.tensors, {"margin": 1})
    engine.process(run.batch())
    quiet = engine.layer_health([])
    assert all(h["severity"] == "ok" and h["reasons"] == [] for h in quiet)  # margin 1: no saturation
    i1 = index_of(run.tensors, 1, "input")
    alert = {"kind": "underflow_excess", "tensor_index": i1, "severity": "info", "first_step": 40,
             "last_step": 60, "count": 2, "message": "excess underflow"}  # fmt: skip
    health = engine.layer_health([alert])
    assert health[0]["layer"] == "blocks.1.fc" and health[0]["severity"] == "info"
    assert "underflow_excess" in health[0]["reasons"][0] and "blocks.1.fc.input" in health[0]["reasons"][0]


def test_fresh_engine_reports_unknown_values_as_nan():
    run = healthy_run(10, n_layers=2)
    health = DetectorEngine(DetectorConfig(), run.tensors, None).layer_health([])
    assert [h["layer"] for h in health] == ["blocks.0.fc", "blocks.1.fc"]
    assert health[0]["severity"] == "ok" and health[0]["tensors"][0]["headroom_log2"] == "NaN"
