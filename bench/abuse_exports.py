"""The abuse benchmark's export attacks (round two, `bench/abuse_round_two.py`): what a read token can make
the server hold in memory or keep streaming by asking for exports (a run deleted mid-download, wide Parquet
files, several exports at once).
"""

from __future__ import annotations

import httpx
import orjson

from bench.abuse_harness import API, OPS, TRAINER, Bench, concurrently, new_run, packed_stats, watched


def _fill_run(url: str, name: str, tensors: int, steps: int, per_batch: int = 1024) -> int:
    """A run of `tensors` x `steps` of packed statistics, stored through the API."""
    run_id = new_run(url, name, tensors)
    stats = packed_stats(bytes(4 * tensors), "float32")
    with httpx.Client(timeout=300) as client:
        for first in range(0, steps, per_batch):
            body = {
                "idempotency_key": f"fill{first}",
                "steps": [{"step": s, "stats": stats} for s in range(first, min(steps, first + per_batch))],
            }
            r = client.post(
                f"{url}{API}/runs/{run_id}/telemetry", content=orjson.dumps(body), headers=TRAINER
            )
            r.raise_for_status()
    return run_id


def attack_export_cut_off(bench: Bench) -> None:
    """Item 2: the run is deleted while its long CSV downloads. Expected: the transfer is cut off (shown as
    status 200 only when the client saw an incomplete transfer; a complete, shorter file shows as -1)."""
    url = bench.server.url
    # smoke: 4,096 steps; with 2,048 the whole CSV once went out into the socket buffers before the DELETE
    # landed (a complete file, the attack shown as -1)
    steps = 4096 if bench.smoke else 10_240
    run_id = _fill_run(url, "exported", 66, steps)

    def delete_mid_download() -> int | None:
        with (
            httpx.Client(timeout=120) as client,
            client.stream("GET", f"{url}{API}/runs/{run_id}/export", headers=OPS) as response,
        ):
            pieces = response.iter_raw()
            next(pieces)
            httpx.delete(f"{url}{API}/runs/{run_id}", headers=OPS, timeout=60).raise_for_status()
            try:
                for _ in pieces:
                    pass
            except httpx.RemoteProtocolError:
                return response.status_code
            return -1

    watched(
        bench,
        "run deleted during its CSV export: client told",
        200,
        delete_mid_download,
        rejected=False,
        time_goal_s=5.0,
    )


def _download(url: str, params: dict[str, str]) -> int:
    """Read an export to its end (discarding it); its status."""
    with httpx.Client(timeout=600) as client, client.stream("GET", url, params=params, headers=OPS) as r:
        for _ in r.iter_raw():
            pass
        return r.status_code


def _events_run(url: str, n_events: int) -> int:
    """A run of `n_events` client events of 1 MB details each, posted 20 a batch."""
    run_id = new_run(url, "events", 3)
    for first in range(0, n_events, 20):
        events = [
            {"kind": "custom", "step": i, "details": {"blob": "x" * 1_000_000}}
            for i in range(first, first + 20)
        ]
        body = orjson.dumps({"idempotency_key": f"ev{first}", "steps": [], "events": events})
        r = httpx.post(f"{url}{API}/runs/{run_id}/telemetry", content=body, headers=TRAINER, timeout=300)
        r.raise_for_status()
    return run_id


def _scalars_run(url: str, n_names: int, n_steps: int) -> int:
    """A run of `n_names` scalar names, a thousand of them at each of `n_steps` steps per batch."""
    names = [f"metric/{j:04d}" for j in range(n_names)]
    run_id = new_run(url, "scalars")
    for part in range(-(-n_names // 1000)):
        chunk = names[part * 1000 : (part + 1) * 1000]
        body = {
            "idempotency_key": f"sc{part}",
            "steps": [
                {"step": part * n_steps + i, "scalars": dict.fromkeys(chunk, 1.5)} for i in range(n_steps)
            ],
        }
        r = httpx.post(
            f"{url}{API}/runs/{run_id}/telemetry", content=orjson.dumps(body), headers=TRAINER, timeout=300
        )
        r.raise_for_status()
    return run_id


def attack_export_memory(bench: Bench) -> None:
    """Item 5: exports a read token can ask for. Expected: a wide Parquet file of 4,096 tensors refused
    (422, the column budget) alone and 3 at once; events of 1 MB details each and 4,096 scalar names
    streamed within the memory goal; beyond `export_concurrency` (2) at once, 429."""
    url = bench.server.url
    steps = 64 if bench.smoke else 768
    wide = _fill_run(url, "4096 tensors", 4096, steps, per_batch=32)
    export_url = f"{url}{API}/runs/{wide}/export"
    parquet_wide = {"format": "parquet", "layout": "wide"}
    watched(
        bench, f"wide Parquet, 4096 tensors x {steps} steps", 422, lambda: _download(export_url, parquet_wide)
    )

    def three_wide() -> int | None:
        statuses = concurrently([lambda: _download(export_url, parquet_wide)] * 3)
        return 422 if set(statuses) == {422} else -1

    watched(bench, "...3 of them at once", 422, three_wide)
    n_events = 20 if bench.smoke else 200
    run_id = _events_run(url, n_events)
    events_url = f"{url}{API}/runs/{run_id}/export"
    watched(
        bench,
        f"events export, {n_events} x 1 MB details",
        200,
        lambda: _download(events_url, {"table": "events", "format": "parquet"}),
        rejected=False,
        time_goal_s=5.0,
    )

    def four_events() -> int | None:
        calls = [lambda: _download(events_url, {"table": "events", "format": "csv"})] * 4
        statuses = sorted(concurrently(calls))
        return 200 if 200 in statuses and set(statuses) <= {200, 429} else -1

    watched(
        bench, "...4 at once (2 streamed, the rest 429)", 200, four_events, rejected=False, time_goal_s=5.0
    )
    n_steps = 50 if bench.smoke else 500
    run_id = _scalars_run(url, 4000, n_steps)
    watched(
        bench,
        f"scalars export, 4,000 names x {4 * n_steps} steps",
        200,
        lambda: _download(f"{url}{API}/runs/{run_id}/export", {"table": "scalars"}),
        rejected=False,
        time_goal_s=5.0,
    )
