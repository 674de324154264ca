"""The step path of a job on one rank: each ``Monitor.step`` applies the waiting commands, starts the host
copy of this step's statistics and reports the steps whose statistics have reached the host.

The statistics come one step late (``StatsReader.advance`` and the readers like it), so a step waits in a
queue, with its scalars, until the copy of its statistics completes; a step in which no FP8 ran has none to
wait for but is still reported in order, after the steps before it. ``close`` reports what is left,
waiting for the last copy.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from .step_path import StepParts, StepPath

__all__ = ["SingleRankSteps"]


class SingleRankSteps(StepPath):
    """Steps of a one-rank job, from ``Monitor.step`` to the reporter, in order (module docstring); the
    parts are ``StepParts``."""

    def __init__(self, parts: StepParts):
        super().__init__(parts)
        self._prev: tuple[int, Any] | None = None  # (step, scalars) of a run without FP8 layers, one late
        # (step, scalars, FP8 ran) in step order, waiting for the host copy of their statistics: a step
        # whose copy is in flight holds back the later ones, so the service gets every step, in order
        self._waiting: deque[tuple[int, Any, bool]] = deque()

    def step(self, step: int, holder) -> None:
        self.apply_waiting(step + 1)
        if self._reader is None:
            prev, self._prev = self._prev, (step, holder)
            if prev is not None:
                self._report(prev[0], None, prev[1])
            return
        fp8_ran, got = self._reader.advance()
        if got is not None:
            self._notices.merged(self._reader.merged)
        if not fp8_ran:
            self._notices.no_fp8(step)
        self._waiting.append((step, holder, fp8_ran))
        self._release(got)

    def close(self) -> None:
        """Report every step still waiting (the last copy waited for)."""
        self.flush()

    def flush(self) -> None:
        """Report every step still waiting, the copy in flight waited for: a host synchronisation, for a job
        that pauses (the end of a run, an incident replayed before its step's update), not every step."""
        if self._prev is not None:
            self._report(self._prev[0], None, self._prev[1])
            self._prev = None
        if self._reader is not None:
            got = self._reader.flush()
            if got is None and any(fp8 for _, _, fp8 in self._waiting):
                got = self._reader.read_now()
            self._release(got, closing=True)

    def unapplied(self) -> list[dict[str, Any]]:
        """Commands taken from the inbox but not applied (none here: they are applied when taken)."""
        return []

    def _release(self, got: tuple[int, torch.Tensor] | None, closing: bool = False) -> None:
        """Report the waiting steps, in order, up to the first whose statistics are still being copied.
        ``got`` is the copy that just completed: the statistics of the first waiting step in which FP8 ran."""
        while self._waiting:
            step, holder, fp8_ran = self._waiting[0]
            stats = None
            if fp8_ran:
                if got is None and not closing:
                    return
                stats, got = (got[1] if got is not None else None), None
            self._waiting.popleft()
            self._report(step, stats, holder)
