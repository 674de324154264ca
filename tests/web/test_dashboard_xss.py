"""User-controlled text stays text: runs, layers, alert messages and event details named like markup are
shown as written in every view, and nothing in them runs."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.http import loopback
from tests.support.server import API, tensors_named
from tests.web.browser import no_page_errors, open_run
from tests.web.dashboard_data import create_run, post_steps, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

IMG = "<img src=x onerror=alert(1)>"
SCRIPT = '<script>alert("run")</script>'


def assert_inert(page) -> None:
    """No dialog opened and no <img src=x> element exists anywhere on the page."""
    assert page.probe.dialogs == []
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.evaluate("document.querySelectorAll('script:not([src])').length") == 0


def test_markup_in_names_stays_inert(server, page):
    tensors = tensors_named([IMG, "blocks.1.attn"])
    run = create_run(server.url, SCRIPT, tensors=tensors)
    other = create_run(server.url, IMG, tensors=tensors)
    rid = run["id"]
    stats = smooth_stats(80, 6)
    stats["amax"][60, 0] = np.nan  # the first non-finite value is on the IMG layer's input
    stats["nonfinite"][60, 0] = 2
    events = [
        {
            "kind": "loss_spike",
            "step": 70,
            "details": {
                "last_steps": [{"step": s, "loss": 2.0 + (s == 70), IMG: 1.0} for s in range(60, 71)],
                "histograms": {f"{IMG}.weight": {"bins": [IMG], "counts": [1]}},
            },
        }
    ]
    post_steps(server.url, rid, "a", 0, stats, events=events)
    post_steps(server.url, other["id"], "a", 0, smooth_stats(80, 6, factor=2.0))
    r = loopback.post(
        f"{server.url}{API}/runs/{rid}/commands", json={"target": IMG, "changes": {"margin": 1}}
    )
    assert r.status_code == 201, r.text

    # runs list
    page.goto(f"{server.url}/#/")
    page.wait_for_selector(f"#runs-table tr[data-run-id='{rid}']")
    names = page.eval_on_selector_all("#runs-table td.name a", "as => as.map(a => a.textContent)")
    assert SCRIPT in names and IMG in names
    assert_inert(page)

    # run page: title, heatmap labels, layers table, incidents, post-mortem, audit trail
    open_run(page, server.url, rid)
    assert page.text_content("#run-name") == SCRIPT
    ticks = page.eval_on_selector_all("#heatmap .ytick text", "ts => ts.map(t => t.textContent)")
    assert f"{IMG}.input" in ticks
    assert IMG in page.eval_on_selector_all("#layers-table td.name", "tds => tds.map(td => td.textContent)")
    assert IMG in page.text_content("#incidents-list")
    assert page.text_content("#first-nonfinite .name") == f"{IMG}.input"
    assert page.text_content("#commands-table td.name") == IMG
    page.wait_for_selector("#postmortem .timeline[data-points='11']")
    page.click("#postmortem details summary")
    assert IMG in page.text_content("#postmortem pre.json")
    assert_inert(page)

    # hover a heatmap cell of the IMG tensor: the tooltip shows the name as text
    page.locator("#heatmap").scroll_into_view_if_needed()
    box = page.eval_on_selector(
        "#heatmap .nsewdrag", "r => { const b = r.getBoundingClientRect(); return [b.x, b.y, b.width]; }"
    )
    page.mouse.move(box[0] + box[2] / 2, box[1] + 5)
    page.mouse.move(box[0] + box[2] / 2 + 2, box[1] + 6)
    page.wait_for_selector("#tooltip:not([hidden])")
    assert IMG in page.text_content("#tooltip")
    assert_inert(page)

    # the layer's drill-down
    page.click(f"#layers-table tr:has(td.name:text-is('{IMG}'))")
    page.wait_for_selector("#drilldown-plot .main-svg")
    assert IMG in page.text_content("#drilldown h3")
    assert_inert(page)

    # the comparison of the two markup-named runs
    page.goto(f"{server.url}/#/compare?a={rid}&b={other['id']}")
    page.wait_for_function("() => window.fp8scope.drawn.compare !== undefined")
    legend = page.eval_on_selector_all("#compare-loss .legendtext", "ts => ts.map(t => t.textContent)")
    assert legend == [f"#{rid} {SCRIPT}", f"#{other['id']} {IMG}"]
    assert_inert(page)
    no_page_errors(page)
