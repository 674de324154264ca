"""How two steps' statistics merge into one: a reader that did not take a step (several closed between two
polls, a step per micro-batch), a rank's rows reduced with another's (``fp8_trainer.tensor_parallel``,
``fp8_trainer.fsdp``), an external recorder's inbox (``fp8_trainer.monitor.external``). Each column merges
as ``fp8_protocol.stats.MERGE`` says."""

from __future__ import annotations

import torch

from fp8_protocol.stats import AMAX, BLOCK_COLUMNS, MIN_ABS, SCALE

from .block_linear import split_block_stats

__all__ = ["merge_step_stats"]

BLOCK_RANGE = BLOCK_COLUMNS.index("block_range")


def merge_step_stats(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two FP8 steps' statistics ``(n, C)`` as one, each column as ``fp8_protocol.stats.MERGE`` says: amax
    the max (NaN ignored), scale the one that scaled the larger amax (so headroom stays negative only where
    something overflowed), ``min_abs`` the min (NaN ignored), the counts, numel and sums of squares summed.
    The base columns alone (``C`` = 6) merge the same way; a block with the quality columns and one without
    (a switch between steps) merge into the base columns they share. A block part (``C + BLOCK_WIDTH``
    columns) merges as its own columns say (``block_range`` max, the counts and histogram summed); a step
    without one (before the model's first block-scaled layer) counts as zeros there."""
    a_stats, a_block = split_block_stats(a)
    b_stats, b_block = split_block_stats(b)
    if a_block is not None or b_block is not None:
        merged = _merge_plain(a_stats, b_stats)
        a_block = a_block if a_block is not None else torch.zeros_like(b_block)
        b_block = b_block if b_block is not None else torch.zeros_like(a_block)
        block = a_block + b_block
        block[:, BLOCK_RANGE] = torch.fmax(a_block[:, BLOCK_RANGE], b_block[:, BLOCK_RANGE])
        return torch.cat([merged, block], 1)
    return _merge_plain(a, b)


def _merge_plain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    width = min(a.shape[1], b.shape[1])
    a, b = a[:, :width], b[:, :width]
    out = a + b
    out[:, AMAX] = torch.fmax(a[:, AMAX], b[:, AMAX])
    out[:, SCALE] = torch.where(b[:, AMAX] > a[:, AMAX], b[:, SCALE], a[:, SCALE])
    if a.shape[1] > MIN_ABS:
        out[:, MIN_ABS] = torch.fmin(a[:, MIN_ABS], b[:, MIN_ABS])
    return out
