"""The tracker views on real trainings: two `fp8-train` runs (tagged, evaluating, with different learning
rates) streamed into the service, then what a user sees on the runs list, the run page and the comparison."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.http import loopback
from tests.support.polling import wait_for
from tests.support.server import API
from tests.web.browser import no_page_errors, open_run

pytestmark = pytest.mark.slow  # real trainings, a real browser and server

FLAGS = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--steps", "24", "--eval-interval", "8"]
FLAGS += ["--eval-iters", "2", "--no-progress", "--log-interval", "1000"]


def train(url: str, name: str, lr: str, tmp_path) -> None:
    cmd = [sys.executable, "-m", "fp8_trainer.app.cli", *FLAGS, "--lr", lr, "--monitor-url", url]
    cmd += ["--run-name", name, "--tag", "real-pair", "--tag", f"lr-{lr}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_real_runs_in_the_list_the_run_page_and_the_comparison(server, page, tmp_path):
    train(server.url, "real-lr1e-3", "1e-3", tmp_path)
    train(server.url, "real-lr3e-3", "3e-3", tmp_path)
    runs = {r["name"]: r for r in loopback.get(f"{server.url}{API}/runs", params={"tag": "real-pair"}).json()}
    assert set(runs) == {"real-lr1e-3", "real-lr3e-3"}

    # the list, filtered by the tag, with the learning rate as a column
    page.add_init_script("localStorage.setItem('fp8scope.runColumns', 'lr')")
    page.goto(f"{server.url}/#/?tag=real-pair")
    page.wait_for_function("() => document.querySelectorAll('#runs-table tbody tr').length === 2")
    lrs = page.eval_on_selector_all(
        "#runs-table tbody td.config-value", "tds => tds.map(td => td.textContent)"
    )
    assert lrs == ["0.003", "0.001"]

    # the run page: every scalar the job sent on offer, the evaluations charted, the config listed
    rid = runs["real-lr1e-3"]["id"]
    open_run(page, server.url, rid, stream=False)
    page.wait_for_selector("#scalars-picker label[data-name='eval.val_loss']")
    offered = set(page.eval_on_selector_all("#scalars-picker label", "ls => ls.map(l => l.dataset.name)"))
    assert {
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "step_time_s",
        "host_memory_mb",
        "eval.val_loss",
    } <= offered
    page.wait_for_function(
        "() => (document.getElementById('scalars-plot').data || []).some(t => t.name === 'eval.val_loss')"
    )
    # the loss chart draws its val-loss trace apart from the scalars plot: wait for the value asserted
    val_x = (
        "() => Array.from(((document.getElementById('curves').data || [])"
        ".find(t => t.name === 'val loss') || {}).x || [])"
    )
    page.wait_for_function(f"() => JSON.stringify(({val_x})()) === '[8,16,24]'")
    assert page.evaluate(val_x) == [8, 16, 24]
    assert page.text_content("#config-table tr[data-key='lr'] td:last-child") == "0.001"
    assert sorted(page.eval_on_selector_all("#run-tags-list .tag", "ts => ts.map(t => t.textContent)")) == [
        "lr-1e-3",
        "real-pair",
    ]

    # the two compared: both losses, the learning rate in the config diff
    other = runs["real-lr3e-3"]["id"]
    page.goto(f"{server.url}/#/compare?runs={rid},{other}")
    page.wait_for_function("() => window.fp8scope.drawn.compare !== undefined")
    assert len(page.evaluate("document.getElementById('compare-loss').data")) == 2
    diff = page.eval_on_selector_all("#compare-config tbody tr", "trs => trs.map(tr => tr.dataset.key)")
    assert "lr" in diff and "run_name" in diff and "preset" not in diff
    no_page_errors(page)


def test_a_margin_pushed_into_a_real_run_is_marked_where_its_scale_drop_is(server, page, tmp_path):
    """A margin of 3 sent to a real `fp8-train` while it runs: the run page marks the step the job applied
    it at on the loss curve and the scale heatmap, named in the hover, and that is where the model's scales
    drop by the margin on the scale heatmap (and not around it)."""
    steps = 300
    flags = [
        *FLAGS[: FLAGS.index("--steps")],
        "--steps",
        str(steps),
        "--no-progress",
        "--log-interval",
        "1000",
    ]
    cmd = [
        sys.executable,
        "-m",
        "fp8_trainer.app.cli",
        *flags,
        "--monitor-url",
        server.url,
        "--run-name",
        "pushed",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        run = wait_for(
            lambda: next((r for r in loopback.get(f"{server.url}{API}/runs").json()
                          if r["name"] == "pushed" and (r["last_step"] or 0) >= 3), None),
            what="the run's first steps",
        )  # fmt: skip
        sent = loopback.post(f"{server.url}{API}/runs/{run['id']}/commands", json={"changes": {"margin": 3}})
        assert sent.status_code == 201, sent.text
    finally:
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    (cmd_row,) = loopback.get(f"{server.url}{API}/runs/{run['id']}/commands").json()
    step = cmd_row["applied_step"]
    assert cmd_row["state"] == "applied" and 3 < step < steps, cmd_row

    page.goto(f"{server.url}/#/runs/{run['id']}?metric=scale")
    marks = "id => (document.getElementById(id).data || []).find(t => t.name === 'recipe changes')"
    for plot in ("curves", "heatmap"):
        page.wait_for_function(f"id => {{ const t = ({marks})(id); return t && t.x.length > 0; }}", arg=plot)
        trace = page.evaluate(f"id => {{ const t = ({marks})(id); return {{x: t.x, text: t.text}}; }}", plot)
        assert trace["x"] == [step]
        assert trace["text"][0].endswith(f"at step {step}: margin = 3 (was margin = 0)")
    # the scale heatmap as drawn: one step per column here; the marked column is where the scales fell
    drawn = page.evaluate(
        "() => { const t = document.getElementById('heatmap').data[0]; return {x0: t.x0, dx: t.dx, z: t.z}; }"
    )
    assert drawn["dx"] == 1
    z = np.array([[np.nan if v is None else v for v in row] for row in drawn["z"]], dtype=float)
    at = int(step - (drawn["x0"] - 0.5))  # the column of the step the change took effect at

    def drop(c: int) -> float:
        """The median fall of log2 scale over the tensors from column c - 1 to c + 1."""
        return float(np.nanmedian(z[:, c - 1] - z[:, c + 1]))

    # the margin's 3 binades across the marked step (a tensor's amax moving in those two steps shifts its
    # own a little); the steps around it, unmarked, hardly move
    assert drop(at) == pytest.approx(3.0, abs=0.05), z[:, at - 1] - z[:, at + 1]
    around = [drop(c) for c in range(max(1, at - 6), min(z.shape[1] - 1, at + 7)) if abs(c - at) > 1]
    assert around and max(abs(d) for d in around) < 0.1, around
    no_page_errors(page)
