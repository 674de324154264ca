"""The detector state is written back every few batches, not after each one; an engine restored from an
older checkpoint runs the steps stored since again and ends where the engine that saw every batch is. Seen
by the user: the same alerts, and the same per-layer totals, after a restart that lost the unsaved state."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import numpy as np
from sqlalchemy import select

from monitor_server.services.alerting import CHECKPOINT_VERSION_KEY
from monitor_server.storage.models import Run
from tests.support.http import loopback
from tests.support.server import API, ServerProcess, batch_body, create_run, random_stats

T = 9  # three layers


def _run_stats(seed: int, steps: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    stats = random_stats(rng, steps, T)
    stats["overflow"][:, 4] = 0.0
    stats["overflow"][40:44, 4] = 300.0  # a run of overflows in one tensor
    stats["amax"][25, 2] = np.nan  # a non-finite value
    stats["nonfinite"][25, 2] = 3.0
    return stats


def _post_steps(client, run_id: int, stats: dict[str, np.ndarray], lo: int, hi: int, prefix: str) -> None:
    for s in range(lo, hi):
        if s % 13 == 5:  # now and then a step in which no FP8 layer ran: scalars only
            body = {"idempotency_key": f"{prefix}{s}", "steps": [{"step": s, "scalars": {"loss": 2.5}}]}
        else:
            body = batch_body(f"{prefix}{s}", [s], {k: v[s : s + 1] for k, v in stats.items()}, losses=[2.5])
        r = client.post(f"{API}/runs/{run_id}/telemetry", json=body)
        assert r.status_code == 200, r.text


def _same_state(a: dict, b: dict, where: str = "") -> None:
    """Two `state_dict()`s equal value for value (NaN equal to NaN)."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), where


def _saved(client, run_id: int) -> tuple[int, int | None]:
    with client.app.state.ctx.db.read_session() as session:
        version, state = session.execute(
            select(Run.detector_version, Run.detector_state).where(Run.id == run_id)
        ).one()
    return version, None if state is None else state.get(CHECKPOINT_VERSION_KEY)


def test_restored_engine_replays_to_the_same_state(client):
    service = client.app.state.ctx.detection
    service.checkpoint_every = (1000, 1000, 1e9)  # no checkpoint but the first
    run = create_run(client, n_layers=3)
    stats = _run_stats(3, 90)
    _post_steps(client, run["id"], stats, 0, 90, "s")
    version, saved = _saved(client, run["id"])
    assert saved is not None and saved < version  # the last batches are not written back
    with client.app.state.ctx.db.read_session() as session:
        live = service.engine_for(session, run["id"]).state_dict()
        service.forget(run["id"])
        restored = service.engine_for(session, run["id"])
    assert restored.last_step == 89
    _same_state(live, restored.state_dict())


def test_state_is_written_every_few_batches(client):
    service = client.app.state.ctx.detection
    service.checkpoint_every = (4, 1000, 1e9)
    run = create_run(client, n_layers=3)
    stats = random_stats(np.random.default_rng(4), 20, T)
    stats["overflow"][:] = 0.0
    seen = []
    for s in range(11):
        _post_steps(client, run["id"], stats, s, s + 1, "q")
        seen.append(_saved(client, run["id"]))
    # the first batch writes (nothing saved yet), then every fourth
    assert [saved for _, saved in seen] == [1, 1, 1, 1, 5, 5, 5, 5, 9, 9, 9]
    assert [version for version, _ in seen] == list(range(1, 12))
    # a run that finishes writes back what it has
    r = client.patch(f"{API}/runs/{run['id']}", json={"status": "finished"})
    assert r.status_code == 200, r.text
    assert _saved(client, run["id"]) == (11, 11)


def _layers(port: int, run_id: int) -> dict[str, dict]:
    r = loopback.get(f"http://127.0.0.1:{port}{API}/runs/{run_id}/layers", timeout=30)
    assert r.status_code == 200, r.text
    return {layer["layer"]: layer for layer in r.json()}


def _alerts(port: int, run_id: int) -> list[tuple]:
    r = loopback.get(f"http://127.0.0.1:{port}{API}/runs/{run_id}/alerts", timeout=30)
    assert r.status_code == 200, r.text
    return sorted((a["kind"], a["tensor_index"], a["first_step"], a["count"]) for a in r.json())


def test_killed_server_loses_no_detector_state(tmp_path: Path):
    """A server killed between checkpoints: after the restart the layers table counts every step and the
    alerts are those of a server that was never killed."""
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    stats = _run_stats(5, 60)

    def post(port: int, run_id: int, lo: int, hi: int, prefix: str) -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            _post_steps(http, run_id, stats, lo, hi, prefix)

    with ServerProcess(url, log_path=tmp_path / "a.log") as server:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as http:
            reference = create_run(http, n_layers=3, name="reference")["id"]
            killed = create_run(http, n_layers=3, name="killed")["id"]
        post(server.port, reference, 0, 60, "r")
        post(server.port, killed, 0, 50, "k")
        server.stop(signal.SIGKILL)
    with ServerProcess(url, log_path=tmp_path / "b.log") as server:
        post(server.port, killed, 50, 60, "k")
        assert _alerts(server.port, killed) == _alerts(server.port, reference)
        assert _layers(server.port, killed) == _layers(server.port, reference)
