"""Waiting for something that happens in another thread or process: poll a predicate until it holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def _poll(predicate: Callable[[], Any], timeout: float, interval: float) -> Any:
    """The predicate's first truthy value within `timeout` seconds (checked once more at the deadline), else
    its last, falsy value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(interval)
    return predicate()


def wait_until(predicate: Callable[[], Any], timeout: float = 15.0, interval: float = 0.05) -> bool:
    """True as soon as `predicate()` is true, polling every `interval` seconds; False after `timeout` seconds.
    For ``assert wait_until(...)``."""
    return bool(_poll(predicate, timeout, interval))


def wait_for(
    predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition", interval: float = 0.2
) -> Any:
    """The first truthy value `predicate()` returns, polling every `interval` seconds; AssertionError naming
    `what` after `timeout` seconds."""
    got = _poll(predicate, timeout, interval)
    if not got:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")
    return got
