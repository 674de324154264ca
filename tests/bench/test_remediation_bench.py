"""``bench/remediation.py --smoke``: one lowprec run with ``--remediation act`` and its float32 twin, real
`fp8-train` runs against a real `fp8-monitor serve`. The job pauses at its step-40 incident and replays
its own bundle (nobody runs `fp8-train replay`), the policy turns the layer's FP8 off, the job runs step 40
again under the command, the check keeps or rolls it back, and the bench reads the action and its audited
command back."""

import json
import subprocess
import sys

import pytest

from tests.support import ROOT

LAYER = "blocks.3.mlp.fc2"


@pytest.mark.slow
def test_remediation_smoke(tmp_path):
    out = tmp_path / "rem.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "remediation.py"), "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    data = json.loads(out.read_text())
    assert data["meta"]["smoke"] is True and data["meta"]["last"] == 50
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"act", "twin"} and all(r["kind"] == "lowprec" for r in rows.values())
    act, twin = rows["act"], rows["twin"]
    assert (
        act["steps"] == twin["steps"] == data["meta"]["steps"] == 100
        and "incident-step40.pt" in act["bundles"]
    )
    assert any("fp8-caused" in line for line in act["replays"]), act["replays"]  # replayed by the job
    # the step-40 incident's action; a later bundle of the run (a gradient saturated while the run is
    # still off its course, in another layer) may bring one more
    (action,) = [a for a in act["actions"] if a["target"] == LAYER]
    assert action["rule"] == "low_sqnr"  # lowprec's pair of casts names one layer
    assert action["changes"] == {"fp8_enabled": False} and action["applied_step"] == 40  # the step run again
    assert action["state"] in ("kept", "rolled_back") and action["audited"] and action["consistent"]
    assert twin["actions"] == [] and twin["bundles"] == []  # float32 undoes the fault: nothing to capture
    assert act["gap"] == pytest.approx((act["final"] - twin["final"]) / twin["final"])
    assert act["within"] == (abs(act["gap"]) <= 0.02)
    goal = data["goals"]["within_twin"]
    assert goal["met"] == (goal["value"] >= goal["target"]) and goal["target"] == 0.8
    assert all(a["audited"] and a["consistent"] for a in act["actions"]), act["actions"]
    assert data["audited"] == data["actions"] == len(act["actions"]) and "goal: with policies" in proc.stdout
