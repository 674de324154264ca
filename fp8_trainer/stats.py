"""Reading the statistics of completed steps without stalling training.

``step_stats(model)`` returns the device tensor of the last completed step (a snapshot: later steps write
to new buffers). ``StatsReader`` turns that into host data one step late: each ``poll()`` starts a
non-blocking copy of the newest step into pinned host memory and returns the copy started by the previous
poll, which has long finished by then, so nothing waits on the GPU.
"""

from __future__ import annotations

import torch
from fp8_kernels import STAT_COLUMNS
from torch import nn

from .convert import get_fp8_state
from .hostcopy import HostCopy

__all__ = ["STAT_COLUMNS", "StatsReader", "step_stats"]


def step_stats(model: nn.Module) -> torch.Tensor | None:
    """Statistics of the last completed step: float64 ``(n_tensors, 6)`` on the model's device, columns
    ``STAT_COLUMNS`` (amax, scale used, overflow, underflow, nonfinite, numel; counts summed over
    micro-batches), rows in ``tensor_table(model)`` order. ``None`` before the first completed step.

    Rows of layers with FP8 turned off are kept (stable indices): amax, counts and numel are 0 and scale is
    the layer's last scale. With amax reduction across ranks, ``amax`` is this rank's own value (the
    reduced one is what enters the history), so a monitor can tell which rank saw a spike."""
    return get_fp8_state(model).last_stats


class StatsReader:
    """One-step-late host copies of ``step_stats`` with no host synchronisation on the hot path."""

    def __init__(self, model: nn.Module):
        self._state = get_fp8_state(model)
        self._started_step = 0
        self._inflight: tuple[int, HostCopy] | None = None

    def poll(self) -> tuple[int, torch.Tensor] | None:
        """Start copying the newest completed step; return ``(step, host_stats)`` of the previous copy.

        ``step`` is the 1-based number of the step the statistics belong to. Returns ``None`` when no
        earlier copy is pending. Calling twice without a new step in between starts no second copy.
        """
        state = self._state
        if state.last_stats is None or state.steps == self._started_step:
            return None
        previous = self._inflight
        self._inflight = (state.steps, HostCopy(state.last_stats))
        self._started_step = state.steps
        if previous is None:
            return None
        step, copy = previous
        return step, copy.wait()  # started a step ago: already complete, returns at once

    def read_now(self) -> tuple[int, torch.Tensor] | None:
        """The newest completed step, copied synchronously (for the end of a run, not the training loop)."""
        state = self._state
        if state.last_stats is None:
            return None
        return state.steps, state.last_stats.to("cpu", copy=True)
