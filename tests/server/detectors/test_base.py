"""The detectors' base: every registered detector's state round-trips whole, the stored layout is the one
persisted runs hold, and the engine runs and persists every registered detector, in order."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from monitor_server.detectors import base
from monitor_server.detectors.base import BatchView, Detector, array_state, registered, value_state
from monitor_server.detectors.engine import DetectorConfig, DetectorEngine
from monitor_server.detectors.types import Finding
from tests.server.detectors.runs import faulty_run, healthy_run, index_of

CONFIG = DetectorConfig(warmup_steps=0)
KEYS = [cls.key for cls in registered()]

#: the keys of each part of the engine's state, as runs persisted before the base existed hold them: a
#: renamed state field changes the stored format and must come with a migration of the stored states
STORED_LAYOUT = {
    "summary": {"last_amax", "last_scale", "overflow_total", "underflow_total", "nonfinite_total"},
    "nonfinite": {"run", "fired", "loss_active", "first"},
    "loss": {"baseline", "resid", "steps", "loss", "active", "last_scored"},
    "scale_collapse": {"ring", "run", "fired", "fired_critical", "tail"},
    "overflow": {"run", "fired", "fired_critical", "tail"},
    "divergence": {"ring_q", "ring_ok", "run", "fired", "last_growth", "tail"},
    "underflow": {"run", "fired", "tail"},
    "sqnr_drop": {"ring", "run", "fired", "last_sqnr", "last_nonfinite", "level", "tail"},
}
#: fields added since, optional in a stored state (one persisted before them keeps the fresh value)
ADDED_SINCE = {("sqnr_drop", "last_nonfinite")}


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two detectors (or parts of them) differ: arrays by dtype, shape and values (NaN equal to NaN),
    objects by their attributes (those starting with "_" live within one batch and are skipped)."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, np.ndarray):
        same = a.dtype == b.dtype and a.shape == b.shape
        same = same and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        return [] if same else [f"{path}: arrays differ"]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float):
        return [] if a == b or (np.isnan(a) and np.isnan(b)) else [f"{path}: {a} != {b}"]
    if hasattr(a, "__dict__") and not isinstance(a, type):
        # dataclass fields (one left at its class-level default is not in vars) and every other attribute
        names = {f.name for f in dataclasses.fields(a)} if dataclasses.is_dataclass(a) else set()
        names |= set(vars(a)) | set(vars(b))
        public = sorted(n for n in names if not n.startswith("_"))
        return differences({n: getattr(a, n) for n in public}, {n: getattr(b, n) for n in public}, path)
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def processed_engine(stop: int) -> DetectorEngine:
    run = faulty_run()
    # critical episodes still open at step 105 too: an overflow jump and a broken scale
    run.stats["overflow"][104, index_of(run.tensors, 1, "weight")] = 0.05 * run.stats["numel"][104, 0]
    run.stats["scale"][103:107, index_of(run.tensors, 2, "weight")] = 0.0
    # a tensor with no finite element in the last step before the stop at 303 (no SQNR measured there)
    gone = index_of(run.tensors, 3, "input")
    run.stats["nonfinite"][302, gone] = run.stats["numel"][302, gone]
    run.stats["sum_sq"][302, gone] = run.stats["err_sq"][302, gone] = 0.0
    engine = DetectorEngine(CONFIG, run.tensors, None)
    engine.process(run.batch(0, stop // 2))
    engine.process(run.batch(stop // 2, stop))
    return engine


def restored(detector: Detector, state: dict) -> Detector:
    fresh = type(detector)(detector.config, detector.tensors)
    fresh.load_state_dict(json.loads(json.dumps(state, allow_nan=False)))
    return fresh


def test_the_registry_holds_the_detectors_in_the_order_of_their_findings_within_a_step():
    assert KEYS == ["nonfinite", "loss", "scale_collapse", "overflow", "divergence", "sqnr_drop", "underflow"]


# stops in an open overflow episode, an underflow one, a non-finite one (divergence rising), after a NaN loss
@pytest.mark.parametrize("stop", [105, 215, 303, 331])
@pytest.mark.parametrize("key", KEYS)
def test_every_registered_detector_round_trips_all_its_state(key, stop):
    detector = processed_engine(stop).detectors[key]
    assert differences(restored(detector, detector.state_dict()), detector) == []


def test_the_round_trip_runs_leave_every_state_field_changed():
    """The round trips above prove something only for fields that hold more than their fresh value."""
    unchanged = {(key, name) for key in KEYS for name, _ in base.state_fields(base.REGISTRY[key])}
    for stop in (105, 215, 303, 331):
        for key, detector in processed_engine(stop).detectors.items():
            fresh = type(detector)(detector.config, detector.tensors)
            for name, _ in base.state_fields(type(detector)):
                if differences(getattr(fresh, name), getattr(detector, name)):
                    unchanged.discard((key, name))
    assert unchanged == set()


def test_the_stored_layout_is_the_persisted_one():
    state = processed_engine(331).state_dict()
    assert set(state) == {"version", "n_tensors", "last_step", "amax_seen", "recipe", *STORED_LAYOUT}
    assert {key: set(state[key]) for key in STORED_LAYOUT} == STORED_LAYOUT
    for key in ("scale_collapse", "overflow", "divergence", "underflow", "sqnr_drop"):
        assert set(state[key]["tail"]) == {"steps", "values"}


def test_a_state_stored_before_the_added_fields_loads_with_their_fresh_values():
    engine = processed_engine(303)
    state = json.loads(json.dumps(engine.state_dict(), allow_nan=False))
    for key, name in ADDED_SINCE:
        del state[key][name]
    older = DetectorEngine(CONFIG, engine.tensors, None)
    older.load_state_dict(state)
    fresh = DetectorEngine(CONFIG, engine.tensors, None)
    for key, name in ADDED_SINCE:
        assert differences(getattr(older.detectors[key], name), getattr(fresh.detectors[key], name)) == []
        assert differences(getattr(engine.detectors[key], name), getattr(fresh.detectors[key], name)) != []


def test_state_left_undeclared_fails_the_round_trip():
    @dataclass(eq=False)
    class Counting(Detector):  # no key: not registered
        steps_seen: int = value_state(default=0)
        total: np.ndarray = array_state(np.float64)

        def __post_init__(self) -> None:
            self.total = np.zeros(len(self.tensors))
            self.batches = 0  # persistent, but not declared

        def observe(self, view: BatchView) -> list[Finding]:
            self.steps_seen += int(view.steps.size)
            self.batches += 1
            return []

    run = healthy_run(10, n_layers=1)
    engine = DetectorEngine(CONFIG, run.tensors, None)
    detector = Counting(CONFIG, engine.tensors)
    engine.detectors["counting"] = detector
    engine.process(run.batch(0, 10))
    assert detector.state_dict() == {"steps_seen": 10, "total": [0.0, 0.0, 0.0]}
    assert differences(restored(detector, detector.state_dict()), detector) == ["['batches']: 0 != 1"]


def test_the_engine_runs_and_persists_every_registered_detector(monkeypatch):
    monkeypatch.setattr(base, "REGISTRY", dict(base.REGISTRY))  # the class below registers into a copy

    @dataclass(eq=False)
    class Probe(Detector, key="probe", order=1_000):
        last_step: int | None = value_state(default=None)

        def observe(self, view: BatchView) -> list[Finding]:
            self.last_step = int(view.steps[-1])
            return [Finding(kind="stalled", step=self.last_step, severity="info", message="probe")]

    calls: list[str] = []

    def spy(cls: type[Detector]):
        observe = cls.observe

        def counted(self, view: BatchView) -> list[Finding]:
            calls.append(cls.key)
            return observe(self, view)

        return counted

    for cls in registered():
        monkeypatch.setattr(cls, "observe", spy(cls))
    run = faulty_run()
    engine = DetectorEngine(CONFIG, run.tensors, None)
    found = engine.process(run.batch(0, 50))
    assert calls == [*KEYS, "probe"]
    assert [f.step for f in found if f.message == "probe"] == [49]
    state = json.loads(json.dumps(engine.state_dict(), allow_nan=False))
    assert state["probe"] == {"last_step": 49}
    again = DetectorEngine(CONFIG, run.tensors, None, state=state)
    assert list(again.detectors) == [*KEYS, "probe"]
    for key, detector in engine.detectors.items():
        assert differences(again.detectors[key], detector) == [], key


def test_importing_the_engine_registers_the_detectors_of_every_module():
    code = """
import importlib, json, pkgutil
import monitor_server.detectors.engine
from monitor_server.detectors import base
before = [cls.key for cls in base.registered()]
package = importlib.import_module("monitor_server.detectors")
for module in pkgutil.iter_modules(package.__path__):
    importlib.import_module(f"monitor_server.detectors.{module.name}")
print(json.dumps([before, [cls.key for cls in base.registered()]]))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    before, after = json.loads(out.stdout)
    assert before == after == KEYS


def test_a_changed_window_length_restarts_that_window_and_keeps_the_rest():
    engine = processed_engine(303)
    state = json.loads(json.dumps(engine.state_dict(), allow_nan=False))
    config = CONFIG.model_copy(update={"divergence_window": 16, "scale_window": 4})
    again = DetectorEngine(config, engine.tensors, None, state=state)
    fresh = DetectorEngine(config, engine.tensors, None)
    for key, names in {"divergence": ("ring_q", "ring_ok"), "scale_collapse": ("ring",)}.items():
        detector, before = again.detectors[key], engine.detectors[key]
        for name in names:
            assert differences(getattr(detector, name), getattr(fresh.detectors[key], name)) == [], name
        assert differences(detector.run, before.run) == differences(detector.tail, before.tail) == []
