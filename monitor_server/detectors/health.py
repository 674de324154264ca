"""Per-layer health summary, ranked worst first, with the reasons a layer is flagged."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fp8_protocol.codec import encode_float
from fp8_protocol.tensors import TensorInfo

from .nonfinite import forward_backward_order
from .types import Finding

SEVERITY_RANK = {"ok": 0, "info": 1, "warning": 2, "critical": 3}
SEVERITY_WEIGHT = {"info": 1.0, "warning": 10.0, "critical": 100.0}
#: per-tensor saturation facts (`saturation_state`)
SATURATION_STATES = ("unknown", "none", "at_max", "clipping", "saturating")


@dataclass
class TensorSnapshot:
    """Latest per-tensor values the engine keeps; all (T,) arrays indexed by tensor index."""

    last_amax: np.ndarray
    last_scale: np.ndarray
    fp8_max: np.ndarray
    fp8_rounding: np.ndarray  # where a scaled value saturates (types.FP8_ROUNDING_THRESHOLD)
    overflow_total: np.ndarray
    underflow_total: np.ndarray
    nonfinite_total: np.ndarray
    growth_log2: np.ndarray  # latest amax growth over the divergence window (NaN before it is known)
    margin: np.ndarray
    window: np.ndarray
    divergence_log2: np.ndarray  # (T,) the divergence tolerance of each tensor (grad_output's is wider)
    saturation_log2: float
    warming_up: np.ndarray  # (T,) bool: the tensor's amax history has not filled yet
    sqnr_db: np.ndarray | None = None  # (T,) latest SQNR in dB (NaN: none, the run sends no quality columns)
    sqnr_level_db: np.ndarray | None = None  # (T,) its recent level (the SQNR-drop detector's median)
    # (T,) bool: the latest step with an SQNR verdict had no finite element (NaN there: nothing was measured)
    sqnr_nonfinite: np.ndarray | None = None


def headroom_log2(amax: np.ndarray, scale: np.ndarray, fp8_max: np.ndarray) -> np.ndarray:
    """``log2(FP8_MAX / (amax * scale))``: <0 means the tensor saturates; +inf for amax 0; NaN if unknown."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.log2(fp8_max / (amax * scale))


def saturation_state(head: np.ndarray, fp8_max: np.ndarray, fp8_rounding: np.ndarray, saturation_log2: float):
    """Per tensor, what its headroom says (one of SATURATION_STATES):

    - ``none``: amax * scale within the FP8 max (headroom >= 0);
    - ``at_max``: above the max but below the rounding threshold (464 for e4m3, 61440 for e5m2), so it
      rounds to the max and nothing is lost: delayed scaling with margin 0 when the amax repeats its history
      maximum. The recipe working as designed, not saturation;
    - ``clipping``: above the rounding threshold, by less than 2**saturation_log2: the largest elements
      saturate (an amax slightly above the history maximum);
    - ``saturating``: more than that;
    - ``unknown``: no finite headroom yet.
    """
    lossless = np.log2(fp8_max / fp8_rounding)  # about -0.05 (e4m3), -0.10 (e5m2)
    state = np.full(head.shape, "unknown", dtype=object)
    with np.errstate(invalid="ignore"):
        state[head >= 0] = "none"
        state[(head < 0) & (head >= lossless)] = "at_max"
        state[(head < lossless) & (head >= -saturation_log2)] = "clipping"
        state[head < -saturation_log2] = "saturating"
    return state


def layer_health(
    tensors: list[TensorInfo], snap: TensorSnapshot, open_alerts: list[dict]
) -> list[dict[str, Any]]:
    """Rank layers worst first.

    A layer's reasons, each with a severity: an open alert on one of its tensors (the alert's severity);
    non-finite values seen (critical); a ``saturating`` tensor (`saturation_state`: amax * scale well above
    the FP8 max; warning, diverging; info while the tensor is still in its warm-up); a ``clipping`` one
    (info: delayed scaling with margin 0 clips the largest elements when amax reaches a new high); amax
    growth beyond margin + divergence_log2 over the delayed-scaling window (warning, diverging; info in
    warm-up). ``at_max`` (amax * scale rounds to the FP8 max, nothing lost) is no reason: it stays a
    per-tensor fact (``saturation``). Any open alert also marks the layer diverging.
    severity = the worst reason ("ok" if none); score = sum of reason weights (info 1,
    warning 10, critical 100) plus a small term for the least headroom, so healthy layers rank by headroom.
    Ranked by severity, then by the onset of the layer's earliest open alert (its step, then its tensor's
    forward-then-backward position, the incidents' root-cause order: where a NaN spreads to every layer, the
    layer it started in comes first, not the one with the most alerts), then by score.
    Alerts without a tensor (loss_spike, stalled) belong to no layer and are ignored here.
    ``sqnr_db`` is the layer's worst (lowest) latest tensor SQNR in dB, None when none of its tensors has
    one (a run without the quality columns), NaN when one of them had no finite element in its latest
    step (a tensor gone all NaN: its last finite SQNR would read as a healthy quantization).
    """
    view = _TensorView.of(tensors, snap)
    alerts = _alerts_by_tensor(open_alerts, len(tensors))
    ranked = []
    for order, (layer, idx) in enumerate(_layers(tensors).items()):
        verdict = _LayerVerdict()
        for i in idx:
            verdict.add_alerts(alerts.get(i, []), tensors[i].name, float(view.position[i]))
            verdict.add_tensor_facts(i, tensors[i].name, snap, view)
        ranked.append((_layer_entry(layer, idx, tensors, snap, view, verdict), verdict.onset, order))
    ranked.sort(key=lambda r: (-SEVERITY_RANK[r[0]["severity"]], r[1], -r[0]["score"], r[2]))
    return [entry for entry, _, _ in ranked]


@dataclass
class _TensorView:
    """What `layer_health` works out once for every tensor (all (T,) arrays by tensor index) before it
    walks the layers: the headroom and saturation state, the SQNR columns with their defaults for a run
    that sends none, and each tensor's forward-then-backward position."""

    head: np.ndarray
    sat: np.ndarray
    sqnr: np.ndarray
    sqnr_level: np.ndarray
    dead: np.ndarray  # bool: the latest step with an SQNR verdict had no finite element
    position: np.ndarray

    @classmethod
    def of(cls, tensors: list[TensorInfo], snap: TensorSnapshot) -> _TensorView:
        n = len(tensors)
        head = headroom_log2(snap.last_amax, snap.last_scale, snap.fp8_max)
        position = np.empty(n, dtype=np.int64)
        position[forward_backward_order(tensors)] = np.arange(n)
        return cls(
            head=head,
            sat=saturation_state(head, snap.fp8_max, snap.fp8_rounding, snap.saturation_log2),
            sqnr=snap.sqnr_db if snap.sqnr_db is not None else np.full(n, np.nan),
            sqnr_level=snap.sqnr_level_db if snap.sqnr_level_db is not None else np.full(n, np.nan),
            dead=snap.sqnr_nonfinite if snap.sqnr_nonfinite is not None else np.zeros(n, dtype=bool),
            position=position,
        )


def _layers(tensors: list[TensorInfo]) -> dict[str, list[int]]:
    """Layer name -> its tensors' indices, layers in the order their first tensor comes (the tie-break of
    the ranking); a tensor without a layer is in none."""
    layers: dict[str, list[int]] = {}
    for i, meta in enumerate(tensors):
        if meta.layer:
            layers.setdefault(meta.layer, []).append(i)
    return layers


def _alerts_by_tensor(open_alerts: list[dict], n: int) -> dict[int, list[dict]]:
    """The open alerts by the tensor they name; one without a valid tensor index belongs to no layer."""
    by_tensor: dict[int, list[dict]] = {}
    for alert in open_alerts:
        t = alert.get("tensor_index")
        if isinstance(t, int) and 0 <= t < n:
            by_tensor.setdefault(t, []).append(alert)
    return by_tensor


@dataclass
class _LayerVerdict:
    """A layer's reasons as its tensors are read, whether it diverges, and the onset of its earliest open
    alert (step, forward-then-backward position: inf while it has none)."""

    reasons: list[tuple[str, str]] = field(default_factory=list)  # (severity, text)
    diverging: bool = False
    onset: tuple[float, float] = (np.inf, np.inf)

    @property
    def severity(self) -> str:
        """The worst reason's severity; "ok" without reasons."""
        return max((sev for sev, _ in self.reasons), key=SEVERITY_RANK.__getitem__, default="ok")

    def add_alerts(self, alerts: list[dict], name: str, position: float) -> None:
        """An open alert on tensor `name`: a reason of the alert's severity, and the layer diverges."""
        for a in alerts:
            step = a.get("onset_step", a.get("first_step"))
            if isinstance(step, int | float):
                self.onset = min(self.onset, (float(step), position))
            sev = a.get("severity") if a.get("severity") in SEVERITY_WEIGHT else "warning"
            self.reasons.append(
                (
                    sev,
                    f"open {a.get('kind')} alert on {name} (steps {a.get('first_step')}-"
                    f"{a.get('last_step')}, {a.get('count', 1)}x): {a.get('message', '')}",
                )
            )
            self.diverging = True

    def add_tensor_facts(self, i: int, name: str, snap: TensorSnapshot, view: _TensorView) -> None:
        """Tensor `i`'s own reasons: non-finite values, saturation or clipping, amax growth beyond what
        history and margin cover (the last two only info, and not diverging, during its warm-up)."""
        nonfinite = snap.nonfinite_total[i]
        if nonfinite > 0:
            self.reasons.append(("critical", f"{name}: {nonfinite:.0f} non-finite values so far"))
        h, warm = view.head[i], bool(snap.warming_up[i])
        during = " (warm-up: the amax history has not filled yet)" if warm else ""
        if view.sat[i] == "saturating":
            self.reasons.append(
                (
                    "info" if warm else "warning",
                    f"{name} saturates: headroom 2^{h:.2f} (amax * scale above the FP8 "
                    f"max {snap.fp8_max[i]:g}){during}",
                )
            )
            self.diverging |= not warm
        elif view.sat[i] == "clipping":
            self.reasons.append(("info", f"{name} clips its largest elements: headroom 2^{h:.2f}{during}"))
        g, cover = snap.growth_log2[i], snap.margin[i] + snap.divergence_log2[i]
        if g > cover:
            self.reasons.append(
                (
                    "info" if warm else "warning",
                    f"amax of {name} grew 2^{g:.2f}x over the last {snap.window[i]} steps, "
                    f"more than history and margin cover (2^{cover:g}){during}",
                )
            )
            self.diverging |= not warm


def _layer_entry(
    layer: str,
    idx: list[int],
    tensors: list[TensorInfo],
    snap: TensorSnapshot,
    view: _TensorView,
    verdict: _LayerVerdict,
) -> dict[str, Any]:
    """A layer's answer: its severity, its score (the reasons' weights plus a small term for the least
    headroom, so healthy layers rank by headroom), its reasons worst first, its worst SQNR and its tensors."""
    finite_head = view.head[idx][np.isfinite(view.head[idx])]
    least = float(finite_head.min()) if finite_head.size else 16.0
    score = sum(SEVERITY_WEIGHT[sev] for sev, _ in verdict.reasons) + 0.001 * float(
        np.clip(16.0 - least, 0.0, 32.0)
    )
    reasons = sorted(verdict.reasons, key=lambda r: -SEVERITY_RANK[r[0]])
    known = view.sqnr[idx][~np.isnan(view.sqnr[idx])]
    gone = view.dead[idx].any()  # a tensor with nothing finite left: no SQNR to report, and worse than any
    return {
        "layer": layer,
        "severity": verdict.severity,
        "score": score,
        "diverging": verdict.diverging,
        "reasons": [text for _, text in reasons],
        "sqnr_db": "NaN" if gone else encode_float(known.min()) if known.size else None,
        "tensors": [_tensor_entry(tensors[i], i, snap, view) for i in idx],
    }


def _tensor_entry(meta: TensorInfo, i: int, snap: TensorSnapshot, view: _TensorView) -> dict[str, Any]:
    """One tensor's latest values in its layer's answer."""
    return {
        "index": meta.index,
        "name": meta.name,
        "role": meta.role,
        "last_amax": encode_float(snap.last_amax[i]),
        "last_scale": encode_float(snap.last_scale[i]),
        "headroom_log2": encode_float(view.head[i]),
        "saturation": str(view.sat[i]),
        "warming_up": bool(snap.warming_up[i]),
        "amax_growth_log2": encode_float(snap.growth_log2[i]),
        "overflow_total": encode_float(snap.overflow_total[i]),
        "underflow_total": encode_float(snap.underflow_total[i]),
        "nonfinite_total": encode_float(snap.nonfinite_total[i]),
        "sqnr_db": "NaN" if view.dead[i] else None if np.isnan(view.sqnr[i]) else encode_float(view.sqnr[i]),
        "sqnr_level_db": None if np.isnan(view.sqnr_level[i]) else encode_float(view.sqnr_level[i]),
    }


def findings_as_open_alerts(findings: list[Finding]) -> list[dict]:
    """Fold findings into open-alert dicts the way the API layer does (one per kind and tensor); for tests."""
    alerts: dict[tuple[str, int | None], dict] = {}
    for f in findings:
        a = alerts.setdefault(
            (f.kind, f.tensor_index),
            {
                "kind": f.kind,
                "tensor_index": f.tensor_index,
                "severity": f.severity,
                "first_step": f.step,
                "last_step": f.step,
                "count": 0,
                "message": f.message,
            },
        )
        a["last_step"], a["count"] = max(a["last_step"], f.step), a["count"] + 1
        if SEVERITY_RANK[f.severity] > SEVERITY_RANK[a["severity"]]:
            a["severity"], a["message"] = f.severity, f.message
    return list(alerts.values())
