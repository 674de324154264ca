"""The abuse benchmark's second round (`bench/abuse.py --round-two-only`, issue 38): what a holder of an
ingest or read token can do to every other run. Each attack runs `watched`: a bystander run ingests beside
it, and its latency is part of the row's goal.

One function per finding (`attack_<name>`, selected by `--only <name>`); `run_round_two` runs them in order.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson

from bench.abuse_exports import attack_export_cut_off, attack_export_memory
from bench.abuse_harness import (
    API,
    JSON_TRAINER,
    KEEP_IDLE_RUNS,
    MIB,
    OPS,
    ROUND_TWO_GOAL_S,
    TOKENS,
    TRAINER,
    Bench,
    head,
    new_run,
    packed_stats,
    raw_request,
    status_of,
    watched,
)
from tests.support.server import ServerProcess


def _late_batch(url: str, run_id: int, key: str) -> int:
    """A job's next batch (one step, a loss and its statistics) for `run_id`: the status it gets."""
    stats = packed_stats(bytes(48), "float64")
    body = {"idempotency_key": key, "steps": [{"step": 99, "scalars": {"loss": 9.5}, "stats": stats}]}
    return httpx.post(
        f"{url}{API}/runs/{run_id}/telemetry", json=body, headers=TRAINER, timeout=30
    ).status_code


def _deleted_then_registered(url: str, sender_url: str, name: str) -> tuple[int, int]:
    """A run registered, sent a batch through `sender_url` (which then knows it), deleted, and the next run
    registered: (the deleted run's id, the new run's id)."""
    old = new_run(url, name, 6)
    assert _late_batch(sender_url, old, "first") == 200
    assert httpx.delete(f"{url}{API}/runs/{old}", headers=OPS, timeout=30).status_code == 204
    return old, new_run(url, name, 9)


def attack_ids_never_reused_in_tmp(bench: Bench) -> None:
    """`attack_ids_never_reused` with a temporary folder of its own."""
    with tempfile.TemporaryDirectory() as tmpdir:
        attack_ids_never_reused(bench, Path(tmpdir))


def attack_ids_never_reused(bench: Bench, tmp: Path) -> None:
    """Item 1: the newest run is deleted and another registered; the deleted run's job sends its next batch
    (same ingest token) to this instance, and to a second instance on the same database that had cached the
    old run. Expected 404 from both: nothing lands in the new run."""
    url = bench.server.url
    old, new = _deleted_then_registered(url, url, "recycled?")
    watched(
        bench,
        f"deleted run's job sends again (new run id {new} vs {old})",
        404,
        lambda: _late_batch(url, old, "late"),
    )
    env = {"FP8SCOPE_TOKENS": TOKENS, **KEEP_IDLE_RUNS}
    with ServerProcess(bench.server.db_url, log_path=tmp / "second.log", env=env).start(60) as second:
        # the second instance caches the old run's meta as it takes its first batch
        old, new = _deleted_then_registered(url, second.url, "cached elsewhere")
        watched(
            bench,
            f"...the same through a 2nd instance (id {new} vs {old})",
            404,
            lambda: _late_batch(second.url, old, "late"),
        )


def _post_json(url: str, body: bytes, timeout: float = 120) -> int | None:
    """POST a JSON body with the ingest token: its status, None where no answer came."""
    try:
        return httpx.post(url, content=body, headers=JSON_TRAINER, timeout=timeout).status_code
    except httpx.HTTPError:
        return None


#: the run's small batches queued beside its one wide batch (`attack_wide_scalars`)
SMALL_BATCHES = 45


def _wide_body(key: str, start: int, steps: int, width: int, name: Callable[[int, int], str]) -> bytes:
    """A batch of `steps` scalars-only steps from `start` on, `width` scalars each, named `name(step, j)`."""
    rows = [{"step": start + s, "scalars": {name(s, j): 1.0 for j in range(width)}} for s in range(steps)]
    return orjson.dumps({"idempotency_key": key, "steps": rows})


def _wide_beside_small_batches(bench: Bench, wide: bytes, first_small: int) -> None:
    """The row of `wide` (refused, 422) sent from a raw socket with `SMALL_BATCHES` small batches of the
    same run (steps from `first_small` on) posted once its head is out: each small one must be stored or
    refused as busy."""
    url = bench.telemetry_url
    # the small batches share one client made here, as a job's sender would: 45 clients made inside the
    # attack (each loading the CA bundle) took this process seconds of CPU, which on 2 cores showed up as
    # the server's latency
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    client = httpx.Client(limits=limits, headers=JSON_TRAINER, timeout=120)

    def post_small(body: bytes) -> int | None:
        try:
            return client.post(url, content=body).status_code
        except httpx.HTTPError:
            return None

    def queued() -> int | None:
        small = [
            orjson.dumps(
                {"idempotency_key": f"q{i}", "steps": [{"step": first_small + i, "scalars": {"loss": 1.0}}]}
            )
            for i in range(SMALL_BATCHES)
        ]
        out: dict[int, int | None] = {}
        big_sent = threading.Event()

        def post_big() -> None:  # first: its head is out before the small batches start
            big = head(
                "POST",
                url.removeprefix(bench.server.url),
                len(wide),
                "Authorization: Bearer bench-trainer-secret",
            )
            out[-1] = raw_request(bench.server.port, big, iter([wide]), sent=big_sent)

        threads = [threading.Thread(target=post_big)]
        threads += [
            threading.Thread(target=lambda i=i, b=b: out.__setitem__(i, post_small(b)))
            for i, b in enumerate(small)
        ]
        threads[0].start()
        big_sent.wait(30)
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join()
        # 429: more of the run's batches in flight than run_batches_in_flight; 503: the run stayed busy.
        # Either way nothing is stored and the job sends the batch again
        small_ok = all(out[i] in (200, 429, 503) for i in range(SMALL_BATCHES))
        answered = {status: sum(out[i] == status for i in range(SMALL_BATCHES)) for status in (200, 429, 503)}
        print(f"|   the {SMALL_BATCHES} small batches: {answered}", flush=True)
        return out[-1] if small_ok else None

    try:
        watched(
            bench,
            f"...the same with {SMALL_BATCHES} small batches of the run beside it",
            422,
            queued,
            rejected=False,
            time_goal_s=ROUND_TWO_GOAL_S,
        )
    finally:
        client.close()


def attack_wide_scalars(bench: Bench) -> None:
    """Item 4: one batch naming a thousand new scalars per step (refused by name, 422), the same queued with
    45 small batches of the run behind it, and a batch of a thousand scalars that are the same names at every
    step (allowed: stored in one pass)."""
    url = bench.telemetry_url
    S, N = (60, 200) if bench.smoke else (300, 1000)
    first = 1_000_000  # scalars-only steps, past every other attack's
    new_names = _wide_body("wide-new", first, S, N, lambda s, j: f"s{s}.n{j}")
    watched(
        bench,
        f"{S} steps x {N} new scalar names each ({len(new_names) // MIB} MiB)",
        422,
        lambda: _post_json(url, new_names),
    )
    _wide_beside_small_batches(bench, new_names, first + S)
    same_names = _wide_body("wide-same", first + S + SMALL_BATCHES, S, N, lambda s, j: f"n{j}")
    watched(
        bench,
        f"{S} steps x the same {N} scalar names ({len(same_names) // MIB} MiB)",
        200,
        lambda: _post_json(url, same_names),
        rejected=False,
    )


class StuckStream:
    """A run's SSE stream on a socket with a 4 KiB receive buffer, read only by `read_events` (what it counts
    of the `event` events and whether it was told it fell behind)."""

    def __init__(self, server: ServerProcess, run_id: int, auth: str = "Bearer bench-ops-secret"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        self.sock.settimeout(30)
        self.sock.connect(("127.0.0.1", server.port))
        self.sock.sendall(head("GET", f"{API}/runs/{run_id}/stream", None, f"Authorization: {auth}"))
        self.received = b""
        while b"event: subscribed" not in self.received:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.received += chunk
            if self.received.startswith(b"HTTP/1.1 4"):
                break
        self.status = int(self.received.split(b" ", 2)[1]) if self.received.startswith(b"HTTP/") else None

    def read_events(self, expected: int, timeout: float = 60) -> tuple[int, bool]:
        """(client events read, told to reload) once `expected` were read, the stream ended or `timeout`."""
        deadline = time.monotonic() + timeout
        self.sock.settimeout(2)
        while time.monotonic() < deadline:
            if self.received.count(b"event: event\n") >= expected or b"event: dropped" in self.received:
                break
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            if not chunk:
                break
            self.received += chunk
        return self.received.count(b"event: event\n"), b"event: dropped" in self.received

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def attack_event_burst(bench: Bench) -> None:
    """Item 3: one batch of 1,500 client events while a stream reader is not reading; then it reads. The
    answer is 200, and the reader got all of them or was told to reload ("status" is 200 only then)."""
    n = 300 if bench.smoke else 1500
    url = bench.telemetry_url
    seen: dict[str, object] = {}

    def burst() -> int | None:
        reader = StuckStream(bench.server, bench.run_id)
        try:
            events = [{"kind": "custom", "step": i, "details": {"i": i, "note": "n" * 500}} for i in range(n)]
            status = _post_json(url, orjson.dumps({"idempotency_key": f"burst{n}", "events": events}))
            got, told = reader.read_events(n)
        finally:
            reader.close()
        seen.update(got=got, told=told)
        return status if status == 200 and (got == n or told) else None

    watched(
        bench,
        f"{n} stream events in one batch, a reader behind",
        200,
        burst,
        rejected=False,
        time_goal_s=ROUND_TWO_GOAL_S,
    )
    print(f"|   the reader got {seen['got']} of {n} events; told to reload: {seen['told']}", flush=True)


def attack_light_lists(bench: Bench) -> None:
    """Item 6: events whose summaries would carry 32 keys of 5,000 characters, client alerts with a 100 kB
    message and a 1 MB recorder; then the lists of each (their sizes are printed)."""
    n = 20 if bench.smoke else 100
    url = f"{bench.server.url}{API}/runs/{bench.run_id}"
    keys = {("k" * 5000) + str(j): "v" * 200 for j in range(32)}
    recorder = {"steps": list(range(100_000)), "amax": [1.5] * 100_000}

    answers: list[float] = []

    def post_bloat() -> int | None:
        status = None
        with httpx.Client(headers=JSON_TRAINER, timeout=120) as client:
            for i in range(n):
                t0 = time.perf_counter()
                alert = {"alert": True, "kind": "overflow_burst", "message": "m" * 100_000, "tensor_index": 0}
                events = [
                    {"kind": "custom", "step": 2_000_000 + i, "details": keys},
                    {"kind": "custom", "step": 2_000_000 + i, "details": {**alert, "recorder": recorder}},
                ]
                body = orjson.dumps({"idempotency_key": f"bloat{i}", "events": events})
                status = client.post(f"{url}/telemetry", content=body).status_code
                answers.append(time.perf_counter() - t0)
                if status != 200:
                    return status
        return status

    name = f"{n} events with long keys + {n} client alerts (slowest)"
    watched(bench, name, 200, post_bloat, rejected=False, answers=answers)
    sizes: dict[str, int] = {}
    for path, params in (("events", {"limit": 1000}), ("alerts", {})):

        def get(path: str = path, params: dict = params) -> int | None:
            r = httpx.get(f"{url}/{path}", params=params, headers=OPS, timeout=120)
            sizes[path] = len(r.content)
            return r.status_code

        watched(bench, f"GET /{path} of those", 200, get, rejected=False)
        print(f"|   GET /{path}: {sizes[path] / 1024:.0f} KiB", flush=True)


def attack_stuck_streams(bench: Bench) -> None:
    """Item 6: 300 streams of one token that never read, then 500 events of ~4 KB published to them: the
    token's streams beyond `sse_streams_per_token` get 429; one encoding of each event is shared."""
    n_streams, n_events = (30, 50) if bench.smoke else (300, 500)
    url = bench.telemetry_url
    streams: list[StuckStream] = []
    statuses: list[int | None] = []

    def stuck() -> int | None:
        for _ in range(n_streams):
            s = StuckStream(bench.server, bench.run_id)
            statuses.append(s.status)
            streams.append(s)
        events = [
            {"kind": "custom", "step": i, "details": {"i": i, "pad": "p" * 3800}} for i in range(n_events)
        ]
        status = None
        for k in range(0, n_events, 50):
            body = orjson.dumps({"idempotency_key": f"stuck{k}", "events": events[k : k + 50]})
            status = _post_json(url, body)
        return status

    try:
        watched(
            bench, f"{n_streams} stuck streams of one token, {n_events} events", 200, stuck, rejected=False
        )
    finally:
        for s in streams:
            s.close()
    print(
        f"|   streams: {statuses.count(200)} opened, {statuses.count(429)} refused (429)",
        flush=True,
    )


def attack_big_configs(bench: Bench) -> None:
    """Item 7: a registration with a 900 KiB config (refused, 422), then 150 runs with 60 KiB configs each
    and a runs list of all of them (which carries no config it does not ask for; its size is printed)."""
    root = f"{bench.server.url}{API}/runs"
    big = {"name": "big-config", "tensors": [], "config": {"blob": "c" * (900 * 1024)}}
    watched(
        bench,
        "registration with a 900 KiB config",
        422,
        lambda: httpx.post(root, json=big, headers=TRAINER, timeout=60).status_code,
    )
    n = 30 if bench.smoke else 150
    with httpx.Client(headers=TRAINER, timeout=60) as client:
        for i in range(n):
            body = {"name": f"cfg{i}", "tensors": [], "config": {"lr": 1e-3, "blob": "c" * (60 * 1024)}}
            client.post(root, json=body).raise_for_status()
    size: dict[str, int] = {}

    def listing() -> int:
        r = httpx.get(root, params={"limit": 1000, "config_keys": "lr"}, headers=OPS, timeout=120)
        size["bytes"] = len(r.content)
        return r.status_code

    watched(bench, f"runs list of {n} runs with 60 KiB configs", 200, listing, rejected=False)
    print(f"|   the list: {size['bytes'] / 1024:.0f} KiB", flush=True)


#: trickled bodies per run: the server's default `run_batches_in_flight`, so that every one is admitted and
#: read (one more of a run would get 429 before its body is read)
TRICKLES_PER_RUN = 4


def attack_trickled_bodies(bench: Bench) -> None:
    """Item 11: 500 telemetry bodies announced at 1 MB, each sending 1,000 bytes every 5 s (every piece in
    time for the per-piece timeout), 4 to each of 125 runs of the token: each is refused once below the
    minimum rate (408 for all of them)."""
    n = 50 if bench.smoke else 500
    with httpx.Client(headers=TRAINER, timeout=30) as client:
        root = f"{bench.server.url}{API}/runs"
        runs = [
            client.post(root, json={"name": f"trickled{i}", "tensors": []}).json()["id"]
            for i in range(-(-n // TRICKLES_PER_RUN))
        ]
    paths = [f"{API}/runs/{runs[i // TRICKLES_PER_RUN]}/telemetry" for i in range(n)]
    piece = b" " * 1000

    def trickle() -> int | None:
        socks = []
        for path in paths:
            s = socket.create_connection(("127.0.0.1", bench.server.port), timeout=30)
            s.sendall(head("POST", path, 1_000_000, "Authorization: Bearer bench-trainer-secret") + piece)
            s.setblocking(False)
            socks.append(s)
        answers: dict[int, int | None] = {}
        t0 = last = time.monotonic()
        while len(answers) < n and time.monotonic() - t0 < 120:
            for i, s in enumerate(socks):
                if i in answers:
                    continue
                try:
                    got = s.recv(256)
                except BlockingIOError:
                    continue
                except OSError:
                    got = b""
                answers[i] = status_of(got)
            if time.monotonic() - last >= 5:
                last = time.monotonic()
                for i, s in enumerate(socks):
                    if i not in answers:
                        with contextlib.suppress(OSError):
                            s.sendall(piece)
            time.sleep(0.05)
        for s in socks:
            s.close()
        statuses = set(answers.values()) | ({None} if len(answers) < n else set())
        return statuses.pop() if len(statuses) == 1 else None

    # each is refused body_rate_grace_seconds (2) + 1,000 B / body_min_bytes_per_second (1024) ~ 3 s after the
    # server began reading it, before its second piece
    watched(bench, f"{n} bodies trickling 1,000 B every 5 s", 408, trickle, time_goal_s=ROUND_TWO_GOAL_S)


def attack_probe_run_ids(bench: Bench) -> None:
    """Item 13: a caller without a token asks for a run that exists and one that does not. Expected: 401
    for both, the same answer (shown as 401 only when both are 401 with the same detail)."""
    url, existing = bench.server.url, bench.run_id

    def probe() -> int | None:
        a = httpx.get(f"{url}{API}/runs/{existing}", timeout=30)
        b = httpx.get(f"{url}{API}/runs/99999", timeout=30)
        same = (a.status_code, a.text) == (b.status_code, b.text)
        return a.status_code if same else -b.status_code

    watched(bench, "no token: an existing vs a missing run", 401, probe)


def attack_deep_config_filter(bench: Bench) -> None:
    """Item 9: a runs-list filter whose value nests 5,000 levels deep (it raised RecursionError: a 500 and a
    reset connection). Expected: 422 naming `config`."""
    url, deep = bench.server.url, "[" * 5000 + "]" * 5000

    def deep_filter() -> int | None:
        r = httpx.get(f"{url}{API}/runs", params={"config": f"lr={deep}"}, headers=OPS, timeout=30)
        return r.status_code if "config" in r.text else -r.status_code

    watched(bench, "runs list, config= value 5,000 levels deep", 422, deep_filter)


ROUND_TWO: tuple[Callable[[Bench], None], ...] = (
    attack_ids_never_reused_in_tmp,
    attack_export_cut_off,
    attack_probe_run_ids,
    attack_deep_config_filter,
    attack_export_memory,
    attack_wide_scalars,
    attack_event_burst,
    attack_light_lists,
    attack_stuck_streams,
    attack_big_configs,
    attack_trickled_bodies,
)


def run_round_two(bench: Bench, only: set[str] | None = None) -> None:
    """The round-two attacks, after the others, against the same servers (`only`: those whose function is
    named ``attack_<name>``)."""
    for attack in ROUND_TWO:
        if only is None or attack.__name__.removeprefix("attack_").removesuffix("_in_tmp") in only:
            attack(bench)
