"""The job replays its own bundles (``fp8_trainer/app/auto_replay.py``): with ``--remediation act`` a real
tiny run with an FP8 saturation, reporting to a real `fp8-monitor serve`, replays its step-40 bundle in a
child process, the report lands on the incident, the service's policy queues its command, the job applies it,
and the check decides, without anyone running `fp8-train replay`. A failing child is reported and training
goes on; a child still running when the job ends is stopped."""

import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest

from fp8_trainer.app import cli
from fp8_trainer.app.auto_replay import AutoReplay, find_incident
from fp8_trainer.app.train import train
from tests.support.polling import wait_for
from tests.support.server import API, create_run, running_server
from tests.trainer.test_replay import FLAGS, STEP

pytestmark = pytest.mark.usefixtures("one_thread")
LAYER = "blocks.3.mlp.fc2"
HOLD = 60  # the step at which the test holds the job until the policy has acted (a slow job's long step)


@pytest.mark.slow
def test_the_policy_acts_on_a_running_job_by_itself(tmp_path):
    data = tmp_path / "count.txt"
    data.write_text(" ".join(str(i) for i in range(20000)))
    with running_server(f"sqlite:///{tmp_path / 'monitor.db'}") as server:
        api = server.url + API
        argv = ["--steps", str(HOLD + 40), *FLAGS, "--data", str(data), "--capture-dir", str(tmp_path)]
        argv += ["--inject", f"saturate:{LAYER}@{STEP}", "--monitor-url", server.url, "--run-name", "auto"]
        a, prepared = cli.prepare([*argv, "--remediation", "act"])
        lines: list[str] = []

        def actions():
            (run,) = httpx.get(f"{api}/runs").json()
            return httpx.get(f"{api}/runs/{run['id']}/policy-actions").json()

        def delivered():
            (run,) = httpx.get(f"{api}/runs").json()
            commands = httpx.get(f"{api}/runs/{run['id']}/commands").json()
            return any(c["state"] in ("delivered", "applied") for c in commands)

        def hold(step, model, info):  # the replay runs beside the job; here the job waits for its outcome
            if step == HOLD + 1:
                # the command reaches the job in a telemetry answer: once it has, the job applies it at the
                # next step, however many steps a flush interval holds on this machine
                wait_for(delivered, timeout=120, what="the policy's command delivered to the job")
                return
            if step != HOLD:
                return
            try:  # at a low priority the replay takes a few seconds on an idle machine, minutes on a busy one
                wait_for(actions, timeout=600, what="the policy's action on the auto-replayed incident")
            except AssertionError as e:
                logs = {p.name: p.read_text() for p in tmp_path.glob("*.replay.log")}
                raise AssertionError(f"{e}\n{lines[-8:]}\n{logs}") from None

        result = train(a, prepared, on_step=hold, out=lines.append)
        assert result.status == "finished" and result.step == HOLD + 40
        (run,) = httpx.get(f"{api}/runs").json()
        (action,) = actions()
        assert action["rule"] == "low_sqnr" and action["target"] == LAYER  # SQNR -38 dB: E4M3 lacks it
        assert action["state"] in ("kept", "rolled_back")  # checked 20 steps after it was applied
        commands = {c["id"]: c for c in httpx.get(f"{api}/runs/{run['id']}/commands").json()}
        command = commands[action["command_id"]]
        assert command["created_by"] == "policy:low_sqnr" and command["state"] == "applied"
        assert command["applied_step"] > STEP and command["changes"] == {"fp8_enabled": False}
        if action["state"] == "rolled_back":
            assert commands[action["rollback_id"]]["created_by"] == "policy:rollback"
        (incident,) = [i for i in httpx.get(f"{api}/runs/{run['id']}/incidents").json() if i["bundles"]]
        assert incident["replay_verdict"] == "fp8-caused" and incident["id"] == action["incident_id"]
        bundle = tmp_path / f"incident-step{STEP}.pt"
        assert incident["bundles"] == [str(bundle)]
        done = [ln for ln in lines if ln.startswith(f"fp8-train: auto replay of {bundle}: ")]
        assert done == [f"fp8-train: auto replay of {bundle}: fp8-caused (first culprit {LAYER}.input), "
                        f"stored on incident {incident['id']}"]  # fmt: skip
        assert "stored on incident" in (tmp_path / f"incident-step{STEP}.pt.replay.log").read_text()


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
