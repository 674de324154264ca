"""A replay report on its incident: a real tiny-preset run with an FP8 saturation reports to a real
`fp8-monitor serve`, the service opens an incident that lists the job's bundle, and `fp8-train replay
BUNDLE --monitor-url ... --run-id ... --incident ...` stores the report there, read back as sent."""

import json
import typing

import pytest

from fp8_trainer.app import cli
from fp8_trainer.app.replay import VERDICTS, post_report
from monitor_server.infra.replay_worker import ReplayWorker
from monitor_server.storage.schemas import ReplayVerdict
from tests.support.http import loopback
from tests.support.polling import wait_for
from tests.support.server import API, running_server
from tests.trainer.test_replay import FLAGS, STEP

pytestmark = pytest.mark.usefixtures("one_thread")
LAYER = "blocks.3.mlp.fc2"


def test_a_replay_of_a_real_bundle_is_stored_on_its_incident(tmp_path, capsys):
    data = tmp_path / "count.txt"
    data.write_text(" ".join(str(i) for i in range(20000)))
    with running_server(f"sqlite:///{tmp_path / 'monitor.db'}") as server:
        argv = ["--steps", str(STEP + 1), *FLAGS, "--data", str(data), "--capture-dir", str(tmp_path)]
        argv += ["--inject", f"saturate:{LAYER}@{STEP}", "--monitor-url", server.url, "--run-name", "sat"]
        assert cli.main(argv) == 0
        (bundle,) = tmp_path.glob("incident-step*.pt")
        api = server.url + API
        (run,) = loopback.get(f"{api}/runs").json()

        def incident_with_bundle():
            found = [i for i in loopback.get(f"{api}/runs/{run['id']}/incidents").json() if i["bundles"]]
            return found[0] if found else None

        incident = wait_for(incident_with_bundle, timeout=30, what="an incident listing the bundle")
        assert incident["bundles"] == [str(bundle)] and incident["replay_verdict"] is None
        url = f"{api}/runs/{run['id']}/incidents/{incident['id']}/replay"
        assert loopback.get(url).status_code == 404

        capsys.readouterr()
        out = tmp_path / "report.json"
        where = ["--monitor-url", server.url, "--run-id", str(run["id"]), "--incident", str(incident["id"])]
        assert cli.main(["replay", str(bundle), "--json", str(out), *where]) == 0
        assert f"stored on incident {incident['id']}" in capsys.readouterr().out
        report = json.loads(out.read_text())
        assert report["verdict"] == "fp8-caused", report["reason"]

        stored = loopback.get(url).json()
        assert {k: stored[k] for k in report} == report  # as sent: the evidence, NaN spelled, SQNRs
        fp8 = stored["configs"][0]
        assert fp8["name"] == "fp8" and fp8["sqnr_db"][LAYER] < 0
        assert stored["culprits"][0] == f"{LAYER}.input" and len(stored["configs"]) > 16  # bisected
        incident = loopback.get(f"{api}/runs/{run['id']}/incidents/{incident['id']}").json()
        assert incident["replay_verdict"] == "fp8-caused"

        # the function, and a refusal named: an incident the run does not have
        assert post_report(report, server.url, run["id"], incident["id"])["verdict"] == "fp8-caused"
        with pytest.raises(RuntimeError, match="HTTP 404.*incident 999 not found"):
            post_report(report, server.url, run["id"], 999)


def test_the_service_takes_the_verdicts_the_replay_gives():
    assert typing.get_args(ReplayVerdict) == VERDICTS


def test_a_saturated_gradient_lands_on_its_overflow_alert_and_its_gradient_verdict_is_stored(tmp_path):
    """gradspike moves no loss: the bundle (a statistics trigger) lands on the incident of the service's own
    overflow alert on that grad_output, and the replay's gradient evidence is stored with the report."""
    data = tmp_path / "count.txt"
    data.write_text(" ".join(str(i) for i in range(20000)))
    with running_server(f"sqlite:///{tmp_path / 'monitor.db'}") as server:
        argv = ["--steps", str(STEP + 1), *FLAGS, "--data", str(data), "--capture-dir", str(tmp_path)]
        argv += ["--inject", f"gradspike:{LAYER}@{STEP}", "--monitor-url", server.url, "--run-name", "grad"]
        assert cli.main(argv) == 0
        (bundle,) = tmp_path.glob("incident-step*.pt")
        api = server.url + API
        (run,) = loopback.get(f"{api}/runs").json()

        def incident_with_bundle():
            found = [i for i in loopback.get(f"{api}/runs/{run['id']}/incidents").json() if i["bundles"]]
            return found[0] if found else None

        incident = wait_for(incident_with_bundle, timeout=30, what="an incident listing the bundle")
        assert incident["bundles"] == [str(bundle)]
        assert incident["kind"] == "overflow_burst" and incident["tensors"][0] == f"{LAYER}.grad_output"
        assert incident["first_step"] <= STEP <= incident["last_step"]

        # asked for on the incident page, run by a replay worker (`fp8-monitor replay-worker`)
        asked = loopback.post(f"{api}/runs/{run['id']}/incidents/{incident['id']}/replay-requests", json={})
        assert asked.status_code == 201 and asked.json()["bundle"] == str(bundle)
        said: list[str] = []
        worker = ReplayWorker(server.url, None, say=said.append)
        try:
            finished = worker.run_once()
            assert finished is not None and finished["state"] == "done", (finished, said)
            assert worker.run_once() is None  # nothing else pending
        finally:
            worker.close()
        stored = loopback.get(f"{api}/runs/{run['id']}/incidents/{incident['id']}/replay").json()
        assert stored["verdict"] == "fp8-caused" and stored["trigger"]["kind"] == "grad_overflow"
        assert stored["bundle"] == str(bundle) and stored["culprits"][0] == f"{LAYER}.grad_output"
        fp8, hp = stored["configs"][:2]
        assert fp8["layer_grad_sqnr_db"] < 1 and hp["layer_grad_sqnr_db"] == "Infinity"
