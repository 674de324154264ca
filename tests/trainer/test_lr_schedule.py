"""Learning-rate schedules: warmup, then cosine / linear decay to min_lr at the last step, or constant."""

import math

import pytest

from fp8_trainer.app.schedule import lr_at

KW = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 4, "total_steps": 14}


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_is_linear_from_zero(schedule):
    assert [lr_at(s, schedule=schedule, **KW) for s in range(1, 5)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_decays_to_min_lr_at_the_last_step():
    lrs = [lr_at(s, schedule="cosine", **KW) for s in range(5, 15)]
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-12)
    assert lr_at(9, schedule="cosine", **KW) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 2)))
    assert lr_at(20, schedule="cosine", **KW) == pytest.approx(0.1)  # past the end: stays at min_lr


def test_linear_and_constant():
    assert [lr_at(s, schedule="linear", **KW) for s in (9, 14)] == pytest.approx([0.55, 0.1])
    assert {lr_at(s, schedule="constant", **KW) for s in range(4, 15)} == {1.0}


def test_no_warmup_starts_at_lr():
    assert lr_at(1, lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=10, schedule="linear") == pytest.approx(
        1.8
    )
    with pytest.raises(ValueError, match="schedule: expected one of"):
        lr_at(1, lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=10, schedule="step")
