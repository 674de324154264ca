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


def test_layers_left_out_of_fp8_are_listed_with_their_reason_in_the_run_config(server, page, tmp_path):
    """A GPT-2 whose vocabulary (60) is no multiple of 16: its lm_head stays in high precision, and the run
    page's config says so, with the reason, beside the eight Conv1D layers that train in FP8."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from fp8_trainer import DelayedScaling, Monitor, convert_to_fp8, fp8_autocast
    from tests.trainer.monitor_utils import FAST

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=60, n_positions=16))
    recipe = DelayedScaling()
    convert_to_fp8(model, recipe=recipe)
    with Monitor(server.url, "gpt2-left-out", model, recipe, spool_path=tmp_path / "s.jsonl", **FAST) as mon:
        for step in (1, 2):
            ids = torch.randint(0, 60, (2, 16))
            with fp8_autocast(fp8_recipe=recipe):
                loss = model(ids, labels=ids).loss
            loss.backward()
            mon.step(step, loss=loss.detach())
    page.goto(f"{server.url}/#/runs/{mon.run_id}")
    row = "#config-table tr[data-key='fp8_left_out.lm_head'] td:last-child"
    page.wait_for_selector(row)
    assert page.text_content(row) == "in_features=32, out_features=60: not multiples of 16"
    no_page_errors(page)
