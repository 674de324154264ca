"""The detector engine the ingest path calls: incremental, vectorised over tensors, with JSON-able state.

Usage (API layer)::

    engine = DetectorEngine(DetectorConfig(), tensors, recipe, state=saved_state_or_None)
    findings = engine.process(batch) + engine.process_events(batch_events)
    saved_state = engine.state_dict()          # json.dumps-able (~300 kB for 512 tensors); restores exactly
    engine.set_recipe(recipe_in_force)         # after a recipe command was applied (see `recipe.py`)
    layers = engine.layer_health(open_alerts)  # ranked worst first

Conventions:

- Steps already processed (``<= the last processed step``, e.g. a spool replay) are skipped by every
  detector; a batch may mix old and new steps.
- Persistent conditions fire once per *episode* (consecutive steps in which the condition holds), at the
  step the detector's rule first holds, so an open alert is updated when the problem recurs, not every step.
  Overflow bursts and scale collapses fire once more if an episode escalates from warning to critical.
- Findings come out ordered by step; within a step in the registered detectors' ``order`` (``base.py``):
  nonfinite (in forward-then-backward order), loss_spike, scale_collapse, overflow_burst, amax_divergence,
  sqnr_drop, underflow_excess.
- A NaN loss counts as non-finite only where ``batch.present["loss"]`` says the step carried a loss (types.py
  documents NaN as "missing" otherwise); an infinite loss always counts.
- Tensors of layers with FP8 turned off in the recipe are ignored by the tensor detectors.
- Warm-up grace: a tensor's overflow, underflow, divergence and scale-drop findings wait until it has
  reported `warmup_len` steps with a non-zero finite amax (see `recipe.warmup_len`); a zero amax (a layer
  that did not run) does not count, as it does not enter the amax history. Non-finite values always alert.
- Client events (`process_events`): ``loss_spike`` -> a loss_spike finding (warning) unless the engine has
  scored that step's loss itself, with enough history (the client sends a step before the events about it;
  the server's rule detrends the loss, the client's does not, and two rules must not give two verdicts),
  ``nonfinite`` -> a
  nonfinite finding (critical; details may name ``tensor_index`` or ``tensor``), ``custom`` -> nothing unless
  ``details["alert"] is True`` and ``details["kind"]`` is one of ALERT_KINDS (then that kind, with
  ``details["severity"]`` / ``details["message"]`` if given), ``rank_amax`` -> a rank_divergence finding per
  tensor on which one data-parallel rank's amax disagrees with the others' (``ranks.py``). Malformed events
  are skipped, never raised.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8_protocol.client_events import parse_rank_amax
from fp8_protocol.codec import jsonable
from fp8_protocol.stats import FP8_MAX
from fp8_protocol.tensors import TensorInfo
from monitor_server.core.detector_config import DetectorConfig
from monitor_server.infra.wire import details_summary

from .base import BatchView, Detector, Stateful, array_state, registered
from .health import TensorSnapshot, layer_health
from .ranks import rank_divergence
from .recipe import merge_recipe, per_tensor, split_recipe
from .stall import check_stalled
from .state import decode_array, encode_array
from .types import ALERT_KINDS, FP8_ROUNDING_THRESHOLD, SEVERITIES, Finding, StepBatch

__all__ = ["DetectorConfig", "DetectorEngine", "check_stalled"]

log = logging.getLogger(__name__)
STATE_VERSION = 1
#: the longest message a client alert keeps (a `custom` event's `message`)
CLIENT_MESSAGE_CHARS = 500


def _dense(tensors: list[TensorInfo]) -> list[TensorInfo]:
    """Tensors by index, gaps filled with placeholders (layer "" so they belong to no layer)."""
    n = max((t.index for t in tensors), default=-1) + 1
    out: list[TensorInfo | None] = [None] * n
    for t in tensors:
        out[t.index] = t
    return [
        t or TensorInfo(index=i, name=f"tensor[{i}]", layer="", role="input", format="e4m3")
        for i, t in enumerate(out)
    ]


@dataclass(eq=False)
class TensorSummary(Stateful):
    """Running per-tensor values for layer health; all (T,) float64, indexed by tensor index."""

    n: int
    last_amax: np.ndarray = array_state(np.float64)
    last_scale: np.ndarray = array_state(np.float64)
    overflow_total: np.ndarray = array_state(np.float64)
    underflow_total: np.ndarray = array_state(np.float64)
    nonfinite_total: np.ndarray = array_state(np.float64)

    def __post_init__(self) -> None:
        self.last_amax = np.full(self.n, np.nan)
        self.last_scale = np.full(self.n, np.nan)
        self.overflow_total = np.zeros(self.n)
        self.underflow_total = np.zeros(self.n)
        self.nonfinite_total = np.zeros(self.n)


def client_evidence(event: dict, details: dict) -> dict[str, Any]:
    """A client alert's evidence: the event's details when they are their own summary, else the summary
    (`monitor_server.infra.wire.details_summary`), marked incomplete, with the event's id when it has one (its
    whole details are at ``GET /runs/{id}/events/{event_id}``): an alert never holds a flight recorder."""
    summary = details_summary(details)
    evidence: dict[str, Any] = {"source": "client", "details": summary}
    if summary != details:
        evidence["details_complete"] = False
        if isinstance(event.get("id"), int):
            evidence["event_id"] = event["id"]
    return jsonable(evidence)


class DetectorEngine:
    """All detectors of one run: every registered detector (`base.registered`), in their order. See the
    module docstring for the conventions and each detector's class docstring (or `DetectorConfig`) for its
    rule and thresholds.

    Args:
        config: thresholds.
        tensors: the run's registered tensors (stats columns are indexed by `TensorInfo.index`).
        recipe: the run's scaling recipe (see `recipe.py`); None means the defaults (margin 0, history 1024).
        state: a previous `state_dict()`; the recipe saved in it (with any `set_recipe` / `update_recipe`
            changes) replaces `recipe`; call `set_recipe` afterwards if the caller's copy is the truth.
    """

    def __init__(
        self,
        config: DetectorConfig,
        tensors: list[TensorInfo],
        recipe: dict | None,
        state: dict | None = None,
    ) -> None:
        self.config = config
        self.tensors = _dense(tensors)
        self.by_name = {t.name: t.index for t in tensors}
        self.registered = np.zeros(len(self.tensors), dtype=bool)
        self.registered[[t.index for t in tensors]] = True
        n = len(self.tensors)
        self.fp8_max = np.array([FP8_MAX.get(t.format, FP8_MAX["e4m3"]) for t in self.tensors])
        self.fp8_rounding = np.array(
            [FP8_ROUNDING_THRESHOLD.get(t.format, FP8_ROUNDING_THRESHOLD["e4m3"]) for t in self.tensors]
        )
        self._base: dict[str, Any] = {}
        self._overrides: dict[str, dict[str, Any]] = {}
        self.set_recipe(recipe)
        self.detectors: dict[str, Detector] = {cls.key: cls(config, self.tensors) for cls in registered()}
        self.last_step: int | None = None
        self.amax_seen = np.zeros(n, dtype=np.int64)  # steps with a non-zero finite amax, per tensor
        self.summary = TensorSummary(n)
        if state is not None:
            self.load_state_dict(state)

    # ---- recipe -------------------------------------------------------------------------------------------
    def set_recipe(self, recipe: dict | None) -> None:
        """Replace the recipe in force with `recipe` (whole-model keys plus optional ``"overrides": {layer:
        {...}}``, as the constructor takes it); None means the defaults. Pass the whole effective recipe."""
        self._apply_recipe(*split_recipe(recipe))

    def update_recipe(self, change: dict | None) -> None:
        """Merge a partial change into the recipe in force: whole-model keys replace theirs, ``"overrides":
        {layer: {...} | None}`` merges into (or with None removes) that layer's override; None resets."""
        self._apply_recipe(*merge_recipe(self._base, self._overrides, change))

    def _apply_recipe(self, base: dict[str, Any], overrides: dict[str, dict[str, Any]]) -> None:
        self._base, self._overrides = base, overrides
        self.margin, self.window, self.enabled, self.warmup = per_tensor(
            self.tensors, self._base, self._overrides, self.config
        )
        self.enabled &= self.registered  # placeholders for unregistered indices are never watched

    @property
    def recipe(self) -> dict[str, Any]:
        """The recipe in force: whole-model keys plus ``"overrides"``."""
        return {**self._base, "overrides": {k: dict(v) for k, v in self._overrides.items()}}

    # ---- processing ---------------------------------------------------------------------------------------
    def process(self, batch: StepBatch) -> list[Finding]:
        """Run every detector over the batch's new steps; returns findings ordered by step."""
        parts = batch.segments()
        if parts[0] is not batch:  # steps without statistics feed the scalar detectors only, in step order
            return [f for part in parts for f in self.process(part)]
        steps = np.asarray(batch.steps, dtype=np.int64).reshape(-1)
        if steps.size == 0:
            return []
        floor = np.iinfo(np.int64).min if self.last_step is None else self.last_step
        seen = np.concatenate([[floor], np.maximum.accumulate(steps)[:-1]])
        seen = np.maximum(seen, floor)
        rows = np.flatnonzero(steps > seen)
        if rows.size == 0:
            return []
        steps = steps[rows]
        n = len(self.tensors)
        cols = {name: self._column(batch, name, rows, n) for name in batch.stats}
        amax, scale = cols.get("amax"), cols.get("scale")
        overflow, underflow, nonfinite = cols.get("overflow"), cols.get("underflow"), cols.get("nonfinite")
        enabled = self.enabled[None, :]
        loss = self._scalar(batch, "loss", rows)

        # nonfinite: counts > 0 or amax NaN/inf; the loss where the step carried one
        counts = np.nan_to_num(nonfinite, nan=0.0) if nonfinite is not None else np.zeros((steps.size, n))
        amax_bad = ~np.isfinite(amax) if amax is not None else np.zeros((steps.size, n), dtype=bool)
        bad = enabled & ((counts > 0) | amax_bad)
        present = batch.present.get("loss")
        if loss is None:
            loss_bad = np.zeros(steps.size, dtype=bool)
        elif present is not None:
            present = np.asarray(present, dtype=bool).reshape(-1)
            if present.shape[0] != len(batch.steps):
                raise ValueError(
                    f"present['loss'] has {present.shape[0]} values for {len(batch.steps)} steps"
                )
            loss_bad = present[rows] & ~np.isfinite(loss)
        else:
            loss_bad = np.isinf(loss)
        # warm-up grace: watched once the amax history has filled (steps before this one, per tensor)
        if amax is not None:
            usable = np.isfinite(amax) & (amax > 0)
            seen_before = self.amax_seen[None, :] + np.cumsum(usable, axis=0) - usable
            self.amax_seen += usable.sum(axis=0)
        else:
            seen_before = np.broadcast_to(self.amax_seen, (steps.size, n))
        watched = enabled & (seen_before >= self.warmup[None, :])
        view = BatchView(
            steps=steps,
            stats=cols,
            loss=loss,
            bad=bad,
            loss_bad=loss_bad,
            nonfinite=counts,
            enabled=enabled,
            watched=watched,
            margin=self.margin,
            window=self.window,
        )
        findings = [f for detector in self.detectors.values() for f in detector.observe(view)]

        # running per-tensor summary for layer health
        summary = self.summary
        if amax is not None:
            summary.last_amax = amax[-1].copy()
        if scale is not None:
            summary.last_scale = scale[-1].copy()
        if overflow is not None:
            summary.overflow_total += np.nansum(overflow, axis=0)
        if underflow is not None:
            summary.underflow_total += np.nansum(underflow, axis=0)
        summary.nonfinite_total += np.maximum(counts, amax_bad).sum(axis=0)
        self.last_step = int(steps[-1])
        findings.sort(key=lambda f: f.step)  # stable: keeps the per-step order documented above
        return findings

    @staticmethod
    def _column(batch: StepBatch, name: str, rows: np.ndarray, n: int) -> np.ndarray:
        col = np.asarray(batch.stats[name], dtype=np.float64)
        if col.ndim != 2 or col.shape[0] != len(batch.steps) or col.shape[1] != n:
            raise ValueError(
                f"stats column {name!r} has shape {col.shape}, expected ({len(batch.steps)}, {n})"
            )
        return col[rows]

    @staticmethod
    def _scalar(batch: StepBatch, name: str, rows: np.ndarray) -> np.ndarray | None:
        if name not in batch.scalars:
            return None
        col = np.asarray(batch.scalars[name], dtype=np.float64).reshape(-1)
        if col.shape[0] != len(batch.steps):
            raise ValueError(f"scalar {name!r} has {col.shape[0]} values for {len(batch.steps)} steps")
        return col[rows]

    def process_events(self, events: list[dict]) -> list[Finding]:
        """Client-reported events as findings (see the module docstring for the mapping)."""
        findings = []
        for event in events:
            try:
                finding = self._event(event)
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                log.debug("skipping malformed event %r: %s", event, exc)
                continue
            if isinstance(finding, list):
                findings.extend(finding)
            elif finding is not None:
                findings.append(finding)
        return findings

    def _event(self, event: dict) -> Finding | list[Finding] | None:
        kind, step = event.get("kind"), int(event["step"])
        details = event.get("details") or {}
        if not isinstance(details, dict):
            details = {"value": details}
        severity = details.get("severity")
        evidence = client_evidence(event, details)
        if kind == "loss_spike":
            last_scored = self.detectors["loss"].last_scored
            if last_scored is not None and step <= last_scored:
                return None  # the engine scored this loss itself (see the module docstring)
            loss = details.get("loss")
            extra = f" (loss {loss})" if loss is not None else ""
            return Finding(
                kind="loss_spike",
                step=step,
                severity=severity if severity in SEVERITIES else "warning",
                message=f"client reported a loss spike at step {step}{extra}",
                evidence=evidence,
            )
        if kind == "nonfinite":
            t = self._tensor_ref(details)
            where = f" in {self.tensors[t].name}" if t is not None else ""
            return Finding(
                kind="nonfinite",
                step=step,
                severity="critical",
                tensor_index=t,
                message=f"client reported non-finite values{where} at step {step}",
                evidence=evidence,
            )
        if kind == "rank_amax":
            amax = parse_rank_amax(details, len(self.tensors))
            return rank_divergence(amax, self.tensors, step, self.config.rank_divergence_log2, ~self.enabled)
        if kind == "custom" and details.get("alert") is True and details.get("kind") in ALERT_KINDS:
            t = self._tensor_ref(details)
            msg = details.get("message")
            msg = msg[:CLIENT_MESSAGE_CHARS] if isinstance(msg, str) else f"client alert at step {step}"
            return Finding(
                kind=details["kind"],
                step=step,
                tensor_index=t,
                severity=severity if severity in SEVERITIES else "warning",
                message=msg,
                evidence=evidence,
            )
        return None

    def _tensor_ref(self, details: dict) -> int | None:
        t = details.get("tensor_index")
        if isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(self.tensors):
            return t
        return self.by_name.get(details.get("tensor")) if isinstance(details.get("tensor"), str) else None

    # ---- summaries ----------------------------------------------------------------------------------------
    def layer_health(self, open_alerts: list[dict]) -> list[dict]:
        """Per-layer health, worst first (see `health.layer_health`)."""
        summary, divergence, sqnr = self.summary, self.detectors["divergence"], self.detectors["sqnr_drop"]
        snap = TensorSnapshot(
            last_amax=summary.last_amax,
            last_scale=summary.last_scale,
            fp8_max=self.fp8_max,
            fp8_rounding=self.fp8_rounding,
            overflow_total=summary.overflow_total,
            underflow_total=summary.underflow_total,
            nonfinite_total=summary.nonfinite_total,
            growth_log2=divergence.last_growth,
            margin=self.margin,
            window=self.window,
            divergence_log2=divergence.tol,
            saturation_log2=self.config.saturation_log2,
            warming_up=self.amax_seen < self.warmup,
            sqnr_db=sqnr.last_sqnr,
            sqnr_nonfinite=sqnr.last_nonfinite,
            sqnr_level_db=sqnr.level,
        )
        return layer_health(self.tensors, snap, open_alerts)

    # ---- state --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (non-finite floats as "NaN" / "Infinity" / "-Infinity"): the engine's own,
        then each detector's under its key."""
        return {
            "version": STATE_VERSION,
            "n_tensors": len(self.tensors),
            "last_step": self.last_step,
            "amax_seen": encode_array(self.amax_seen),
            "recipe": {"base": self._base, "overrides": self._overrides},
            "summary": self.summary.state_dict(),
            **{key: detector.state_dict() for key, detector in self.detectors.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; raises ValueError if it belongs to another tensor list or version."""
        if state.get("version") != STATE_VERSION or state.get("n_tensors") != len(self.tensors):
            raise ValueError(
                f"detector state (version {state.get('version')}, {state.get('n_tensors')} tensors) "
                f"does not match this engine (version {STATE_VERSION}, {len(self.tensors)} tensors)"
            )
        self.last_step = state["last_step"]
        if "amax_seen" in state:
            self.amax_seen = decode_array(state["amax_seen"], np.int64)
        else:  # a state saved before warm-up grace existed: that run is past its warm-up
            self.amax_seen = np.full(len(self.tensors), np.iinfo(np.int32).max, dtype=np.int64)
        self._apply_recipe(dict(state["recipe"]["base"]), dict(state["recipe"]["overrides"]))
        self.summary.load_state_dict(state["summary"])
        for key, detector in self.detectors.items():
            if key in state:  # a detector added since the state was saved starts fresh
                detector.load_state_dict(state[key])
