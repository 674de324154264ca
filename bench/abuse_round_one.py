"""The abuse benchmark's first round (`bench/abuse.py`): requests anyone can send (oversized and
compressed bodies, a huge header, deep nesting, a cross-site request to a server without tokens, slow
clients) and the heavy but allowed work of a token holder, each answered with the status it should get.

One function per finding, in the order the rows are printed; `run_round_one` runs them all.
"""

from __future__ import annotations

import contextlib
import gzip
import socket
from collections.abc import Callable

import httpx
import numpy as np
import orjson

from bench.abuse_harness import (
    API,
    HEADER_TIMEOUT_S,
    JSON_TRAINER,
    MIB,
    OPS,
    TRAINER,
    Bench,
    concurrently,
    head,
    new_run,
    packed_stats,
    raw_request,
    status_of,
    zeros,
)
from bench.ingest import tensors_for


def nested_json(depth: int) -> bytes:
    """A JSON object nested `depth` levels deep."""
    return b'{"a":' * (depth - 1) + b'{"leaf":1}' + b"}" * (depth - 1)


def attack_bodies_without_token(bench: Bench) -> None:
    """High 1: bodies without a token, answered before they are read; per-route limits with one."""
    port, rid = bench.server.port, bench.run_id
    big = (8 if bench.smoke else 64) * MIB
    for method, path in (("POST", "/runs"), ("PATCH", f"/runs/{rid}"), ("POST", f"/runs/{rid}/commands")):
        bench.attack(
            f"no token, {big // MIB} MiB body: {method} {path.replace(str(rid), '{id}')}",
            401,
            lambda m=method, p=path: raw_request(port, head(m, API + p, big), zeros(big)),
        )
    bench.attack(
        "ingest token, 2 MiB registration",
        413,
        lambda: raw_request(
            port,
            head("POST", f"{API}/runs", 2 * MIB, "Authorization: Bearer bench-trainer-secret"),
            zeros(2 * MIB),
        ),
    )


def attack_huge_header(bench: Bench) -> None:
    """High 2: a request header of many megabytes."""
    header = (8 if bench.smoke else 80) * MIB
    bench.attack(
        f"{header // MIB} MiB request header",
        431,
        lambda: raw_request(
            bench.server.port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ", zeros(header)
        ),
    )


def _two_far_steps(bench: Bench, run_id: int, T: int) -> None:
    """Steps 0 and 2^40 of a run of `T` tensors: a heatmap over them would be all empty columns."""
    stats = packed_stats(np.ones(T, "<f4").tobytes(), "float32")
    body = {
        "idempotency_key": "far",
        "steps": [{"step": 0, "stats": stats}, {"step": 2**40, "stats": stats}],
    }
    r = httpx.post(f"{bench.server.url}{API}/runs/{run_id}/telemetry", json=body, headers=TRAINER, timeout=60)
    r.raise_for_status()


def attack_wide_runs(bench: Bench) -> None:
    """High 3: a registration of many tensors, and a heatmap of empty columns."""
    url, T = bench.server.url, 4096
    many = {"name": "wide", "tensors": tensors_for(65536 if not bench.smoke else 16384)}
    bench.attack(
        f"registration of {len(many['tensors'])} tensors",
        413,
        lambda: httpx.post(f"{url}{API}/runs", json=many, headers=TRAINER, timeout=60).status_code,
    )
    wide = new_run(url, "wide", T, timeout=60)
    _two_far_steps(bench, wide, T)
    bench.attack(
        "heatmap T=4096, steps 0 and 2^40, max_cols=10000",
        422,
        lambda: (
            httpx.get(
                f"{url}{API}/runs/{wide}/heatmap/packed",
                params={"max_cols": 10000},
                headers=OPS,
                timeout=60,
            ).status_code
        ),
    )


def attack_gzip_bombs(bench: Bench) -> None:
    """Medium 4: gzip and JSON amplification, one body and three at once."""
    url = bench.telemetry_url
    inflated = (8 if bench.smoke else 63) * MIB
    bomb = gzip.compress(b'{"idempotency_key":"bomb","events":[' + b"{}," * (inflated // 3) + b"{}]}", 9)
    gz = {**JSON_TRAINER, "Content-Encoding": "gzip"}
    bench.attack(
        f"gzip {len(bomb) // 1024} KiB -> {inflated // MIB} MiB of {{}}",
        413,
        lambda: httpx.post(url, content=bomb, headers=gz, timeout=120).status_code,
    )
    small = gzip.compress(b'{"idempotency_key":"b","events":[' + b"{}," * (32 * MIB // 3) + b"{}]}", 9)

    def post_small() -> int:
        return httpx.post(url, content=small, headers=gz, timeout=120).status_code

    def parallel() -> int | None:
        out = concurrently([post_small] * 3)
        return out[0] if len(set(out)) == 1 else None

    bench.attack(f"3 parallel gzip bodies of {len(small) // 1024} KiB -> 32 MiB", 413, parallel)


def attack_deep_nesting(bench: Bench) -> None:
    """Medium 5: event details nested deeper than the parser allows."""
    url = bench.telemetry_url
    for depth in (254, 1024):
        body = b'{"idempotency_key":"deep%d","events":[{"kind":"custom","step":1,"details":%s}]}' % (
            depth,
            nested_json(depth),
        )
        bench.attack(
            f"event details nested {depth} deep",
            422,
            lambda b=body: httpx.post(url, content=b, headers=JSON_TRAINER, timeout=60).status_code,
        )


def attack_open_server(bench: Bench) -> None:
    """Medium 6: the server without tokens, from another site's page (a simple cross-site POST, DNS
    rebinding)."""
    ourl = f"{bench.open.url}{API}/runs/{bench.open_run}"
    cmd = httpx.post(f"{ourl}/commands", json={"changes": {"fp8_enabled": False}}).json()["id"]
    ack = orjson.dumps(
        {"idempotency_key": "csrf", "acks": [{"command_id": cmd, "state": "applied", "step": 1}]}
    )
    bench.attack(
        "open server: text/plain ack from another site",
        415,
        server=bench.open,
        fn=lambda: (
            httpx.post(f"{ourl}/telemetry", content=ack, headers={"Content-Type": "text/plain"}).status_code
        ),
    )
    bench.attack(
        "open server: Host attacker.example (DNS rebinding)",
        400,
        server=bench.open,
        fn=lambda: httpx.get(f"{ourl}", headers={"Host": "attacker.example"}).status_code,
    )


def attack_big_events(bench: Bench) -> None:
    """Medium 7: one event over the cap; many under it, listed and streamed to a client that never
    reads."""
    url = bench.telemetry_url
    blob = (
        b'{"idempotency_key":"huge","events":[{"kind":"custom","step":1,"details":{"b":"'
        + b"x" * (9 * MIB)
        + b'"}}]}'
    )
    bench.attack(
        "event details of 9 MiB",
        422,
        lambda: httpx.post(url, content=blob, headers=JSON_TRAINER, timeout=60).status_code,
    )
    n_events = 30 if bench.smoke else 300
    stream = socket.create_connection(("127.0.0.1", bench.server.port))
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stream.sendall(
        head("GET", f"{API}/runs/{bench.run_id}/stream", None, "Authorization: Bearer bench-ops-secret")
    )

    def many_events() -> int | None:
        status = None
        with httpx.Client(headers=JSON_TRAINER, timeout=60) as client:
            for i in range(n_events):
                ev = {"kind": "custom", "step": i, "details": {"i": i, "blob": "y" * MIB}}
                status = client.post(
                    url, content=orjson.dumps({"idempotency_key": f"ev{i}", "events": [ev]})
                ).status_code
                if status != 200:
                    return status
        return status

    bench.attack(
        f"{n_events} events of 1 MB, a stream client that never reads",
        200,
        many_events,
        rejected=False,
        time_goal_s=600,
    )
    bench.attack(
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


def attack_slow_heads(bench: Bench) -> None:
    """Low: slow clients hold connections only until the read timeout."""
    n_slow = 50 if bench.smoke else 1000

    def slow_heads() -> int | None:
        socks = []
        for _ in range(n_slow):
            s = socket.create_connection(("127.0.0.1", bench.server.port))
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            socks.append(s)
        statuses = set()
        for s in socks:
            s.settimeout(HEADER_TIMEOUT_S + 30)
            with contextlib.suppress(OSError):
                statuses.add(status_of(s.recv(64)))
            s.close()
        return statuses.pop() if len(statuses) == 1 else None

    bench.attack(
        f"{n_slow} connections sending half a request head",
        408,
        slow_heads,
        time_goal_s=HEADER_TIMEOUT_S + 1,
    )


ROUND_ONE: tuple[Callable[[Bench], None], ...] = (
    attack_bodies_without_token,
    attack_huge_header,
    attack_wide_runs,
    attack_gzip_bombs,
    attack_deep_nesting,
    attack_open_server,
    attack_big_events,
    attack_slow_heads,
)


def run_round_one(bench: Bench) -> None:
    """The first round's attacks, in order, against `bench`'s servers."""
    for attack in ROUND_ONE:
        attack(bench)
