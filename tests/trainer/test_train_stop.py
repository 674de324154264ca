"""fp8-train ending early: Ctrl-C gives one line, a checkpoint and the status "interrupted"; a non-finite loss
with --halt-on-nonfinite stops before the update, with the previous step's weights saved and "halted"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from fp8_trainer.app import cli
from fp8_trainer.app.checkpoint import load_checkpoint
from fp8_trainer.app.train import train
from tests.trainer.monitor_utils import get

FLAGS = ["--batch-size", "2", "--seq-len", "32", "--eval-interval", "0", "--no-progress"]
FLAGS += ["--lr-schedule", "constant", "--warmup-steps", "0", "--log-interval", "1"]

pytestmark = pytest.mark.usefixtures("one_thread")


def _runs(url: str, name: str) -> list[dict]:
    return [r for r in get(url, "/runs") if r["name"] == name]


def test_ctrl_c_is_one_line_a_checkpoint_and_an_interrupted_run(server, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    args = ["--steps", "100000", *FLAGS, "--save", str(ckpt), "--monitor-url", server.url]
    args += ["--run-name", "ctrl-c"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp8_trainer.app.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines = []
    try:
        for line in proc.stdout:  # wait for the third step's line, then press Ctrl-C
            lines.append(line)
            if line.startswith("step     3  loss"):
                break
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == cli.EXIT_INTERRUPTED, err
    assert "Traceback" not in err and "Traceback" not in out
    said = [line for line in out.splitlines() if line.startswith("fp8-train: interrupted after step")]
    assert len(said) == 1
    step = int(said[0].rsplit(" ", 1)[1])
    assert step >= 3
    saved = load_checkpoint(ckpt)
    assert saved["step"] == step
    assert f"step {step:5d}  saved {ckpt}" in out
    (run,) = _runs(server.url, "ctrl-c")
    assert run["status"] == "interrupted" and run["last_step"] == step


def test_halt_on_nonfinite_stops_before_the_update_with_the_previous_weights(server, tmp_path):
    ckpt = tmp_path / "halt.pt"
    a, prepared = cli.prepare(
        ["--steps", "8", *FLAGS, "--inject", "nan:blocks.1.attn.qkv@5", "--halt-on-nonfinite"]
        + ["--save", str(ckpt), "--monitor-url", server.url, "--run-name", "halt"]
    )
    lines: list[str] = []
    result = train(a, prepared, out=lines.append)
    assert result.status == "halted" and result.step == 4
    assert "fp8-train: halted: non-finite loss at step 5; the weights are those of step 4" in lines
    saved = load_checkpoint(ckpt)
    assert saved["step"] == 4
    for name, p in result.model.state_dict().items():  # the NaN step changed nothing
        if isinstance(p, torch.Tensor) and p.is_floating_point():
            assert torch.isfinite(p).all(), name
            assert torch.equal(saved["model"][name], p), name
    (run,) = _runs(server.url, "halt")
    assert run["status"] == "halted"
    loss = get(server.url, f"/runs/{run['id']}/series", name="loss")
    assert loss["steps"] == [1, 2, 3, 4, 5] and loss["values"][-1] == "NaN"  # the service saw the NaN
    alerts = get(server.url, f"/runs/{run['id']}/alerts", kind="nonfinite")
    assert alerts and min(a["first_step"] for a in alerts) == 5


def test_without_the_flag_a_nan_run_goes_on(tmp_path):
    a, prepared = cli.prepare(["--steps", "6", *FLAGS, "--inject", "nan:blocks.1.attn.qkv@5"])
    result = train(a, prepared, out=lambda line: None)
    assert result.status == "finished" and result.step == 6
