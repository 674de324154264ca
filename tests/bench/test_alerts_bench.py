"""bench/alerts.py on the CPU, a few of its scenarios: real trainings through the real client and service,
a local webhook receiver; the healthy runs stay quiet, the faults are one incident each, with the right
root cause and exactly one webhook message."""

import json
import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow  # about 40 s: an fp8-train run and four small in-process ones

SCENARIOS = "grad-accum-te,moe-skips,frozen-weight,drift,nan"


def test_alerts_bench_quick_subset(tmp_path):
    out = tmp_path / "alerts.json"
    bench = str(ROOT / "bench" / "alerts.py")
    cmd = [sys.executable, bench, "--quick", "--only", SCENARIOS, "--out", str(out)]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert f"wrote {out}" in proc.stdout and "precision 1.000  recall 1.000" in proc.stdout
    data = json.loads(out.read_text())
    rows = {r["scenario"]: r for r in data["rows"]}
    assert sorted(rows) == sorted(f"{name}/s0" for name in SCENARIOS.split(","))
    for name in ("grad-accum-te", "moe-skips", "frozen-weight"):
        r = rows[f"{name}/s0"]
        assert (r["alarms"], r["alerts"], r["webhook_posts"]) == (0, 0, 0), r
    nan = rows["nan/s0"]
    # the NaN reaches every tensor: dozens of alerts, one incident, one message, the injected tensor first
    assert nan["alerts"] > 10 and nan["alarms"] == 1 and nan["webhook_posts"] == 1, nan
    assert nan["root"] == "nonfinite on blocks.1.mlp.fc.input at 40" and nan["delay"] == 0
    assert nan["incidents"][0]["url"].startswith("https://fp8scope.example.org/#/runs/")
    drift = rows["drift/s0"]
    assert drift["root_ok"] and drift["alarms"] == 1 and drift["webhook_posts"] == 1, drift
    s = data["summary"]
    assert s["all_ok"] and s["false_alarms"] == 0 and s["faults_found"] == s["faults"] == 2
    assert s["healthy_policy_actions"] == 0 and all(r["policy_actions"] == 0 for r in rows.values())
