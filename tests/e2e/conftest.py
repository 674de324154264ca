"""End-to-end fixtures: a real `fp8-monitor serve` subprocess on SQLite and real `fp8-train` subprocesses.

`train(...)` runs the tiny GPT for a few dozen steps (small batches, so a run takes seconds on 2 CPU
cores) and returns the finished process; `api` is an httpx client of the running server.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.server.utils import ServerProcess  # noqa: E402

API = "/api/v1"
FAST = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-interval", "0", "--no-progress"]


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fp8_trainer.cli", *FAST, *args]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(f"sqlite:///{tmp_path / 'monitor.db'}", log_path=tmp_path / "server.log").start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def api(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url + API, timeout=10.0) as c:
        yield c


@pytest.fixture
def train(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    def run(*args: str, timeout: float = 240.0, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            train_cmd(*args), cwd=tmp_path, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            raise AssertionError(f"fp8-train failed ({proc.returncode}):\n{tail}")
        return proc

    return run


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
