"""``FP8State.set_capturable``: the end of a step updates the scaling state in place, which is what lets a
CUDA graph replay a whole training step (``fp8_trainer.graphs.GraphedStep``; its GPU test replays one).

On the CPU: a capturable model trains bit for bit as the default one (scales, history, statistics, what a
``StatsReader`` hands out), while every buffer a replay would read or write keeps its address from step to
step; the host side of a step (``replayed``) is the only thing left to run after a replay; and replacing
buffers outside a step (a recipe change, a checkpoint load) bumps ``version``, which tells a captured graph
that it is stale."""

import pytest
import torch
from torch import nn

import fp8_trainer
from fp8_trainer.block_linear import BLOCK_WIDTH, split_block_stats
from fp8_trainer.convert import get_fp8_state

pytestmark = pytest.mark.usefixtures("one_thread")

BUFFERS = ("amax_history", "scale", "scale_inv", "stats", "last_stats", "step_t")


RECIPES = {
    "delayed": fp8_trainer.DelayedScaling,
    "current": fp8_trainer.CurrentScaling,
    "mxfp8": fp8_trainer.MXFP8BlockScaling,
    "block": fp8_trainer.Float8BlockScaling,
}


def _model(recipe: str = "delayed") -> nn.Module:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    return fp8_trainer.convert_to_fp8(mlp, recipe=RECIPES[recipe]())


def _train(model: nn.Module, steps: int, reader=None, on_step=None) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    got = []
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(32, 32, generator=g) * (1 + 3 * (i % 3))  # amaxes that move the scales
        with fp8_trainer.fp8_autocast(fp8_recipe=get_fp8_state(model).recipe):
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if reader is not None:
            got.append(reader.poll())
        if on_step is not None:
            on_step()
    return got


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_capturable_trains_bit_for_bit_as_default_with_fixed_buffers(recipe):
    plain, cap = _model(recipe), _model(recipe)
    state = get_fp8_state(cap)
    state.set_capturable(True)
    block = recipe in ("mxfp8", "block")
    buffers = BUFFERS + (("block_stats", "last_block_stats") if block else ())
    r_plain, r_cap = fp8_trainer.StatsReader(plain), fp8_trainer.StatsReader(cap)
    _train(cap, 1)  # the first step allocates last_stats
    _train(plain, 1)
    r_plain.poll(), r_cap.poll()
    ptrs = {name: getattr(state, name).data_ptr() for name in buffers}
    seen = []
    got_cap = _train(
        cap, 6, r_cap, on_step=lambda: seen.append({n: getattr(state, n).data_ptr() for n in buffers})
    )
    got_plain = _train(plain, 6, r_plain)
    assert all(s == ptrs for s in seen)  # same addresses every step
    ps = get_fp8_state(plain)
    assert ps.steps == state.steps == 7
    names = ("amax_history", "scale", "scale_inv", "last_stats", "step_t")
    for name in names + (("last_block_stats",) if block else ()):
        assert torch.equal(getattr(ps, name), getattr(state, name)), name
    assert [g[0] for g in got_cap[1:]] == [g[0] for g in got_plain[1:]] == list(range(2, 7))
    for a, b in zip(got_cap[1:], got_plain[1:], strict=True):
        assert torch.equal(a[1], b[1])
    if block:  # readers get the block part (block counts, exponent histogram) of every step, as eagerly
        assert all(g[1].shape[1] == ps.last_stats.shape[1] + BLOCK_WIDTH for g in got_cap[1:])
        assert all(split_block_stats(g[1])[1][:, 0].sum() > 0 for g in got_cap[1:])  # blocks counted
    for p, q in zip(plain.parameters(), cap.parameters(), strict=True):
        assert torch.equal(p, q)
    # the statistics handed out are copies: the next step overwrites the buffer, not what a reader holds
    held = got_cap[-1][1].clone()
    _train(cap, 1)
    assert torch.equal(got_cap[-1][1], held)


def test_replayed_is_the_host_side_of_a_step():
    model = _model()
    state = get_fp8_state(model)
    state.set_capturable(True)
    reader = fp8_trainer.StatsReader(model)
    _train(model, 2)
    assert reader.take()[1] == 2
    state.replayed()  # what GraphedStep does after a replay: count the step, hand its statistics on
    stats, n = reader.take()
    assert n == 1 and state.steps == 3
    assert torch.equal(stats, state.last_stats) and stats.data_ptr() != state.last_stats.data_ptr()


def test_buffers_replaced_outside_a_step_bump_the_version():
    model = _model()
    state = get_fp8_state(model)
    state.set_capturable(True)
    _train(model, 2)
    v = state.version
    _train(model, 1)
    assert state.version == v  # steps alone never do
    fp8_trainer.set_layer_recipe(model, "0", margin=1)
    assert state.version > v
    v = state.version
    saved = model.state_dict()
    model.load_state_dict(saved)
    assert state.version > v


def test_switching_mid_step_is_refused():
    model = _model()
    state = get_fp8_state(model)
    with fp8_trainer.fp8_autocast():
        model(torch.randn(4, 32)).sum()
    with pytest.raises(RuntimeError, match="pending"):
        state.set_capturable(True)
