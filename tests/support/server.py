"""Factories and helpers for the monitor-service tests: runs, telemetry batches, COL encodings, servers."""

from __future__ import annotations

import base64
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from sqlalchemy import create_engine, make_url, text

from tests.support.http import loopback

STATS = ("amax", "scale", "overflow", "underflow", "nonfinite", "numel")
API = "/api/v1"
#: the PostgreSQL server of the tests (a database on it is created per session, see tests/server/conftest.py)
PG_URL = os.environ.get("FP8SCOPE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


ROLES = (("input", "e4m3"), ("weight", "e4m3"), ("grad_output", "e5m2"))


def tensors_named(layers: list[str]) -> list[dict[str, Any]]:
    """Tensors as the training runtime registers them, three per layer: the k-th layer's input, weight and
    grad_output are indices 3k, 3k+1 and 3k+2."""
    return [
        {"index": 3 * k + j, "name": f"{layer}.{role}", "layer": layer, "role": role, "format": fmt}
        for k, layer in enumerate(layers)
        for j, (role, fmt) in enumerate(ROLES)
    ]


def make_tensors(n_layers: int) -> list[dict[str, Any]]:
    """The tensors of `n_layers` layers named ``blocks.<k>.mlp.fc``."""
    return tensors_named([f"blocks.{k}.mlp.fc" for k in range(n_layers)])


def run_body(n_layers: int = 2, name: str = "test-run", **extra: Any) -> dict[str, Any]:
    """A POST /runs body."""
    return {
        "name": name,
        "config": {"model": "gpt-tiny", "lr": 3e-4},
        "recipe": {"format": "HYBRID", "margin": 0, "amax_history_len": 16, "amax_compute_algo": "max"},
        "world_size": 1,
        "host": "test-host",
        "tensors": make_tensors(n_layers),
        **extra,
    }


def create_run(client: Any, n_layers: int = 2, headers: dict | None = None, **extra: Any) -> dict[str, Any]:
    """Create a run and return its JSON."""
    r = client.post(f"{API}/runs", json=run_body(n_layers, **extra), headers=headers or {})
    assert r.status_code == 201, r.text
    return r.json()


def wire(x: float) -> float | str:
    """A float in the wire encoding."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return float(x)


def col(values: np.ndarray, encoding: str = "json") -> Any:
    """One statistic column in the requested encoding: json, float32 or float64 (packed)."""
    values = np.asarray(values, dtype=np.float64)
    if encoding == "json":
        return [wire(v) for v in values.tolist()]
    dtype = {"float32": "<f4", "float64": "<f8"}[encoding]
    return {"dtype": encoding, "b64": base64.b64encode(values.astype(dtype).tobytes()).decode()}


def random_stats(rng: np.random.Generator, steps: int, tensors: int) -> dict[str, np.ndarray]:
    """Plausible statistics, (steps, tensors) each: amax log-normal, scale a power of two, small counts."""
    amax = np.exp(rng.normal(0.0, 2.0, size=(steps, tensors)))
    scale = 2.0 ** np.floor(np.log2(448.0 / amax))
    return {
        "amax": amax,
        "scale": scale,
        "overflow": rng.poisson(0.3, size=(steps, tensors)).astype(np.float64),
        "underflow": rng.poisson(3.0, size=(steps, tensors)).astype(np.float64),
        "nonfinite": np.zeros((steps, tensors)),
        "numel": np.full((steps, tensors), 4096.0),
    }


def quiet_stats(steps: int, tensors: int) -> dict[str, np.ndarray]:
    """Healthy statistics, (steps, tensors) each, that no detector flags: steady amax, a matching scale, no
    overflow, underflow or non-finite values."""
    amax = np.tile(np.linspace(0.5, 3.0, tensors), (steps, 1))
    return {
        "amax": amax,
        "scale": 2.0 ** np.floor(np.log2(448.0 / (amax * 1.1))),
        "overflow": np.zeros((steps, tensors)),
        "underflow": np.zeros((steps, tensors)),
        "nonfinite": np.zeros((steps, tensors)),
        "numel": np.full((steps, tensors), 4096.0),
    }


def batch_body(
    key: str,
    steps: list[int] | np.ndarray,
    stats: dict[str, np.ndarray],
    encoding: str = "json",
    losses: list[float] | np.ndarray | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A telemetry body for `steps` with rows of `stats` in order."""
    out = []
    for i, step in enumerate(list(steps)):
        scalars = {"lr": 3e-4}
        if losses is not None:
            scalars["loss"] = wire(float(losses[i]))
        out.append(
            {"step": int(step), "scalars": scalars, "stats": {n: col(stats[n][i], encoding) for n in STATS}}
        )
    return {"idempotency_key": key, "steps": out, **extra}


def post_batch(
    client: Any,
    run_id: int,
    key: str,
    first: int,
    stats: dict[str, np.ndarray],
    losses: list[float] | np.ndarray | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """POST /runs/{id}/telemetry with the rows of `stats` as steps `first`, `first` + 1, ... (loss 2.0 each
    unless `losses`) through an in-process client; asserts 200 and returns the answer."""
    n = len(stats["amax"])
    losses = [2.0] * n if losses is None else losses
    body = batch_body(key, range(first, first + n), stats, losses=losses, **extra)
    r = client.post(f"{API}/runs/{run_id}/telemetry", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def decode(values: list) -> np.ndarray:
    """Wire floats (with null for 'no data') back to float64, null -> NaN."""
    table = {"NaN": np.nan, "Infinity": np.inf, "-Infinity": -np.inf, None: np.nan}
    return np.array([table[v] if isinstance(v, str) or v is None else v for v in values], dtype=np.float64)


def slow_reader(timeout: float = 120) -> httpx.Client:
    """A client whose connections take at most 64 KiB into the kernel's receive buffer: a reader that stops
    reading stalls the server's writes after a few MB (the server's send buffer), where an autotuned loopback
    buffer (tens of MB) could take a whole export and let the server finish it."""
    small = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)]
    return httpx.Client(timeout=timeout, transport=httpx.HTTPTransport(socket_options=small))


def free_port() -> int:
    """An unused TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`fp8-monitor serve` in a subprocess on a free port (or `port`, e.g. to restart a killed server)."""

    def __init__(
        self,
        db_url: str,
        *args: str,
        log_path: Path | None = None,
        env: dict | None = None,
        port: int | None = None,
    ):
        self.db_url = db_url
        self.extra_env = env or {}
        self.args = args
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> ServerProcess:
        """Start and wait for /healthz."""
        cmd = [
            sys.executable,
            "-m",
            "monitor_server.cli",
            "serve",
            "--db",
            self.db_url,
            "--port",
            str(self.port),
        ]
        cmd += ["--log-level", "warning", *self.args]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env}
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if loopback.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not come up in {timeout}s; log: {self.log_text()}")

    def log_text(self) -> str:
        """The server's captured output (when a log path was given)."""
        return (
            self.log_path.read_text(errors="replace")[-4000:]
            if self.log_path and self.log_path.exists()
            else ""
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Signal the server and wait for it to exit; returns its exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise

    def __enter__(self) -> ServerProcess:
        if self.proc is not None and self.proc.poll() is None:  # started already: a second one could not bind
            return self
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_server(
    db_url: str, *args: str, log_path: Path | None = None, env: dict | None = None
) -> Iterator[ServerProcess]:
    """Context manager form of `ServerProcess`."""
    server = ServerProcess(db_url, *args, log_path=log_path, env=env).start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def fresh_pg_database(server_url: str, prefix: str) -> Iterator[str]:
    """A new, uniquely named database on the PostgreSQL server of `server_url`, created through its
    `postgres` maintenance database and dropped on exit; yields the new database's URL."""
    base = make_url(server_url)
    maintenance = create_engine(base.set(database="postgres"), isolation_level="AUTOCOMMIT")
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        with maintenance.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))  # name is generated here, not user input
    except Exception:
        maintenance.dispose()
        raise
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with maintenance.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        maintenance.dispose()


@contextlib.contextmanager
def pg_database_or_skip(prefix: str) -> Iterator[str]:
    """`fresh_pg_database` on the tests' PostgreSQL server (PG_URL). An unreachable server skips the test,
    or fails it when FP8SCOPE_REQUIRE_PG=1 (CI)."""
    import pytest

    database = fresh_pg_database(PG_URL, prefix)
    try:
        url = database.__enter__()
    except Exception as exc:
        where = make_url(PG_URL).render_as_string(hide_password=True)
        message = f"PostgreSQL not reachable at {where}: {exc}"
        if os.environ.get("FP8SCOPE_REQUIRE_PG") == "1":
            pytest.fail(message + " (FP8SCOPE_REQUIRE_PG=1)")
        pytest.skip(message)
    try:
        yield url
    finally:
        database.__exit__(None, None, None)


def raw_exchange(port: int, data: bytes, timeout: float = 15.0) -> tuple[int, dict[str, str], bytes]:
    """Send `data` as is on a new connection and read one response: (status, headers, body).

    For requests no HTTP client would send: a head without its body, an oversized head. Raises
    TimeoutError when no complete response arrives within `timeout` seconds.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        deadline = time.monotonic() + timeout
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)  # the server may answer and stop reading before it has everything
        received = b""
        while b"\r\n\r\n" not in received or len(received) < _response_size(received):
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                raise TimeoutError(f"no complete response within {timeout} s: {received[:200]!r}") from None
            if not chunk:
                break
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/"):
        raise ConnectionError(f"no HTTP response: {received[:200]!r}")
    pairs = [line.split(": ", 1) for line in lines[1:] if ": " in line]
    headers = {name.lower(): value for name, value in pairs}
    return int(lines[0].split()[1]), headers, body


def _response_size(received: bytes) -> int:
    head, _, _ = received.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(received) + 1  # no length: read until the server closes
