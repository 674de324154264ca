"""An FP8 ``Conv1D`` (GPT-2's linear layer, weight stored (in, out)) is an FP8 ``Linear`` on the transposed
weight: bit for bit the same output, input gradient, weight gradient (transposed back) and statistics (the
sums of squares to float64 rounding), for every recipe, with the weight copy kept within a step as a
parameter's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8_trainer
from fp8_trainer import Conv1D, CurrentScaling, DelayedScaling, Float8BlockScaling, MXFP8BlockScaling
from tests.kernels.exact_checks import same_row

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency")

RECIPES = [DelayedScaling(), CurrentScaling(), MXFP8BlockScaling(), Float8BlockScaling()]


def _pair(recipe):
    torch.manual_seed(0)
    conv = transformers.pytorch_utils.Conv1D(96, 64)  # nx = 64 in, nf = 96 out: weight (64, 96)
    linear = nn.Linear(64, 96)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    a = fp8_trainer.convert_to_fp8(nn.Sequential(conv), recipe=recipe)
    b = fp8_trainer.convert_to_fp8(nn.Sequential(linear), recipe=recipe)
    assert isinstance(a[0], Conv1D) and a[0].weight is conv.weight
    return a, b


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.scaling)
def test_fp8_conv1d_is_the_fp8_linear_of_its_transposed_weight(recipe):
    a, b = _pair(recipe)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 32, 64, generator=g) * (10.0 if step == 2 else 1.0)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
            ya, yb = a(xa), b(xb)
        assert torch.equal(ya, yb)
        ya.square().mean().backward()
        yb.square().mean().backward()
        assert torch.equal(xa.grad, xb.grad)
        assert torch.equal(a[0].weight.grad, b[0].weight.grad.t())
        assert torch.equal(a[0].bias.grad, b[0].bias.grad)
        sa = fp8_trainer.get_fp8_state(a).newest_stats()
        sb = fp8_trainer.get_fp8_state(b).newest_stats()
        # every column exact but the float64 sums of squares, taken over the view in another order
        same_row(sa, sb, f"step {step}")


def test_the_transposed_weight_is_quantized_once_per_step_as_a_parameter():
    a, _ = _pair(DelayedScaling())
    state = fp8_trainer.get_fp8_state(a)
    x = torch.randn(16, 64)
    for i in range(3):  # three micro-batches of one step
        with fp8_trainer.fp8_autocast(step_boundary=i == 2):
            a(x.clone().requires_grad_()).sum().backward()
        if i == 0:
            held = state.weight_cache.values()[0][0]
        elif i == 1:
            assert state.weight_cache.values()[0][0] is held  # the copy of the view, kept
    assert fp8_trainer.step_stats(a)[1, 5] == 64 * 96  # the weight counted once
