"""Count-based per-tensor detectors: overflow bursts (saturation) and excess underflow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import BatchView, Detector, Stateful, array_state, nested_state
from .episodes import advance
from .per_tensor import by_role, firings
from .types import Finding

TAIL = 8  # evidence carries this many recent values of the series that fired


def fraction(count: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """count / numel, 0 where either is missing or numel is not positive."""
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = count / numel
    return np.where((numel > 0) & np.isfinite(frac), frac, 0.0)


def _f32(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # beyond float32 reads as inf in the tail; the evidence keeps float64
        return values.astype(np.float32)


@dataclass(eq=False)
class Tail(Stateful):
    """The last TAIL values of one series for every tensor, kept across batches so that a finding's
    evidence tail does not depend on where the run was cut into batches. Values are kept as float32
    (context for a human, and half the persisted state)."""

    n: int
    steps: np.ndarray = array_state(np.int64)
    values: np.ndarray = array_state(np.float32)

    def __post_init__(self) -> None:
        self.steps = np.zeros(0, dtype=np.int64)
        self.values = np.zeros((0, self.n), dtype=np.float32)
        # the last pushed batch, for `get` within that batch only
        self._batch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._ext: tuple[np.ndarray, np.ndarray] | None = None

    def push(self, steps: np.ndarray, values: np.ndarray) -> None:
        """Record a batch (by reference; the concatenation waits until a finding asks for its tail)."""
        self._batch, self._ext = (self.steps, self.values, steps, values), None
        if len(steps) >= TAIL:
            self.steps, self.values = steps[-TAIL:].copy(), _f32(values[-TAIL:])
        else:
            self.steps = np.concatenate([self.steps, steps])[-TAIL:]
            self.values = np.concatenate([self.values, _f32(values)])[-TAIL:]

    def get(self, s: int, t: int) -> dict[str, np.ndarray]:
        """Steps and values of tensor t up to row s of the last pushed batch."""
        prev_steps, prev_values, steps, values = self._batch
        if self._ext is None:
            self._ext = (
                np.concatenate([prev_steps, steps]),
                np.concatenate([prev_values, _f32(values)]),
            )
        ext_steps, ext_values = self._ext
        p = len(prev_steps) + s
        lo = max(0, p - TAIL + 1)
        return {"steps": ext_steps[lo : p + 1], "values": ext_values[lo : p + 1, t]}


@dataclass(eq=False)
class CountShareDetector(Detector):
    """Base of the detectors that watch what share of a tensor's elements one count column counts
    (``frac = column / numel``), in episodes per tensor: `observe` takes the share, adds it to the evidence
    tail and hands it, both columns and where the tensors are watched, to `process`."""

    run: np.ndarray = array_state(np.int64)  # (T,) length of the open episode
    fired: np.ndarray = array_state(bool)  # (T,) fired in the open episode
    tail: Tail = nested_state()  # the shares, for evidence
    column: ClassVar[str]

    def __post_init__(self) -> None:
        n = len(self.tensors)
        self.run = np.zeros(n, dtype=np.int64)
        self.fired = np.zeros(n, dtype=bool)
        self.tail = Tail(n)

    def observe(self, view: BatchView) -> list[Finding]:
        count, numel = view.stats.get(self.column), view.stats.get("numel")
        if count is None or numel is None:
            return []
        frac = fraction(count, numel)
        self.tail.push(view.steps, frac)
        return self.process(view.steps, count, numel, frac, view.watched)

    def process(self, steps, count, numel, frac, enabled) -> list[Finding]:
        """The findings of (S, T) counts of `numel` elements, their share `frac`, where `enabled`."""
        raise NotImplementedError


@dataclass(eq=False)
class OverflowBurstDetector(CountShareDetector, key="overflow", order=40):
    """Rule: ``frac = overflow / numel``; a step overflows when ``frac > overflow_frac``. Fires once per
    episode of consecutive overflowing steps: severity warning when the episode reaches
    `overflow_consecutive` steps, critical at once when ``frac >= overflow_jump_frac`` (grad_output:
    `overflow_jump_frac_grad`); a warning episode that
    later jumps fires once more, as critical.
    """

    fired_critical: np.ndarray = array_state(bool)  # (T,) fired as critical in the open episode
    column: ClassVar[str] = "overflow"

    def __post_init__(self) -> None:
        super().__post_init__()
        cfg = self.config
        self.jump_frac = by_role(self.tensors, cfg.overflow_jump_frac, cfg.overflow_jump_frac_grad)
        self.fired_critical = np.zeros(len(self.tensors), dtype=bool)

    def process(self, steps, overflow, numel, frac, enabled) -> list[Finding]:
        cfg = self.config
        mask = enabled & (frac > cfg.overflow_frac)
        jump = frac >= self.jump_frac
        cols, run, (fire, escalate) = advance(
            mask,
            self.run,
            [self.fired, self.fired_critical],
            lambda run, c: [(run >= cfg.overflow_consecutive) | jump[:, c], jump[:, c]],
        )
        findings = []
        for f in firings(fire | escalate, cols, run, steps, self.tensors):
            s, t = f.s, f.t
            critical = bool(jump[s, t])
            how = (
                f"{frac[s, t]:.3%} of elements saturated (jump above {self.jump_frac[t]:.3%})"
                if critical
                else f"more than {cfg.overflow_frac:.3%} of elements saturated for "
                f"{f.run} consecutive steps "
                f"({frac[s, t]:.3%} now)"
            )
            evidence = {
                **f.at(overflow=overflow, numel=numel, fraction=frac),
                "consecutive_steps": f.run,
                "threshold": cfg.overflow_frac,
                "jump_threshold": self.jump_frac[t],
                "escalation": bool(escalate[s, f.j] and not fire[s, f.j]),
                "fraction_tail": self.tail.get(s, t),
            }
            message = f"overflow burst in {f.name} at step {f.step}: {how}"
            severity = "critical" if critical else "warning"
            findings.append(f.finding("overflow_burst", severity, message, evidence))
        return findings


@dataclass(eq=False)
class UnderflowExcessDetector(CountShareDetector, key="underflow", order=60):
    """Rule: ``frac = underflow / numel``; fires (severity info) once per episode when ``frac`` stays above
    `underflow_frac` (input, weight) or `underflow_frac_grad` (grad_output) for `underflow_consecutive`
    consecutive steps. Gradients have many tiny values that flush to zero in normal training, hence the
    separate, higher threshold for them.
    """

    column: ClassVar[str] = "underflow"

    def __post_init__(self) -> None:
        super().__post_init__()
        cfg = self.config
        self.threshold = by_role(self.tensors, cfg.underflow_frac, cfg.underflow_frac_grad)

    def process(self, steps, underflow, numel, frac, enabled) -> list[Finding]:
        cfg = self.config
        mask = enabled & (frac > self.threshold)
        cols, run, (fire,) = advance(
            mask, self.run, [self.fired], lambda run, c: [run >= cfg.underflow_consecutive]
        )
        findings = []
        for f in firings(fire, cols, run, steps, self.tensors):
            s, t = f.s, f.t
            message = (
                f"excess underflow in {f.name} at step {f.step}: {frac[s, t]:.2%} of elements flushed to "
                f"zero, above {self.threshold[t]:.2%} for {f.run} consecutive steps"
            )
            evidence = {
                **f.at(underflow=underflow, numel=numel, fraction=frac),
                "consecutive_steps": f.run,
                "threshold": self.threshold[t],
                "fraction_tail": self.tail.get(s, t),
            }
            findings.append(f.finding("underflow_excess", "info", message, evidence))
        return findings
