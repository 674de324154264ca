"""End-to-end fixtures: a real `fp8-monitor serve` subprocess on SQLite and real `fp8-train` subprocesses.

`train(...)` runs the tiny GPT for a few dozen steps (small batches, so a run takes seconds on 2 CPU
cores) and returns the finished process; `api` is an httpx client of the running server.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.e2e_utils import train_cmd
from tests.support.server import API, ServerProcess


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
        proc = subprocess.run(train_cmd(*args), cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            raise AssertionError(f"fp8-train failed ({proc.returncode}):\n{tail}")
        return proc

    return run
