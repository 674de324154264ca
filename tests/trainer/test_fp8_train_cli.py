"""fp8-train: a short run prints losses and the FP8 health table; bad flag combinations are errors."""

import os
import subprocess
import sys

import pytest

from fp8_trainer import cli


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "fp8_trainer.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.slow
def test_short_run_prints_loss_and_health_table():
    r = run(
        "--preset",
        "tiny",
        "--steps",
        "6",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--log-interval",
        "3",
        "--eval-interval",
        "0",
        "--recipe",
        "delayed",
        "--amax-history-len",
        "4",
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "step     3  loss" in out and "step     6  loss" in out
    assert "FP8 health after step 6" in out
    table = out.split("FP8 health after step 6")[1].splitlines()
    assert table[1].split()[:3] == ["layer", "in", "amax"]
    assert sum(line.startswith("blocks.") for line in table) == 16  # one row per FP8 layer of the tiny GPT
    assert "worst:" in out or "all tensors healthy" in out
    assert "fp8: max amax" in out  # the one-line summary at the intermediate log step


@pytest.mark.parametrize(
    "args,message",
    [
        (["--recipe", "fp32", "--fp8-format", "e4m3"], "--fp8-format needs an FP8 recipe"),
        (["--recipe", "current", "--margin", "1"], "--margin applies to --recipe delayed only"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--seq-len", "4096"], "exceeds preset tiny's block size"),
        (["--recipe", "delayed", "--amax-history-len", "0"], "amax_history_len: must be an integer >= 1"),
    ],
)
def test_bad_flags_are_errors(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2  # argparse's usage error
    assert message in capsys.readouterr().err
