"""Recipes: validation with field-naming errors, JSON round trip, format per role."""

import json

import pytest

from fp8_trainer import recipe
from fp8_trainer.formats import E4M3, E5M2
from fp8_trainer.recipe import CurrentScaling, DelayedScaling, Format, recipe_from_dict


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"margin": -1}, "margin"),
        ({"margin": float("nan")}, "margin"),
        ({"amax_history_len": 0}, "amax_history_len"),
        ({"amax_history_len": 2.5}, "amax_history_len"),
        ({"interval": 0}, "interval"),
        ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
        ({"fp8_format": "E3M4"}, "fp8_format"),
        ({"reduce_amax": "yes"}, "reduce_amax"),
    ],
)
def test_delayed_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        DelayedScaling(**kwargs)


def test_defaults_and_frozen():
    r = DelayedScaling()
    assert (r.margin, r.interval, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.reduce_amax) == (
        0,
        1,
        Format.HYBRID,
        1024,
        "max",
        True,
    )
    with pytest.raises(AttributeError):
        r.margin = 3
    assert DelayedScaling(fp8_format="e4m3").fp8_format is Format.E4M3


@pytest.mark.parametrize(
    "r",
    [
        DelayedScaling(),
        DelayedScaling(
            margin=2,
            interval=3,
            fp8_format=Format.E4M3,
            amax_history_len=16,
            amax_compute_algo="most_recent",
            reduce_amax=False,
        ),
        CurrentScaling(),
        CurrentScaling(fp8_format=Format.E4M3, power_2_scale=True),
    ],
)
def test_json_round_trip(r):
    d = json.loads(json.dumps(r.to_dict()))
    assert recipe_from_dict(d) == r
    assert type(r).from_dict(d) == r


@pytest.mark.parametrize("make", [DelayedScaling, CurrentScaling])
def test_pure_e5m2_is_refused_as_in_transformer_engine(make):
    with pytest.raises(ValueError, match="^fp8_format: pure E5M2 training is not supported"):
        make(fp8_format="e5m2")


def test_from_dict_errors():
    with pytest.raises(ValueError, match="^type:"):
        recipe_from_dict({"type": "sometimes"})
    with pytest.raises(ValueError, match="^bogus:"):
        DelayedScaling.from_dict({"type": "delayed", "bogus": 1})
    with pytest.raises(ValueError, match="^margin:"):
        recipe_from_dict({"type": "delayed", "margin": -2})
    with pytest.raises(ValueError, match="^type:"):
        CurrentScaling.from_dict({"type": "delayed"})


def test_format_per_role():
    assert [Format.HYBRID.for_role(r) for r in ("input", "weight", "grad_output")] == [E4M3, E4M3, E5M2]
    assert {Format.E4M3.for_role(r) for r in ("input", "grad_output")} == {E4M3}
    assert E4M3.max == 448 and E5M2.max == 57344
    assert recipe.Format is Format


def test_current_scaling_power_2_scale_round_trip_and_training():
    import torch
    from torch import nn

    import fp8_trainer
    from fp8_trainer import fp8_autocast

    r = CurrentScaling(power_2_scale=True)
    assert recipe_from_dict(json.loads(json.dumps(r.to_dict()))) == r
    with pytest.raises(ValueError, match="^power_2_scale:"):
        CurrentScaling(power_2_scale="yes")
    torch.manual_seed(0)
    model = fp8_trainer.convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16)), recipe=r)
    x = torch.randn(8, 32, requires_grad=True) * 3.7
    with fp8_autocast(fp8_recipe=r):
        model(x).square().sum().backward()
    stats = fp8_trainer.step_stats(model)
    amax, scale = stats[:, 0], stats[:, 1]
    fmax = torch.tensor([448.0, 448.0, 57344.0] * 2, dtype=torch.float64)
    assert torch.all(torch.log2(scale) == torch.round(torch.log2(scale)))  # powers of two
    assert torch.all(scale <= fmax / amax) and torch.all(scale > fmax / amax / 2)  # rounded down, one binade
    assert stats[:, 2].sum() == 0  # nothing can saturate under a scale rounded down
