"""What the per-tensor episode detectors share: a threshold per tensor role, and the findings at the places
where an episode fired (`episodes.advance`).

Every such finding names its step, its tensor and the step its episode began, and carries its evidence made
JSON-able; only the kind, severity, message and evidence differ between the detectors, so they say only
those.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8_protocol.codec import jsonable
from fp8_protocol.tensors import TensorInfo

from .types import Finding


def by_role(tensors: Sequence[TensorInfo], value: float, grad_value: float) -> np.ndarray:
    """(T,) `grad_value` for the grad_output tensors, `value` for the others: gradients hold many tiny and
    some huge values in normal training, so a rule about them takes its own threshold."""
    return np.array([grad_value if t.role == "grad_output" else value for t in tensors])


@dataclass(frozen=True)
class Firing:
    """One place an episode fired: row `s` of the batch, column `j` of the episode arrays (`advance`'s
    `cols`), tensor `t`, and the episode's length `run` at that step."""

    s: int
    j: int
    t: int
    run: int
    step: int
    name: str

    def at(self, **columns: np.ndarray) -> dict[str, Any]:
        """Each (S, T) column's value at this firing's row and tensor, under its keyword: the evidence's
        values of the step that fired."""
        return {name: values[self.s, self.t] for name, values in columns.items()}

    def finding(self, kind: str, severity: str, message: str, evidence: dict[str, Any]) -> Finding:
        """The finding of this firing; its episode began `run` - 1 steps before it."""
        return Finding(
            kind=kind,
            step=self.step,
            tensor_index=self.t,
            onset=self.step - self.run + 1,
            severity=severity,
            message=message,
            evidence=jsonable(evidence),
        )


def firings(
    fire: np.ndarray, cols: np.ndarray, run: np.ndarray, steps: np.ndarray, tensors: Sequence[TensorInfo]
) -> Iterator[Firing]:
    """The places where `fire` (S, C) holds, step by step (row-major, as the findings are reported)."""
    for s, j in zip(*np.nonzero(fire), strict=True):
        t = int(cols[j])
        yield Firing(int(s), int(j), t, int(run[s, j]), int(steps[s]), tensors[t].name)
