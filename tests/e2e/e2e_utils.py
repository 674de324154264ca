"""Helpers of the end-to-end tests: the `fp8-train` command line, a job started in the background, run lookup
by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

FAST = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-interval", "0", "--no-progress"]


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fp8_trainer.app.cli", *FAST, *args]


def start_train(cwd: Path, *args: str) -> subprocess.Popen:
    """`fp8-train` with `args` in the background (stdout and stderr on one text pipe), for a test that acts on
    the service while the job runs."""
    return subprocess.Popen(
        train_cmd(*args), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def run_by_name(api: httpx.Client, name: str) -> dict[str, Any]:
    runs = [r for r in api.get("/runs").json() if r["name"] == name]
    assert len(runs) == 1, f"expected one run named {name}, got {runs}"
    return runs[0]
