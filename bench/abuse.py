"""Benchmark: hostile and unlucky requests against a real `fp8-monitor serve` (uvicorn subprocess), on SQLite
and PostgreSQL.

Each attack runs on its own while two watchers run beside it: one samples the server's resident memory
(/proc, every 5 ms), one asks `/healthz` over and over. Per attack the table says the status the server
answered (and the one expected), the time to that answer, the server's peak RSS above its idle RSS just
before the attack, the worst `/healthz` latency during it, and whether anything of a rejected request was
stored (runs, steps and events compared before and after).

    .venv/bin/python bench/abuse.py [--skip-pg] [--smoke] [--round-two-only] [--out bench/results/abuse.json]

The round-two attacks (what a holder of an ingest or read token can do to every other run: `watched`)
also run a bystander run beside each attack, posting a small batch every 20 ms from a process of its own
(as the prober), and print its ingest latency (p99 and worst) under the row; their goals (issue 38's):
every request answered or refused within 5 s (a row of several requests one after the other shows the
slowest, marked so), other runs' ingest p99 under 1 s. `--round-two-only` runs only those.

Goals: every attack answered with the expected status within 1 s (the slow-client attacks: within the
configured timeout plus 1 s), peak RSS under 200 MB above idle, `/healthz` under 100 ms throughout,
nothing stored from a rejected request. `--smoke` runs smaller attacks on SQLite only (for CI; its numbers
are not measurements).

Measured on a shared 2-core machine: 32 of 34 attacks meet every goal on SQLite and PostgreSQL (each
answered in at most 0.25 s, peak RSS at most 29 MB above idle). The two misses are the same attack: while
a thousand slow clients connect at once, /healthz waits 120-280 ms, the time asyncio takes to accept the
burst in one turn of the event loop; every slow client is refused with 408 at its timeout.

Round two (`--round-two-only`, both backends, the same shared 2-core machine under other work, load
average 3-6): 30 of 42 rows meet every goal. One batch of 300,000 new scalar names beside 45 small batches
of its run: 422 in 0.56 s (SQLite) / 0.77 s (PostgreSQL), 41 / 42 of the small batches answered 429 at
once (`run_batches_in_flight`), other runs' ingest p99 242 / 378 ms, but `/healthz` waits up to 164 / 204
ms: parsing the 4.6 MB body holds the GIL (orjson.loads alone takes 170-250 ms of it here). 1,500 stream
events in one batch: 200 in 1.61 / 1.89 s, the reader gets all of them, `/healthz` at most 22 / 79 ms.
500 trickled bodies: all 408, in 4.46 / 7.33 s (`/healthz` 82 / 222 ms): each is refused about 3 s after
the server begins to read it, and opening 500 connections on the loaded machine spreads those starts over
1.5-2.5 s.

Since then (`--round-two-only --only trickled_bodies,wide_scalars`, load average about 5): the owner check
before a body is read takes the cached run meta without a database read, and the 500 trickled bodies are
refused in 3.92 / 4.44 s (`/healthz` 92 / 78 ms). A body of many values is parsed by a parser that lets
other threads run between objects (`monitor_server/infra/body_json.py`; `bench/body_parse.py` compares it
with orjson in one run: the worst `/healthz` per round halved, median 132 -> 50 ms). The wide-scalars rows
on this loaded machine (load average about 8): the new names alone 41 / 89 ms, with the 45 small batches
beside it 226 / 85 ms (the PostgreSQL one-batch row took 1.33 s, over its 1 s goal).

Round two again (`--round-two-only`, both backends, 149 s, on an otherwise idle 2-core machine): 42 of 42
rows meet every goal. The slowest answer 4.36 s (the 500 trickled bodies on PostgreSQL, all 408; SQLite
3.94 s), the most memory +181 MB (the scalars export of 4,000 names x 2,000 steps, both backends), the worst
`/healthz` 77 ms (the trickled bodies, PostgreSQL), other runs' ingest p99 at most 158 ms. The rows of many
requests one after the other show their slowest answer: 100 posts of events with 160 KB of keys and client
alerts with a 100 kB message and a 1 MB recorder, 0.19 / 0.22 s each at most (before, the row showed the
sum, 10-14 s, against the 1 s goal of a single request); 300 stuck streams and 500 events in 1.23 / 1.69 s
(`/healthz` 30 / 37 ms; 100 streams opened, 200 refused with 429).

The parts: `bench/abuse_harness.py` (the watchers, raw requests, rows), `bench/abuse_round_one.py` and
`bench/abuse_round_two.py` with `bench/abuse_exports.py` (the attacks); this script runs them against
each backend and writes the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.abuse_harness import (  # noqa: E402  (the parts of this benchmark)
    GOAL_HEALTHZ_MS,
    GOAL_RSS_MB,
    GOAL_S,
    HEADER,
    HEADER_TIMEOUT_S,
    INGEST_LATENCY,
    KEEP_IDLE_RUNS,
    PG_URL,
    TOKENS,
    Bench,
    Row,
)
from bench.abuse_round_one import run_round_one  # noqa: E402
from bench.abuse_round_two import run_round_two  # noqa: E402
from tests.support.server import ServerProcess, fresh_pg_database  # noqa: E402  (shared with the tests)


@contextlib.contextmanager
def servers(db_url: str, open_db_url: str, tmp: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A server with the bench's tokens and one without any (the open-server attacks), both with the short
    read timeout the slow-client attacks wait for."""
    env = {
        "FP8SCOPE_HEADER_TIMEOUT_SECONDS": str(HEADER_TIMEOUT_S),
        "FP8SCOPE_SSE_KEEPALIVE_SECONDS": "1",
        **KEEP_IDLE_RUNS,
    }
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


def run_backend(
    backend: str, db_url: str, open_db_url: str, tmp: Path, args: argparse.Namespace
) -> list[Row]:
    """Every attack the arguments ask for against one backend's pair of servers: their rows."""
    with servers(db_url, open_db_url, tmp) as (srv, opn):
        bench = Bench(backend, srv, opn, args.smoke)
        with bench.http:
            if not args.round_two_only:
                run_round_one(bench)
            run_round_two(bench, args.only)
        return bench.rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-pg", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="small attacks on SQLite only (CI)")
    parser.add_argument("--round-two-only", action="store_true", help="only the attacks of issue 38")
    parser.add_argument(
        "--only",
        type=lambda v: set(v.split(",")),
        help="with --round-two-only: these round-two attacks only (comma-separated, e.g. trickled_bodies)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "abuse.json")
    return parser.parse_args(argv)


def write_results(out: Path, rows: list[Row], smoke: bool) -> str:
    """The rows, goals and other runs' ingest latency as JSON at `out`; the summary line."""
    met = sum(r.ok for r in rows)
    summary = f"{met}/{len(rows)} attacks met every goal"
    meta = {"smoke": smoke, "python": platform.python_version(), "cpus": os.cpu_count(), "time": time.time()}
    goals = {"seconds": GOAL_S, "peak_rss_mb": GOAL_RSS_MB, "healthz_ms": GOAL_HEALTHZ_MS}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "meta": meta,
                "goals": goals,
                "rows": [asdict(r) for r in rows],
                "other_runs_ingest": INGEST_LATENCY,
                "summary": summary,
            },
            indent=1,
        )
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[Row] = []
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        rows += run_backend("sqlite", f"sqlite:///{tmp / 'a.db'}", f"sqlite:///{tmp / 'o.db'}", tmp, args)
        if not (args.skip_pg or args.smoke):
            with (
                fresh_pg_database(PG_URL, "fp8scope_abuse") as a,
                fresh_pg_database(PG_URL, "fp8scope_abuse") as o,
            ):
                rows += run_backend("postgresql", a, o, tmp, args)
    print(write_results(args.out, rows, args.smoke))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
