"""``fp8-train``'s settings live in one place, ``TrainConfig``: the flags' defaults are its defaults, and what
``prepare`` hands to ``train`` is a frozen ``TrainConfig``."""

import dataclasses

import pytest

from fp8_trainer.app import cli
from fp8_trainer.app.build import make_recipe, run_config
from fp8_trainer.app.train_config import HISTORY_LEN, TrainConfig


def test_every_flag_is_a_field_with_the_same_default(monkeypatch):
    monkeypatch.delenv("FP8SCOPE_URL", raising=False)
    parsed = vars(cli.build_parser().parse_args([]))
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    assert set(parsed) == set(fields)
    defaults = dataclasses.asdict(TrainConfig())
    for name, value in parsed.items():
        assert (tuple(value) if isinstance(value, list) else value) == defaults[name], name


def test_prepare_returns_a_frozen_config_with_derived_defaults(monkeypatch):
    monkeypatch.delenv("FP8SCOPE_URL", raising=False)
    a, _ = cli.prepare(["--steps", "3", "--lr", "2e-3", "--tag", "x", "--tag", "y"])
    assert isinstance(a, TrainConfig)
    assert a.min_lr == pytest.approx(2e-4) and a.tags == ("x", "y")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.steps = 4
    # the configuration as the monitor and checkpoints store it: JSON lists, no token
    cfg = run_config(a, 256)
    assert cfg["tags"] == ["x", "y"] and "token" not in cfg and cfg["vocab_size"] == 256


def test_history_length_default_is_stated_once():
    a, _ = cli.prepare(["--steps", "3"])
    assert make_recipe(a).amax_history_len == HISTORY_LEN
    assert make_recipe(dataclasses.replace(a, amax_history_len=1024)).amax_history_len == 1024
