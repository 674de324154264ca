"""One batch must not stall ingest for every run: the scalars' names are bounded per batch, per run and in
length (422 naming the setting, nothing stored), their columns are built in one pass, and a wait for a busy
run's lock ends in 503 with Retry-After (nothing stored) instead of holding a worker thread. On both
backends."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from sqlalchemy import create_engine, text

from monitor_server.core.db import PG_RUN_LOCK_CLASS, Database
from monitor_server.services.ingest import scalar_columns
from tests.support.polling import wait_until
from tests.support.server import API, create_run


def scalars_body(key: str, steps: range, names: list[str]) -> dict:
    return {
        "idempotency_key": key,
        "steps": [{"step": s, "scalars": {n: float(s) for n in names}} for s in steps],
    }


def stored(client, run_id: int) -> tuple[int, list[str]]:
    run = client.get(f"{API}/runs/{run_id}").json()
    return run["steps_stored"], run["scalar_names"]


class RunLockHolder:
    """Another batch of the run being stored: a thread holds the run's lock from construction until
    ``release``."""

    def __init__(self, ctx, run_id: int):
        self.held, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold, args=(ctx, run_id))
        self.thread.start()
        assert self.held.wait(10)

    def _hold(self, ctx, run_id: int) -> None:
        with ctx.db.run_lock(run_id):
            self.held.set()
            self.done.wait(60)

    def release(self) -> None:
        self.done.set()
        self.thread.join(30)


def test_a_batch_with_too_many_names_is_refused_naming_the_setting(make_client):
    client = make_client(max_scalar_names_per_batch=8)
    rid = create_run(client)["id"]
    # one new name per step: nine distinct names in the batch, one over the limit
    body = {
        "idempotency_key": "wide",
        "steps": [{"step": s, "scalars": {f"g{s}": 1.0, "loss": 2.0}} for s in range(8)],
    }
    r = client.post(f"{API}/runs/{rid}/telemetry", json=body)
    assert r.status_code == 422
    assert "max_scalar_names_per_batch" in r.json()["detail"]
    assert stored(client, rid) == (0, [])
    ok = client.post(f"{API}/runs/{rid}/telemetry", json=scalars_body("ok", range(4), ["loss", "lr"]))
    assert ok.status_code == 200 and stored(client, rid) == (4, ["loss", "lr"])


def test_a_run_cannot_grow_past_its_name_limit(make_client):
    client = make_client(max_scalar_names_per_run=10)
    rid = create_run(client)["id"]
    first = [f"a{i}" for i in range(6)]
    assert (
        client.post(f"{API}/runs/{rid}/telemetry", json=scalars_body("1", range(3), first)).status_code == 200
    )
    second = [f"b{i}" for i in range(6)]
    r = client.post(f"{API}/runs/{rid}/telemetry", json=scalars_body("2", range(3, 6), second))
    assert r.status_code == 422
    assert "max_scalar_names_per_run" in r.json()["detail"]
    assert stored(client, rid) == (3, sorted(first))
    # names the run has already cost nothing; four new ones still fit
    again = first + second[:4]
    assert (
        client.post(f"{API}/runs/{rid}/telemetry", json=scalars_body("3", range(3, 6), again)).status_code
        == 200
    )
    assert stored(client, rid) == (6, sorted(again))


def test_a_long_scalar_name_is_refused(make_client):
    client = make_client(max_scalar_name_chars=16)
    rid = create_run(client)["id"]
    r = client.post(f"{API}/runs/{rid}/telemetry", json=scalars_body("long", range(2), ["x" * 17]))
    assert r.status_code == 422
    assert "max_scalar_name_chars" in r.json()["detail"]
    assert stored(client, rid) == (0, [])


def reference_columns(scalars: list[dict[str, float]]) -> dict[str, tuple[list[float], list[bool]]]:
    """The columns one name at a time, as a reader would build them."""
    names = sorted({k for sc in scalars for k in sc})
    return {n: ([sc.get(n, np.nan) for sc in scalars], [n in sc for sc in scalars]) for n in names}


def test_scalar_columns_match_a_name_by_name_reference():
    rng = np.random.default_rng(7)
    scalars = [
        {f"s{j}": float(v) for j, v in enumerate(rng.normal(size=13)) if rng.random() < 0.6}
        for _ in range(37)
    ]
    scalars[5] = {"loss": float("nan")}  # a real NaN, carried
    scalars[9] = {}
    columns, present = scalar_columns(scalars)
    ref = reference_columns(scalars)
    assert list(columns) == list(ref)
    for name, (values, where) in ref.items():
        np.testing.assert_array_equal(columns[name], np.array(values, dtype=np.float64))
        np.testing.assert_array_equal(present[name], np.array(where))


def post_in_thread(client, rid: int, body: dict):
    pool = ThreadPoolExecutor(1)
    return pool, pool.submit(client.post, f"{API}/runs/{rid}/telemetry", json=body)


def answered_while_held(hold, release, future) -> object:
    """The answer to a request sent while `hold` keeps the run's lock; the lock is let go after the answer
    (or after 30 s without one, so that a server that waits for ever fails the test rather than hanging)."""
    try:
        return future.result(timeout=30)
    except TimeoutError:
        return None
    finally:
        release()
        hold.join()


def test_a_wait_for_a_busy_run_ends_in_503_with_retry_after(make_client):
    client = make_client(run_lock_wait_seconds=0.3)
    ctx = client.app.state.ctx
    rid = create_run(client)["id"]
    lock = RunLockHolder(ctx, rid)
    pool, future = post_in_thread(client, rid, scalars_body("busy", range(2), ["loss"]))
    r = answered_while_held(lock.thread, lock.done.set, future)
    pool.shutdown()
    assert r is not None, "the request waited for the run's lock until it was released"
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "run_lock_wait_seconds" in r.json()["detail"]
    assert stored(client, rid) == (0, [])
    again = client.post(f"{API}/runs/{rid}/telemetry", json=scalars_body("busy", range(2), ["loss"]))
    assert again.status_code == 200 and stored(client, rid) == (2, ["loss"])


def test_a_run_locked_by_another_instance_answers_503_quickly(make_client, db_url):
    """On PostgreSQL another instance holds the run's advisory lock (a frozen one would hold it the same
    way): the wait is short, not the minute it was."""
    if not db_url.startswith("postgresql"):
        pytest.skip("the advisory lock orders instances on PostgreSQL; SQLite has one process")
    client = make_client(run_lock_wait_seconds=0.5)
    rid = create_run(client)["id"]
    other = create_engine(db_url, isolation_level="AUTOCOMMIT")
    try:
        with other.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:c, :k)"), {"c": PG_RUN_LOCK_CLASS, "k": rid})
            pool, future = post_in_thread(client, rid, scalars_body("frozen", range(2), ["loss"]))
            try:
                r = future.result(timeout=30)
            finally:
                conn.execute(text("SELECT pg_advisory_unlock_all()"))
                pool.shutdown()
    finally:
        other.dispose()
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert stored(client, rid) == (0, [])


def test_a_frozen_instance_loses_the_run_lock_after_its_lease(make_client, db_url):
    """On PostgreSQL another instance takes the run's lock and stops (its lock connection idle in its
    transaction, as for a stopped process whose kernel still answers keepalives): the run answers 503
    with Retry-After meanwhile, and takes batches again once the lease ran out, not when the holder
    wakes up."""
    if not db_url.startswith("postgresql"):
        pytest.skip("the advisory lock orders instances on PostgreSQL; SQLite has one process")
    client = make_client(run_lock_wait_seconds=0.3, run_lock_lease_seconds=1.0)
    rid = create_run(client)["id"]
    frozen = Database(db_url, 0.3, 1.0)  # the other instance
    held, thaw = threading.Event(), threading.Event()

    def freeze() -> None:
        with frozen.run_lock(rid):  # woken up, it finds its lock gone with its session (and says so)
            held.set()
            thaw.wait(60)

    holder = threading.Thread(target=freeze)
    holder.start()
    try:
        assert held.wait(10)
        url = f"{API}/runs/{rid}/telemetry"
        busy = client.post(url, json=scalars_body("k", range(2), ["loss"]))
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert wait_until(
            lambda: client.post(url, json=scalars_body("k", range(2), ["loss"])).status_code == 200
        )
        assert holder.is_alive(), "the holder was still frozen when the run took batches again"
        assert stored(client, rid) == (2, ["loss"])
    finally:
        thaw.set()
        holder.join(30)
        frozen.dispose()


def test_a_flooded_run_holds_one_worker_thread(make_client):
    """Sixty batches of one run arrive while it is busy (all admitted here): they wait their turn without
    holding the worker threads, so /healthz (and every other run) keeps answering while they wait.

    No wall-clock bound: the run stays busy until the end of the check, so a /healthz answer while every
    batch of the flood is still unanswered is the property itself. Were the waiting batches holding the
    worker threads, /healthz would wait for them to give up (``run_lock_wait_seconds``, 20 s here), past
    the 10 s allowed to each answer."""
    client = make_client(run_lock_wait_seconds=20, run_batches_in_flight=64)
    ctx = client.app.state.ctx
    rid = create_run(client)["id"]
    lock = RunLockHolder(ctx, rid)
    pool = ThreadPoolExecutor(61)
    try:
        url = f"{API}/runs/{rid}/telemetry"
        flood = [
            pool.submit(client.post, url, json=scalars_body(f"f{i}", range(i, i + 1), ["loss"]))
            for i in range(60)
        ]
        assert wait_until(lambda: ctx.run_turns.get(rid, (None, 0))[1] == 60)
        for _ in range(5):
            assert pool.submit(client.get, "/healthz").result(timeout=10).status_code == 200
        assert not any(f.done() for f in flood), "the run was busy, yet a batch of the flood was answered"
    finally:
        lock.release()
    assert sorted(f.result(timeout=60).status_code for f in flood) == [200] * 60
    pool.shutdown()
    assert stored(client, rid) == (60, ["loss"])


def test_batches_of_a_run_beyond_those_in_flight_get_429_before_their_body_is_read(make_client):
    """A run holds `run_batches_in_flight` batches at once on an instance: while those wait for the busy
    run, one more is answered 429 with Retry-After at once, naming the setting (nothing of it stored);
    the admitted ones are stored once the run is free, and other runs are not limited by it."""
    client = make_client(run_lock_wait_seconds=20, run_batches_in_flight=3)
    ctx = client.app.state.ctx
    rid, other = create_run(client)["id"], create_run(client)["id"]
    lock = RunLockHolder(ctx, rid)
    pool = ThreadPoolExecutor(3)
    url = f"{API}/runs/{rid}/telemetry"
    try:
        admitted = [
            pool.submit(client.post, url, json=scalars_body(f"a{i}", range(i, i + 1), ["loss"]))
            for i in range(3)
        ]
        assert wait_until(lambda: ctx.run_turns.get(rid, (None, 0))[1] == 3)
        for i in range(3, 6):
            r = client.post(url, json=scalars_body(f"a{i}", range(i, i + 1), ["loss"]))
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert "run_batches_in_flight" in r.json()["detail"]
        assert (
            client.post(
                f"{API}/runs/{other}/telemetry", json=scalars_body("o", range(1), ["loss"])
            ).status_code
            == 200
        )
    finally:
        lock.release()
    assert [f.result(timeout=60).status_code for f in admitted] == [200] * 3
    pool.shutdown()
    assert stored(client, rid) == (3, ["loss"])
    assert rid not in ctx.run_turns  # every place given back
