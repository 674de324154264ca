"""Benchmark: hostile and unlucky requests against a real `fp8-monitor serve` (uvicorn subprocess), on SQLite
and PostgreSQL.

Each attack runs on its own while two watchers run beside it: one samples the server's resident memory
(/proc, every 5 ms), one asks `/healthz` over and over. Per attack the table says the status the server
answered (and the one expected), the time to that answer, the server's peak RSS above its idle RSS just
before the attack, the worst `/healthz` latency during it, and whether anything of a rejected request was
stored (runs, steps and events compared before and after).

    .venv/bin/python bench/abuse.py [--skip-pg] [--smoke] [--out bench/results/abuse.json]

Goals: every attack answered with the expected status within 1 s (the slow-client attacks: within the
configured timeout plus 1 s), peak RSS under 200 MB above idle, `/healthz` under 100 ms throughout,
nothing stored from a rejected request. `--smoke` runs smaller attacks on SQLite only (for CI; its numbers
are not measurements).

Measured on a shared 2-core machine: 32 of 34 attacks meet every goal on SQLite and PostgreSQL (each
answered in at most 0.25 s, peak RSS at most 29 MB above idle). The two misses are the same attack: while
a thousand slow clients connect at once, /healthz waits 120-280 ms, the time asyncio takes to accept the
burst in one turn of the event loop; every slow client is refused with 408 at its timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ingest import tensors_for  # noqa: E402  (the ingest benchmark's run shape)
from tests.support.server import ServerProcess, fresh_pg_database  # noqa: E402  (shared with the tests)

PG_URL = os.environ.get("FP8SCOPE_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
API = "/api/v1"
TOKENS = "trainer:ingest:bench-trainer-secret,ops:read+control:bench-ops-secret"
TRAINER = {"Authorization": "Bearer bench-trainer-secret"}
OPS = {"Authorization": "Bearer bench-ops-secret"}
MIB = 1024 * 1024
#: the read timeout the bench's servers run with (the slow-client attacks wait for it)
HEADER_TIMEOUT_S = 2.0
GOAL_S, GOAL_RSS_MB, GOAL_HEALTHZ_MS = 1.0, 200.0, 100.0


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc."""
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


#: the /healthz prober: its own process, so the attack's client-side work (this process building and
#: sending bodies, holding a thousand sockets) never shows up as server latency
PROBE = """
import json, sys, time, httpx
url, worst, errors, n = sys.argv[1], 0.0, 0, 0
with httpx.Client(timeout=30) as client:
    while True:
        t0 = time.perf_counter()
        try:
            ok = client.get(url).status_code == 200
        except httpx.HTTPError:
            ok = False
        worst, errors, n = max(worst, time.perf_counter() - t0), errors + (not ok), n + 1
        if n == 1:
            print("ready", flush=True)
        if sys.stdin in __import__("select").select([sys.stdin], [], [], 0.01)[0]:
            break
print(json.dumps({"worst": worst, "errors": errors, "n": n}), flush=True)
"""


class Watch:
    """Peak RSS of the server (sampled here) and worst /healthz latency (from a prober process) while the
    block runs."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.stop = threading.Event()
        self.peak = 0
        self.worst = 0.0
        self.healthz_errors = 0

    def _rss(self) -> None:
        pid = self.server.proc.pid
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_bytes(pid))
            time.sleep(0.005)

    def __enter__(self) -> Watch:
        self.probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, self.server.url + "/healthz"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.probe.stdout.readline().strip() == "ready"  # it has connected: measure from here
        self.idle = rss_bytes(self.server.proc.pid)
        self.sampler = threading.Thread(target=self._rss)
        self.sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.sampler.join()
        out, _ = self.probe.communicate("stop\n", timeout=60)
        result = json.loads(out.strip().splitlines()[-1])
        self.worst, self.healthz_errors = result["worst"], result["errors"]


def raw_request(
    port: int, head: bytes, body: Iterator[bytes] | None = None, timeout: float = 120.0
) -> int | None:
    """Send a request head (and stream `body` behind it, as an attacker would, from another thread) and
    read the status line of the answer; None when the server closed without one."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    stop = threading.Event()

    def pump() -> None:
        with contextlib.suppress(OSError):
            sock.sendall(head)
            for chunk in body or ():
                if stop.is_set():
                    return
                sock.sendall(chunk)

    sender = threading.Thread(target=pump, daemon=True)
    sender.start()
    received = b""
    try:
        while b"\r\n" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    except OSError:
        pass
    finally:
        stop.set()
        sock.close()
    sender.join(timeout)
    line = received.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[0].startswith(b"HTTP/") else None


def head(
    method: str, path: str, length: int | None, *extra: str, content_type: str = "application/json"
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {content_type}", *extra]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def zeros(total: int, chunk: int = MIB) -> Iterator[bytes]:
    block = b" " * chunk
    for _ in range(total // chunk):
        yield block


def nested_json(depth: int) -> bytes:
    return b'{"a":' * (depth - 1) + b'{"leaf":1}' + b"}" * (depth - 1)


@dataclass
class Row:
    backend: str
    attack: str
    expected: int
    status: int | None
    seconds: float
    peak_rss_mb: float
    healthz_ms: float
    healthz_errors: int
    stored_nothing: bool | None
    time_goal_s: float = GOAL_S
    ok: bool = field(default=False)

    def judge(self) -> Row:
        self.ok = (
            self.status == self.expected
            and self.seconds <= self.time_goal_s
            and self.peak_rss_mb < GOAL_RSS_MB
            and self.healthz_ms < GOAL_HEALTHZ_MS
            and self.healthz_errors == 0
            and self.stored_nothing is not False
        )
        return self


class Bench:
    """The attacks, against one server with tokens and one without (for the open-server attacks)."""

    def __init__(self, backend: str, server: ServerProcess, open_server: ServerProcess, smoke: bool):
        self.backend, self.server, self.open = backend, server, open_server
        self.smoke = smoke
        self.rows: list[Row] = []
        reg = {"name": "target", "tensors": tensors_for(6)}
        self.run_id = httpx.post(f"{server.url}{API}/runs", json=reg, headers=TRAINER).json()["id"]
        self.open_run = httpx.post(f"{open_server.url}{API}/runs", json=reg).json()["id"]

    def snapshot(self, server: ServerProcess, auth: dict) -> object:
        runs = httpx.get(f"{server.url}{API}/runs", headers=auth, timeout=30).json()
        state = [(r["id"], r["steps_stored"], r["status"], r["last_telemetry_at"]) for r in runs]
        for r in runs:
            events = httpx.get(f"{server.url}{API}/runs/{r['id']}/events", headers=auth, timeout=30).json()
            commands = httpx.get(
                f"{server.url}{API}/runs/{r['id']}/commands", headers=auth, timeout=30
            ).json()
            state.append((r["id"], len(events), [c["state"] for c in commands]))
        return state

    def attack(
        self,
        name: str,
        expected: int,
        fn: Callable[[], int | None],
        *,
        server: ServerProcess | None = None,
        rejected: bool = True,
        time_goal_s: float = GOAL_S,
    ) -> None:
        server = server or self.server
        auth = OPS if server is self.server else {}
        before = self.snapshot(server, auth) if rejected else None
        with Watch(server) as watch:
            t0 = time.perf_counter()
            status = fn()
            seconds = time.perf_counter() - t0
        stored_nothing = (self.snapshot(server, auth) == before) if rejected else None
        row = Row(
            self.backend,
            name,
            expected,
            status,
            seconds,
            max(0, watch.peak - watch.idle) / MIB,
            watch.worst * 1000,
            watch.healthz_errors,
            stored_nothing,
            time_goal_s,
        ).judge()
        self.rows.append(row)
        print(format_row(row), flush=True)

    def run_all(self) -> None:
        port, rid = self.server.port, self.run_id
        big = (8 if self.smoke else 64) * MIB
        # High 1: bodies without a token, answered before they are read; per-route limits with one
        for method, path in (("POST", "/runs"), ("PATCH", f"/runs/{rid}"), ("POST", f"/runs/{rid}/commands")):
            self.attack(
                f"no token, {big // MIB} MiB body: {method} {path.replace(str(rid), '{id}')}",
                401,
                lambda m=method, p=path: raw_request(port, head(m, API + p, big), zeros(big)),
            )
        self.attack(
            "ingest token, 2 MiB registration",
            413,
            lambda: raw_request(
                port,
                head("POST", f"{API}/runs", 2 * MIB, "Authorization: Bearer bench-trainer-secret"),
                zeros(2 * MIB),
            ),
        )
        # High 2: a huge request header
        header = (8 if self.smoke else 80) * MIB
        self.attack(
            f"{header // MIB} MiB request header",
            431,
            lambda: raw_request(port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ", zeros(header)),
        )
        # High 3: many tensors, a heatmap of empty columns
        T = 4096
        many = {"name": "wide", "tensors": tensors_for(65536 if not self.smoke else 16384)}
        self.attack(
            f"registration of {len(many['tensors'])} tensors",
            413,
            lambda: (
                httpx.post(f"{self.server.url}{API}/runs", json=many, headers=TRAINER, timeout=60).status_code
            ),
        )
        wide = httpx.post(
            f"{self.server.url}{API}/runs",
            json={"name": "wide", "tensors": tensors_for(T)},
            headers=TRAINER,
            timeout=60,
        ).json()["id"]
        self._two_far_steps(wide, T)
        self.attack(
            "heatmap T=4096, steps 0 and 2^40, max_cols=10000",
            422,
            lambda: (
                httpx.get(
                    f"{self.server.url}{API}/runs/{wide}/heatmap/packed",
                    params={"max_cols": 10000},
                    headers=OPS,
                    timeout=60,
                ).status_code
            ),
        )
        # Medium 4: gzip and JSON amplification
        inflated = (8 if self.smoke else 63) * MIB
        bomb = gzip.compress(b'{"idempotency_key":"bomb","events":[' + b"{}," * (inflated // 3) + b"{}]}", 9)
        url = f"{self.server.url}{API}/runs/{rid}/telemetry"
        gz = {**TRAINER, "Content-Encoding": "gzip", "Content-Type": "application/json"}
        self.attack(
            f"gzip {len(bomb) // 1024} KiB -> {inflated // MIB} MiB of {{}}",
            413,
            lambda: httpx.post(url, content=bomb, headers=gz, timeout=120).status_code,
        )
        small = gzip.compress(b'{"idempotency_key":"b","events":[' + b"{}," * (32 * MIB // 3) + b"{}]}", 9)

        def parallel() -> int | None:
            out: list[int] = []
            threads = [
                threading.Thread(
                    target=lambda: out.append(
                        httpx.post(url, content=small, headers=gz, timeout=120).status_code
                    )
                )
                for _ in range(3)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return out[0] if len(set(out)) == 1 else None

        self.attack(f"3 parallel gzip bodies of {len(small) // 1024} KiB -> 32 MiB", 413, parallel)
        # Medium 5: deep nesting
        for depth in (254, 1024):
            body = b'{"idempotency_key":"deep%d","events":[{"kind":"custom","step":1,"details":%s}]}' % (
                depth,
                nested_json(depth),
            )
            self.attack(
                f"event details nested {depth} deep",
                422,
                lambda b=body: (
                    httpx.post(
                        url, content=b, headers={**TRAINER, "Content-Type": "application/json"}, timeout=60
                    ).status_code
                ),
            )
        # Medium 6: the open server, from another site's page
        ourl = f"{self.open.url}{API}/runs/{self.open_run}"
        cmd = httpx.post(f"{ourl}/commands", json={"changes": {"fp8_enabled": False}}).json()["id"]
        ack = orjson.dumps(
            {"idempotency_key": "csrf", "acks": [{"command_id": cmd, "state": "applied", "step": 1}]}
        )
        self.attack(
            "open server: text/plain ack from another site",
            415,
            server=self.open,
            fn=lambda: (
                httpx.post(
                    f"{ourl}/telemetry", content=ack, headers={"Content-Type": "text/plain"}
                ).status_code
            ),
        )
        self.attack(
            "open server: Host attacker.example (DNS rebinding)",
            400,
            server=self.open,
            fn=lambda: httpx.get(f"{ourl}", headers={"Host": "attacker.example"}).status_code,
        )
        # Medium 7: one event over the cap; many under it, listed and streamed to a client that never reads
        huge = 9 * MIB
        blob = (
            b'{"idempotency_key":"huge","events":[{"kind":"custom","step":1,"details":{"b":"'
            + b"x" * huge
            + b'"}}]}'
        )
        self.attack(
            "event details of 9 MiB",
            422,
            lambda: (
                httpx.post(
                    url, content=blob, headers={**TRAINER, "Content-Type": "application/json"}, timeout=60
                ).status_code
            ),
        )
        n_events = 30 if self.smoke else 300
        stream = socket.create_connection(("127.0.0.1", port))
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stream.sendall(
            head("GET", f"{API}/runs/{rid}/stream", None, "Authorization: Bearer bench-ops-secret")
        )

        def many_events() -> int | None:
            status = None
            with httpx.Client(headers={**TRAINER, "Content-Type": "application/json"}, timeout=60) as client:
                for i in range(n_events):
                    ev = {"kind": "custom", "step": i, "details": {"i": i, "blob": "y" * MIB}}
                    status = client.post(
                        url, content=orjson.dumps({"idempotency_key": f"ev{i}", "events": [ev]})
                    ).status_code
                    if status != 200:
                        return status
            return status

        self.attack(
            f"{n_events} events of 1 MB, a stream client that never reads",
            200,
            many_events,
            rejected=False,
            time_goal_s=600,
        )
        self.attack(
            "GET /events?limit=1000 of those",
            200,
            rejected=False,
            fn=lambda: (
                httpx.get(
                    f"{url.rsplit('/', 1)[0]}/events", params={"limit": 1000}, headers=OPS, timeout=60
                ).status_code
            ),
        )
        stream.close()
        # Low: slow clients hold connections only until the read timeout
        n_slow = 50 if self.smoke else 1000

        def slow_heads() -> int | None:
            socks = []
            for _ in range(n_slow):
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                socks.append(s)
            statuses = set()
            for s in socks:
                s.settimeout(HEADER_TIMEOUT_S + 30)
                with contextlib.suppress(OSError):
                    line = s.recv(64).split(b"\r\n", 1)[0].split()
                    statuses.add(int(line[1]) if len(line) > 1 else None)
                s.close()
            return statuses.pop() if len(statuses) == 1 else None

        self.attack(
            f"{n_slow} connections sending half a request head",
            408,
            slow_heads,
            time_goal_s=HEADER_TIMEOUT_S + 1,
        )

    def _two_far_steps(self, run_id: int, T: int) -> None:
        import base64

        import numpy as np

        col = {"dtype": "float32", "b64": base64.b64encode(np.ones(T, "<f4").tobytes()).decode()}
        stats = dict.fromkeys(("amax", "scale", "overflow", "underflow", "nonfinite", "numel"), col)
        body = {
            "idempotency_key": "far",
            "steps": [{"step": 0, "stats": stats}, {"step": 2**40, "stats": stats}],
        }
        r = httpx.post(
            f"{self.server.url}{API}/runs/{run_id}/telemetry", json=body, headers=TRAINER, timeout=60
        )
        r.raise_for_status()


def format_row(r: Row) -> str:
    status = f"{r.status} ({r.expected})" if r.status != r.expected else str(r.status)
    stored = {True: "no", False: "YES", None: "-"}[r.stored_nothing]
    return (
        f"| {r.backend:<10} | {r.attack:<52} | {status:>9} | {r.seconds:7.2f} | {r.peak_rss_mb:8.1f} | "
        f"{r.healthz_ms:8.1f} | {stored:>6} | {'ok' if r.ok else 'MISS':>4} |"
    )


HEADER = (
    f"| {'backend':<10} | {'attack':<52} | {'status':>9} | {'time s':>7} | {'RSS+ MB':>8} | "
    f"{'healthz':>8} | {'stored':>6} | {'goal':>4} |\n|{'-' * 12}|{'-' * 54}|{'-' * 11}|{'-' * 9}|{'-' * 10}|"
    f"{'-' * 10}|{'-' * 8}|{'-' * 6}|"
)


@contextlib.contextmanager
def servers(db_url: str, open_db_url: str, tmp: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    env = {"FP8SCOPE_HEADER_TIMEOUT_SECONDS": str(HEADER_TIMEOUT_S), "FP8SCOPE_SSE_KEEPALIVE_SECONDS": "1"}
    guarded = ServerProcess(
        db_url, log_path=tmp / "guarded.log", env={**env, "FP8SCOPE_TOKENS": TOKENS}
    ).start(60)
    try:
        open_server = ServerProcess(open_db_url, log_path=tmp / "open.log", env=env).start(60)
        try:
            yield guarded, open_server
        finally:
            open_server.stop()
    finally:
        guarded.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-pg", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="small attacks on SQLite only (CI)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "abuse.json")
    args = parser.parse_args(argv)

    rows: list[Row] = []
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        with servers(f"sqlite:///{tmp / 'a.db'}", f"sqlite:///{tmp / 'o.db'}", tmp) as (srv, opn):
            bench = Bench("sqlite", srv, opn, args.smoke)
            bench.run_all()
            rows += bench.rows
        if not (args.skip_pg or args.smoke):
            with (
                fresh_pg_database(PG_URL, "fp8scope_abuse") as a,
                fresh_pg_database(PG_URL, "fp8scope_abuse") as o,
                servers(a, o, tmp) as (srv, opn),
            ):
                bench = Bench("postgresql", srv, opn, args.smoke)
                bench.run_all()
                rows += bench.rows
    met = sum(r.ok for r in rows)
    summary = f"{met}/{len(rows)} attacks met every goal"
    print(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "smoke": args.smoke,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "time": time.time(),
    }
    goals = {"seconds": GOAL_S, "peak_rss_mb": GOAL_RSS_MB, "healthz_ms": GOAL_HEALTHZ_MS}
    args.out.write_text(
        json.dumps(
            {"meta": meta, "goals": goals, "rows": [asdict(r) for r in rows], "summary": summary}, indent=1
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
