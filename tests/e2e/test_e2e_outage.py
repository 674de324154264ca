"""Nothing is lost: the server killed mid-run and restarted stores every step exactly once; the server down
for a whole run leaves a spool that `fp8-monitor upload` turns into the complete run, once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.e2e_utils import run_by_name, start_train, train_cmd
from tests.support.polling import wait_for
from tests.support.server import API, ServerProcess, free_port

pytestmark = pytest.mark.slow


def _loss_steps(api, run_id: int) -> list[int]:
    return api.get(f"/runs/{run_id}/series", params={"name": "loss", "max_points": 100000}).json()["steps"]


def test_server_killed_mid_run_and_restarted_stores_every_step_once(server, api, tmp_path):
    steps = 120
    proc = start_train(tmp_path, "--steps", str(steps), "--monitor-url", server.url, "--run-name", "e2e-kill")
    try:
        wait_for(lambda: any(r["name"] == "e2e-kill" and (r["steps_stored"] or 0) >= 10
                             for r in api.get("/runs").json()), what="10 stored steps")  # fmt: skip
        server.stop(signal.SIGKILL)
        # an outage of a set length, not a wait for something to happen: the job goes on meanwhile (waiting
        # for its spool instead made the outage longer than the rest of the job on a fast machine)
        time.sleep(1.5)
        restarted = ServerProcess(server.db_url, log_path=server.log_path, port=server.port).start()
        try:
            out, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, out[-3000:]
            run = run_by_name(api, "e2e-kill")
            assert run["status"] == "finished" and run["steps_stored"] == steps
            assert _loss_steps(api, run["id"]) == list(range(1, steps + 1))
        finally:
            restarted.stop()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_server_down_for_the_whole_run_then_upload_once(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    steps = 25
    t0 = time.monotonic()
    cmd = train_cmd("--steps", str(steps), "--monitor-url", dead, "--run-name", "e2e-offline")
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 120
    log = proc.stdout + proc.stderr
    assert log.lower().count("spooling") == 1, log[-3000:]
    spools = sorted(tmp_path.rglob("*.jsonl"))
    assert len(spools) == 1 and "fp8-monitor upload" in log

    with ServerProcess(f"sqlite:///{tmp_path / 'later.db'}") as server:
        upload = [sys.executable, "-m", "monitor_server.cli", "upload", str(spools[0]), "--url", server.url]
        for _ in range(2):  # a second upload stores nothing twice
            up = subprocess.run(upload, capture_output=True, text=True, timeout=120)
            assert up.returncode == 0, up.stderr
        with httpx.Client(base_url=server.url + API) as api:
            run = run_by_name(api, "e2e-offline")
            assert run["status"] == "finished" and run["steps_stored"] == steps
            assert _loss_steps(api, run["id"]) == list(range(1, steps + 1))
            assert api.get(f"/runs/{run['id']}/tensors").json()[0]["name"] == "blocks.0.attn.qkv.input"
