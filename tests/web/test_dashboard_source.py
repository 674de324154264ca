"""Where a run's FP8 statistics come from is visible: a shadow-mode run (what-if statistics of a model that
trains in its own precision) carries a "shadow" badge in the runs list and on its page; a torchao run a
"torchao" badge that says its weights are counted per micro-batch; others none."""

from __future__ import annotations

import pytest

from tests.web.browser import no_page_errors
from tests.web.dashboard_data import create_run

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

IMG = "<img src=x onerror=alert(1)>"


def test_shadow_runs_are_marked(server, page):
    what_if = create_run(server.url, "bf16-what-if", config={"fp8_source": "shadow"})
    real = create_run(server.url, "fp8-real")
    odd = create_run(server.url, "odd-source", config={"fp8_source": IMG})  # the job's own text: stays text
    torchao = create_run(server.url, "torchao-run", config={"fp8_source": "torchao"})

    page.goto(f"{server.url}/#/")
    page.wait_for_selector(f"#runs-table tr[data-run-id='{real['id']}']")
    badge = f"#runs-table tr[data-run-id='{what_if['id']}'] td.name .badge.source"
    page.wait_for_selector(badge)
    assert page.text_content(badge) == "shadow"
    assert "what-if" in page.get_attribute(badge, "title")
    assert page.query_selector(f"#runs-table tr[data-run-id='{real['id']}'] td.name .badge") is None
    assert page.text_content(f"#runs-table tr[data-run-id='{odd['id']}'] td.name .badge.source") == IMG
    # torchao casts weights at every micro-batch: its weight counts are not per step, and the badge says so
    torchao_badge = f"#runs-table tr[data-run-id='{torchao['id']}'] td.name .badge.source"
    assert "per micro-batch" in page.get_attribute(torchao_badge, "title")
    assert page.evaluate("document.querySelectorAll('img').length") == 0

    page.goto(f"{server.url}/#/runs/{what_if['id']}")
    page.wait_for_selector("#run-name")
    assert page.text_content("#run-name") == "bf16-what-if"
    assert page.eval_on_selector_all(".badge.source", "bs => bs.map(b => b.textContent)") == ["shadow"]
    no_page_errors(page)
