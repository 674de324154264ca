"""Running a step again (``fp8_trainer.rewind``): put back to where the step began, the same step gives the
same loss, gradients, history and scales bit for bit; under a recipe change it gives what that change gives
from the start of the step; the readers get each step once."""

import pytest
import torch
from torch import nn

import fp8_trainer
from fp8_trainer import DelayedScaling, StatsReader, fp8_autocast
from fp8_trainer.rewind import rewind, scaling_state


def model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    return fp8_trainer.convert_to_fp8(net, recipe=DelayedScaling(amax_history_len=4))


def forward_backward(m, x):
    with fp8_autocast():
        loss = m(x).square().mean()
    loss.backward()
    return loss.detach()


def step(m, opt, x):
    loss = forward_backward(m, x)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def state_of(m):
    s = fp8_trainer.get_fp8_state(m)
    grads = [p.grad.clone() for p in m.parameters()]
    return s.amax_history.clone(), s.scale.clone(), s.scale_inv.clone(), int(s.step_t), s.steps, grads


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, list):
            assert_same(x, y)
        elif isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        else:
            assert x == y


def test_the_same_step_again_is_the_same_step_and_is_read_once():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    reader = StatsReader(m)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):  # a history that is not empty, scales that moved
        step(m, opt, torch.randn(8, 32, generator=g) * 3)
    reader.poll()
    reader.poll()  # every step so far handed out
    state = fp8_trainer.get_fp8_state(m)
    saved, x = scaling_state(state), torch.randn(8, 32, generator=g) * 50  # a jump the history has not seen
    loss = forward_backward(m, x)
    first = state_of(m)
    assert reader.take() is not None  # the readers had the step's statistics as it first ran
    m.zero_grad(set_to_none=True)
    rewind(state, saved)
    assert state.steps == first[4] - 1
    again = forward_backward(m, x)
    assert again.item() == loss.item()
    assert_same(state_of(m), first)
    assert reader.take() is None  # the run again is counted, not handed out a second time
    step(m, opt, x)
    assert reader.take()[1] == 1 and state.steps == first[4] + 1  # the next step reads as usual


def test_again_under_a_change_is_the_step_as_the_change_would_have_run_it():
    x = torch.randn(8, 32) * 50
    changed = model()  # the change in force from the start of the step
    fp8_trainer.set_layer_recipe(changed, "2", fp8_enabled=False)
    expected = forward_backward(changed, x)
    m = model()
    state = fp8_trainer.get_fp8_state(m)
    saved = scaling_state(state)
    first = forward_backward(m, x)
    m.zero_grad(set_to_none=True)
    rewind(state, saved)
    fp8_trainer.set_layer_recipe(m, "2", fp8_enabled=False)
    assert forward_backward(m, x).item() == expected.item() != first.item()
    assert_same(state_of(m), state_of(changed))


def test_only_between_steps():
    m = model()
    state = fp8_trainer.get_fp8_state(m)
    saved = scaling_state(state)
    with fp8_autocast():
        m(torch.randn(2, 32))  # a forward without its backward: the step is pending
    with pytest.raises(RuntimeError, match="rewind: a step is pending"):
        rewind(state, saved)
    with pytest.raises(RuntimeError, match="scaling_state: a step is pending"):
        scaling_state(state)
