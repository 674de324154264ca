"""The end-of-run health table's worst tensor: its shares of saturated and flushed elements read as what
they are, a few elements of a million included."""

from __future__ import annotations

import torch
from torch import nn

from fp8_protocol.stats import BASE_COLUMNS, NUMEL, OVERFLOW, SCALE, UNDERFLOW
from fp8_trainer import DelayedScaling
from fp8_trainer.app.report import health_table
from fp8_trainer.convert import convert_to_fp8, tensor_table


def test_worst_tensor_shares_never_round_a_few_elements_to_zero():
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), DelayedScaling())
    names = [t.name for t in tensor_table(model)]
    stats = torch.zeros(len(names), len(BASE_COLUMNS), dtype=torch.float64)
    stats[:, NUMEL] = 1e6
    stats[:, SCALE] = 1.0
    stats[4, OVERFLOW] = 3  # 3 of a million: 0.0003%
    stats[4, UNDERFLOW] = 25_000  # 2.5%
    stats[1, UNDERFLOW] = 40_000  # more flushed, but nothing saturated: not the worst
    last = health_table(model, stats).splitlines()[-1]
    assert last == f"worst: {names[4]} (nonfinite 0, overflow <0.01%, underflow 2.50%)"
    stats[4, OVERFLOW] = 0
    assert health_table(model, stats).splitlines()[-1] == (
        f"worst: {names[1]} (nonfinite 0, overflow 0.00%, underflow 4.00%)"
    )
