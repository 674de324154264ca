"""DetectorEngine as a whole: healthy runs, state round trips, replayed steps, events, recipes, stalls."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from pydantic import ValidationError

from monitor_server.detectors.engine import DetectorConfig, DetectorEngine, check_stalled
from monitor_server.detectors.types import ALERT_KINDS, StepBatch
from tests.server.detectors.runs import faulty_run, healthy_run, keys, run_engine


def full(findings):
    return [(f.kind, f.tensor_index, f.step, f.severity, f.message, f.evidence) for f in findings]


def test_faulty_run_triggers_every_tensor_and_loss_detector():
    found = run_engine(faulty_run())
    # stalled comes from the clock, rank_divergence from rank_amax events (test_ranks.py)
    assert {f.kind for f in found} == set(ALERT_KINDS) - {"stalled", "rank_divergence"}
    assert all(f.kind in ALERT_KINDS and f.severity in ("info", "warning", "critical") for f in found)
    assert [f.step for f in found] == sorted(f.step for f in found)
    json.dumps([f.evidence for f in found], allow_nan=False)  # evidence is strict JSON


def test_healthy_run_raises_nothing_however_it_is_batched():
    run = healthy_run(500, n_layers=6, seed=7)
    assert run_engine(run) == []
    assert run_engine(run, cuts=[1, 2, 3, 64, 65, 300], reload_state=True) == []


@pytest.mark.parametrize(("seed", "n_layers"), [(0, 4), (1, 4), (2, 15)])  # 45 tensors: packed arrays
def test_state_round_trip_with_arbitrary_cuts_matches_one_pass(seed, n_layers):
    run = faulty_run(n_layers)
    one_pass = full(run_engine(run))
    rng = np.random.default_rng(seed)
    cuts = sorted(set(rng.integers(1, 400, size=12).tolist()) | {101, 301})
    assert full(run_engine(run, cuts=cuts, reload_state=True)) == one_pass
    assert full(run_engine(run, cuts=list(range(1, 400)), reload_state=False)) == one_pass


def test_state_is_strict_json_with_non_finite_values_and_checks_its_tensors():
    run = faulty_run()
    run.stats["amax"][319, 0] = np.nan
    engine = DetectorEngine(DetectorConfig(), run.tensors, {"margin": 1})
    engine.process(run.batch(0, 320))
    state = engine.state_dict()
    text = json.dumps(state, allow_nan=False)
    assert '"NaN"' in text or '"Infinity"' in text
    again = DetectorEngine(DetectorConfig(), run.tensors, None, state=json.loads(text))
    assert again.recipe == engine.recipe == {"margin": 1, "overrides": {}}
    assert json.dumps(again.state_dict(), allow_nan=False) == text
    with pytest.raises(ValueError, match="tensors"):
        DetectorEngine(DetectorConfig(), run.tensors[:-3], None, state=state)


def test_replayed_and_backward_steps_are_ignored():
    run = faulty_run()
    one_pass = full(run_engine(run))
    engine = DetectorEngine(DetectorConfig(), run.tensors, None)
    found = engine.process(run.batch(0, 200))
    found += engine.process(run.batch(100, 300))  # a spool replay overlapping what was seen
    assert engine.process(run.batch(0, 50)) == []  # entirely old
    found += engine.process(run.batch(250, 400))
    assert full(found) == one_pass


def test_unordered_or_duplicate_steps_within_a_batch_do_not_crash():
    run = healthy_run(20, n_layers=1)
    batch = run.batch(0, 6)
    batch.steps = np.array([3, 4, 4, 2, 5, 5])
    engine = DetectorEngine(DetectorConfig(), run.tensors, None)
    assert engine.process(batch) == []
    assert engine.last_step == 5
    assert engine.process(StepBatch(steps=np.zeros(0, dtype=np.int64))) == []


def test_missing_columns_and_wrong_shapes():
    run = healthy_run(50, n_layers=2)
    engine = DetectorEngine(DetectorConfig(), run.tensors, None)
    batch = run.batch(0, 10)
    del batch.stats["overflow"], batch.stats["scale"]
    batch.scalars.clear()
    assert engine.process(batch) == []
    bad = run.batch(10, 20)
    bad.stats["amax"] = bad.stats["amax"][:, :-1]
    with pytest.raises(ValueError, match="amax"):
        engine.process(bad)


def test_layers_with_fp8_off_are_not_watched():
    run = healthy_run(100, n_layers=2)
    run.stats["amax"][:, 3:6] = np.nan  # layer 1 runs in high precision: no statistics
    found = run_engine(run, recipe={"overrides": {"blocks.1.fc": {"fp8_enabled": False}}})
    assert found == []
    assert {f.tensor_index for f in run_engine(run)} == {3, 4, 5}


def test_gaps_in_tensor_indices():
    run = healthy_run(60, n_layers=2)
    tensors = [t for t in run.tensors if t.index != 1]  # index 1 unregistered: its column is ignored
    run.stats["nonfinite"][30, 1] = 5
    run.stats["nonfinite"][40, 4] = 5
    engine = DetectorEngine(DetectorConfig(), tensors, None)
    assert keys(engine.process(run.batch())) == [("nonfinite", 4, 40, "critical")]
    assert [layer["layer"] for layer in engine.layer_health([])][0] == "blocks.1.fc"


def test_client_events():
    run = healthy_run(10, n_layers=2)
    engine = DetectorEngine(DetectorConfig(), run.tensors, None)
    events = [
        {"kind": "loss_spike", "step": 7, "details": {"loss": 9.5, "z": 8.1}},
        {"kind": "nonfinite", "step": 8, "details": {"tensor": "blocks.1.fc.grad_output"}},
        {"kind": "nonfinite", "step": 9, "details": {"tensor_index": 0}},
        {"kind": "custom", "step": 9, "details": {"note": "lr warmup done"}},
        {"kind": "custom", "step": 9, "details": {"alert": True, "kind": "overflow_burst",
                                                  "severity": "critical", "message": "my check",
                                                  "tensor_index": 1}},
        {"kind": "custom", "step": 9, "details": {"alert": True, "kind": "not-a-kind"}},
        {"kind": "loss_spike"},  # no step: skipped
        {"kind": "nonfinite", "step": "x"},
    ]  # fmt: skip
    found = engine.process_events(events)
    assert keys(found) == [
        ("loss_spike", None, 7, "warning"),
        ("nonfinite", 5, 8, "critical"),
        ("nonfinite", 0, 9, "critical"),
        ("overflow_burst", 1, 9, "critical"),
    ]
    assert found[0].evidence == {"source": "client", "details": {"loss": 9.5, "z": 8.1}}
    assert "blocks.1.fc.grad_output" in found[1].message and found[3].message == "my check"


def test_a_client_loss_spike_on_a_loss_the_engine_scored_is_not_a_second_verdict():
    run = healthy_run(40, n_layers=1)
    engine = DetectorEngine(DetectorConfig(), run.tensors, None)
    engine.process(run.batch(0, 15))  # 14 residuals: too few to score these losses
    spike = {"kind": "loss_spike", "details": {"loss": 9.5, "z": 8.1}}
    assert keys(engine.process_events([{**spike, "step": 12}])) == [("loss_spike", None, 12, "warning")]
    engine.process(run.batch(15, 40))  # steps 21..39 scored (quiet): the engine's verdict stands
    assert engine.process_events([{**spike, "step": 30}]) == []
    assert keys(engine.process_events([{**spike, "step": 45}])) == [("loss_spike", None, 45, "warning")]


def test_config_is_validated_and_serialisable():
    config = DetectorConfig(loss_window=100, loss_z_threshold=5.0)
    assert DetectorConfig.model_validate_json(config.model_dump_json()) == config
    for bad in ({"loss_min_history": 60}, {"loss_z_threshold": -1}, {"overflow_jump_frac": 1e-4},
                {"loss_z_critical": 3.0}, {"stall_seconds": 0}, {"no_such_field": 1}):  # fmt: skip
        with pytest.raises(ValidationError):
            DetectorConfig(**bad)


def test_check_stalled():
    config = DetectorConfig(stall_seconds=120)
    last = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    assert check_stalled(last, last + timedelta(seconds=119), config) is None
    found = check_stalled(last, last + timedelta(seconds=121), config, last_step=4200)
    assert (found.kind, found.tensor_index, found.step, found.severity) == ("stalled", None, 4200, "warning")
    assert "121" in found.message and found.evidence["silent_seconds"] == 121
    naive = datetime(2026, 1, 1, 12, 0)  # naive datetimes are UTC
    late = check_stalled(naive, last + timedelta(hours=1), config)
    assert late.severity == "critical" and late.step == -1
    json.dumps(late.evidence, allow_nan=False)
