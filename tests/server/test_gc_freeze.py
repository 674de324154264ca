"""`fp8-monitor serve` freezes its startup heap out of the cyclic garbage collector: without it, a burst of
a thousand connections set off a full collection on the event loop that stalled every request for 100-200 ms
(bench/abuse.py, "1000 connections sending half a request head", measures the latency)."""

from __future__ import annotations

import re

from tests.support.http import loopback
from tests.support.server import running_server


def _frozen(metrics_text: str) -> float:
    match = re.search(r"^fp8scope_gc_frozen_objects (\S+)$", metrics_text, re.MULTILINE)
    assert match, metrics_text[:2000]
    return float(match.group(1))


def test_served_process_freezes_its_startup_heap(tmp_path):
    with running_server(f"sqlite:///{tmp_path / 'm.db'}", log_path=tmp_path / "server.log") as srv:
        frozen = _frozen(loopback.get(f"{srv.url}/metrics", timeout=10).text)
    # the app, SQLAlchemy, pydantic and the rest of the imported code: far more than a few objects
    assert frozen > 50_000


def test_an_in_process_app_does_not_freeze(client):
    # freezing is the server process's business: an app made in a test (or embedded) leaves the GC alone
    assert _frozen(client.get("/metrics").text) == 0
