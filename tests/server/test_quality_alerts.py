"""What a user sees of the SQNR-drop detector through the API: a realistic run whose one tensor loses
18 dB of SQNR raises exactly one alert for it; the same run without the drop, and a run without the quality
columns, raise none; the layers table carries each layer's SQNR."""

from __future__ import annotations

import numpy as np
import pytest

from fp8_protocol.stats import BASE_COLUMNS, QUALITY_COLUMNS
from tests.server.detectors.runs import Run, add_quality, healthy_run, index_of, set_sqnr
from tests.support.server import API, col, create_run

N_LAYERS, STEPS, DROP_AT = 8, 200, 150  # 24 tensors


def realistic_run(drop: bool) -> tuple[Run, int]:
    run = add_quality(healthy_run(STEPS, n_layers=N_LAYERS, seed=11), seed=11, level_db=30.0, noise_db=1.5)
    t = index_of(run.tensors, 5, "weight")
    if drop:
        set_sqnr(run, slice(DROP_AT, None), t, level_db=12.0, noise_db=1.5, seed=12)
    return run, t


def post_run(client, run: Run, quality: bool = True, batch: int = 20) -> int:
    """Register a run (the tensors of `make_tensors`, the same layout as detector_runs') and post its
    steps in batches, as the training client does."""
    run_id = create_run(client, n_layers=N_LAYERS)["id"]
    names = (*BASE_COLUMNS, *QUALITY_COLUMNS) if quality else BASE_COLUMNS
    for lo in range(0, STEPS, batch):
        steps = [
            {
                "step": int(run.steps[i]),
                "scalars": {"loss": float(run.loss[i])},
                "stats": {n: col(run.stats[n][i], "float64") for n in names},
            }
            for i in range(lo, min(STEPS, lo + batch))
        ]
        r = client.post(f"{API}/runs/{run_id}/telemetry", json={"idempotency_key": f"b{lo}", "steps": steps})
        assert r.status_code == 200, r.text
    return run_id


def alerts(client, run_id: int) -> list[dict]:
    r = client.get(f"{API}/runs/{run_id}/alerts")
    assert r.status_code == 200, r.text
    return r.json()


def layers(client, run_id: int) -> dict[str, dict]:
    r = client.get(f"{API}/runs/{run_id}/layers")
    assert r.status_code == 200, r.text
    return {layer["layer"]: layer for layer in r.json()}


def test_one_tensor_losing_sqnr_raises_one_alert_for_it(client):
    run, t = realistic_run(drop=True)
    run_id = post_run(client, run)
    found = alerts(client, run_id)
    assert [(a["kind"], a["tensor_index"]) for a in found] == [("sqnr_drop", t)], found
    alert = found[0]
    assert alert["tensor_name"] == "blocks.5.mlp.fc.weight" and alert["layer"] == "blocks.5.mlp.fc"
    assert alert["onset_step"] == DROP_AT and alert["severity"] == "warning"
    level, drop = alert["evidence"]["level_db"], alert["evidence"]["drop_db"]
    assert 25.0 < level < 36.0 and 10.0 < drop < 26.0
    assert f"{level:.1f} dB" in alert["message"] and f"{drop:.1f} dB below" in alert["message"]
    incidents = client.get(f"{API}/runs/{run_id}/incidents").json()
    assert len(incidents) == 1
    by_layer = layers(client, run_id)
    dropped = by_layer["blocks.5.mlp.fc"]
    assert dropped["diverging"] and any("open sqnr_drop alert" in r for r in dropped["reasons"])
    last = 10.0 * np.log10(run.stats["sum_sq"][-1] / run.stats["err_sq"][-1])
    for k in range(N_LAYERS):
        entry = by_layer[f"blocks.{k}.mlp.fc"]
        assert entry["sqnr_db"] == pytest.approx(last[3 * k : 3 * k + 3].min(), rel=1e-12)
    assert dropped["sqnr_db"] < 20.0 < min(by_layer[f"blocks.{k}.mlp.fc"]["sqnr_db"] for k in range(5))


def test_the_same_run_without_the_drop_raises_nothing(client):
    run, _ = realistic_run(drop=False)
    run_id = post_run(client, run)
    assert alerts(client, run_id) == []
    assert all(20.0 < layer["sqnr_db"] < 40.0 for layer in layers(client, run_id).values())


def test_a_layer_gone_non_finite_never_shows_a_perfect_sqnr(client):
    # a NaN reaches blocks.2.mlp.fc's input for good: every element non-finite, so the kernel's sums of
    # squares are zero, and 0/0 is no measurement, not an exact round trip (+inf dB)
    run, _ = realistic_run(drop=False)
    t, bad = index_of(run.tensors, 2, "input"), slice(180, None)
    run.stats["nonfinite"][bad, t] = run.stats["numel"][bad, t]
    run.stats["amax"][bad, t] = 0.0  # NaN elements never win the amax
    run.stats["sum_sq"][bad, t] = run.stats["err_sq"][bad, t] = 0.0
    run_id = post_run(client, run)
    # nor its last finite one, a healthy-looking 30 dB beside a layer that is all NaN: NaN, for the
    # tensor and its layer; the other layers keep theirs
    by_layer = layers(client, run_id)
    entry = by_layer["blocks.2.mlp.fc"]
    tensor = next(x for x in entry["tensors"] if x["index"] == t)
    assert tensor["sqnr_db"] == "NaN" and entry["sqnr_db"] == "NaN", entry
    others = [x for x in entry["tensors"] if x["index"] != t]
    assert all(20.0 < x["sqnr_db"] < 40.0 for x in others), others
    assert all(20.0 < v["sqnr_db"] < 40.0 for k, v in by_layer.items() if k != "blocks.2.mlp.fc")
    assert [a["kind"] for a in alerts(client, run_id)] == ["nonfinite"]  # and no SQNR alert from it


def test_a_tensor_that_recovers_shows_its_sqnr_again(client):
    # the NaN steps pass (a skipped step, a reloaded checkpoint): the latest step measures again
    run, _ = realistic_run(drop=False)
    t, bad = index_of(run.tensors, 2, "input"), slice(150, 160)
    run.stats["nonfinite"][bad, t] = run.stats["numel"][bad, t]
    run.stats["sum_sq"][bad, t] = run.stats["err_sq"][bad, t] = 0.0
    run_id = post_run(client, run)
    entry = layers(client, run_id)["blocks.2.mlp.fc"]
    tensor = next(x for x in entry["tensors"] if x["index"] == t)
    last = 10.0 * np.log10(run.stats["sum_sq"][-1, t] / run.stats["err_sq"][-1, t])
    assert tensor["sqnr_db"] == pytest.approx(last, rel=1e-12)


def test_a_run_without_quality_columns_raises_nothing_and_shows_no_sqnr(client):
    run, _ = realistic_run(drop=True)  # the drop is in err_sq, which this sender does not send
    run_id = post_run(client, run, quality=False)
    assert alerts(client, run_id) == []
    for layer in layers(client, run_id).values():
        assert layer["sqnr_db"] is None
        assert all(t["sqnr_db"] is None for t in layer["tensors"])
