"""The runs list as a tracker's: search, filters, tags, config columns, rename and delete, paging, and a
comparison of up to 8 runs with any scalar overlaid and the config diff."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.support.http import loopback
from tests.support.server import API, batch_body
from tests.web.browser import no_page_errors, wait_stream
from tests.web.dashboard_data import create_run, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each


def names_shown(page) -> list[str]:
    return page.eval_on_selector_all("#runs-table tbody tr td.name a", "as => as.map(a => a.textContent)")


def wait_names(page, names: list[str]) -> None:
    """Wait until the list shows exactly these runs, in this order."""
    page.wait_for_function(
        "want => JSON.stringify([...document.querySelectorAll('#runs-table tbody tr td.name a')]"
        ".map(a => a.textContent)) === JSON.stringify(want)",
        arg=names,
    )


def test_search_filter_tags_columns_rename_delete(server, page):
    ids = {}
    for name, lr, layers, tags in [
        ("alpha-small", 0.001, 2, ["sweep-a", "t-list"]),
        ("alpha-large", 0.0003, 8, ["sweep-a", "best", "t-list"]),
        ("beta", 0.001, 2, ["t-list"]),
    ]:
        run = create_run(server.url, name, 1, config={"lr": lr, "model": {"n_layer": layers}}, tags=tags)
        ids[name] = run["id"]
    loopback.patch(f"{server.url}{API}/runs/{ids['beta']}", json={"status": "finished"})
    page.goto(f"{server.url}/#/?tag=t-list")  # a filtered list can be linked to (the server is shared)
    page.wait_for_selector("#runs-table tbody tr")
    wait_stream(page, "/stream")
    wait_names(page, ["beta", "alpha-large", "alpha-small"])
    assert page.input_value("#runs-tag") == "t-list"
    tags = page.eval_on_selector(
        f"#runs-table tr[data-run-id='{ids['alpha-large']}'] td.tags-cell",
        "td => [...td.children].map(a => a.textContent)",
    )
    assert tags == ["best", "sweep-a", "t-list"]

    page.fill("#runs-search", "ALPHA")
    wait_names(page, ["alpha-large", "alpha-small"])
    page.fill("#runs-config", "model.n_layer=8")
    wait_names(page, ["alpha-large"])
    page.fill("#runs-config", "")
    page.fill("#runs-search", "")
    page.select_option("#runs-status", "finished")
    wait_names(page, ["beta"])
    page.select_option("#runs-status", "")
    page.fill("#runs-tag", "sweep-a")
    wait_names(page, ["alpha-large", "alpha-small"])
    page.fill("#runs-tag", "t-list")
    wait_names(page, ["beta", "alpha-large", "alpha-small"])

    # chosen config keys as columns (kept for the next visit)
    page.fill("#runs-columns", "lr, model.n_layer")
    page.dispatch_event("#runs-columns", "change")
    row = f"#runs-table tr[data-run-id='{ids['alpha-large']}']"
    page.wait_for_selector(f"{row} td.config-value[data-key='model.n_layer']")
    values = page.eval_on_selector_all(f"{row} td.config-value", "tds => tds.map(td => td.textContent)")
    assert values == ["0.0003", "8"]
    heads = page.eval_on_selector_all(
        "#runs-table thead th.config-col", "ths => ths.map(th => th.textContent)"
    )
    assert heads == ["lr", "model.n_layer"]

    # rename, retag and delete from the list (an open server: the page may change runs)
    page.probe.answers.append("alpha-xl")
    page.click(f"{row} button.run-rename")
    page.wait_for_function(f"() => document.querySelector(\"{row} td.name a\").textContent === 'alpha-xl'")
    page.probe.answers.append("best final")
    page.click(f"{row} button.run-tags")
    page.wait_for_function(
        f"() => document.querySelector(\"{row} td.tags-cell\").textContent === 'bestfinal'"
    )
    got = loopback.get(f"{server.url}{API}/runs/{ids['alpha-large']}").json()
    assert got["name"] == "alpha-xl" and got["tags"] == ["best", "final"]
    gone = f"#runs-table tr[data-run-id='{ids['beta']}']"
    page.probe.answers.append("")
    page.click(f"{gone} button.run-delete")
    page.wait_for_selector(gone, state="detached")
    assert loopback.get(f"{server.url}{API}/runs/{ids['beta']}").status_code == 404
    no_page_errors(page)


def test_a_list_answer_older_than_a_rename_does_not_undo_it(server, page):
    """A list read in flight while a run is renamed (another run appeared meanwhile) answers with the old
    name; it lands after the rename and after the row's re-read, and the row keeps the new name."""
    run = create_run(server.url, "held-a", 1, tags=["t-held"])
    page.goto(f"{server.url}/#/?tag=t-held")
    wait_stream(page, "/stream")
    wait_names(page, ["held-a"])

    held = []  # (route, the service's answer read before the rename)

    def hold(route):
        held.append((route, route.fetch()))

    def a_list_read(url):
        return f"{API}/runs?" in url

    def the_row_reread(response):
        return response.url.endswith(f"{API}/runs/{run['id']}") and response.request.method == "GET"

    page.route(a_list_read, hold)
    create_run(server.url, "held-b", 1, tags=["t-held"])  # the stream's "run created" reloads the list
    deadline = time.monotonic() + 15
    while not held:  # the route handler runs while Playwright is called
        assert time.monotonic() < deadline, "the list was not read again after a run was created"
        page.wait_for_timeout(20)

    row = f"#runs-table tr[data-run-id='{run['id']}']"
    page.probe.answers.append("held-renamed")
    with page.expect_response(the_row_reread):  # the stream's "run changed" re-reads the row, after the PATCH
        page.click(f"{row} button.run-rename")
    page.wait_for_selector(f"{row} td.name a >> text='held-renamed'")

    for route, answer in held:
        route.fulfill(response=answer)
    page.unroute(a_list_read)
    # the old answer is placed (it brings the new run) and the renamed row keeps its name
    page.wait_for_selector("#runs-table tbody tr td.name a >> text=held-b")
    assert names_shown(page) == ["held-b", "held-renamed"]
    no_page_errors(page)


def test_paging_loads_more_runs(server, page):
    created = [create_run(server.url, f"page-run-{i}", 1, tags=["paging"])["id"] for i in range(105)]
    page.goto(f"{server.url}/#/?tag=paging")
    page.wait_for_function("() => document.querySelectorAll('#runs-table tbody tr').length === 100")
    assert page.is_visible("#runs-more")
    page.click("#runs-more")
    page.wait_for_function("() => document.querySelectorAll('#runs-table tbody tr').length === 105")
    shown = page.eval_on_selector_all(
        "#runs-table tbody tr", "trs => trs.map(tr => Number(tr.dataset.runId))"
    )
    assert shown == created[::-1]
    assert page.is_hidden("#runs-more")
    no_page_errors(page)


def test_compare_four_runs_scalars_config_and_any_pair(server, page):
    runs = []
    for i in range(4):
        run = create_run(
            server.url, f"cmp-{i}", 2, config={"lr": 0.001 * (i + 1), "seed": 0, "model": {"n_layer": 2}}
        )
        rid = run["id"]
        stats = smooth_stats(30, 6, factor=2.0**i)
        body = batch_body(f"k{i}", range(30), stats, encoding="float64", losses=np.full(30, 2.0 + i))
        for step in body["steps"]:
            step["scalars"]["accuracy"] = 0.1 * i
        assert loopback.post(f"{server.url}{API}/runs/{rid}/telemetry", json=body).status_code == 200
        runs.append(run)
    page.goto(f"{server.url}/#/")
    page.wait_for_selector("#runs-table tbody tr")
    for run in runs:
        page.check(f"#runs-table tr[data-run-id='{run['id']}'] input[type=checkbox]")
    assert page.text_content("#compare-selected") == "Compare 4 runs"
    page.click("#compare-selected")
    page.wait_for_function("() => window.fp8scope.drawn.compare !== undefined")
    loss = page.evaluate("document.getElementById('compare-loss').data.map(t => [t.name, t.y[0]])")
    assert loss == [[f"#{r['id']} cmp-{i}", 2.0 + i] for i, r in enumerate(runs)]
    page.check("#compare-scalars-picker label[data-name='accuracy'] input")
    page.wait_for_function("() => document.getElementById('compare-loss').data.length === 8")
    # the config diff: only the keys that differ, every run's value
    rows = page.eval_on_selector_all(
        "#compare-config tbody tr", "trs => trs.map(tr => [...tr.cells].map(c => c.textContent))"
    )
    assert rows == [["lr", "0.001", "0.002", "0.003", "0.004"]]
    page.uncheck("#compare-config-diff")
    keys = page.eval_on_selector_all("#compare-config tbody tr", "trs => trs.map(tr => tr.dataset.key)")
    assert keys == ["lr", "model.n_layer", "seed", "recipe changes applied"]
    # the amax difference between any two of them: run 3 has 8x run 0's amax -> 3 binades
    page.select_option("#compare-a", str(runs[3]["id"]))
    # the page is drawn again for the new pair (A = run 3, B still run 1) before B is changed
    page.wait_for_function(
        "want => (document.getElementById('compare-diff-info')?.textContent || '').startsWith(want)",
        arg=f"#{runs[3]['id']} − #{runs[1]['id']}",
    )
    page.select_option("#compare-b", str(runs[0]["id"]))
    page.wait_for_function(f"() => location.hash.includes('b={runs[0]['id']}')")
    page.wait_for_function(
        "want => (document.getElementById('compare-diff-info')?.textContent || '').startsWith(want)",
        arg=f"#{runs[3]['id']} − #{runs[0]['id']}",
    )
    page.wait_for_function(
        "() => { const d = document.getElementById('compare-diff').data;"
        " return d && d[0].z[0][0] !== undefined; }"
    )
    z = page.evaluate("document.getElementById('compare-diff').data[0].z")
    finite = [v for row in z for v in row if v is not None]
    assert finite and all(abs(v - 3.0) < 0.05 for v in finite)
    no_page_errors(page)
