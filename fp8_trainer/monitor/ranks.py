"""Multi-rank telemetry: one asynchronous all_gather per step, reduced statistics, command broadcast.

Every rank calls ``RankSync.step`` once per optimizer step (inside ``Monitor.step``). It launches one
``all_gather`` (``async_op=True``) of a ``(T + 1, 10)`` float64 buffer: rows ``0..T-1`` are this rank's
``step_stats`` (its own amaxes), row ``T`` a header ``[has_stats, commands_announced, has_quality,
has_block, data_lead, 0, ...]`` (columns ``HAS_STATS``, ``N_COMMANDS``, ``HAS_QUALITY``, ``HAS_BLOCK`` and
``DATA_LEAD``: a source without quality statistics sends the base columns, and the reduced step then carries
the base columns alone; ``DATA_LEAD`` below). The gather is waited for at the next call, a step later, when
it has long completed, so nothing waits on the other ranks; on a GPU the result then takes one more step to
reach the host through a pinned copy.

Once the model has had a block-scaled layer, the buffer is ``(T + 1, 10 + BLOCK_WIDTH)``: the block part
(``BLOCK_COLUMNS`` and the scale exponent histogram) rides in the same gather. Every rank must gather the
same shape, so the width does not follow the step's own statistics (a rank in which no FP8 ran has none)
but the caller's ``with_block``, which the monitor takes from the model's recipe state; every rank changes
its recipe at the same step (the command broadcast below, or the training script on every rank), so every
rank widens its gather at the same step. A rank without a block part in the step sends zeros there, the
neutral element of every block column's merge, as ``merge_step_stats`` merges a step without one.

From the gathered ``(W, T + 1, 10)`` (or wider) block rank 0 reports the *reduced* statistics, one row per
logical tensor (``reduce_rank_stats``). Which rows enter the reduction:

* **one rank per tensor-parallel group.** After the step's end a tensor-parallel group's ranks hold the same
  rows (a sharded tensor's rows are merged over the group, ``tensor_parallel.py``; a replicated tensor is the
  same on each), so only the rank whose header says ``DATA_LEAD`` (the group's first; every rank without
  tensor parallelism) is counted: counting the others would multiply every count by the TP degree;
* **weights once.** The data-parallel ranks' weights are the same tensor (DDP's replicas; FSDP2's weight rows
  are the whole weight's on every rank), so a weight's row is reduced as copies of one tensor: every column
  the max over ranks, the counts, ``numel`` and sums of squares included (exact where the copies agree, the
  worst copy where they do not), where activations and gradients, which are each rank's own part of the
  global batch, are summed.

Each column as ``fp8_protocol.stats.MERGE`` says: amax: max over ranks, NaN ignored, as the kernels'
amaxes ignore it; scale: the one of the rank whose amax is the max, so the pair stays consistent under
current scaling, where each rank has its own; overflow, underflow, nonfinite, numel and the sums of
squares: summed (the max for weights, above); min_abs: min. Then the reduced block part where any rank had
one (``reduce_rank_block``: the block counts and histogram bins summed, ``block_range`` the max, as over
micro-steps), and, every ``rank_sample_interval`` steps, the per-rank amaxes as a ``rank_amax`` event.

Commands (only rank 0 hears from the service) ride on the same collective: rank 0 writes how many it
announces into the header; every rank reads that header at the same ``Monitor.step`` call, and only then
do they all enter one ``broadcast_object_list`` carrying the commands, and apply them at that call. So the
extra collective runs only when there is something to apply, and every rank changes its recipe between
the same two optimizer steps.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from fp8_protocol.stats import AMAX, BASE_COLUMNS, BLOCK_COLUMNS, MERGE, MIN_ABS, SCALE, STAT_COLUMNS

from ..block_linear import BLOCK_WIDTH, split_block_stats
from ..hostcopy import HostCopy

__all__ = [
    "DATA_LEAD",
    "HAS_BLOCK",
    "HAS_QUALITY",
    "HAS_STATS",
    "N_COMMANDS",
    "RankSync",
    "reduce_rank_block",
    "reduce_rank_stats",
]

#: Columns of the header row (row ``T``) of a gathered block: whether the rank had statistics in the step,
#: how many commands rank 0 announced in it, whether its statistics have the quality columns, and whether
#: they have a block part, and whether its rows count in the reduction (module docstring: the first rank of
#: a tensor-parallel group, every rank without tensor parallelism).
HAS_STATS, N_COMMANDS, HAS_QUALITY, HAS_BLOCK, DATA_LEAD = 0, 1, 2, 3, 4


def _summed(block: np.ndarray, copies: np.ndarray | None) -> np.ndarray:
    """Summed columns ``(W, T, ...)`` over ranks: the sum, but the max for the rows that are ``copies`` of
    one tensor (a data-parallel job's weights: counted once, module docstring)."""
    out = np.sum(block, axis=0)
    if copies is not None and copies.any():
        out[copies] = np.max(block[:, copies], axis=0)
    return out


def reduce_rank_stats(block: np.ndarray, copies: np.ndarray | None = None) -> np.ndarray:
    """``(W, T, C)`` per-rank stats -> ``(T, C)``, each column as ``MERGE`` says: amax max (NaN ignored), the
    scale of the rank with that amax (the one that scaled it: headroom stays negative only where something
    overflowed), ``min_abs`` min (NaN ignored), the counts, numel and sums of squares summed, except in the
    rows that ``copies`` (``(T,)`` bool) marks as copies of one tensor on every rank, where they are the max.
    """
    amax = block[:, :, AMAX]
    out = np.empty(block.shape[1:], dtype=np.float64)
    for j, name in enumerate(STAT_COLUMNS[: block.shape[2]]):
        how = MERGE[name]
        if j == SCALE:
            top = np.argmax(np.where(np.isnan(amax), -np.inf, amax), axis=0)  # first rank with the max
            out[:, SCALE] = block[top, np.arange(block.shape[1]), SCALE]
        elif how == "max":
            out[:, j] = np.fmax.reduce(block[:, :, j], axis=0)
        elif how == "min":
            out[:, j] = np.fmin.reduce(block[:, :, j], axis=0)
        else:
            out[:, j] = _summed(block[:, :, j], copies)
    return out


def reduce_rank_block(block: np.ndarray, copies: np.ndarray | None = None) -> np.ndarray:
    """``(W, T, BLOCK_WIDTH)`` per-rank block parts -> ``(T, BLOCK_WIDTH)``, as steps merge over micro-steps
    (``merge_step_stats``): each ``BLOCK_COLUMNS`` column as ``MERGE`` says (``block_range`` the max, NaN
    ignored; the block counts summed), the histogram bins summed (every rank's blocks counted once); in the
    rows ``copies`` marks (as for ``reduce_rank_stats``) the max instead of the sum."""
    out = _summed(block, copies)
    for j, name in enumerate(BLOCK_COLUMNS):
        if MERGE[name] == "max":
            out[:, j] = np.fmax.reduce(block[:, :, j], axis=0)
    return out


class RankSync:
    """The per-step gather pipeline of one rank (see the module docstring)."""

    def __init__(self, n_tensors: int, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.n_tensors = n_tensors
        self._inflight: deque = deque()  # (step, work, gathered list)
        self._host: deque = deque()  # (step, HostCopy)

    def step(
        self,
        step: int,
        stats: torch.Tensor | None,
        n_commands: int,
        device,
        with_block: bool = False,
        data_lead: bool = True,
    ) -> list[tuple[int, np.ndarray]]:
        """Collect the gathers that are ready (older steps), then launch this step's gather.

        ``stats``: this rank's statistics of the step, with or without a block part (``split_block_stats``),
        None where no FP8 ran. ``with_block``: whether this step's gather carries block parts; it sets the
        gathered width, so it must be the same on every rank (module docstring). ``data_lead``: whether this
        rank's rows count in the reduction (False on a tensor-parallel group's ranks but the first).

        Returns ``[(step, block (W, T + 1, 10 or 10 + BLOCK_WIDTH))]`` for the steps whose data reached the
        host now.
        """
        ready = self._collect()
        T = self.n_tensors
        C = len(STAT_COLUMNS)
        # always the full width, so every rank gathers the same shape; min_abs +inf where a rank has no
        # quality statistics (the neutral element of its min), and the header says which ranks have them
        buf = torch.zeros(T + 1, C + (BLOCK_WIDTH if with_block else 0), dtype=torch.float64, device=device)
        buf[:T, MIN_ABS] = torch.inf
        stats, block = split_block_stats(stats)
        if stats is not None:
            buf[:T, : stats.shape[1]] = stats
            buf[T, HAS_STATS] = 1.0
            buf[T, HAS_QUALITY] = float(stats.shape[1] > len(BASE_COLUMNS))
        if block is not None and with_block:  # else zeros: the neutral element of the block merge
            buf[:T, C:] = block
            buf[T, HAS_BLOCK] = 1.0
        buf[T, N_COMMANDS] = float(n_commands)
        buf[T, DATA_LEAD] = float(data_lead)
        gathered = [torch.empty_like(buf) for _ in range(self.world)]
        work = dist.all_gather(gathered, buf, group=self.group, async_op=True)
        self._inflight.append((step, work, gathered))
        return ready

    def _collect(self) -> list[tuple[int, np.ndarray]]:
        ready = []
        while self._host:
            s, copy = self._host.popleft()
            ready.append((s, copy.wait().numpy()))  # started a step ago: complete
        while self._inflight:
            s, work, gathered = self._inflight.popleft()
            work.wait()
            block = torch.stack(gathered)
            if block.device.type == "cuda":
                self._host.append((s, HostCopy(block)))
            else:
                ready.append((s, block.numpy()))
        return ready

    def flush(self) -> list[tuple[int, np.ndarray]]:
        """Everything still in flight, synchronously (at close)."""
        ready = self._collect()
        return ready + self._collect()

    def broadcast_commands(self, commands: list | None) -> list:
        """Rank 0's ``commands`` on every rank (one ``broadcast_object_list``)."""
        obj = [commands if self.rank == 0 else None]
        dist.broadcast_object_list(
            obj, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group
        )
        return obj[0] or []
