"""Incidents on the run page: a NaN that spreads through every tensor is one entry, which expands to its
alerts with the root cause first; a second fault later is a second entry, live; the webhook's link opens an
incident; acknowledging one incident or all of them acknowledges their alerts."""

from __future__ import annotations

import pytest

from tests.support.http import loopback
from tests.support.server import API
from tests.web.browser import (
    FirstReadHeld,
    count_json_reads,
    json_reads,
    no_page_errors,
    open_run,
    wait_drawn,
    wait_json_reads,
)
from tests.web.dashboard_data import create_run, post_steps, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

N_LAYERS = 4  # T = 12; layer k owns 3k (input), 3k+1 (weight), 3k+2 (grad_output)


def nan_run(url: str) -> int:
    """40 quiet steps, then a NaN in blocks.2's input at step 40 that reaches every tensor by step 41."""
    rid = create_run(url, "nan-run", N_LAYERS)["id"]
    stats = smooth_stats(60, 3 * N_LAYERS)
    stats["nonfinite"][40, [6, 9, 2, 5, 8, 11]] = 3  # downstream inputs and every gradient
    stats["nonfinite"][41, :] = 5
    post_steps(url, rid, "a", 0, stats)
    return rid


def incident_ids(page) -> list[str]:
    return page.eval_on_selector_all(
        "#incidents-list li.incident", "lis => lis.map(li => li.dataset.incidentId)"
    )


def test_one_entry_per_incident_root_cause_first(server, page):
    rid = nan_run(server.url)
    open_run(page, server.url, rid)
    page.wait_for_selector("#incidents-list li.incident")
    (first,) = incident_ids(page)
    item = f"#incidents-list li[data-incident-id='{first}']"
    title = page.text_content(f"{item} .incident-title")
    assert title == "non-finite values in blocks.2.mlp.fc.input at step 40 (12 tensors affected)"
    # collapsed until asked: 12 alerts behind one line
    assert not page.is_visible(f"{item} li.alert")
    page.click(f"{item} details summary")
    page.wait_for_selector(f"{item} li.alert.root")
    names = page.eval_on_selector_all(f"{item} li.alert .name", "ns => ns.map(n => n.textContent)")
    assert len(names) == 12 and names[0] == "blocks.2.mlp.fc.input"
    assert names[:3] == ["blocks.2.mlp.fc.input", "blocks.3.mlp.fc.input", "blocks.3.mlp.fc.grad_output"]
    assert "root cause" in page.text_content(f"{item} li.alert.root")

    # a second fault, far later, arrives live as a second entry, on top; the first stays expanded
    later = smooth_stats(3, 3 * N_LAYERS)
    later["overflow"][1, 4] = 0.5 * 4096  # blocks.1's weight saturates at step 201
    post_steps(server.url, rid, "b", 200, later)
    page.wait_for_function("() => document.querySelectorAll('#incidents-list li.incident').length === 2")
    second, again = incident_ids(page)
    assert again == first and int(second) > int(first)
    assert page.is_visible(f"{item} li.alert.root")
    assert "saturation in blocks.1.mlp.fc.weight at step 201" in page.text_content(
        f"#incidents-list li[data-incident-id='{second}'] .incident-title"
    )
    page.wait_for_function("() => document.getElementById('run-open-incidents').textContent === '2'")

    # acknowledging one alert inside an incident acknowledges that alert only
    root_alert = page.get_attribute(f"{item} li.alert.root", "data-alert-id")
    page.click(f"{item} li.alert.root button.ack")
    page.wait_for_selector(f"{item} li.alert.root[data-state='acknowledged']")
    assert page.get_attribute(item, "data-state") == "open"

    # acknowledge all: both incidents and every alert
    page.click("#ack-all")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#incidents-list li.incident')]"
        ".every(li => li.dataset.state === 'acknowledged')"
    )
    assert page.is_disabled("#ack-all")
    alerts = loopback.get(f"{server.url}{API}/runs/{rid}/alerts").json()
    assert len(alerts) == 13 and {a["state"] for a in alerts} == {"acknowledged"}
    assert next(a for a in alerts if str(a["id"]) == root_alert)["acknowledged_by"] == "anonymous"
    incidents = loopback.get(f"{server.url}{API}/runs/{rid}/incidents").json()
    assert {i["state"] for i in incidents} == {"acknowledged"}
    no_page_errors(page)


def test_the_webhook_link_opens_its_incident_and_acknowledging_it_acks_its_alerts(server, page):
    rid = nan_run(server.url)
    incident = loopback.get(f"{server.url}{API}/runs/{rid}/incidents").json()[0]
    page.goto(f"{server.url}/#/runs/{rid}?incident={incident['id']}")
    wait_drawn(page, "heatmap", "curves")
    item = f"#incidents-list li[data-incident-id='{incident['id']}']"
    page.wait_for_selector(f"{item}.focus li.alert.root")  # opened without a click
    page.click(f"{item} button.ack-incident")
    page.wait_for_selector(f"{item}[data-state='acknowledged'] li.alert.root[data-state='acknowledged']")
    states = page.eval_on_selector_all(f"{item} li.alert", "lis => lis.map(li => li.dataset.state)")
    assert len(states) == 12 and set(states) == {"acknowledged"}
    stored = loopback.get(f"{server.url}{API}/runs/{rid}/alerts", params={"state": "open"}).json()
    assert stored == []
    no_page_errors(page)


def test_runs_list_counts_incidents(server, page):
    rid = nan_run(server.url)
    page.goto(f"{server.url}/#/")
    cell = f"#runs-table tr[data-run-id='{rid}'] td.alerts"
    page.wait_for_selector(cell)
    assert page.text_content(cell) == "1" and page.get_attribute(cell, "title") == "12 open alerts"
    no_page_errors(page)


def test_a_read_answered_after_a_later_acknowledgement_does_not_undo_it(server, page):
    """Two incidents acknowledged one after the other: the re-read after the first is answered after the
    second was shown acknowledged (it read the second still open). Both stay acknowledged."""
    rid = nan_run(server.url)
    later = smooth_stats(3, 3 * N_LAYERS)
    later["overflow"][1, 4] = 0.5 * 4096  # a second incident: blocks.1's weight saturates at step 201
    post_steps(server.url, rid, "b", 200, later)
    path = f"{API}/runs/{rid}/incidents"
    count_json_reads(page)
    open_run(page, server.url, rid)
    page.wait_for_function("() => document.querySelectorAll('#incidents-list li.incident').length === 2")
    second, first = incident_ids(page)

    held = FirstReadHeld(page, lambda url: f"{path}?" in url)
    page.click(f"#incidents-list li[data-incident-id='{first}'] button.ack-incident")
    held.wait("the incidents were not read again after an acknowledgement")
    page.click(f"#incidents-list li[data-incident-id='{second}'] button.ack-incident")
    both = (
        "() => [...document.querySelectorAll('#incidents-list li.incident')]"
        ".every(li => li.dataset.state === 'acknowledged')"
    )
    page.wait_for_function(both)
    before = json_reads(page, path)
    held.release()  # read before the second acknowledgement: the second incident open
    wait_json_reads(page, path, before + 1)
    assert page.evaluate(both)
    states = page.eval_on_selector_all("#incidents-list li.alert", "lis => lis.map(li => li.dataset.state)")
    assert len(states) == 13 and set(states) == {"acknowledged"}
    assert page.is_disabled("#ack-all")
    no_page_errors(page)
