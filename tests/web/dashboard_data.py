"""Runs for the browser tests, created through the HTTP API: tensors, packed telemetry, events, acks."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.support.http import loopback
from tests.support.server import API, batch_body, make_tensors


def create_run(url: str, name: str, n_layers: int = 4, tensors: list | None = None, **extra: Any) -> dict:
    """POST /runs; returns the run."""
    body = {
        "name": name,
        "recipe": {"format": "HYBRID", "margin": 0, "amax_history_len": 16},
        "host": "test-host",
        "tensors": tensors or make_tensors(n_layers),
        **extra,
    }
    r = loopback.post(f"{url}{API}/runs", json=body, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()


def smooth_stats(steps: int, tensors: int, seed: int = 0, factor: float = 1.0) -> dict[str, np.ndarray]:
    """Quiet statistics (no alerts): amax steady per tensor, scale matching it, few counts."""
    rng = np.random.default_rng(seed)
    base = np.exp(rng.normal(0.0, 1.5, tensors)) * factor
    amax = base * (1.0 + 0.01 * rng.random((steps, tensors)))
    scale = np.broadcast_to(2.0 ** np.floor(np.log2(448.0 / (base * 1.1))), (steps, tensors)).copy()
    return {
        "amax": amax,
        "scale": scale,
        "overflow": np.zeros((steps, tensors)),
        "underflow": rng.integers(0, 3, (steps, tensors)).astype(np.float64),
        "nonfinite": np.zeros((steps, tensors)),
        "numel": np.full((steps, tensors), 4096.0),
    }


def post_steps(
    url: str,
    run_id: int,
    key: str,
    first: int,
    stats: dict[str, np.ndarray],
    losses: np.ndarray | None = None,
    **extra: Any,
) -> dict:
    """POST /telemetry with len(stats["amax"]) steps from `first`, packed float64 columns."""
    n = len(stats["amax"])
    if losses is None:
        losses = 3.0 - 0.001 * np.arange(first, first + n)
    body = batch_body(key, range(first, first + n), stats, encoding="float64", losses=losses, **extra)
    for step in body["steps"]:
        step["scalars"]["grad_norm"] = 1.0
    r = loopback.post(f"{url}{API}/runs/{run_id}/telemetry", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()
