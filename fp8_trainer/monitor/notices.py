"""What the client says in the log: each kind of warning once per run, so a long run's log stays readable.

The monitor never raises into training (see ``client.py``); where something goes wrong, or a loop does not
do what the monitor expects, it says so here, once.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["Notices", "log"]

log = logging.getLogger("fp8scope.monitor")


class Notices:
    """One run's warnings, each ``kind`` logged at most once.

    Args:
        caller: the run's statistics source when not fp8scope's own layers (``external.attach_source``):
            it decides how a step without FP8 statistics is explained.
    """

    def __init__(self, caller=None):
        self._caller = caller
        self._logged: set[str] = set()

    def once(self, kind: str, msg: str, *args: Any, exc: bool = False) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg, *args, exc_info=exc)

    def no_fp8(self, step: int) -> None:
        """Step ``step`` has no FP8 statistics: why, in the words of its source."""
        if hasattr(self._caller, "put"):  # the caller's own statistics
            how = "no statistics block was given with step(%s, stats=...)"
        elif self._caller is not None:  # another runtime's state (Transformer Engine)
            how = "no FP8 cast ran in step %s"
        else:
            how = "no FP8 layer ran in step %s: wrap the forward in fp8_autocast"
        self.once(
            "no-fp8-step",
            f"fp8scope monitor: {how}. Steps without FP8 statistics are reported with their scalars only.",
            step,
        )

    def merged(self, n: int) -> None:
        """``n`` FP8 steps closed between two ``monitor.step()`` calls: say once how they are reported."""
        if n > 1:
            self.once(
                "merged-steps",
                "fp8scope monitor: %d FP8 steps closed between two monitor.step() calls (one per "
                "micro-batch, as in Transformer Engine's loop); each monitor step reports them merged: amax "
                "the max with the scale that scaled it, counts summed. For one amax-history entry per "
                "optimizer step, use fp8_autocast(step_boundary=False) for all micro-batches but the last.",
                n,
            )
