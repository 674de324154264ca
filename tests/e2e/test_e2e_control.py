"""Recipe changes posted over HTTP during a real run are applied at a step boundary, acknowledged with the
step, and visible in the telemetry: the layer's scale follows the new margin; a layer switched off FP8 stops
reporting quantization."""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.e2e_utils import run_by_name, start_train
from tests.support.polling import wait_for

pytestmark = pytest.mark.slow

HISTORY = 16  # fp8-train's default amax_history_len
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def _column(api, run_id: int, metric: str, steps: int) -> np.ndarray:
    body = api.get(f"/runs/{run_id}/heatmap", params={"metric": metric, "max_cols": 4 * steps}).json()
    assert body["bucket_width"] == 1
    return np.array([[np.nan if v is None else float(v) for v in row] for row in body["values"]])


def test_margin_change_and_fp8_off_are_applied_acked_and_visible(server, api, tmp_path):
    steps = 160
    args = ("--steps", str(steps), "--monitor-url", server.url, "--run-name", "e2e-control")
    proc = start_train(tmp_path, *args)
    try:
        run = wait_for(
            lambda: next((r for r in api.get("/runs").json() if r["name"] == "e2e-control"
                          and (r["last_step"] or 0) >= 3), None),
            what="the run's first steps",
        )  # fmt: skip
        margin = api.post(f"/runs/{run['id']}/commands",
                          json={"target": "blocks.1.mlp.fc", "changes": {"margin": 3}})  # fmt: skip
        off = api.post(f"/runs/{run['id']}/commands",
                       json={"target": "blocks.2.mlp.fc", "changes": {"fp8_enabled": False}})  # fmt: skip
        assert margin.status_code == off.status_code == 201, (margin.text, off.text)
        ids = [margin.json()["id"], off.json()["id"]]

        def applied():
            cmds = {c["id"]: c for c in api.get(f"/runs/{run['id']}/commands").json()}
            return [cmds[i] for i in ids] if all(cmds[i]["state"] == "applied" for i in ids) else None

        cmd_margin, cmd_off = wait_for(applied, what="both commands applied")
    finally:
        out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]

    s_margin, s_off = cmd_margin["applied_step"], cmd_off["applied_step"]
    assert 3 < s_margin < steps - HISTORY - 2 and 3 < s_off < steps - 2, (s_margin, s_off)
    assert cmd_margin["previous"] == {"margin": 0}
    run = run_by_name(api, "e2e-control")
    eff = run["effective_recipe"]["layers"]
    assert eff["blocks.1.mlp.fc"]["margin"] == 3 and eff["blocks.2.mlp.fc"]["fp8_enabled"] is False

    tensors = api.get(f"/runs/{run['id']}/tensors").json()
    amax, scale = _column(api, run["id"], "amax", steps), _column(api, run["id"], "scale", steps)
    counts = _column(api, run["id"], "overflow", steps) + _column(api, run["id"], "underflow", steps)
    col = {s: s - 1 for s in range(1, steps + 1)}  # heatmap column of a step (steps start at 1)

    def headroom_log2(t: int, s: int) -> float:
        """log2 of fp8_max / (max amax over the history the scale of step s was computed from) / scale."""
        hist = amax[t, col[max(1, s - HISTORY)] : col[s]]
        return float(np.log2(FP8_MAX[tensors[t]["format"]] / hist.max() / scale[t, col[s]]))

    for t in (i for i, x in enumerate(tensors) if x["layer"] == "blocks.1.mlp.fc"):
        before = [headroom_log2(t, s) for s in range(HISTORY + 2, s_margin)]
        after = [headroom_log2(t, s) for s in range(s_margin + 1, steps + 1)]
        np.testing.assert_allclose(before, 0.0, atol=1e-5, err_msg=tensors[t]["name"])
        np.testing.assert_allclose(after, 3.0, atol=1e-5, err_msg=tensors[t]["name"])

    for t in (i for i, x in enumerate(tensors) if x["layer"] == "blocks.2.mlp.fc"):
        # an FP8-off layer's rows stay (stable indices) but record nothing: amax and counts are 0
        assert (amax[t, : col[s_off]] > 0).all()
        assert (amax[t, col[s_off] :] == 0).all() and (counts[t, col[s_off] :] == 0).all()
