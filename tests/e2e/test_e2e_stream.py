"""A real FP8 run streams every step into a real server; what is stored equals what the job computed."""

from __future__ import annotations

import numpy as np
import pytest

from fp8_protocol.stats import BASE_COLUMNS
from tests.e2e.e2e_utils import run_by_name

pytestmark = pytest.mark.slow


def _heatmap(api, run_id: int, metric: str, steps: int) -> np.ndarray:
    r = api.get(f"/runs/{run_id}/heatmap", params={"metric": metric, "max_cols": 4 * steps})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["bucket_width"] == 1 and body["bucket_start"] == list(range(1, steps + 1))
    return np.array([[np.nan if v in (None, "NaN") else float(v) for v in row] for row in body["values"]])


def test_every_step_stored_and_equal_to_the_jobs_statistics(server, api, train, tmp_path):
    steps = 30
    train("--steps", str(steps), "--monitor-url", server.url, "--run-name", "e2e-stream",
          "--stats-dump", "stats.npz")  # fmt: skip
    dump = np.load(tmp_path / "stats.npz")
    assert dump["steps"].tolist() == list(range(1, steps + 1))

    run = run_by_name(api, "e2e-stream")
    assert (run["status"], run["steps_stored"], run["first_step"], run["last_step"]) == (
        "finished", steps, 1, steps)  # fmt: skip
    tensors = api.get(f"/runs/{run['id']}/tensors").json()
    assert len(tensors) == dump["stats"].shape[1] == run["num_tensors"]
    assert tensors[0]["name"] == "blocks.0.attn.qkv.input" and tensors[2]["format"] == "e5m2"

    for c, metric in enumerate(BASE_COLUMNS):  # the quality columns: test_e2e_quality.py
        if metric == "numel":
            continue
        stored = _heatmap(api, run["id"], metric, steps)
        np.testing.assert_array_equal(stored, dump["stats"][:, :, c].T, err_msg=metric)

    loss = api.get(f"/runs/{run['id']}/series", params={"name": "loss"}).json()
    assert loss["steps"] == list(range(1, steps + 1))
    np.testing.assert_allclose(loss["values"], dump["loss"], rtol=1e-6)
