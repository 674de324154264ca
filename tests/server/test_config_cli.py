"""Detector configuration is checked at start-up, through the real `fp8-monitor serve` command line: an
unknown key or a bad value stops the service with one line naming the key, instead of a service that
starts and then never raises the alert the typo was meant to tune."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from monitor_server.core.config import Settings
from tests.support.http import loopback
from tests.support.server import free_port, running_server


def serve(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`fp8-monitor serve` that is expected to refuse to start (a timeout means it started)."""
    cmd = [sys.executable, "-m", "monitor_server.cli", "serve", "--db", f"sqlite:///{tmp_path / 'x.db'}",
           "--port", str(free_port()), *args]  # fmt: skip
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}, cwd=tmp_path
    )


@pytest.mark.parametrize(
    ("detectors", "names"),
    [
        ('{"loss_z_treshold": 5}', ["detectors.loss_z_treshold", "unknown", "'loss_z_threshold'"]),
        ('{"loss_z_threshold": -1}', ["detectors.loss_z_threshold", "greater than 0", "-1"]),
        ('{"overflow_frac": "lots"}', ["detectors.overflow_frac", "'lots'"]),
        ('{"loss_min_history": 80}', ["loss_min_history", "loss_window"]),
        ("[1, 2]", ["detectors", "dictionary"]),
        ("{not json", ["detectors"]),
    ],
)
def test_bad_detector_setting_in_the_environment_stops_the_start(tmp_path, detectors, names):
    proc = serve(tmp_path, env={"FP8SCOPE_DETECTORS": detectors})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("fp8-monitor: invalid configuration: ")
    for name in names:
        assert name in lines[0], lines[0]
    assert not (tmp_path / "x.db").exists()  # refused before touching the database


def test_bad_detector_flag_stops_the_start(tmp_path):
    proc = serve(tmp_path, "--detectors", '{"divergence_log2": 0}')
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "fp8-monitor: invalid configuration: "
        "detectors.divergence_log2: Input should be greater than 0 (got 0)"
    )
    proc = serve(tmp_path, "--detectors", "{'single': 'quotes'}")
    assert proc.returncode == 2 and "--detectors: not JSON" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1


def test_valid_detector_settings_start(tmp_path):
    env = {"FP8SCOPE_DETECTORS": '{"loss_z_threshold": 5, "loss_z_critical": 9}'}
    with running_server(f"sqlite:///{tmp_path / 'ok.db'}", env=env) as srv:
        assert loopback.get(srv.url + "/healthz").status_code == 200


def test_settings_refuse_a_typo_in_process():
    with pytest.raises(ValueError, match=r"detectors\.overflow_consecutiv: unknown.*'overflow_consecutive'"):
        Settings(detectors={"overflow_consecutiv": 2})
    cfg = Settings(detectors={"overflow_consecutive": 2}, stall_seconds=7).detector_config
    assert cfg.overflow_consecutive == 2 and cfg.stall_seconds == 7
