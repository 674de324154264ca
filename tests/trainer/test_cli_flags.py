"""``fp8-train``'s flags are made from ``TrainConfig``'s fields: every field has a flag with the field's
default, in the group its ``flag`` names, and parsing an argv gives the ``TrainConfig`` it spells."""

import argparse
import dataclasses

import pytest

from fp8_trainer.app import cli, train_config
from fp8_trainer.app.flags import FLAG, add_flags, config_from_args, flag
from fp8_trainer.app.train_config import TrainConfig

FIELDS = dataclasses.fields(TrainConfig)


@pytest.fixture
def parser(monkeypatch) -> argparse.ArgumentParser:
    monkeypatch.delenv("FP8SCOPE_URL", raising=False)
    return cli.build_parser()


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's flags by destination, without ``--help``."""
    return {a.dest: a for a in parser._actions if not isinstance(a, argparse._HelpAction)}


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> TrainConfig:
    return config_from_args(TrainConfig, parser.parse_args(argv))


def test_every_field_has_a_flag_with_its_default(parser):
    flags = _flags(parser)
    for field in FIELDS:
        assert field.name in flags, f"no flag for TrainConfig.{field.name}"
        default = flags[field.name].default
        assert (tuple(default) if isinstance(default, list) else default) == field.default, field.name
    assert set(flags) == {f.name for f in FIELDS}  # and no flag without a field


def test_every_flag_is_in_its_fields_group_in_field_order(parser):
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    expected: dict[str, list[str]] = {}
    for field in FIELDS:
        expected.setdefault(field.metadata[FLAG].group, []).append(field.name)
    assert {title: groups[title] for title in expected} == expected
    titles = [g.title for g in parser._action_groups if g.title in expected]
    assert titles == [
        train_config.MODEL,
        train_config.RECIPE,
        train_config.OPTIMIZATION,
        train_config.OUTPUT,
        train_config.CAPTURE,
        train_config.MONITOR,
    ]


@pytest.mark.parametrize(
    "dest,option",
    [
        ("batch_size", "--batch-size"),
        ("power_2_scale", "--power-2-scale"),
        ("progress", "--no-progress"),  # on by default: the flag turns it off
        ("capture", "--no-capture"),
        ("quality_stats", "--no-quality-stats"),
        ("tags", "--tag"),  # named in the field's flag
        ("inject", "--inject"),
    ],
)
def test_flag_names(parser, dest, option):
    assert _flags(parser)[dest].option_strings == [option]


def test_no_flags_give_the_default_config(parser):
    assert _parse(parser, []) == TrainConfig()


@pytest.mark.parametrize(
    "argv,expected",
    [
        (
            ["--preset", "124m", "--batch-size", "4", "--seq-len", "32", "--device", "cuda", "--tp", "2"],
            dict(preset="124m", batch_size=4, seq_len=32, device="cuda", tp=2),
        ),
        (
            ["--margin", "1", "--amax-history-len", "32", "--amax-compute-algo", "most_recent"],
            dict(margin=1, amax_history_len=32, amax_compute_algo="most_recent"),
        ),
        (
            ["--recipe", "current", "--power-2-scale", "--fp8-format", "e4m3", "--interval", "2"],
            dict(recipe="current", power_2_scale=True, fp8_format="e4m3", interval=2),
        ),
        (
            ["--lr", "2e-3", "--min-lr", "1e-4", "--grad-clip", "0", "--lr-schedule", "linear"],
            dict(lr=2e-3, min_lr=1e-4, grad_clip=0.0, lr_schedule="linear"),
        ),
        (
            ["--no-progress", "--no-capture", "--no-quality-stats", "--cuda-graph", "--compile"],
            dict(progress=False, capture=False, quality_stats=False, cuda_graph=True, compile=True),
        ),
        (
            ["--tag", "a", "--tag", "b", "--inject", "nan:blocks.0.mlp.fc@3", "--inject", "lr-spike@5"],
            dict(tags=("a", "b"), inject=("nan:blocks.0.mlp.fc@3", "lr-spike@5")),
        ),
        (
            ["--save", "s{step}", "--save-interval", "10", "--capture-max-mb", "64", "--quality-every", "5"],
            dict(save="s{step}", save_interval=10, capture_max_mb=64.0, quality_every=5),
        ),
    ],
)
def test_argv_parses_to_the_config_it_spells(parser, argv, expected):
    config = _parse(parser, argv)
    assert config == dataclasses.replace(TrainConfig(), **expected)
    for name, value in expected.items():  # the flag's type is the field's: 64, not "64"
        assert type(getattr(config, name)) is type(value), name


def test_values_outside_the_choices_or_the_type_are_refused(parser, capsys):
    for argv in (["--recipe", "fp16"], ["--steps", "ten"], ["--capture-max-mb", "lots"]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2
        assert argv[0] in capsys.readouterr().err


def test_monitor_url_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("FP8SCOPE_URL", "http://127.0.0.1:9")
    p = cli.build_parser()
    assert _parse(p, []).monitor_url == "http://127.0.0.1:9"
    assert _parse(p, ["--monitor-url", "http://h:1"]).monitor_url == "http://h:1"
    monkeypatch.setenv("FP8SCOPE_URL", "")  # set but empty: no monitor
    assert _parse(cli.build_parser(), []).monitor_url is None


def test_a_field_without_a_flag_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Settings:
        steps: int = flag(1, "g", help="steps")
        seed: int = 0

    with pytest.raises(TypeError, match=r"Settings\.seed has no flag"):
        add_flags(argparse.ArgumentParser(), Settings)
