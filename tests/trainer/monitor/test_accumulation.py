"""Every micro-batch reaches the monitor, whatever the gradient-accumulation loop looks like.

A Transformer-Engine-style loop (no ``step_boundary=False``) closes one FP8 step per micro-batch; before, the
monitor forwarded only the newest one, so a micro-batch that saturated (amax 50 between two of amax 1) never
reached the service. Checked here through a real ``fp8-monitor serve``: the stored statistics of each
optimizer step are the merge of its micro-batches (amax max, the scale that scaled it, counts summed), and the
invariant a user reads off the headroom heatmap holds: headroom < 0 only where something overflowed.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

import fp8_trainer
from fp8_trainer import CurrentScaling, DelayedScaling, Monitor, StatsReader, fp8_autocast
from fp8_trainer.merge import merge_step_stats
from tests.support.polling import wait_until
from tests.trainer.monitor_utils import FAST, get, stored_stats

MICRO = (1.0, 50.0, 1.0)  # the input amax of each micro-batch; the middle one saturates at scale ~448


def _model(recipe):
    torch.manual_seed(0)
    return fp8_trainer.convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16)), recipe=recipe)


def _micro_batch(amax: float, step: int, i: int) -> torch.Tensor:
    x = torch.rand(8, 32, generator=torch.Generator().manual_seed(10 * step + i)) * 0.5 + 0.25
    x[0, 0] = amax
    return x


def _train(model, recipe, steps: int, boundary_each: bool, monitor=None, reader=None):
    """Returns per optimizer step the statistics each micro-batch recorded (its own FP8 step or not)."""
    state = fp8_trainer.get_fp8_state(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    per_step, got = {}, {}
    for step in range(1, steps + 1):
        rows = []
        for i, amax in enumerate(MICRO):
            last = i == len(MICRO) - 1
            with fp8_autocast(fp8_recipe=recipe, step_boundary=boundary_each or last):
                y = model(_micro_batch(amax, step, i))
            y.square().mean().backward()
            if boundary_each:
                rows.append(fp8_trainer.step_stats(model).clone())
        if not boundary_each:
            rows.append(fp8_trainer.step_stats(model).clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
        per_step[step] = rows
        if monitor is not None:
            monitor.step(step, loss=float(step))
        if reader is not None:
            polled = reader.poll()
            if polled is not None:
                got[step - 1] = (polled[1], reader.merged)
    assert state.steps == steps * (len(MICRO) if boundary_each else 1)
    return per_step, got


def test_reader_merges_the_steps_closed_between_polls():
    model = _model(DelayedScaling(amax_history_len=4))
    reader = StatsReader(model)
    per_step, got = _train(model, DelayedScaling(amax_history_len=4), 4, boundary_each=True, reader=reader)
    assert sorted(got) == [1, 2, 3]
    for step, (stats, merged) in got.items():
        assert merged == 3
        rows = per_step[step]
        want = merge_step_stats(merge_step_stats(rows[0], rows[1]), rows[2])
        assert torch.equal(stats, want)
        assert stats[0, 0].item() == 50.0  # the saturating micro-batch is there
        assert stats[0, 1].item() == rows[1][0, 1].item()  # paired with the scale that scaled it
        assert stats[0, 5].item() == sum(r[0, 5].item() for r in rows)  # numel of all three


@pytest.mark.parametrize("boundary_each", [True, False], ids=["te-style", "step_boundary=False"])
@pytest.mark.parametrize(
    "recipe", [DelayedScaling(amax_history_len=4), CurrentScaling()], ids=["delayed", "current"]
)
def test_every_micro_batch_reaches_the_service(server, recipe, boundary_each, caplog):
    model = _model(recipe)
    name = f"accum-{recipe.scaling}-{boundary_each}"
    with caplog.at_level(logging.WARNING), Monitor(server.url, name, model, recipe, **FAST) as mon:
        per_step, _ = _train(model, recipe, 5, boundary_each, monitor=mon)
    merged_said = [r for r in caplog.records if "FP8 steps closed between two monitor.step()" in r.message]
    assert len(merged_said) == (1 if boundary_each else 0)  # said once, and only where it happens
    assert wait_until(lambda: get(server.url, f"/runs/{mon.run_id}")["steps_stored"] == 5)
    stored = stored_stats(server.url, mon.run_id)
    assert stored["steps"].tolist() == [1, 2, 3, 4, 5]
    for col, step in enumerate(stored["steps"]):
        rows = per_step[int(step)]
        want = rows[0]
        for r in rows[1:]:
            want = merge_step_stats(want, r)
        want = want.numpy()
        # the first layer's input: amax 50 from the middle micro-batch, counted with its own scale
        assert stored["amax"][0, col] == 50.0
        for j, metric in enumerate(("amax", "scale", "overflow", "underflow", "nonfinite")):
            np.testing.assert_array_equal(stored[metric][:, col], want[:, j], err_msg=f"{metric} step {step}")
    # what the headroom heatmap shows, log2(FP8_MAX / (amax * scale)): below the cast's rounding threshold
    # (464 for E4M3, 61440 for E5M2: up to there values round to FP8_MAX and lose nothing) only where
    # something overflowed. Pairing the max amax with another micro-batch's scale broke this by binades.
    threshold = np.array([464.0, 464.0, 61440.0] * 2)[:, None]
    bad = (stored["amax"] * stored["scale"] > threshold) & (stored["overflow"] == 0)
    assert not bad.any(), np.argwhere(bad)
