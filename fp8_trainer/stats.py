"""Reading the statistics of completed steps without stalling training.

``step_stats(model)`` returns the device tensor of the last completed step (a snapshot: later steps write
to new buffers). ``StatsReader`` turns that into host data one step late: each ``poll()`` starts a
non-blocking copy of the steps completed since the previous poll into pinned host memory and returns the
copy started by the previous poll, which has long finished by then, so nothing waits on the GPU.

Every completed FP8 step reaches a reader, whatever the loop does: where several steps close between two
polls (a gradient-accumulation loop without ``step_boundary=False`` closes one per micro-batch, as
Transformer Engine's does), the reader gets them merged (``fp8_trainer.state.merge_step_stats``: amax max,
the scale that scaled it, counts summed), so a micro-batch that saturated is never dropped.
"""

from __future__ import annotations

import torch
from fp8_kernels import STAT_COLUMNS
from torch import nn

from .convert import get_fp8_state
from .hostcopy import HostCopy

__all__ = ["STAT_COLUMNS", "StatsReader", "read_newest", "step_stats"]


def step_stats(model: nn.Module) -> torch.Tensor | None:
    """Statistics of the last completed step: float64 ``(n_tensors, 6)`` on the model's device, columns
    ``STAT_COLUMNS`` (amax, scale used, overflow, underflow, nonfinite, numel; counts summed over
    micro-batches), rows in ``tensor_table(model)`` order. ``None`` before the first completed step.

    Rows of layers with FP8 turned off are kept (stable indices): amax, counts and numel are 0 and scale is
    the layer's last scale. With amax reduction across ranks, ``amax`` is this rank's own value (the
    reduced one is what enters the history), so a monitor can tell which rank saw a spike."""
    return get_fp8_state(model).last_stats


def read_newest(model: nn.Module) -> tuple[int, torch.Tensor] | None:
    """``(step, host copy)`` of the newest completed step, copied synchronously (for log lines and the end
    of a run, not every step); ``None`` before the first. Unlike a ``StatsReader`` it collects nothing."""
    state = get_fp8_state(model)
    if state.last_stats is None:
        return None
    return state.steps, state.last_stats.to("cpu", copy=True)


class StatsReader:
    """One-step-late host copies of the steps completed between polls, with no host synchronisation on the
    hot path. ``merged`` is how many FP8 steps the statistics last handed out by ``poll`` cover."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._state = get_fp8_state(model)
        self._box = self._state.open_inbox()
        self._inflight: tuple[int, int, HostCopy] | None = None
        self.merged = 0

    def take(self) -> tuple[torch.Tensor, int] | None:
        """The device statistics of the steps completed since the last take or poll (merged) and how many
        steps they cover, or ``None`` if none completed. No copy, no synchronisation."""
        stats, n = self._box
        if stats is None:
            return None
        self._box[0], self._box[1] = None, 0
        return stats, n

    def poll(self) -> tuple[int, torch.Tensor] | None:
        """Start copying the steps completed since the last poll; return ``(step, host_stats)`` of the copy
        started by the previous poll.

        ``step`` is the 1-based number of the newest FP8 step in it. Returns ``None`` when no earlier copy
        is pending. Calling twice without a new step in between starts no second copy.
        """
        got = self.take()
        if got is None:
            return None
        previous, self._inflight = self._inflight, (self._state.steps, got[1], HostCopy(got[0]))
        if previous is None:
            return None
        step, self.merged, copy = previous
        return step, copy.wait()  # started a poll ago: already complete, returns at once

    def advance(self) -> tuple[bool, tuple[int, torch.Tensor] | None]:
        """Once per training-loop step: start copying the FP8 steps completed since the last call, and hand
        back the copy an earlier call started, whether or not an FP8 step completed since.

        Returns ``(fp8_ran, previous)``: ``fp8_ran`` is False when no FP8 step completed since the last call
        (no FP8 layer ran); ``previous`` is ``(step, host_stats)`` as from `poll`, or None.
        """
        got = self.take()
        previous = self._inflight
        self._inflight = (self._state.steps, got[1], HostCopy(got[0])) if got is not None else None
        if previous is None:
            return got is not None, None
        step, self.merged, copy = previous
        return got is not None, (step, copy.wait())  # started a call ago: already complete

    def flush(self) -> tuple[int, torch.Tensor] | None:
        """The copy started by the last poll, waited for (for the end of a run, not the training loop)."""
        previous, self._inflight = self._inflight, None
        if previous is None:
            return None
        step, self.merged, copy = previous
        return step, copy.wait()

    def read_now(self) -> tuple[int, torch.Tensor] | None:
        """The newest completed step, copied synchronously (for the end of a run, not the training loop)."""
        return read_newest(self._model)

    def close(self) -> None:
        """Stop collecting steps for this reader."""
        self._state.close_inbox(self._box)
