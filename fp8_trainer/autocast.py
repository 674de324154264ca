"""``fp8_autocast``: the region in which FP8 Linears run in FP8.

Usage, as with Transformer Engine (no extra call per step)::

    for x, y in batches:
        with fp8_autocast(fp8_recipe=recipe):
            loss = model(x, y)
        loss.backward()        # the step's statistics enter the amax history when backward ends
        opt.step()

Gradient accumulation: every micro-batch but the last of an optimizer step uses ``step_boundary=False``,
so its amaxes (max) and counts (sum) accumulate into the same step::

    for i, (x, y) in enumerate(micro_batches):
        with fp8_autocast(fp8_recipe=recipe, step_boundary=(i == len(micro_batches) - 1)):
            loss = model(x, y) / len(micro_batches)
        loss.backward()
    opt.step()

``fp8_trainer.end_step(model)`` closes a step explicitly at any point (for loops that do not fit the two
patterns above).

How it works: a recorded forward marks the model's state "pending" and remembers whether its region is a
step boundary. The FP8 Linear's backward queues a callback on the autograd engine that runs once when that
backward pass ends and, for a step-boundary region, closes the step (all_reduce of the amaxes, history
push, scale update). If no backward comes, the next recorded forward in another region closes it first.
So several forward+backward passes inside ONE ``step_boundary=True`` region are several steps: use
``step_boundary=False`` (or separate regions) for micro-batches. Forwards under ``torch.no_grad()``
(evaluation) use the current scales and record nothing.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .recipe import Recipe

__all__ = ["FP8Region", "current_region", "fp8_autocast", "is_fp8_enabled"]

_ids = itertools.count()


class _Local(threading.local):
    def __init__(self):
        self.stack: list[FP8Region] = []  # this thread's regions, innermost last


_local = _Local()


@dataclass(frozen=True)
class FP8Region:
    """One ``fp8_autocast`` region (its settings and a unique id)."""

    id: int
    enabled: bool
    recipe: Recipe | None
    group: object
    step_boundary: bool


class _Traced:
    """What a compiled graph may depend on: whether the innermost region, of the thread that entered or left
    one last, runs FP8. Dynamo guards on ``enabled`` (a change re-traces); everything else about a region
    (its id, recipe, group, step boundary) changes every step and is read where the FP8 operators run
    (``fp8_trainer.step.begin_forward``), never in traced code."""

    enabled = False


def fp8_traced_enabled() -> bool:
    """``is_fp8_enabled`` as a compiled graph reads it (``_Traced``)."""
    return _Traced.enabled


def _stack() -> list[FP8Region]:
    return _local.stack


def current_region() -> FP8Region | None:
    """The innermost active region, or ``None`` outside any ``fp8_autocast``."""
    s = _local.stack
    return s[-1] if s else None


def is_fp8_enabled() -> bool:
    """True inside an enabled ``fp8_autocast`` region."""
    r = current_region()
    return r is not None and r.enabled


@torch.compiler.disable
@contextmanager
def fp8_autocast(
    enabled: bool = True,
    fp8_recipe: Recipe | None = None,
    fp8_group=None,
    step_boundary: bool = True,
) -> Iterator[FP8Region]:
    """Run FP8 Linears in FP8 inside this region (outside, or with ``enabled=False``: input precision).

    Args:
        enabled: turn FP8 on (default) or off for the region.
        fp8_recipe: recipe for the region; ``None`` uses the one given to ``convert_to_fp8`` (default
            ``DelayedScaling()``). Per-layer overrides apply on top of it.
        fp8_group: process group whose ranks all-reduce (MAX) their amaxes before each scale update. ``None``:
            the default group if the recipe's ``reduce_amax`` is set and torch.distributed is initialised.
        step_boundary: the forward (and backward) of this region end the optimizer step; ``False`` for all
            but the last micro-batch of a step under gradient accumulation.
    """
    region = FP8Region(next(_ids), bool(enabled), fp8_recipe, fp8_group, bool(step_boundary))
    stack = _stack()
    stack.append(region)
    _Traced.enabled = region.enabled
    try:
        yield region
    finally:
        stack.pop()
        _Traced.enabled = bool(stack) and stack[-1].enabled
