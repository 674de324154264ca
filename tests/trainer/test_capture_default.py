"""Incident capture is on by default in ``fp8-train`` when a monitor is set: a real tiny-preset run reporting
to a real `fp8-monitor serve` writes its bundle into ``incidents/<run name>/`` and the service lists it on
the incident; ``--no-capture`` turns it off; where capture cannot run (several ranks, --cuda-graph,
--fsdp) the run says so and trains without it."""

from pathlib import Path

import pytest
import torch

from fp8_trainer.app import cli
from fp8_trainer.app.incident_capture import default_directory
from fp8_trainer.app.train import _make_capture
from fp8_trainer.app.train_config import TrainConfig
from tests.support.http import loopback
from tests.support.polling import wait_for
from tests.support.server import API, running_server
from tests.trainer.test_replay import FLAGS, STEP

pytestmark = pytest.mark.usefixtures("one_thread")
FAULT = f"saturate:blocks.3.mlp.fc2@{STEP}"


def test_a_monitored_run_captures_by_default_and_no_capture_turns_it_off(tmp_path, monkeypatch, capsys):
    data = tmp_path / "count.txt"
    data.write_text(" ".join(str(i) for i in range(20000)))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with running_server(f"sqlite:///{tmp_path / 'monitor.db'}") as server:
        argv = ["--steps", str(STEP + 1), *FLAGS, "--data", str(data), "--inject", FAULT]
        argv += ["--monitor-url", server.url]
        assert cli.main([*argv, "--run-name", "auto/1"]) == 0
        out = capsys.readouterr().out
        assert "incident capture into incidents/auto_1 (with a monitor; --no-capture: off)" in out
        (bundle,) = (work / "incidents" / "auto_1").glob("incident-step*.pt")
        assert bundle.name == f"incident-step{STEP}.pt"
        api = server.url + API
        (run,) = loopback.get(f"{api}/runs").json()

        def listed():
            found = [i for i in loopback.get(f"{api}/runs/{run['id']}/incidents").json() if i["bundles"]]
            return found[0]["bundles"] if found else None

        assert wait_for(listed, timeout=30, what="the incident listing the bundle") == [
            str(Path("incidents/auto_1") / bundle.name)
        ]

        assert cli.main([*argv, "--run-name", "off", "--no-capture"]) == 0
        assert "incident capture" not in capsys.readouterr().out
        assert sorted(p.name for p in (work / "incidents").iterdir()) == ["auto_1"]  # nothing for "off"

    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--no-capture", "--capture-dir", str(tmp_path)])
    assert exited.value.code == 2
    assert "--no-capture and --capture-dir: choose one" in capsys.readouterr().err


def test_without_a_monitor_nothing_is_captured_unless_asked():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    said: list[str] = []
    assert _make_capture(TrainConfig(), model, opt, {}, 1, said.append) is None and said == []


@pytest.mark.parametrize(
    "flags,world",
    [({}, 2), ({"cuda_graph": True}, 1), ({"fsdp": True}, 1), ({"capture_dir": "x"}, 2)],
)
def test_where_capture_cannot_run_the_run_says_so_and_trains_without(flags, world):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    said: list[str] = []
    a = TrainConfig(monitor_url="http://127.0.0.1:9", **flags)
    assert _make_capture(a, model, opt, {}, world, said.append) is None
    assert said == [
        "note: incident capture covers single-process eager runs only (not several ranks, --cuda-graph, "
        "--fsdp): this run trains without it"
    ]


def test_the_default_directory_is_per_run_beside_the_checkpoint():
    assert default_directory(None, "tiny-delayed-20260101-000000") == "incidents/tiny-delayed-20260101-000000"
    assert default_directory("ckpt/run-{step}.pt", "a b/../c") == "ckpt/incidents/a_b_.._c"
    assert default_directory("model.pt", "..") == "incidents/run"
