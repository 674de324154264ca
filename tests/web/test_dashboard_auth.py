"""Tokens: the page asks for one once (kept in localStorage), reads with it, and is read-only — actions
disabled, saying why — without the control scope; with it, actions work."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.support.http import loopback
from tests.support.server import API, ServerProcess, batch_body, make_tensors
from tests.web.browser import wait_drawn, wait_stream
from tests.web.dashboard_data import smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

VIEWER = "viewer-secret-1"
OPS = "ops-secret-12"
TRAINER = "trainer-secret-1"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("web-auth")
    tokens = f"viewer:read:{VIEWER},ops:read+control:{OPS},trainer:ingest:{TRAINER}"
    srv = ServerProcess(
        f"sqlite:///{tmp / 'auth.db'}", log_path=tmp / "server.log", env={"FP8SCOPE_TOKENS": tokens}
    )
    yield srv.start()
    srv.stop()


def make_run(url: str) -> int:
    """A run with a non-finite step (so there is an alert to acknowledge), posted by the trainer token."""
    headers = {"Authorization": f"Bearer {TRAINER}"}
    r = loopback.post(
        f"{url}{API}/runs", json={"name": "guarded", "tensors": make_tensors(2)}, headers=headers
    )
    assert r.status_code == 201, r.text
    rid = r.json()["id"]
    stats = smooth_stats(30, 6)
    stats["nonfinite"][20, 1] = 1
    body = batch_body("a", range(30), stats, encoding="float64", losses=np.full(30, 2.0))
    assert loopback.post(f"{url}{API}/runs/{rid}/telemetry", json=body, headers=headers).status_code == 200
    return rid


def enter_token(page, secret: str) -> None:
    page.wait_for_selector("#token-dialog[open]")
    page.fill("#token-input", secret)
    page.click("#token-form button[type=submit]")


def test_read_only_without_control_scope(auth_server, page):
    rid = make_run(auth_server.url)
    page.goto(f"{auth_server.url}/#/runs/{rid}")
    # asked for a token; a wrong one is refused and nothing is shown
    enter_token(page, "not-a-token")
    page.wait_for_function(
        "() => document.getElementById('token-error').textContent.includes('did not accept')"
    )
    assert page.is_visible("#token-dialog")
    assert page.query_selector("#run-name") is None
    assert page.evaluate("window.fp8scope.drawn.heatmap") is None

    # the read token: data loads, the page says read-only, actions are disabled and say why
    page.fill("#token-input", VIEWER)
    page.click("#token-form button[type=submit]")
    wait_drawn(page, "heatmap", "curves")
    assert not page.is_visible("#token-dialog")
    assert page.text_content("#read-only") == "read-only"
    assert "lacks the control scope" in page.get_attribute("#read-only", "title")
    ack = page.wait_for_selector("#incidents-list li.incident button.ack-incident")
    assert ack.is_disabled() and "lacks the control scope" in ack.get_attribute("title")
    assert page.is_disabled("#ack-all")
    assert "lacks the control scope" in page.get_attribute("#ack-all", "title")
    assert "read-only" in page.text_content("#alerts-readonly")
    assert page.is_disabled("#recipe-submit") and page.is_disabled("#recipe-margin")
    assert "read-only" in page.text_content("#recipe-readonly")
    # reads include the live stream (sent with the token in a header)
    wait_stream(page, f"/runs/{rid}/stream")
    body = batch_body("b", [30], smooth_stats(1, 6), encoding="float64", losses=[1.5])
    loopback.post(
        f"{auth_server.url}{API}/runs/{rid}/telemetry",
        json=body,
        headers={"Authorization": f"Bearer {TRAINER}"},
    )
    page.wait_for_function(
        "() => document.getElementById('run-last-step').textContent === '30'", timeout=2000
    )

    # the token is kept: a reload asks for nothing
    page.reload()
    wait_drawn(page, "heatmap", "curves")
    assert not page.is_visible("#token-dialog")
    assert page.evaluate("localStorage.getItem('fp8scope.token')") == VIEWER

    # a control token enables the actions
    page.click("#token-button")
    enter_token(page, OPS)
    # the page is drawn again once the new token is checked (the drawn marks of the first mount are still
    # set, so wait on the token's effect itself)
    page.wait_for_function(
        "() => document.getElementById('auth-status').textContent === 'ops: read + control'"
    )
    wait_drawn(page, "heatmap", "curves")
    page.wait_for_selector("#incidents-list li.incident button.ack-incident:not([disabled])").click()
    page.wait_for_selector("#incidents-list li.incident[data-state='acknowledged']")
    alerts = loopback.get(
        f"{auth_server.url}{API}/runs/{rid}/alerts", headers={"Authorization": f"Bearer {OPS}"}
    ).json()
    assert alerts[0]["state"] == "acknowledged" and alerts[0]["acknowledged_by"] == "ops"
    assert page.probe.dialogs == []
    # the only console errors are the refused requests (401) before a token was given
    assert all("401" in e for e in page.probe.errors), [e for e in page.probe.errors if "401" not in e]
