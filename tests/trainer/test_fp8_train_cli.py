"""fp8-train: a short run prints losses and the FP8 health table; bad flag combinations are errors."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from fp8_trainer.app import cli


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "fp8_trainer.app.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
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
        (["--recipe", "delayed", "--power-2-scale"], "--power-2-scale applies to --recipe current only"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--seq-len", "4096"], "exceeds preset tiny's block size"),
        (["--recipe", "delayed", "--amax-history-len", "0"], "amax_history_len: must be an integer >= 1"),
        (["--token", "t0k"], "--token needs --monitor-url"),
        (["--run-name", "r1"], "--run-name needs --monitor-url"),
        (["--monitor-url", "127.0.0.1:8000"], "expected http://HOST:PORT"),
        (["--save-interval", "10"], "--save-interval needs --save PATH"),
        (["--min-lr", "0.1"], "--min-lr must be between 0 and --lr 0.001"),
        (["--warmup-steps", "300"], "--warmup-steps must be between 0 and --steps 200"),
        (["--inject", "overflow:blocks.1.mlp.fc1@5"], "unknown layer 'blocks.1.mlp.fc1'; the FP8 layers are"),
        (["--inject", "nan:blocks.4.mlp.fc@5"], "unknown layer 'blocks.4.mlp.fc'"),
        (["--inject", "lr-spike@201"], "step 201 is beyond --steps 200"),
        (["--inject", "spike@20"], "expected overflow:LAYER@STEP[xFACTOR], nan:LAYER@STEP"),
        (["--recipe", "bf16", "--stats-dump", "s.npz"], "--stats-dump needs an FP8 recipe"),
    ],
)
def test_bad_flags_are_errors(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2  # argparse's usage error
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_progress_bar_on_a_terminal():
    """On a TTY the bar (stderr) shows loss, tokens/s and alerts and replaces the periodic log lines."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))  # a 200-column terminal
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--steps", "12", "--batch-size", "2", "--seq-len", "16", "--log-interval", "2"]
    args += ["--eval-interval", "6"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp8_trainer.app.cli", *args], stdout=subprocess.PIPE, stderr=follower, env=env
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    out = proc.stdout.read().decode()
    assert proc.wait(timeout=60) == 0
    os.close(leader)
    bar = b"".join(chunks).decode(errors="replace")
    assert "12/12" in bar and "loss=" in bar and "tok/s=" in bar and "incidents=0" in bar
    assert "step     6  val loss" in out and "FP8 health after step 12" in out  # still printed
    assert "step     2  loss" not in out  # the bar replaces the periodic lines


def test_the_run_config_holds_the_recipe_values_in_force_not_nulls():
    from fp8_trainer.app.build import run_config

    delayed, _ = cli.prepare(["--recipe", "delayed"])
    cfg = run_config(delayed, 256)
    assert (cfg["margin"], cfg["amax_compute_algo"], cfg["interval"], cfg["fp8_format"]) == (
        0,
        "max",
        1,
        "hybrid",
    )
    assert cfg["amax_history_len"] == 16  # fp8-train's own default, not DelayedScaling's 1024
    current, _ = cli.prepare(["--recipe", "current"])
    cfg = run_config(current, 256)
    assert cfg["margin"] is None and cfg["power_2_scale"] is False  # no margin under current scaling
    assert run_config(cli.prepare(["--recipe", "mxfp8"])[0], 256)["fp8_format"] == "e4m3"
