"""Per-layer recipe overrides at run time: validation, rollback, FP8 off/on, history length, scaling mode."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8_trainer
from fp8_trainer import DelayedScaling, fp8_autocast, set_layer_recipe


def model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    return fp8_trainer.convert_to_fp8(m, recipe=DelayedScaling(amax_history_len=4))


def step(m, amax: float):
    x = torch.full((3, 32), amax, requires_grad=True)
    with fp8_autocast():
        y = m(x)
    y.sum().backward()
    return y


def test_layer_margin_and_rollback():
    m = model()
    state = fp8_trainer.get_fp8_state(m)
    prev = set_layer_recipe(m, "0", margin=2, amax_compute_algo="most_recent")
    assert prev == {"margin": 0, "amax_compute_algo": "max"}
    step(m, 8.0)
    assert state.scale[0].item() == 448 / 8 / 4  # layer 0 input: margin 2
    step(m, 4.0)
    assert state.scale[0].item() == 448 / 4 / 4  # most_recent, not max(8, 4)
    recipes = fp8_trainer.get_layer_recipes(m)
    assert recipes["0"]["margin"] == 2 and recipes["2"]["margin"] == 0
    json.dumps(recipes)
    set_layer_recipe(m, "0", **prev)  # roll back
    assert fp8_trainer.get_layer_recipes(m)["0"] == fp8_trainer.get_layer_recipes(m)["2"]
    step(m, 2.0)
    assert state.scale[0].item() == 448 / 8  # max over the window [2, 4, 8], margin 0


def test_errors_change_nothing():
    m = model()
    before = fp8_trainer.get_layer_recipes(m)
    with pytest.raises(ValueError, match="layer_name"):
        set_layer_recipe(m, "nope", margin=1)
    with pytest.raises(ValueError, match="^amax_compute_algo:"):
        set_layer_recipe(m, "0", margin=1, amax_compute_algo="mean")
    with pytest.raises(ValueError, match="^amax_history_len:"):
        set_layer_recipe(m, None, amax_history_len=0)
    with pytest.raises(ValueError, match="^scaling:"):
        set_layer_recipe(m, "model", scaling="sometimes")
    with pytest.raises(ValueError, match="^fp8_enabled:"):
        set_layer_recipe(m, "2", fp8_enabled="off")
    assert fp8_trainer.get_layer_recipes(m) == before


def test_fp8_off_runs_in_input_precision_and_back_on():
    m = model()
    state = fp8_trainer.get_fp8_state(m)
    step(m, 2.0)
    hist_before, scale_before = state.amax_history[:, 3:6].clone(), state.scale[3:6].clone()
    assert set_layer_recipe(m, "2", fp8_enabled=False) == {"fp8_enabled": True}
    x = torch.randn(5, 32)
    with fp8_autocast():
        y = m(x)
    assert torch.equal(y, F.linear(F.relu(m[0](x)), m[2].weight, m[2].bias)) is False  # layer 0 still FP8
    with fp8_autocast():
        h = m[0](x).relu()
        assert torch.equal(m[2](h), F.linear(h, m[2].weight, m[2].bias))
    step(m, 3.0)
    rows = fp8_trainer.step_stats(m)[3:6]
    assert rows[:, [0, 2, 3, 4, 5]].abs().sum().item() == 0  # rows exist, with zeros
    assert torch.equal(rows[:, 1].float(), scale_before)  # and the last scale
    assert torch.equal(state.amax_history[:, 3:6], hist_before) and torch.equal(
        state.scale[3:6], scale_before
    )
    set_layer_recipe(m, "2", fp8_enabled=True)
    step(m, 3.0)
    assert fp8_trainer.step_stats(m)[3, 5].item() > 0
    with fp8_autocast():
        assert not torch.equal(m[2](h), F.linear(h, m[2].weight, m[2].bias))


def test_history_len_change_keeps_newest_entries():
    m = model()
    state = fp8_trainer.get_fp8_state(m)
    for a in (1.0, 2.0, 4.0, 8.0):
        step(m, a)
    assert state.amax_history[:, 0].tolist() == [8, 4, 2, 1]
    assert set_layer_recipe(m, "0", amax_history_len=2) == {"amax_history_len": 4}
    assert state.amax_history[:, 0].tolist() == [8, 4, 0, 0]
    assert state.amax_history[:, 3].tolist() != [0, 0, 0, 0]  # other layer untouched
    set_layer_recipe(m, "0", amax_history_len=4)
    assert state.amax_history[:, 0].tolist() == [8, 4, 0, 0]  # dropped entries do not come back
    set_layer_recipe(m, None, amax_history_len=6)
    assert state.amax_history.shape[0] == 6
    step(m, 0.5)
    assert state.amax_history[:, 0].tolist() == [0.5, 8, 4, 0, 0, 0]


def test_switch_layer_to_current_scaling_and_model_wide_margin():
    m = model()
    state = fp8_trainer.get_fp8_state(m)
    step(m, 1.0)
    set_layer_recipe(m, "0", scaling="current")
    prev = set_layer_recipe(m, "model", margin=1)
    assert prev == {"margin": 0}
    step(m, 7.0)
    stats = fp8_trainer.step_stats(m)
    assert stats[0, 1].item() == pytest.approx(448 / 7, rel=1e-7)  # used this step's own amax
    assert stats[0, 2].item() == 0  # so nothing saturated although the amax jumped from 1 to 7
    # layer 2 stays delayed and picks up the model-wide margin 1
    assert state.scale[3].item() == (torch.tensor(448.0) / state.amax_history[:, 3].max() / 2).item()
    assert fp8_trainer.get_layer_recipes(m)["2"]["scaling"] == "delayed"
