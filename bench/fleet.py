"""Benchmark: a lab's worth of runs on two monitor instances sharing one PostgreSQL database.

R simulated runs (T tensors each, one step per second, the wire format of the real client: packed float32
columns, an idempotency key per batch) post to instance A or B (half each); an all-runs dashboard stream
(`GET /api/v1/stream`) is open on each instance. A few runs get a NaN at one step. Halfway through, instance
B is killed with SIGKILL and started again after a pause; while it is down its runs post to A (what a load
balancer would do), with the same idempotency keys, and B's stream reconnects once B is back.

Printed: values/s stored, the latency from a step's POST (sent to one instance) to its `step` event on the
*other* instance's stream (p50 / p99), steps lost or stored twice, alerts / incidents / webhook messages
against what the injected NaNs call for, bytes stored per value, and, with `--sweep`, the largest R whose
p99 stays within 2 s.

    .venv/bin/python bench/fleet.py [--runs 50] [--tensors 512] [--seconds 300] [--sweep 50,100,200]

Needs PostgreSQL (FP8SCOPE_BENCH_PG_URL, default postgresql+psycopg://postgres@127.0.0.1:5432/postgres);
writes bench/results/fleet.json.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import orjson
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp8_protocol.stats import BASE_COLUMNS  # noqa: E402
from monitor_server.core.db import Database  # noqa: E402
from monitor_server.storage.retention import compact  # noqa: E402
from tests.support.server import API, ServerProcess, fresh_pg_database, make_tensors  # noqa: E402  (shared with the tests)

PG_URL = os.environ.get("FP8SCOPE_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
GOAL_P99_S = 2.0
GOAL_BYTES_PER_VALUE = 4.0
NAME = re.compile(r"fleet-\d{4}")


class Receiver(ThreadingHTTPServer):
    """A webhook endpoint on loopback that counts messages per run name."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ReceiverHandler)
        self.messages: dict[str, int] = {}
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _ReceiverHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        server: Receiver = self.server  # type: ignore[assignment]
        with server.lock:
            for name in set(NAME.findall(body.decode(errors="replace"))):
                server.messages[name] = server.messages.get(name, 0) + 1
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class StreamWatcher:
    """The all-runs stream of one instance, reconnecting when it drops: first arrival time per (run, step)."""

    def __init__(self, url: str):
        self.url, self.arrived, self.reconnects = url, {}, 0
        self.ended: dict[str, int] = {}  # why streams ended: the server's `dropped` reason, or the error
        self.stop = threading.Event()
        self.connected = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        connections = 0
        while not self.stop.is_set():
            why = "closed by the server"
            try:
                with httpx.stream("GET", f"{self.url}{API}/stream", timeout=httpx.Timeout(5, read=30)) as r:
                    connections += 1
                    self.reconnects = connections - 1
                    self.connected.set()
                    event = None
                    for line in r.iter_lines():
                        if self.stop.is_set():
                            return
                        if line.startswith("event: "):
                            event = line[7:]
                        elif line.startswith("data: ") and event == "step":
                            data = orjson.loads(line[6:])
                            self.arrived.setdefault((data["run_id"], data["step"]), time.time())
                        elif line.startswith("data: ") and event == "dropped":
                            why = f"dropped: {line[6:][:120]}"
            except httpx.HTTPError as exc:
                why = type(exc).__name__
            if not self.stop.is_set():
                self.ended[why] = self.ended.get(why, 0) + 1
            self.stop.wait(0.5)

    def close(self) -> None:
        self.stop.set()


def packed(values: np.ndarray) -> dict:
    return {"dtype": "float32", "b64": base64.b64encode(values.astype("<f4").tobytes()).decode()}


class SimRun:
    """One simulated training run: healthy statistics (steady amax, scale from it, no saturation), a loss
    that falls slowly, and optionally a NaN in one tensor at `nan_step`."""

    def __init__(self, run_id: int, name: str, home: int, T: int, seed: int, nan_step: int | None):
        rng = np.random.default_rng(seed)
        self.run_id, self.name, self.home, self.nan_step = run_id, name, home, nan_step
        base = np.exp(rng.normal(0.0, 1.5, T))
        # a few variants with 1 % noise, cycled: packing a fresh block every step would cost the client
        # more CPU than the service spends storing it on this 2-core machine
        self.variants = []
        for _ in range(8):
            amax = base * np.exp(rng.normal(0.0, 0.01, T))
            scale = 2.0 ** np.floor(np.log2(448.0 / amax))
            cols = {
                "amax": amax,
                "scale": scale,
                "overflow": np.zeros(T),
                "underflow": rng.poisson(2.0, T).astype(np.float64),
                "nonfinite": np.zeros(T),
                "numel": np.full(T, 1 << 20, dtype=np.float64),
            }
            self.variants.append({k: packed(cols[k]) for k in BASE_COLUMNS})
        nan_amax = base.copy()
        nan_amax[0] = np.nan
        nonfinite = np.zeros(T)
        nonfinite[0] = 1
        self.nan_cols = {**self.variants[0], "amax": packed(nan_amax), "nonfinite": packed(nonfinite)}

    def body(self, step: int) -> bytes:
        stats = self.nan_cols if step == self.nan_step else self.variants[step % len(self.variants)]
        loss = 4.0 * 0.999**step
        item = {"step": step, "scalars": {"loss": loss, "lr": 3e-4}, "stats": stats}
        return orjson.dumps({"idempotency_key": f"{self.run_id}-{step}", "steps": [item]})


@dataclass
class Result:
    runs: int
    tensors: int
    seconds: float
    steps_sent: int = 0
    steps_stored: int = 0
    steps_lost: int = 0
    steps_twice: int = 0
    values_per_s: float = 0.0
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    latency_samples: int = 0
    local_p50_s: float | None = None  # the same, on the stream of the instance that took the POST
    local_p99_s: float | None = None
    failovers: int = 0
    reconnects: list = field(default_factory=list)  # per instance's stream
    streams_ended: dict = field(default_factory=dict)  # why, how often
    nan_runs: int = 0
    incidents_expected: int = 0
    incidents: int = 0
    nonfinite_alerts: int = 0
    other_alerts: int = 0
    webhook_messages: int = 0
    bytes_per_value_on_disk: float | None = None
    bytes_per_value: float | None = None
    bytes_per_value_compacted: float | None = None
    killed: bool = False
    post_failures: dict = field(default_factory=dict)  # by instance and reason
    restarted_after_s: float | None = None  # from the kill until B answered again
    alert_kinds: dict = field(default_factory=dict)


def start_instances(db_url: str, receiver: Receiver, tmp: Path) -> list[ServerProcess]:
    """Instances A and B on the one database, their webhooks to ``receiver``, settling fast enough for a
    short run, and their streams' keep-alives frequent enough to notice a dead instance."""
    env = {
        "FP8SCOPE_WEBHOOK_URL": receiver.url,
        "FP8SCOPE_WEBHOOK_SETTLE_SECONDS": "1",
        "FP8SCOPE_WEBHOOK_MIN_INTERVAL_SECONDS": "0",
        "FP8SCOPE_SSE_KEEPALIVE_SECONDS": "5",
    }
    servers = [ServerProcess(db_url, log_path=tmp / f"server-{i}.log", env=env) for i in range(2)]
    for s in servers:
        s.start(timeout=120)
    return servers


def create_runs(
    http: httpx.Client, servers: list[ServerProcess], R: int, T: int, seconds: float, nan_runs: int
) -> list[SimRun]:
    """``R`` runs, created on A and B in turn (each run's home); ``nan_runs`` of them, spread evenly, get a
    NaN a third of the way through."""
    runs: list[SimRun] = []
    nan_every = max(1, R // max(1, nan_runs)) if nan_runs else 0
    for i in range(R):
        name = f"fleet-{i:04d}"
        body = {
            "name": name,
            "config": {"bench": "fleet"},
            "world_size": 1,
            "tensors": make_tensors(-(-T // 3))[:T],
        }
        r = http.post(f"{servers[i % 2].url}{API}/runs", json=body)
        r.raise_for_status()
        with_nan = nan_every and i % nan_every == 0 and i // nan_every < nan_runs
        nan_step = int(seconds // 3) if with_nan else None
        runs.append(SimRun(r.json()["id"], name, i % 2, T, seed=i, nan_step=nan_step))
    return runs


class Sender:
    """Posts the runs' steps as a load balancer in front of the two instances would: to a run's home, to A
    while B is down, and to the other instance after a failure (60 tries, 0.2 s apart). Keeps when each
    stored step was sent and which instance took it, and counts failovers and failures on ``result``."""

    def __init__(self, http: httpx.Client, servers: list[ServerProcess], result: Result) -> None:
        self.http, self.servers, self.result = http, servers, result
        self.sent: dict[tuple[int, int], tuple[float, int]] = {}  # (run, step) -> (send time, instance)
        self.down = threading.Event()  # B killed and not back yet
        self.lock = threading.Lock()

    def post(self, run: SimRun, step: int) -> None:
        """Post one step of ``run`` until an instance takes it (or the tries run out)."""
        data = run.body(step)
        target = run.home
        for _attempt in range(60):
            if target == 1 and self.down.is_set():
                target = 0
            t0 = time.time()
            try:
                r = self.http.post(
                    f"{self.servers[target].url}{API}/runs/{run.run_id}/telemetry", content=data
                )
                if r.status_code == 200:
                    with self.lock:
                        self.sent[(run.run_id, step)] = (t0, target)
                        if target != run.home:
                            self.result.failovers += 1
                    return
                why = f"{'AB'[target]}: {r.status_code} {r.text[:80]}"
            except httpx.HTTPError as exc:
                why = f"{'AB'[target]}: {type(exc).__name__}"
            with self.lock:
                self.result.post_failures[why] = self.result.post_failures.get(why, 0) + 1
            target = 1 - target  # the load balancer tries the other instance
            time.sleep(0.2)

    def restart_b(self, killed_at: float) -> None:
        """Start B again (beside the sending loop: the runs keep their one step per second meanwhile)."""
        self.servers[1].start(timeout=120)
        self.result.restarted_after_s = time.time() - killed_at
        self.down.clear()


def drive(sender: Sender, runs: list[SimRun], seconds: float, kill: bool) -> int:
    """One step per run per second for ``seconds``, each step's posts in a pool; with ``kill``, B is killed
    halfway through and started again 10 s later. Returns the steps each run sent."""
    pool = ThreadPoolExecutor(max_workers=min(64, 2 * len(runs)))
    start = time.time()
    kill_at, back_at = seconds / 2, seconds / 2 + 10
    restarter: threading.Thread | None = None
    step = 0
    while time.time() - start < seconds:
        tick = start + step
        time.sleep(max(0.0, tick - time.time()))
        for run in runs:
            pool.submit(sender.post, run, step)
        elapsed = time.time() - start
        if kill and restarter is None and not sender.down.is_set() and elapsed >= kill_at:  # once
            sender.down.set()
            sender.servers[1].stop(signal.SIGKILL)
        if kill and sender.down.is_set() and elapsed >= back_at and restarter is None:
            restarter = threading.Thread(target=sender.restart_b, args=(start + kill_at,))
            restarter.start()
        step += 1
    if restarter is not None:
        restarter.join()
    pool.shutdown(wait=True)
    return step


def p50_p99(values: list[float]) -> tuple[float, float]:
    """The median and the 99th percentile (nearest rank, from below) of a non-empty sample."""
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def record_latencies(result: Result, sent: dict, watchers: list[StreamWatcher]) -> None:
    """Latency from each stored step's POST to its event on the other instance's stream, and on the
    stream of the instance that took it, once every stored step was seen (or 10 s passed)."""
    deadline = time.time() + 10
    while time.time() < deadline and not all(
        all(key in w.arrived for key in sent) for w in watchers if not w.stop.is_set()
    ):
        time.sleep(0.2)
    latencies, local = [], []
    for key, (t0, instance) in sent.items():
        other = watchers[1 - instance].arrived.get(key)
        if other is not None:
            latencies.append(other - t0)
        same = watchers[instance].arrived.get(key)
        if same is not None:
            local.append(same - t0)
    if local:
        result.local_p50_s, result.local_p99_s = p50_p99(local)
    if latencies:
        result.latency_p50_s, result.latency_p99_s = p50_p99(latencies)
        result.latency_samples = len(latencies)


def close_watchers(result: Result, watchers: list[StreamWatcher]) -> None:
    """Stop the streams, and keep how often each reconnected and why streams ended."""
    for w in watchers:
        w.close()
        result.reconnects.append(w.reconnects)
        for why, n in w.ended.items():
            result.streams_ended[why] = result.streams_ended.get(why, 0) + n


def count_kept(result: Result, http: httpx.Client, url: str, runs: list[SimRun], steps_sent: int) -> None:
    """What the service kept, read from ``url``: every step once, and the alerts and incidents the NaNs
    call for and nothing else."""
    for run in runs:
        stored = http.get(f"{url}{API}/runs/{run.run_id}").json()["steps_stored"]
        result.steps_stored += stored
        result.steps_lost += max(0, steps_sent - stored)
        result.steps_twice += max(0, stored - steps_sent)
        alerts = http.get(f"{url}{API}/runs/{run.run_id}/alerts", params={"limit": 1000}).json()
        for alert in alerts:
            result.alert_kinds[alert["kind"]] = result.alert_kinds.get(alert["kind"], 0) + 1
            if alert["kind"] == "nonfinite" and run.nan_step is not None:
                result.nonfinite_alerts += 1
            else:
                result.other_alerts += 1
        result.incidents += len(http.get(f"{url}{API}/runs/{run.run_id}/incidents").json())
    result.incidents_expected = result.nan_runs


def measure_storage(result: Result, db_url: str, T: int, keep: int) -> None:
    """Bytes per value stored: on disk as the run left it (rollup rows are rewritten as their blocks fill,
    so it holds dead row versions until autovacuum reuses them), then the live rows alone (VACUUM FULL),
    then after compacting all but each run's last ``keep`` steps (what FP8SCOPE_RAW_STEPS_KEPT has the
    service do)."""
    values = max(1, result.steps_stored * T * len(BASE_COLUMNS))
    result.bytes_per_value_on_disk = _stats_bytes(db_url) / values
    result.bytes_per_value = _stats_bytes(db_url, vacuum=True) / values
    if keep:
        db = Database(db_url)
        compact(db, keep)
        db.dispose()
        result.bytes_per_value_compacted = _stats_bytes(db_url, vacuum=True) / values


def simulate(
    db_url: str, R: int, T: int, seconds: float, nan_runs: int, kill: bool, tmp: Path, keep: int = 0
) -> Result:
    receiver = Receiver()
    servers = start_instances(db_url, receiver, tmp)
    watchers = [StreamWatcher(s.url) for s in servers]
    for w in watchers:
        w.connected.wait(30)
    result = Result(runs=R, tensors=T, seconds=seconds, killed=kill)
    http = httpx.Client(timeout=30, headers={"content-type": "application/json"})
    runs = create_runs(http, servers, R, T, seconds, nan_runs)
    result.nan_runs = sum(run.nan_step is not None for run in runs)

    sender = Sender(http, servers, result)
    steps_sent = drive(sender, runs, seconds, kill)
    # the last events may still be on their way: record_latencies waits for them
    record_latencies(result, sender.sent, watchers)
    result.steps_sent = steps_sent * R
    close_watchers(result, watchers)

    time.sleep(3)  # the webhook's settle time (1 s) and its delivery: the messages are counted below
    count_kept(result, http, servers[0].url, runs, steps_sent)
    with receiver.lock:
        result.webhook_messages = sum(receiver.messages.values())
    result.values_per_s = result.steps_stored * T * len(BASE_COLUMNS) / seconds
    http.close()
    for s in servers:
        s.stop()
    receiver.close()
    measure_storage(result, db_url, T, keep)
    return result


def _stats_bytes(db_url: str, vacuum: bool = False) -> int:
    engine = create_engine(db_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        if vacuum:
            conn.execute(text("VACUUM FULL step_stats, rollups"))
        size = conn.execute(
            text("SELECT pg_total_relation_size('step_stats') + pg_total_relation_size('rollups')")
        ).scalar_one()
    engine.dispose()
    return int(size)


def report(r: Result) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    ok_latency = r.latency_p99_s is not None and r.latency_p99_s <= GOAL_P99_S
    return "\n".join(
        [
            f"R = {r.runs} runs x {r.tensors} tensors, {r.seconds:.0f} s, "
            f"instance B killed mid-run: {r.killed}",
            f"  values/s stored            {r.values_per_s:,.0f}",
            f"  latency A->B stream p50    {s(r.latency_p50_s)} s   p99 {s(r.latency_p99_s)} s "
            f"(goal <= {GOAL_P99_S} s: {'ok' if ok_latency else 'MISS'}; {r.latency_samples} samples)",
            f"  latency on the same one    p50 {s(r.local_p50_s)} s   p99 {s(r.local_p99_s)} s",
            f"  steps sent / stored        {r.steps_sent} / {r.steps_stored} "
            f"(lost {r.steps_lost}, stored twice {r.steps_twice}); {r.failovers} posts failed over",
            f"  posts that failed          {r.post_failures}",
            f"  B back after               {s(r.restarted_after_s)} s (from the kill)",
            f"  stream reconnects          {r.reconnects} (A, B); ended: {r.streams_ended}",
            f"  NaN runs                   {r.nan_runs}: incidents {r.incidents} "
            f"(expected {r.incidents_expected}),"
            f" nonfinite alerts {r.nonfinite_alerts}, webhook messages {r.webhook_messages},"
            f" other alerts {r.other_alerts} {r.alert_kinds}",
            f"  bytes stored per value     {s(r.bytes_per_value)} (live rows; "
            f"{s(r.bytes_per_value_on_disk)} on disk before vacuum), after compaction "
            f"{s(r.bytes_per_value_compacted)} (goal <= {GOAL_BYTES_PER_VALUE})",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--tensors", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--nan-runs", type=int, default=3)
    parser.add_argument("--no-kill", action="store_true", help="keep both instances up")
    parser.add_argument(
        "--keep-steps", type=int, default=60, help="steps kept per step by the final compaction (0: none)"
    )
    parser.add_argument("--sweep", default="", help="R values for short rounds, e.g. 50,100,200")
    parser.add_argument("--sweep-seconds", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fleet.json")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        with fresh_pg_database(PG_URL, "fleet") as url:
            main_run = simulate(
                url,
                args.runs,
                args.tensors,
                args.seconds,
                args.nan_runs,
                not args.no_kill,
                Path(tmp),
                keep=args.keep_steps,
            )
        print(report(main_run), flush=True)
        results.append(main_run)
        largest = None
        for R in [int(x) for x in args.sweep.split(",") if x]:
            with fresh_pg_database(PG_URL, "fleet") as url:
                r = simulate(url, R, args.tensors, args.sweep_seconds, 0, False, Path(tmp))
            print(report(r), flush=True)
            results.append(r)
            if r.latency_p99_s is not None and r.latency_p99_s <= GOAL_P99_S and r.steps_lost == 0:
                largest = R
        if args.sweep:
            print(f"largest R holding p99 <= {GOAL_P99_S} s: {largest}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
