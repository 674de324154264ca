"""Running an optimizer step again: the FP8 scaling state as it was when the step began, and back to it.

``fp8-train --remediation act`` replays an incident's step before its update, and when the service's
policy answers with a recipe change it runs the step again under that change (``fp8_trainer.app.retry``).
The weights and the optimizer have not moved yet, but the step's forward and backward have folded its
amaxes into the history and updated the scales: ``scaling_state`` keeps what the step began from (a copy
of the history, the scales and the step counters: ``(L + 2) * n`` floats, no host synchronisation) and
``rewind`` puts it back. The readers (a ``Monitor``'s ``StatsReader``) have had the first run's statistics;
the run again is counted but not handed to them a second time, so the service keeps the step as it first
ran, the fault included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8_kernels import as_aligned_scales

from .state import FP8State

__all__ = ["ScalingState", "rewind", "scaling_state"]


@dataclass(frozen=True)
class ScalingState:
    """What ``FP8State`` holds between two steps that a step changes (copies)."""

    amax_history: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor
    step_t: torch.Tensor
    steps: int


def scaling_state(state: FP8State) -> ScalingState:
    """A copy of ``state``'s scaling state, taken between steps."""
    _between_steps(state, "scaling_state")
    return ScalingState(
        state.amax_history.clone(),
        state.scale.clone(),
        state.scale_inv.clone(),
        state.step_t.clone(),
        state.steps,
    )


def rewind(state: FP8State, saved: ScalingState) -> None:
    """Put back the scaling state ``saved`` (``scaling_state``, taken before the step that just ran) so that
    the step runs again from it; between steps, before any recipe change for the run again (a change of
    history length resizes the history put back here). The step's FP8 weight copies are dropped (they were
    made with the scales of the first run) and the run again is not handed to the readers."""
    _between_steps(state, "rewind")
    state.amax_history = saved.amax_history.clone()
    state.scale = as_aligned_scales(saved.scale.clone())
    state.scale_inv = as_aligned_scales(saved.scale_inv.clone())
    state.step_t = saved.step_t.clone()
    state.steps = saved.steps
    state.weight_cache.clear()
    state._new_stats_buffer()  # the buffer of the step run again: its width follows its index (``steps``)
    state.version += 1  # buffers replaced outside a step
    state.reruns += 1


def _between_steps(state: FP8State, what: str) -> None:
    if state.pending:
        raise RuntimeError(
            f"{what}: a step is pending (a forward without its backward); call it between steps"
        )
