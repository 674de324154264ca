"""Non-finite detector: which tensor went NaN/Inf first, in forward-then-backward order, and at which step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8_protocol.codec import encode_float, jsonable
from fp8_protocol.tensors import TensorInfo

from .base import BatchView, Detector, array_state, value_state
from .episodes import advance
from .types import Finding

ROLE_RANK = {"input": 0, "weight": 1}
MAX_LISTED = 64  # evidence lists at most this many affected tensors


def forward_backward_order(tensors: list[TensorInfo]) -> np.ndarray:
    """Tensor indices in the order the training step touches them.

    Forward: input then weight of each layer, layers in order of first appearance by index; then backward:
    grad_output of each layer, layers last to first. Returns (T,) positions into `tensors`.
    """
    layer_pos: dict[str, int] = {}
    for meta in tensors:
        layer_pos.setdefault(meta.layer, len(layer_pos))
    n_layers = len(layer_pos)

    def key(i: int) -> tuple[int, int, int, int]:
        meta = tensors[i]
        lp = layer_pos[meta.layer]
        if meta.role == "grad_output":
            return (1, n_layers - 1 - lp, 0, meta.index)
        return (0, lp, ROLE_RANK.get(meta.role, 2), meta.index)

    return np.array(sorted(range(len(tensors)), key=key), dtype=np.int64)


@dataclass(eq=False)
class NonfiniteDetector(Detector, key="nonfinite", order=10):
    """Rule: a tensor is non-finite at a step when its `nonfinite` count is > 0 or its amax is NaN/±inf; the
    loss when it is NaN/±inf. Fires once per episode (a run of consecutive non-finite steps) per tensor, at
    the episode's first step, severity critical. At each firing step the affected tensors are ordered
    forward-then-backward (the loss sits between the forward and backward tensors: it is computed after the
    forward pass); the first of them is marked ``first_at_step``, and at the run's first non-finite step also
    ``first_in_run``; its evidence lists the tensors affected at that step in that order (the others name
    it and give their position).
    """

    run: np.ndarray = array_state(np.int64)  # (T,) length of the open episode
    fired: np.ndarray = array_state(bool)  # (T,) fired in the open episode
    loss_active: bool = value_state(bool, default=False)  # the previous step's loss was non-finite
    # the run's first non-finite: {"step", "tensor_index", "name"}
    first: dict[str, Any] | None = value_state(default=None)

    def __post_init__(self) -> None:
        n = len(self.tensors)
        self.rank = np.empty(n, dtype=np.int64)
        self.rank[forward_backward_order(self.tensors)] = np.arange(n)
        n_forward = sum(1 for t in self.tensors if t.role != "grad_output")
        self.loss_rank = n_forward - 0.5
        self.run = np.zeros(n, dtype=np.int64)
        self.fired = np.zeros(n, dtype=bool)

    def observe(self, view: BatchView) -> list[Finding]:
        return self.process(
            view.steps,
            view.bad,
            view.loss_bad,
            view.nonfinite,
            view.column_or_nan("amax"),
            view.column_or_nan("numel"),
            view.loss if view.loss is not None else np.full(view.steps.size, np.nan),
        )

    def process(
        self,
        steps: np.ndarray,
        bad: np.ndarray,
        loss_bad: np.ndarray,
        nonfinite: np.ndarray,
        amax: np.ndarray,
        numel: np.ndarray,
        loss: np.ndarray,
    ) -> list[Finding]:
        """bad: (S, T) bool, tensor non-finite; loss_bad: (S,) bool; the rest are values for evidence."""
        cols, _, (fire,) = advance(bad, self.run, [self.fired], lambda run, c: [bad[:, c]])
        loss_fire = loss_bad & ~np.concatenate([[self.loss_active], loss_bad[:-1]])
        self.loss_active = bool(loss_bad[-1])

        findings: list[Finding] = []
        for s in np.flatnonzero(fire.any(axis=1) | loss_fire):
            step = int(steps[s])
            items: list[tuple[float, int | None]] = [(float(self.rank[t]), int(t)) for t in cols[fire[s]]]
            if loss_fire[s]:
                items.append((self.loss_rank, None))
            items.sort(key=lambda item: item[0])
            listed = jsonable([self._describe(t, s, nonfinite, amax, loss) for _, t in items[:MAX_LISTED]])
            first_in_run = self.first is None
            if first_in_run:
                t0 = items[0][1]
                self.first = {"step": step, "tensor_index": t0, "name": self._name(t0)}
            for pos, (_, t) in enumerate(items):
                findings.append(
                    self._finding(
                        step, s, t, pos, first_in_run, listed, len(items), nonfinite, amax, numel, loss
                    )
                )
        return findings

    def _name(self, t: int | None) -> str:
        return "loss" if t is None else self.tensors[t].name

    def _describe(self, t: int | None, s: int, nonfinite, amax, loss) -> dict[str, Any]:
        if t is None:
            return {"index": None, "name": "loss", "role": None, "loss": loss[s]}
        meta = self.tensors[t]
        return {
            "index": meta.index,
            "name": meta.name,
            "role": meta.role,
            "nonfinite": nonfinite[s, t],
            "amax": amax[s, t],
        }

    def _finding(
        self, step, s, t, pos, first_in_run, listed, n_affected, nonfinite, amax, numel, loss
    ) -> Finding:
        name = self._name(t)
        if t is None:
            what = f"loss is non-finite ({loss[s]}) at step {step}"
        else:
            what = (
                f"tensor {name} is non-finite at step {step} "
                f"({int(np.nan_to_num(nonfinite[s, t]))} non-finite elements, amax {amax[s, t]})"
            )
        if pos == 0 and first_in_run:
            msg = f"{what}: first non-finite value of the run, in forward-then-backward order"
        elif pos == 0:
            msg = (
                f"{what}: first at this step in forward-then-backward order (run's first: "
                f"{self.first['name']} at step {self.first['step']})"
            )
        else:
            msg = (
                f"{what}: #{pos + 1} of {n_affected} at this step in forward-then-backward order "
                f"(first: {listed[0]['name']})"
            )
        evidence: dict[str, Any] = {
            "step": step,
            "first_in_run": pos == 0 and first_in_run,
            "first_at_step": pos == 0,
            "position": pos,
            "n_affected": n_affected,
            "run_first": dict(self.first),
        }
        if pos == 0:  # the first carries the whole ordered list; the others name the first
            evidence["affected_in_order"] = listed
        else:
            evidence["first_at_this_step"] = listed[0]["name"]
        if t is None:
            evidence["loss"] = encode_float(loss[s])
        else:
            evidence.update(
                nonfinite=encode_float(nonfinite[s, t]),
                amax=encode_float(amax[s, t]),
                numel=encode_float(numel[s, t]),
            )
        return Finding(
            kind="nonfinite", step=step, severity="critical", message=msg, tensor_index=t, evidence=evidence
        )
