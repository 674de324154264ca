"""An incident's replay on the run page: before it, "No replay yet" with the bundle the job wrote and the
command that replays it; once a report is stored (live, no reload), the verdict first, then the culprit
tensor with its evidence (the loss with it in high precision, its layer's SQNR), and the bundle; the
download menu has the replays."""

from __future__ import annotations

import pytest

from tests.support.http import loopback
from tests.support.server import API
from tests.web.browser import no_page_errors, open_run
from tests.web.dashboard_data import create_run, post_steps, smooth_stats
from tests.web.test_dashboard_download import fetch_download

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

LAYER = "blocks.1.mlp.fc"
BUNDLE = "runs/sat/incident-step40.pt"


def report() -> dict:
    """The report of a replay that found LAYER's input cast at fault (an FP8 saturation)."""
    sqnr = {f"blocks.{k}.mlp.fc": 30.0 + k for k in range(4)} | {LAYER: -4.25}
    fp8 = {"name": "fp8", "high_precision": [], "loss": 9.5, "losses": [2.1, 9.5], "fault": True}
    fp8["sqnr_db"] = sqnr
    hp = {"name": "high-precision", "high_precision": list(sqnr), "loss": 2.11, "losses": [2.1, 2.11]}
    hp["fault"] = False
    cast = {"name": f"cast {LAYER}.input", "high_precision": [f"{LAYER}.input"], "loss": 2.125}
    cast |= {"losses": [2.1, 2.125], "fault": False}
    other = {"name": "layer blocks.0.mlp.fc", "high_precision": ["blocks.0.mlp.fc"], "loss": 9.4}
    other |= {"losses": [2.1, 9.4], "fault": True}
    return {
        "verdict": "fp8-caused",
        "reason": "the fault comes back in FP8 (loss 9.5) and is gone in high precision (loss 2.11)",
        "culprits": [f"{LAYER}.input", "<b>x</b>"],  # a name is text, never markup
        "configs": [fp8, hp, cast, other],
        "bundle": BUNDLE,
        "step": 40,
        "window": [35, 40],
        "bitwise": True,
    }


def test_the_incident_shows_its_replay_verdict_first_then_the_culprit(server, page):
    rid = create_run(server.url, "replayed", 4)["id"]
    stats = smooth_stats(60, 12)
    stats["overflow"][40, 3] = 2048  # blocks.1's input saturates at step 40
    bundle = {"kind": "custom", "step": 40, "details": {"name": "incident_bundle", "path": BUNDLE}}
    post_steps(server.url, rid, "a", 0, stats, events=[bundle])
    (incident,) = loopback.get(f"{server.url}{API}/runs/{rid}/incidents").json()
    assert incident["bundles"] == [BUNDLE]

    open_run(page, server.url, rid)
    item = f"#incidents-list li[data-incident-id='{incident['id']}']"
    page.wait_for_selector(f"{item} .incident-replay[data-verdict='none']")
    assert page.text_content(f"{item} .replay-none") == "No replay yet."
    assert page.text_content(f"{item} .replay-bundle code") == BUNDLE
    assert f"--run-id {rid} --incident {incident['id']}" in page.text_content(f"{item} .replay-hint")

    r = loopback.put(f"{server.url}{API}/runs/{rid}/incidents/{incident['id']}/replay", json=report())
    assert r.status_code == 200, r.text
    # live: the incident's event carries the verdict, the page reads the report
    page.wait_for_selector(f"{item} .incident-replay[data-verdict='fp8-caused'] tr.replay-culprit")
    replay = f"{item} .incident-replay"
    texts = page.eval_on_selector_all(f"{replay} > *", "ns => ns.map(n => n.className)")
    assert texts[0] == "replay-head"  # the verdict first
    assert page.text_content(f"{replay} .replay-verdict") == "FP8-caused"
    assert "gone in high precision" in page.text_content(f"{replay} .replay-reason")
    rows = page.eval_on_selector_all(
        f"{replay} tr.replay-culprit", "rs => rs.map(r => [...r.cells].map(c => c.textContent))"
    )
    assert rows[0] == [f"{LAYER}.input", "2.125", "-4.25 dB"]
    assert rows[1][0] == "<b>x</b>"
    assert "9.5 in FP8, 2.11 in high precision" in page.text_content(f"{replay} .replay-losses")
    assert page.text_content(f"{replay} .replay-bundle code") == BUNDLE
    assert page.evaluate("document.querySelectorAll('.incident-replay b b').length") == 0

    # the download menu has the replays, as the API exports them
    name, body = fetch_download(page, 5, "csv")
    assert name == f"run-{rid}-replays.csv"
    query = {"table": "replays", "format": "csv"}
    assert body == loopback.get(f"{server.url}{API}/runs/{rid}/export", params=query).content
    assert "fp8-caused" in body.decode()
    no_page_errors(page)


def test_a_proposed_remediation_is_applied_with_one_click(server, page):
    """A run whose policy proposes (a dry run): the replay's culprit layer, with its SQNR collapsed in FP8,
    gets a proposal to train in high precision on the incident; Apply queues the command, by the person."""
    config = {"remediation": {"mode": "propose"}}
    rid = create_run(server.url, "proposed", 4, config=config)["id"]
    stats = smooth_stats(60, 12)
    stats["overflow"][40, 3] = 2048
    post_steps(server.url, rid, "a", 0, stats)
    (incident,) = loopback.get(f"{server.url}{API}/runs/{rid}/incidents").json()
    r = loopback.put(f"{server.url}{API}/runs/{rid}/incidents/{incident['id']}/replay", json=report())
    assert r.status_code == 200, r.text

    open_run(page, server.url, rid)
    action = f"#incidents-list li[data-incident-id='{incident['id']}'] .policy-action"
    page.wait_for_selector(f"{action}[data-state='proposed']")
    assert page.get_attribute(action, "data-rule") == "low_sqnr"
    assert page.text_content(f"{action} code") == LAYER and "fp8_enabled → false" in page.text_content(action)
    assert loopback.get(f"{server.url}{API}/runs/{rid}/commands").json() == []
    page.click(f"{action} button.policy-apply")
    page.wait_for_selector(f"{action}[data-state='queued']")
    assert page.query_selector(f"{action} button.policy-apply") is None
    (command,) = loopback.get(f"{server.url}{API}/runs/{rid}/commands").json()
    assert (command["target"], command["changes"]) == (LAYER, {"fp8_enabled": False})
    (stored,) = loopback.get(f"{server.url}{API}/runs/{rid}/policy-actions").json()
    assert stored["state"] == "queued" and stored["command_id"] == command["id"]
    no_page_errors(page)


def test_the_replay_button_asks_a_worker_and_shows_how_it_goes(server, page):
    """Replay on an incident with a bundle: a pending request for its bundle, the button disabled while it
    is open; a worker claiming it and failing it shows live (no reload), with why, and the button comes back
    as "Replay again"."""
    rid = create_run(server.url, "asked", 4)["id"]
    stats = smooth_stats(60, 12)
    stats["overflow"][40, 3] = 2048
    bundle = {"kind": "custom", "step": 40, "details": {"name": "incident_bundle", "path": BUNDLE}}
    post_steps(server.url, rid, "a", 0, stats, events=[bundle])
    (incident,) = loopback.get(f"{server.url}{API}/runs/{rid}/incidents").json()

    open_run(page, server.url, rid)
    line = f"#incidents-list li[data-incident-id='{incident['id']}'] .replay-request-line"
    page.wait_for_selector(f"{line}[data-state='none'] button.replay-request")
    page.click(f"{line} button.replay-request")
    page.wait_for_selector(f"{line}[data-state='pending']")
    assert "waiting for a replay worker" in page.text_content(f"{line} .replay-request-state")
    assert page.is_disabled(f"{line} button.replay-request")
    (asked,) = loopback.get(f"{server.url}{API}/runs/{rid}/replay-requests").json()
    assert (asked["incident_id"], asked["bundle"], asked["state"]) == (incident["id"], BUNDLE, "pending")

    # a worker takes it and fails it: both show live
    assert loopback.post(f"{server.url}{API}/replay-requests/{asked['id']}/claim").status_code == 200
    page.wait_for_selector(f"{line}[data-state='running']")
    why = {"state": "failed", "detail": "bundle not found on the replay worker's machine: <i>x</i>"}
    assert (
        loopback.post(f"{server.url}{API}/replay-requests/{asked['id']}/finish", json=why).status_code == 200
    )
    page.wait_for_selector(f"{line}[data-state='failed']")
    assert page.text_content(f"{line} .replay-request-state").strip() == f"the replay failed: {why['detail']}"
    assert page.text_content(f"{line} button.replay-request") == "Replay again"
    assert not page.is_disabled(f"{line} button.replay-request")
    assert page.evaluate("document.querySelectorAll('.replay-request-line i').length") == 0
    no_page_errors(page)
