"""The job replays its own bundles (``fp8_trainer/app/auto_replay.py``, ``fp8_trainer/app/retry.py``): with
``--remediation act`` a real tiny run with an FP8 saturation, reporting to a real `fp8-monitor serve`, pauses
at its step-40 incident, replays the bundle in a child process, the report lands on the incident, the
service's policy queues its command, and the job runs step 40 again under it before the update, without
anyone running `fp8-train replay`. A failing child is reported and training goes on; a child still running
when the job ends is stopped."""

import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest

from fp8_trainer.app import cli
from fp8_trainer.app.auto_replay import AutoReplay, find_incident
from fp8_trainer.app.train import train
from fp8_trainer.monitor.read import Reader
from tests.support.http import loopback
from tests.support.polling import wait_for
from tests.support.server import API, create_run, running_server
from tests.trainer.test_replay import FLAGS, STEP

pytestmark = pytest.mark.usefixtures("one_thread")
LAYER = "blocks.3.mlp.fc2"
AFTER = 25  # steps after the fault: the policy's check (20 steps) decides within them


@pytest.mark.slow
def test_the_job_runs_its_failing_step_again_under_the_policys_change(tmp_path):
    data = tmp_path / "count.txt"
    data.write_text(" ".join(str(i) for i in range(20000)))
    with running_server(f"sqlite:///{tmp_path / 'monitor.db'}") as server:
        api = server.url + API
        argv = ["--steps", str(STEP + AFTER), *FLAGS, "--data", str(data), "--capture-dir", str(tmp_path)]
        argv += ["--inject", f"saturate:{LAYER}@{STEP}", "--monitor-url", server.url, "--run-name", "auto"]
        a, prepared = cli.prepare([*argv, "--remediation", "act"])
        lines: list[str] = []
        result = train(a, prepared, out=lines.append)
        assert result.status == "finished" and result.step == STEP + AFTER
        (run,) = loopback.get(f"{api}/runs").json()
        rid = run["id"]
        # the policy acted on the replayed incident while the job waited at step 40
        (action,) = wait_for(
            lambda: loopback.get(f"{api}/runs/{rid}/policy-actions").json(), what="the action"
        )
        assert action["rule"] == "low_sqnr" and action["target"] == LAYER  # SQNR -38 dB: E4M3 lacks it
        commands = {c["id"]: c for c in loopback.get(f"{api}/runs/{rid}/commands").json()}
        command = commands[action["command_id"]]
        assert command["created_by"] == "policy:low_sqnr" and command["changes"] == {"fp8_enabled": False}
        # step 40 itself, run again, is the first under the change: the fault never reached the weights
        assert command["state"] == "applied" and command["applied_step"] == STEP
        assert action["state"] in ("kept", "rolled_back")  # checked 20 steps after step 40
        (incident,) = [i for i in loopback.get(f"{api}/runs/{rid}/incidents").json() if i["bundles"]]
        assert incident["replay_verdict"] == "fp8-caused" and incident["id"] == action["incident_id"]
        bundle = tmp_path / f"incident-step{STEP}.pt"
        assert incident["bundles"] == [str(bundle)]
        assert f"fp8-train: step {STEP}: paused while {bundle} is replayed (--remediation act)" in lines
        done = [ln for ln in lines if ln.startswith(f"fp8-train: auto replay of {bundle}: ")]
        assert done == [f"fp8-train: auto replay of {bundle}: fp8-caused (first culprit {LAYER}.input), "
                        f"stored on incident {incident['id']}"]  # fmt: skip
        (again,) = [ln for ln in lines if ln.startswith(f"fp8-train: step {STEP} ran again")]
        assert again.startswith(f"fp8-train: step {STEP} ran again under command(s) {command['id']}: loss ")
        # the service keeps the step as it first ran (the spike its incident reports); the event has both
        # losses, and the job trained on from the run again, whose loss is back near the steps before it
        events = loopback.get(f"{api}/runs/{rid}/events", params={"limit": 1000}).json()
        (retried,) = [e for e in events if (e.get("details") or {}).get("name") == "step_retried"]
        details = retried["details"]
        assert retried["step"] == STEP and details["commands"] == [command["id"]]
        with Reader(server.url) as reader:
            steps, stored = reader.series(rid, "loss")
        first = float(stored[list(steps).index(STEP)])
        assert details["first_loss"] == pytest.approx(first, rel=1e-6)
        assert details["loss"] == pytest.approx(result.losses[STEP - 1], rel=1e-6)
        before = sorted(result.losses[STEP - 6 : STEP - 1])[2]  # the median of the 5 steps before
        ran_again = result.losses[STEP - 1]
        assert first > 2 * before and ran_again < 1.2 * before, (first, result.losses[STEP - 5 :])


def test_with_the_monitor_down_the_job_does_not_pause(tmp_path, monkeypatch):
    """Nothing listens at the monitor's address (the run never registers): the job spools, writes its bundle,
    and trains on without waiting for a replay that could not store its report (the bundle is left to be
    replayed beside training)."""
    monkeypatch.chdir(tmp_path)  # the spool file lands here
    data = tmp_path / "count.txt"
    data.write_text(" ".join(str(i) for i in range(20000)))
    argv = ["--steps", str(STEP + 2), *FLAGS, "--data", str(data), "--capture-dir", str(tmp_path)]
    argv += ["--inject", f"saturate:{LAYER}@{STEP}", "--monitor-url", "http://127.0.0.1:9"]
    a, prepared = cli.prepare([*argv, "--remediation", "act"])
    lines: list[str] = []
    result = train(a, prepared, out=lines.append)
    assert result.status == "finished" and result.step == STEP + 2
    bundle = tmp_path / f"incident-step{STEP}.pt"
    assert bundle.is_file() and not any("paused while" in line for line in lines)
    late = f"fp8-train: step {STEP}: the monitor did not take the step in time; {bundle} is replayed beside"
    assert f"{late} training (as under propose)" in lines
    assert not any("ran again" in line for line in lines)


class _Events:
    """Stands in for the job's monitor: a registered run id, and the events the job would send."""

    def __init__(self, run_id=7):
        self.run_id, self.sent = run_id, []

    def event(self, kind, step, **details):
        self.sent.append((kind, step, details))


def test_a_failed_replay_is_reported_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    auto = AutoReplay("http://127.0.0.1:9", "cpu", lines.append)
    monitor = _Events()
    auto.after_step(40, "missing.pt", monitor)  # starts the child at once (the run is registered)
    assert auto.running is not None and auto.running.proc is not None
    auto.running.proc.wait(60)  # the child's own end: it names the missing file and exits 2
    auto.after_step(41, None, monitor)  # the job's next step notices, without waiting
    assert auto.finished == [("missing.pt", 2)] and auto.running is None
    assert lines[-1] == "fp8-train: auto replay of missing.pt failed (exit 2): missing.pt: no such file " \
        "(log missing.pt.replay.log)"  # fmt: skip
    assert monitor.sent == [("auto_replay_failed", 41, {"bundle": "missing.pt", "exit_code": 2,
                                                         "reason": "missing.pt: no such file"})]  # fmt: skip


def test_one_replay_at_a_time_and_a_running_one_stopped_at_the_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with (
        running_server(f"sqlite:///{tmp_path / 'monitor.db'}") as server,
        httpx.Client(base_url=server.url) as c,
    ):
        rid = create_run(c)["id"]  # a run without incidents: the child waits for one that lists its bundle
        for name in ("a.pt", "b.pt"):
            (tmp_path / name).write_bytes(b"not read before its incident is found")
        lines: list[str] = []
        auto = AutoReplay(server.url, "cpu", lines.append)
        monitor = _Events(rid)
        auto.after_step(3, "a.pt", monitor)
        auto.after_step(4, "b.pt", monitor)
        assert (
            auto.running is not None
            and auto.running.bundle == "a.pt"
            and [p.bundle for p in auto.queue] == ["b.pt"]
        )
        child = auto.running.proc
        wait_for(lambda: "waiting for its incident" in (tmp_path / "a.pt.replay.log").read_text(), timeout=60,
                 what="the child polling the service")  # fmt: skip
        auto.close(monitor, 5)
        assert child is not None and child.poll() is not None  # stopped, not left behind
        assert lines[-3] == "fp8-train: auto replay of a.pt stopped: the job ended first"
        assert lines[-2] == (
            f"fp8-train: not replayed: a.pt (by hand: fp8-train replay a.pt --monitor-url {server.url} "
            f"--run-id {rid} --incident ID, the incident that lists it)"
        )
        assert lines[-1].startswith("fp8-train: not replayed: b.pt")
        assert auto.running is None and not auto.queue and monitor.sent == []


def test_the_incident_a_bundle_belongs_to():
    def inc(i, first, last, bundles):
        return {"id": i, "first_step": first, "last_step": last, "bundles": bundles}

    incidents = [inc(1, 30, 31, ["b40"]), inc(2, 40, 44, ["b40"]), inc(3, 45, 50, ["b40", "b47"])]
    assert find_incident(incidents, "b40", 40)["id"] == 2  # the one whose steps hold the bundle's
    assert find_incident(incidents, "b47", 47)["id"] == 3
    assert find_incident([inc(1, 30, 31, ["b40"]), inc(3, 45, 50, ["b40"])], "b40", 40)["id"] == 3  # nearest
    assert find_incident(incidents, "b99", 99) is None


def test_the_child_is_a_module_with_its_own_usage():
    out = subprocess.run(
        [sys.executable, "-m", "fp8_trainer.app.auto_replay", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--run-id" in out.stdout and "--step" in out.stdout


def test_only_with_remediation_a_monitor_and_a_capture():
    lines: list[str] = []
    flags = SimpleNamespace(
        remediation="act", monitor_url="http://x:1", token=None, token_file=None, device="cpu"
    )
    assert AutoReplay.for_job(flags, object(), lines.append) is not None
    assert AutoReplay.for_job(SimpleNamespace(**{**vars(flags), "remediation": "propose"}), object(), print)
    assert AutoReplay.for_job(flags, None, lines.append) is None  # no capture (several ranks, --no-capture)
    assert (
        AutoReplay.for_job(SimpleNamespace(**{**vars(flags), "remediation": "off"}), object(), print) is None
    )
