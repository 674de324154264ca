"""Reading the statistics of completed steps without stalling training.

``step_stats(model)`` returns the device tensor of the last completed step (a snapshot: later steps write
to new buffers). ``StatsReader`` turns that into host data one step late: each ``poll()`` starts a
non-blocking copy of the steps completed since the previous poll into pinned host memory and returns the
copy started by the previous poll, which has long finished by then, so nothing waits on the GPU.

Once a layer of the model has been block-scaled, a reader's steps are ``(n_tensors, C + BLOCK_WIDTH)``:
the statistics, then the block columns and scale exponent histogram (``block_linear.split_block_stats``
parts them; ``step_stats`` stays the statistics alone).

Every completed FP8 step reaches a reader, whatever the loop does: where several steps close between two
polls (a gradient-accumulation loop without ``step_boundary=False`` closes one per micro-batch, as
Transformer Engine's does), the reader gets them merged (``fp8_trainer.merge.merge_step_stats``: amax max,
the scale that scaled it, counts summed), so a micro-batch that saturated is never dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fp8_kernels import STAT_COLUMNS

from .convert import get_fp8_state
from .hostcopy import LateCopy
from .tensor_parallel import leads_tp_group

__all__ = ["STAT_COLUMNS", "LateReader", "StatsReader", "read_newest", "step_stats"]


def step_stats(model: nn.Module) -> torch.Tensor | None:
    """Statistics of the last completed step: float64 ``(n_tensors, 10)`` on the model's device, columns
    ``STAT_COLUMNS`` (amax, scale used, overflow, underflow, nonfinite, numel, sum_sq, err_sq, subnormal,
    min_abs; merged over micro-batches as ``fp8_protocol.stats.MERGE`` says), rows in ``tensor_table(model)``
    order. ``None`` before the first completed step.

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


class LateReader:
    """The one-step-late part of the reader interface ``Monitor`` uses: ``poll``, ``advance`` and ``flush``
    over a subclass's ``take()``, which returns ``(device statistics, n)`` of what is new since the last
    take (``n``: how many steps it covers) or None, without a copy or a synchronisation.

    Each copy travels with a tag (``_tag(n)``, by default ``n``); a landed copy is handed out as
    ``_hand_out(tag, host)`` -> ``(step, host statistics)``. The copy itself is a ``LateCopy``.
    """

    def __init__(self) -> None:
        self._late = LateCopy()

    def take(self) -> tuple[torch.Tensor, Any] | None:
        raise NotImplementedError

    def has_block_part(self) -> bool:
        """Whether steps closed from now on carry a block part (``block_linear.split_block_stats``); a
        reader whose source never block-scales says False."""
        return False

    def data_lead(self) -> bool:
        """Whether this rank's statistics count in a reduction over ranks (``monitor/ranks.py``): False on
        the ranks of a tensor-parallel group but the first, whose rows repeat the first's."""
        return True

    def _tag(self, n: Any) -> Any:
        return n

    def _hand_out(self, tag: Any, host: torch.Tensor) -> tuple[int, torch.Tensor]:
        raise NotImplementedError

    def _landed(self, landed: tuple[Any, torch.Tensor] | None) -> tuple[int, torch.Tensor] | None:
        return None if landed is None else self._hand_out(*landed)

    def poll(self) -> tuple[int, torch.Tensor] | None:
        """Start copying what is new since the last poll; return ``(step, host_stats)`` of the copy started
        by the previous poll, None when none is pending. Calling twice without anything new in between
        starts no second copy."""
        got = self.take()
        if got is None:
            return None
        return self._landed(self._late.swap(got[0], self._tag(got[1])))

    def advance(self) -> tuple[bool, tuple[int, torch.Tensor] | None]:
        """Once per training-loop step: start copying what is new since the last call, and hand back the
        copy an earlier call started, whether or not anything is new. Returns ``(new, previous)``."""
        got = self.take()
        landed = self._late.swap(None) if got is None else self._late.swap(got[0], self._tag(got[1]))
        return got is not None, self._landed(landed)  # started a call ago: already complete

    def flush(self) -> tuple[int, torch.Tensor] | None:
        """The copy in flight, waited for (for the end of a run, not the training loop)."""
        return self._landed(self._late.flush())


class StatsReader(LateReader):
    """One-step-late host copies of the steps completed between polls, with no host synchronisation on the
    hot path. ``merged`` is how many FP8 steps the statistics last handed out by ``poll`` cover.

    ``poll()`` starts copying the steps completed since the last poll and returns ``(step, host_stats)`` of
    the copy the previous poll started (``step``: the 1-based number of the newest FP8 step in it), or None.
    ``advance()``, once per training-loop step, returns ``(fp8_ran, previous)``: ``fp8_ran`` is False when
    no FP8 step completed since the last call (no FP8 layer ran), ``previous`` as from ``poll``. ``flush()``
    hands out the copy still in flight (at the end of a run).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self._model = model
        self._state = get_fp8_state(model)
        self._box = self._state.open_inbox()
        self.merged = 0

    def take(self) -> tuple[torch.Tensor, int] | None:
        """The device statistics of the steps completed since the last take or poll (merged) and how many
        steps they cover, or ``None`` if none completed. No copy, no synchronisation."""
        stats, n = self._box
        if stats is None:
            return None
        self._box[0], self._box[1] = None, 0
        return stats, n

    def has_block_part(self) -> bool:
        """True once a layer of the model has been block-scaled (it stays so: module docstring). A recipe
        fact, not one of a step's statistics: every rank applying the same recipes at the same steps gets
        the same answer at the same step, whether or not FP8 ran on it (the multi-rank gather needs that).
        """
        return self._state.block_stats is not None

    def data_lead(self) -> bool:
        return leads_tp_group(self._state)

    def _tag(self, n: int) -> tuple[int, int]:
        return self._state.steps, n  # the newest FP8 step in the copy, and how many it merges

    def _hand_out(self, tag: tuple[int, int], host: torch.Tensor) -> tuple[int, torch.Tensor]:
        step, self.merged = tag
        return step, host

    def read_now(self) -> tuple[int, torch.Tensor] | None:
        """The newest completed step, copied synchronously (for the end of a run, not the training loop), as
        ``poll`` hands steps out: with the block part where the model has had block-scaled layers."""
        newest = self._state.newest_stats()
        return None if newest is None else (self._state.steps, newest.to("cpu", copy=True))

    def close(self) -> None:
        """Stop collecting steps for this reader."""
        self._state.close_inbox(self._box)
