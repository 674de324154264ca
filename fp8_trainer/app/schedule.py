"""Learning-rate schedules: linear warmup, then cosine, linear or constant (a pure function of the step)."""

from __future__ import annotations

import math

__all__ = ["LR_SCHEDULES", "lr_at"]

LR_SCHEDULES = ("cosine", "linear", "constant")


def lr_at(
    step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int, schedule: str = "cosine"
) -> float:
    """Learning rate of optimizer step ``step`` (1-based).

    Warmup: ``lr * step / warmup_steps`` for the first ``warmup_steps`` steps. Then ``constant`` keeps
    ``lr``; ``cosine`` and ``linear`` decay from ``lr`` to ``min_lr``, reaching it at ``total_steps``.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"schedule: expected one of {LR_SCHEDULES}, got {schedule!r}")
    if step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))  # (0, 1]
    if schedule == "linear":
        return lr + (min_lr - lr) * progress
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
