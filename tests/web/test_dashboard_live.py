"""Live updates without a reload (steps on the run page and the runs list), and incidents with acknowledge."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.support.http import loopback
from tests.support.server import API
from tests.web.browser import no_page_errors, open_run, wait_stream
from tests.web.dashboard_data import create_run, post_steps, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each


def test_step_posted_appears_without_reload(server, page):
    run = create_run(server.url, "live-run", 2)
    post_steps(server.url, run["id"], "first", 0, smooth_stats(50, 6))
    open_run(page, server.url, run["id"])
    page.evaluate("window.__sameDocument = true")

    posted = time.time()
    post_steps(server.url, run["id"], "live", 50, smooth_stats(1, 6, seed=1), losses=np.array([1.25]))
    page.wait_for_function(
        "() => document.getElementById('run-last-step').textContent === '50'", timeout=2000
    )
    seen_ms = page.evaluate(f"window.fp8scope.stepSeen['{run['id']}:50']")
    assert seen_ms / 1000 - posted < 2.0
    assert page.evaluate("window.__sameDocument") is True  # no reload happened
    assert page.text_content("#run-last-loss") == "1.25"
    assert page.text_content("#run-steps-stored") == "51"  # steps 0-49, then 50: follows the last step
    # the loss curve got the new point appended
    page.wait_for_function(
        "() => { const x = document.getElementById('curves').data[0].x; return x[x.length - 1] === 50; }"
    )
    assert page.evaluate("document.getElementById('curves').data[0].y.at(-1)") == 1.25
    no_page_errors(page)


def test_header_counts_follow_the_stream_and_never_step_back(server, page):
    """The header's last step and stored-step count follow the live steps of a multi-step batch, and a run
    read the server answered before those steps arrived (a refresh racing the stream) does not put them
    back to what they were."""
    run = create_run(server.url, "live-counts", 1)
    rid = run["id"]
    post_steps(server.url, rid, "first", 0, smooth_stats(50, 3))
    open_run(page, server.url, rid)
    held = []  # the page's next GET /runs/{id}, answered now and handed to the page later

    def hold(route):
        held.append((route, route.fetch()))

    page.route(lambda url: url.split("?")[0].endswith(f"{API}/runs/{rid}"), hold)
    # a rename makes the page re-read the run; the answer is taken while the run has 50 steps
    assert loopback.patch(f"{server.url}{API}/runs/{rid}", json={"name": "live-counts-2"}).status_code == 200
    deadline = time.monotonic() + 10
    while not held and time.monotonic() < deadline:
        page.wait_for_timeout(50)  # lets Playwright dispatch the route handler
    assert held, "the page did not re-read the run"
    post_steps(server.url, rid, "more", 50, smooth_stats(20, 3, seed=1))
    page.wait_for_function("() => document.getElementById('run-last-step').textContent === '69'")
    assert page.text_content("#run-steps-stored") == "70"
    page.evaluate("document.getElementById('run-last-step').dataset.before = '1'")
    route, answer = held.pop()
    route.fulfill(response=answer)  # the header is drawn again from the older answer
    page.wait_for_function("() => !document.getElementById('run-last-step').dataset.before")
    assert page.text_content("#run-name") == "live-counts-2"
    assert (page.text_content("#run-last-step"), page.text_content("#run-steps-stored")) == ("69", "70")
    page.unroute_all()
    no_page_errors(page)


def test_runs_list_is_live(server, page):
    page.goto(f"{server.url}/#/")
    page.wait_for_selector("#runs-table")
    wait_stream(page, "/stream")
    page.evaluate("window.__sameDocument = true")
    run = create_run(server.url, "appears-live", 1)
    row = f"#runs-table tr[data-run-id='{run['id']}']"
    page.wait_for_selector(row, timeout=2500)
    post_steps(server.url, run["id"], "k", 0, smooth_stats(7, 3), losses=np.linspace(3, 2.5, 7))
    page.wait_for_function(
        "sel => document.querySelector(sel + ' td.step').textContent === '6'", arg=row, timeout=2000
    )
    assert page.text_content(f"{row} td.loss") == "2.5"
    # newest first
    assert page.get_attribute("#runs-table tbody tr:first-child", "data-run-id") == str(run["id"])
    page.wait_for_selector(f"{row} td.spark svg polyline")
    assert page.evaluate("window.__sameDocument") is True
    no_page_errors(page)


def test_incident_appears_and_is_acknowledged(server, page):
    run = create_run(server.url, "alert-run", 2)
    post_steps(server.url, run["id"], "quiet", 0, smooth_stats(40, 6))
    open_run(page, server.url, run["id"])
    assert page.text_content("#incidents-list") == "No incidents."
    assert page.is_disabled("#ack-all")

    bad = smooth_stats(1, 6, seed=2)
    bad["amax"][0, 3] = np.inf
    bad["nonfinite"][0, 3] = 5
    post_steps(server.url, run["id"], "bad", 40, bad)
    item = page.wait_for_selector("#incidents-list li.incident[data-state='open']", timeout=2000)
    assert "non-finite values in blocks.1.mlp.fc.input at step 40" in item.text_content()
    incident_id = item.get_attribute("data-incident-id")
    page.wait_for_function("() => document.getElementById('run-open-incidents').textContent === '1'")

    page.click(f"#incidents-list li[data-incident-id='{incident_id}'] button.ack-incident")
    page.wait_for_selector(f"#incidents-list li[data-incident-id='{incident_id}'][data-state='acknowledged']")
    stored = loopback.get(f"{server.url}{API}/runs/{run['id']}/alerts").json()
    assert [(a["state"], a["acknowledged_by"]) for a in stored] == [("acknowledged", "anonymous")]
    assert page.is_disabled(f"#incidents-list li[data-incident-id='{incident_id}'] button.ack-incident")
    no_page_errors(page)
