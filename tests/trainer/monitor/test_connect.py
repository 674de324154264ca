"""Connecting like a library: the URL and token from the environment or a token file (never on a command
line), and a refusal said as what it is ("token rejected", "no fp8scope API at ..."), not "unreachable",
with an option to fail at once instead of spooling. Against a real `fp8-monitor serve` with tokens."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from fp8_trainer import Monitor
from fp8_trainer.monitor import MonitorRefused
from tests.support.http import loopback
from tests.support.polling import wait_until
from tests.support.server import running_server
from tests.trainer.monitor_utils import FAST, tiny_model

INGEST, READ = "tr41ner-secret", "r3ader-secret"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("monitor") / "monitor.db"
    tokens = ("--token", f"trainer:ingest:{INGEST}", "--token", f"dash:read:{READ}")
    with running_server(f"sqlite:///{db}", *tokens) as srv:
        yield srv


def _get(server, path):

    r = loopback.get(f"{server.url}/api/v1{path}", headers={"Authorization": f"Bearer {READ}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_url_and_token_file_from_the_environment(server, tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(INGEST + "\n")
    monkeypatch.setenv("FP8SCOPE_URL", server.url)
    monkeypatch.setenv("FP8SCOPE_TOKEN_FILE", str(token_file))
    monkeypatch.delenv("FP8SCOPE_TOKEN", raising=False)
    model, recipe = tiny_model()
    with Monitor(None, "from-env", model, recipe, fail_fast=True, **FAST) as mon:
        assert mon.run_id is not None  # fail_fast registered before returning
        assert mon.dashboard_url == f"{server.url}/#/runs/{mon.run_id}"
    assert _get(server, f"/runs/{mon.run_id}")["name"] == "from-env"


@pytest.mark.parametrize(
    "url_suffix, token, said",
    [
        ("", "wrong", "token rejected (HTTP 401"),
        ("", READ, "the token lacks the 'ingest' scope (HTTP 403"),
        ("/api/v1", INGEST, "no fp8scope API at"),
    ],
    ids=["bad-token", "read-scope", "wrong-url"],
)
def test_refusals_are_said_as_what_they_are(server, tmp_path, caplog, url_suffix, token, said):
    model, recipe = tiny_model()
    url = server.url + url_suffix
    with pytest.raises(MonitorRefused, match=said.replace("(", r"\(")):
        Monitor(url, "refused", model, recipe, token=token, fail_fast=True, **FAST)
    # without fail_fast the job goes on, spooling, and the log says why, not "unreachable"
    spool = tmp_path / "spool.jsonl"
    mon = Monitor(url, "refused", model, recipe, token=token, spool_path=spool, **FAST)
    with caplog.at_level(logging.INFO, logger="fp8scope"), mon:
        assert wait_until(lambda: mon.spooling)
    messages = [r.getMessage() for r in caplog.records]
    assert any(said in m for m in messages), messages
    assert not any("unreachable" in m for m in messages), messages
    assert any("refused the run" in m and str(spool) in m for m in messages), messages


def test_fp8_train_prints_the_dashboard_url(server, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(INGEST + "\n")
    cmd = [sys.executable, "-m", "fp8_trainer.app.cli", "--steps", "6", "--batch-size", "2", "--seq-len",
           "16", "--eval-interval", "0", "--no-progress", "--token-file", str(token_file),
           "--run-name", "url-run"]  # fmt: skip
    env = {"FP8SCOPE_URL": server.url, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = [r for r in _get(server, "/runs") if r["name"] == "url-run"]
    assert len(runs) == 1
    assert f"fp8-train: dashboard {server.url}/#/runs/{runs[0]['id']}" in proc.stdout
    assert INGEST not in proc.stdout + proc.stderr
