"""Helpers of the end-to-end tests: the `fp8-train` command line, run lookup by name, polling."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

API = "/api/v1"
FAST = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-interval", "0", "--no-progress"]


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fp8_trainer.cli", *FAST, *args]


def run_by_name(api: httpx.Client, name: str) -> dict[str, Any]:
    runs = [r for r in api.get("/runs").json() if r["name"] == name]
    assert len(runs) == 1, f"expected one run named {name}, got {runs}"
    return runs[0]


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
