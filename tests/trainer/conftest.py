"""Shared fixtures of the runtime tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Small ops on a shared 2-core machine: one thread is several times faster than two contending ones.
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")`` or as a test argument."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def dynamo() -> Iterator[Any]:
    """``torch.compile`` from a clean slate: Dynamo's caches reset and its counters (graphs, graph-break
    reasons) cleared before the test, and again after it. Yields the counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real `fp8-monitor serve` (a `tests.support.server.ServerProcess`) on a fresh SQLite database, one per
    test module (imported here: loading this conftest needs no service stack)."""
    from tests.support.server import running_server

    db = tmp_path_factory.mktemp("monitor") / "monitor.db"
    with running_server(f"sqlite:///{db}") as srv:
        yield srv
