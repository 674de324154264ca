"""The step path of a torch.distributed job: every rank calls ``Monitor.step`` alike; rank 0 reports.

Each call hands this rank's statistics to ``RankSync`` (one asynchronous gather per step, see ``ranks.py``)
and gets back the gathered blocks of earlier steps. From each block rank 0 reports the reduced statistics
with the scalars it kept for that step, and now and then every rank's amaxes; and when rank 0 announced
commands in a block's header, every rank enters the broadcast that carries them at the same call and applies
them there, so all ranks change their recipe between the same two optimizer steps.

Block-scaling statistics (the block columns and scale exponent histograms of block-scaled layers) are
reduced over ranks too: once the model has had a block-scaled layer (the same step on every rank: recipe
changes are applied in step, above) each rank's block part rides in its gather, and rank 0 reports their
merge (``reduce_rank_block``: counts and histograms summed, ``block_range`` the max), so an overflowing
block on any rank shows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from fp8_protocol.client_events import RANK_AMAX_EVENT, rank_amax_details
from fp8_protocol.stats import AMAX, BASE_COLUMNS, STAT_COLUMNS

from .ranks import (
    DATA_LEAD,
    HAS_BLOCK,
    HAS_QUALITY,
    HAS_STATS,
    N_COMMANDS,
    RankSync,
    reduce_rank_block,
    reduce_rank_stats,
)
from .step_path import StepParts, StepPath

__all__ = ["MultiRankSteps"]


class MultiRankSteps(StepPath):
    """Steps of one rank of a distributed job (module docstring).

    Args:
        ranks: this rank's gather pipeline.
        parts: the ``StepParts``; only rank 0 hears commands in its inbox, reports, and has a sender (None
            on the other ranks).
        model: the model (a run without FP8 still gathers on its device).
        recipe: the run's recipe (None: a step without statistics on any rank is no news).
        n_tensors: rows of a statistics block.
        rank_sample_interval: every how many steps rank 0 sends the per-rank amaxes.
        copies: ``(n_tensors,)`` bool, the rows that are copies of one tensor on every data-parallel rank
            (the weights), reduced once rather than summed (``ranks.py``); None: none.
    """

    def __init__(
        self,
        ranks: RankSync,
        parts: StepParts,
        *,
        model: nn.Module,
        recipe,
        n_tensors: int,
        rank_sample_interval: int,
        copies: np.ndarray | None = None,
    ):
        super().__init__(parts)
        self._ranks = ranks
        self.rank = ranks.rank
        self._model = model
        self._recipe = recipe
        self.n_tensors = n_tensors
        self.rank_sample_interval = rank_sample_interval
        self._copies = copies
        self._scalars_by_step: dict[int, Any] = {}  # rank 0: the scalars of steps not reported yet
        self._announced: list[list[dict[str, Any]]] = []  # rank 0: commands announced, not yet broadcast

    def step(self, step: int, holder) -> None:
        n_commands = 0
        if self.rank == 0:
            self._scalars_by_step[step] = holder
            new = self._inbox.take()
            if new:
                self._announced.append(new)
                n_commands = len(new)
        taken = self._reader.take() if self._reader is not None else None
        stats = None
        if taken is not None:
            stats, merged = taken
            self._notices.merged(merged)
        if stats is not None:
            device = stats.device
        else:  # a bf16/fp32 baseline: the gather still needs the backend's device (NCCL: the GPU)
            device = next((p.device for p in self._model.parameters()), torch.device("cpu"))
        # the gathered width must agree on every rank: it follows the recipe state, which every rank changes
        # at the same step, never this rank's own statistics (read before this call applies any command)
        with_block = self._reader is not None and self._reader.has_block_part()
        lead = self._reader is None or self._reader.data_lead()
        for s, block in self._ranks.step(step, stats, n_commands, device, with_block, lead):
            self._handle_block(s, block, closing=False, now=step)

    def close(self) -> None:
        """Report every step still in flight (commands announced in them are not applied any more)."""
        for s, block in self._ranks.flush():
            self._handle_block(s, block, closing=True)

    def unapplied(self) -> list[dict[str, Any]]:
        """Commands rank 0 announced that no step boundary applied (at close)."""
        return [c for batch in self._announced for c in batch]

    def _handle_block(self, s: int, block: np.ndarray, closing: bool, now: int | None = None) -> None:
        header = block[0, self.n_tensors]
        if self.rank == 0:
            try:
                self._report_block(s, block, header)
            except Exception:  # never skip the broadcast below: the other ranks would wait in it forever
                self._notices.once("report-error", "fp8scope monitor: reporting a step failed", exc=True)
        if header[N_COMMANDS] and not closing:
            # every rank sees this header at the same call: all enter the broadcast together
            commands = self._ranks.broadcast_commands(self._announced.pop(0) if self.rank == 0 else None)
            acks = self._apply(commands, now)
            if self._sender is not None:
                for ack in acks:
                    self._sender.put_ack(ack)

    def _report_block(self, s: int, gathered: np.ndarray, header: np.ndarray) -> None:
        """Rank 0: step ``s``'s reduced statistics to the reporter, and every rank's amaxes now and then."""
        T = self.n_tensors
        holder = self._scalars_by_step.pop(s, None)
        if not (header[HAS_STATS] or self._recipe is None):  # no FP8 layer ran in this step on any rank
            self._notices.no_fp8(s)
            self._report(s, None, holder)
            return
        # one rank per tensor-parallel group: its other ranks hold the same rows (ranks.py)
        leads = gathered[gathered[:, T, DATA_LEAD] > 0]
        # the quality columns only where every rank with statistics had them
        with_stats = leads[:, T, HAS_STATS] > 0
        quality = bool(np.all(leads[with_stats, T, HAS_QUALITY] > 0))
        width = len(STAT_COLUMNS) if quality else len(BASE_COLUMNS)
        reduced = reduce_rank_stats(leads[:, :T, :width], self._copies) if T else None
        if reduced is not None and np.any(leads[:, T, HAS_BLOCK] > 0):
            # the ranks without a block part in this step sent zeros there (ranks.py)
            block = reduce_rank_block(leads[:, :T, len(STAT_COLUMNS) :], self._copies)
            reduced = np.concatenate([reduced, block], axis=1)
        self._report(s, reduced, holder)
        if T and s % self.rank_sample_interval == 0:
            details = rank_amax_details(gathered[:, :T, AMAX].tolist())
            self._sender.put_event({"kind": RANK_AMAX_EVENT, "step": s, "details": details})
