"""Step boundary, gradient accumulation, the statistics contract, convert_to_fp8 and fp8_autocast."""

import json

import pytest
import torch
from torch import nn

import fp8_trainer
from fp8_trainer import STAT_COLUMNS, DelayedScaling, StatsReader, fp8_autocast


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.act = nn.GELU()
        self.inner = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 10))  # the last one is ineligible
        self.b = nn.Linear(10, 16)  # ineligible

    def forward(self, x):
        return self.b(self.inner(self.act(self.a(x))))


def net(recipe=None, **kw):
    torch.manual_seed(0)
    return fp8_trainer.convert_to_fp8(Net(), recipe=recipe or DelayedScaling(amax_history_len=8), **kw)


def train_step(model, x, opt=None, **autocast):
    with fp8_autocast(**autocast):
        loss = model(x).square().mean()
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()


def test_convert_reports_ineligible_and_filter():
    m = net()
    assert isinstance(m.a, fp8_trainer.Linear) and isinstance(m.inner[0], fp8_trainer.Linear)
    assert type(m.inner[1]) is nn.Linear and type(m.b) is nn.Linear
    assert set(fp8_trainer.ineligible_layers(m)) == {"inner.1", "b"}
    m2 = net(module_filter_fn=lambda mod, fqn: fqn != "a")
    assert type(m2.a) is nn.Linear and isinstance(m2.inner[0], fp8_trainer.Linear)
    assert [t.name for t in fp8_trainer.tensor_table(m2)] == [
        "inner.0.input",
        "inner.0.weight",
        "inner.0.grad_output",
    ]


def test_tensor_table_indices_and_formats():
    table = fp8_trainer.tensor_table(net())
    assert [(t.index, t.name, t.layer, t.role, t.format) for t in table] == [
        (0, "a.input", "a", "input", "e4m3"),
        (1, "a.weight", "a", "weight", "e4m3"),
        (2, "a.grad_output", "a", "grad_output", "e5m2"),
        (3, "inner.0.input", "inner.0", "input", "e4m3"),
        (4, "inner.0.weight", "inner.0", "weight", "e4m3"),
        (5, "inner.0.grad_output", "inner.0", "grad_output", "e5m2"),
    ]
    assert json.loads(json.dumps(table[2].to_dict()))["format"] == "e5m2"
    e4m3 = fp8_trainer.tensor_table(net(DelayedScaling(fp8_format="E4M3")))
    assert {t.format for t in e4m3} == {"e4m3"}


def test_one_history_entry_per_optimizer_step():
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    state = fp8_trainer.get_fp8_state(m)
    xs = [torch.full((5, 32), float(2**i)) for i in range(4)]  # input amax 1, 2, 4, 8
    for i, x in enumerate(xs):
        train_step(m, x, opt)
        assert state.steps == i + 1  # closed at the end of backward, no extra call
        assert int(state.step_t) == i + 1
    assert state.amax_history[:4, 0].tolist() == [8.0, 4.0, 2.0, 1.0]  # newest first, one per step
    assert state.amax_history[4:, 0].tolist() == [0.0] * 4
    assert state.scale[0].item() == 448 / 8
    # the stats of the last step report the scale used in it (computed after step 3 from max(1,2,4))
    stats = fp8_trainer.step_stats(m)
    assert stats.shape == (6, len(STAT_COLUMNS)) and stats.dtype == torch.float64
    # delayed scaling lags: 8 * 112 = 896 > 448, so all 160 input elements saturated in step 4
    assert stats[0, :6].tolist() == [8.0, 448 / 4, 160, 0, 0, 5 * 32]
    assert stats[1, 5].item() == 64 * 32 and stats[2, 5].item() == 5 * 64


def test_forward_without_backward_is_closed_at_next_region():
    m = net()
    state = fp8_trainer.get_fp8_state(m)
    x = torch.ones(3, 32, requires_grad=True)
    with fp8_autocast():
        m(x)
    assert state.steps == 0 and state.pending
    with fp8_autocast():
        m(x)
    assert state.steps == 1
    fp8_trainer.end_step(m)
    fp8_trainer.end_step(m)  # idempotent
    assert state.steps == 2
    with torch.no_grad(), fp8_autocast():  # evaluation: quantized with current scales, nothing recorded
        m(x)
    assert not state.pending and state.steps == 2


def test_gradient_accumulation_max_amax_and_summed_counts():
    m = net()
    state = fp8_trainer.get_fp8_state(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    micro = [torch.full((3, 32), 2.0), torch.full((4, 32), -16.0), torch.full((5, 32), 4.0)]
    for step in range(2):
        for i, x in enumerate(micro):
            train_step(m, x, step_boundary=i == len(micro) - 1)
            assert state.steps == step + (i == len(micro) - 1)
        opt.step()
    assert state.amax_history[:3, 0].tolist() == [16.0, 16.0, 0.0]  # one entry per step: the max
    stats = fp8_trainer.step_stats(m)
    assert stats[0, 5].item() == (3 + 4 + 5) * 32  # numel summed over micro-batches
    assert stats[1, 5].item() == 64 * 32  # the weight is quantized (and counted) once per step
    assert stats[0, 1].item() == 448 / 16
    # step 2 under scale 28: 16*28 = 448 fits, nothing saturated; step 1 under scale 1 had none either
    assert stats[0, 2].item() == 0


@pytest.mark.parametrize(
    "recipe",
    [None, fp8_trainer.CurrentScaling(), fp8_trainer.Float8BlockScaling()],
    ids=["delayed", "current", "block"],
)
def test_weight_quantized_once_per_step_and_again_after_it_changes(recipe):
    m = net(recipe)
    state = fp8_trainer.get_fp8_state(m)
    x = torch.randn(4, 32)

    def micro(boundary: bool) -> torch.Tensor:
        with fp8_autocast(fp8_recipe=recipe, step_boundary=boundary):
            y = m(x)
        y.square().mean().backward()
        return y.detach()

    y1 = micro(False)
    held = {k: v[0] for k, v in state.weight_cache.values().items()}  # each layer's FP8 weight
    assert len(held) == 2  # both FP8 layers
    y2 = micro(False)
    assert torch.equal(y1, y2)
    held_now = state.weight_cache.values()
    assert all(held_now[k][0] is q for k, q in held.items())  # the same copy, not requantized
    with torch.no_grad():
        m.a.weight.mul_(2)  # changed within the step: its version counter moves, its copy is made again
    y3 = micro(True)
    assert not torch.equal(y3, y2)
    assert state.steps == 1 and len(state.weight_cache) == 0  # emptied when the step closed
    stats = fp8_trainer.step_stats(m)
    # the first layer's weight recorded twice (the change), the second's once; the inputs three times
    assert stats[1, 5].item() == 2 * 64 * 32 and stats[4, 5].item() == 48 * 64
    assert stats[0, 5].item() == 3 * 4 * 32


def test_counts_are_recorded_per_step():
    m = net(DelayedScaling(amax_history_len=1))
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    train_step(m, torch.full((2, 32), 1.0), opt)  # scale becomes 448
    x = torch.full((2, 32), 1.0)
    x[0, :3] = 2.0  # 2 * 448 saturates
    x[1, :2] = 1e-6  # 4.5e-4 < 2^-10: underflows
    x[1, 5] = float("nan")
    train_step(m, x, opt)
    row = fp8_trainer.step_stats(m)[0]
    assert row[0].item() == 2.0  # the amax ignores the NaN element, as Transformer Engine's does
    assert row[1:6].tolist() == [448.0, 3, 2, 1, 64]  # ... which the nonfinite count still records
    scale_after = fp8_trainer.get_fp8_state(m).scale[0].item()
    assert scale_after == 224.0  # the scale follows the finite values: 448 / 2


def test_step_stats_is_a_snapshot_and_reader_is_one_step_late():
    m = net()
    reader = StatsReader(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    assert reader.poll() is None
    train_step(m, torch.full((2, 32), 1.0), opt)
    first = fp8_trainer.step_stats(m)
    assert reader.poll() is None  # started the copy of step 1
    assert reader.poll() is None  # no new step: nothing new started, nothing handed back
    train_step(m, torch.full((2, 32), 3.0), opt)
    assert first[0, 0].item() == 1.0  # not overwritten by step 2
    step, host = reader.poll()
    assert step == 1 and host.device.type == "cpu" and host[0, 0].item() == 1.0
    assert reader.read_now()[0] == 2 and reader.read_now()[1][0, 0].item() == 3.0


def test_autocast_disabled_and_recipe_from_region():
    m = net()
    state = fp8_trainer.get_fp8_state(m)
    x = torch.randn(4, 32)
    with fp8_autocast(enabled=False):
        y_off = m(x)
    assert not state.pending
    torch.testing.assert_close(y_off, Net.forward(m, x), rtol=0, atol=0)
    with fp8_autocast(fp8_recipe=DelayedScaling(margin=1, amax_history_len=8)):
        y_on = m(x.requires_grad_(True))
    y_on.sum().backward()
    assert not torch.equal(y_on, y_off)
    assert fp8_trainer.get_layer_recipes(m)["a"]["margin"] == 1
    assert state.scale[0].item() == (torch.tensor(448.0) / x.detach().abs().max() / 2).item()


def test_hot_path_never_reads_tensor_values_on_the_host(monkeypatch):
    """Forward, backward and the scale update (end of backward) must not sync: no .item(), .tolist(),
    .cpu() or Python truth value of a tensor. On the CPU nothing would stall, so make them raise."""
    m = net(DelayedScaling(amax_history_len=4))
    x = torch.randn(6, 32)
    train_step(m, x)  # first step outside the guard (lazy set-up is allowed to look)

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a tensor value on the hot path")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for micro in range(2):
        train_step(m, x, step_boundary=micro == 1)
    fp8_trainer.set_layer_recipe(m, "a", scaling="current")
    train_step(m, x)
    monkeypatch.undo()
    assert fp8_trainer.get_fp8_state(m).steps == 3
