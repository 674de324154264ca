"""Spooling: a dead service costs the job nothing, `fp8-monitor upload` completes the run exactly once, and a
service killed (SIGKILL) and restarted mid-run ends with every step stored exactly once."""

from __future__ import annotations

import logging
import signal
import threading
import time

import orjson
import pytest

from fp8_trainer import Monitor
from fp8_trainer.monitor.spool import SpoolWriter, read_spool
from monitor_server import cli
from tests.support.http import loopback
from tests.support.polling import wait_until
from tests.support.server import API, ServerProcess, free_port, running_server
from tests.trainer.monitor_utils import FAST, assert_stored_equal, get, tiny_model, train


def upload(spool, url, capsys) -> tuple[int, str, str]:
    """`fp8-monitor upload SPOOL --url URL` (the console entry point, in process)."""
    code = cli.main(["upload", str(spool), "--url", url])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_unreachable_service_spools_and_upload_completes_the_run_once(tmp_path, caplog, capsys):
    dead = f"http://127.0.0.1:{free_port()}"
    spool = tmp_path / "spool" / "run.jsonl"
    model, recipe = tiny_model()
    mon = Monitor(dead, "offline", model, recipe, spool_path=spool, **FAST)
    with caplog.at_level(logging.WARNING, logger="fp8scope.monitor"), mon:
        seen = train(model, recipe, mon, 10)
        assert mon.spooling and mon.run_id is None
    messages = [r.getMessage() for r in caplog.records]
    assert sum("spooling telemetry to" in m for m in messages) == 1  # said once
    assert any(f"fp8-monitor upload {spool}" in m for m in messages)  # the hint at close

    contents = read_spool(spool)
    assert contents.run["name"] == "offline" and contents.status == "finished"
    assert sorted(s["step"] for b in contents.batches for s in b.get("steps", [])) == list(range(1, 11))

    with spool.open("ab") as f:
        f.write(b'{"type": "batch", "body": {"idem')  # a job killed while writing its last line
    assert read_spool(spool).torn_lines == 1
    with running_server(f"sqlite:///{tmp_path / 'm.db'}") as server:
        code, out, err = upload(spool, server.url, capsys)
        assert code == 0, err
        assert "10 new steps stored" in out
        runs = get(server.url, "/runs")
        assert len(runs) == 1 and runs[0]["status"] == "finished"
        assert_stored_equal(server.url, runs[0]["id"], seen)
        code, out, err = upload(spool, server.url, capsys)  # a second upload stores nothing
        assert code == 0, err
        assert "0 new steps stored" in out and "existing" in out
        assert len(get(server.url, "/runs")) == 1
        assert_stored_equal(server.url, runs[0]["id"], seen)


def test_upload_refuses_what_is_not_a_spool(tmp_path, capsys):
    bad = tmp_path / "x.jsonl"
    dead = f"http://127.0.0.1:{free_port()}"
    run = b'{"type": "run", "version": 1, "client_key": "k", "body": {}}\n'
    for content, words in [
        (b'{"type": "batch", "body": {}}\n', "not an fp8scope spool"),
        (b'[1, 2]\n{"type": "run"}\n', "not a JSON object line"),
        (b'{"type": "run", "version": 1, "body": {}}\n', "lacks its client_key or body"),
        (run + b'{"type": "batch"}\n', "a batch record without a valid body"),
        (run + run.replace(b'"k"', b'"other"'), "a second run"),
    ]:
        bad.write_bytes(content)
        code, _, err = upload(bad, dead, capsys)
        assert code == 2 and words in err, (content, err)


def test_a_job_appending_after_a_torn_line_leaves_an_uploadable_spool(tmp_path, capsys):
    """A writer killed mid-line, then another writer of the same run appending to the same file: the
    appended records start on a line of their own, and the spool still uploads, once."""
    dead = f"http://127.0.0.1:{free_port()}"
    spool = tmp_path / "run.jsonl"
    model, recipe = tiny_model()
    with Monitor(dead, "torn", model, recipe, spool_path=spool, **FAST) as mon:
        seen = train(model, recipe, mon, 3)
    first = read_spool(spool)
    with spool.open("ab") as f:
        f.write(b'{"type": "batch", "body": {"idem')  # the kill, mid-line
    writer = SpoolWriter(spool, first.run, first.client_key)
    writer.write_status("crashed")
    writer.close()
    again = read_spool(spool)
    assert again.torn_lines == 1 and again.status == "crashed" and len(again.batches) == len(first.batches)
    with running_server(f"sqlite:///{tmp_path / 'm.db'}") as server:
        code, out, err = upload(spool, server.url, capsys)
        assert code == 0, err
        run = get(server.url, "/runs")[0]
        assert run["status"] == "crashed"
        assert_stored_equal(server.url, run["id"], seen)


@pytest.mark.slow
def test_service_killed_mid_run_and_at_the_end_every_step_stored_once(tmp_path, capsys):
    server = ServerProcess(f"sqlite:///{tmp_path / 'm.db'}").start()
    spool = tmp_path / "run.jsonl"
    try:
        model, recipe = tiny_model()
        mon = Monitor(server.url, "killed", model, recipe, spool_path=spool, **FAST)
        seen = train(model, recipe, mon, 4)
        assert wait_until(lambda: mon.run_id is not None)
        run_id = mon.run_id
        # 1. killed mid-run and restarted: the client spools, notices the service is back, drains
        server.stop(signal.SIGKILL)
        seen.update(train(model, recipe, mon, 3, start=5))
        assert wait_until(lambda: mon.spooling)
        seen.update(train(model, recipe, mon, 2, start=8))
        server.start()  # same port, same database
        assert wait_until(lambda: not mon.spooling)
        assert mon.sender.stats["drained"] >= 1
        seen.update(train(model, recipe, mon, 3, start=10))
        assert wait_until(lambda: get(server.url, f"/runs/{run_id}")["steps_stored"] >= 11)
        assert_stored_equal(server.url, run_id, {s: v for s, v in seen.items() if s <= 11})
        # 2. killed again until after the job ended: the rest stays in the spool
        server.stop(signal.SIGKILL)
        seen.update(train(model, recipe, mon, 4, start=13))
        mon.close()
        contents = read_spool(spool)
        assert contents.status == "finished"
        spooled = sorted(st["step"] for b in contents.batches for st in b.get("steps", []))
        assert spooled[-1] == 16 and set(range(13, 17)) <= set(spooled)
        # 3. part of the spool delivered by hand first: the upload still stores nothing twice
        server.start()
        for body in contents.batches[: len(contents.batches) // 2]:
            r = loopback.post(
                f"{server.url}{API}/runs/{run_id}/telemetry",
                content=orjson.dumps(body),
                headers={"Content-Type": "application/json"},  # the open server requires it
            )
            assert r.status_code == 200
        code, out, err = upload(spool, server.url, capsys)
        assert code == 0, err
        assert f"run {run_id} (existing)" in out
        assert len(get(server.url, "/runs")) == 1
        assert_stored_equal(server.url, run_id, seen)  # the capped steps came back from the spool, once
        assert get(server.url, f"/runs/{run_id}")["status"] == "finished"
    finally:
        server.stop()


@pytest.mark.slow
def test_stalled_service_caps_buffered_steps_and_loses_nothing(tmp_path, caplog):
    """A service that accepts connections but does not answer (the real server paused with SIGSTOP):
    steps beyond `max_buffered_steps` wait in the spool, the loop never blocks on the service, and once it
    answers again every step is stored exactly once."""
    server = ServerProcess(f"sqlite:///{tmp_path / 'm.db'}").start()
    spool = tmp_path / "run.jsonl"
    model, recipe = tiny_model()
    tuning = {**FAST, "http_timeout": 1.0, "max_buffered_steps": 4, "max_batch_steps": 2}
    step_seconds = []
    try:
        with caplog.at_level(logging.WARNING, logger="fp8scope.monitor"):
            with Monitor(server.url, "stalled", model, recipe, spool_path=spool, **tuning) as mon:
                seen = train(model, recipe, mon, 5)
                assert wait_until(lambda: any(r["steps_stored"] >= 3 for r in get(server.url, "/runs")))
                server.proc.send_signal(signal.SIGSTOP)
                try:
                    t0 = time.perf_counter()

                    def timed(step):
                        step_seconds.append(time.perf_counter() - t0)

                    seen |= train(model, recipe, mon, 40, start=6, hook=timed)
                    # the post in flight times out, later batches pile up behind it and go over the cap
                    capped = "more than 4 steps waiting; the oldest go to the spool"
                    assert wait_until(lambda: any(capped in r.getMessage() for r in caplog.records), 60)
                finally:
                    server.proc.send_signal(signal.SIGCONT)
                seen |= train(model, recipe, mon, 5, start=46)
            run_id = mon.run_id
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "more than 4 steps waiting; the oldest go to the spool" in messages, messages
        # the training thread never waited on the paused service: 40 steps took far less than a timeout each
        assert step_seconds[-1] < 40 * 1.0 / 2, step_seconds[-1]
        assert_stored_equal(server.url, run_id, seen)
        assert get(server.url, f"/runs/{run_id}")["status"] == "finished"
    finally:
        server.stop()


@pytest.mark.slow
def test_job_that_ends_while_the_service_restarts_still_delivers_everything(tmp_path):
    """The job ends during an outage of a service that answered earlier in the run (killed, restarting):
    close keeps trying until close_timeout instead of one last try, so the spooled steps and the final
    status reach the service once it is back, and no spool is left behind."""
    server = ServerProcess(f"sqlite:///{tmp_path / 'm.db'}").start()
    spool = tmp_path / "run.jsonl"
    model, recipe = tiny_model()
    restarted = None
    try:
        mon = Monitor(
            server.url, "ends-in-outage", model, recipe, spool_path=spool, close_timeout=30.0, **FAST
        )
        seen = train(model, recipe, mon, 5)
        assert wait_until(lambda: any(r["steps_stored"] >= 3 for r in get(server.url, "/runs")))
        server.stop(signal.SIGKILL)
        seen |= train(model, recipe, mon, 5, start=6)
        assert wait_until(lambda: mon.spooling)  # the outage is noticed before the job ends
        # the job ends now, while the service is down; the service comes back only afterwards
        closing = threading.Thread(target=mon.close)
        closing.start()
        restarted = ServerProcess(server.db_url, log_path=server.log_path, port=server.port).start()
        closing.join(60)
        assert not closing.is_alive()
        run = get(restarted.url, "/runs")[0]
        assert run["status"] == "finished"
        assert_stored_equal(restarted.url, run["id"], seen)
        assert not spool.exists()  # everything delivered: nothing for a later upload
    finally:
        if restarted is not None:
            restarted.stop()
