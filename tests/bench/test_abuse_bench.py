"""bench/abuse.py in its smoke mode: smaller attacks against real servers on SQLite; each is answered with
the status it should get and nothing of a rejected request is stored (the timings and memory figures are
the full benchmark's to measure, not this test's)."""

import json
import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow  # about 20 s: two servers and seventeen attacks


def test_abuse_bench_smoke(tmp_path):
    out = tmp_path / "abuse.json"
    cmd = [sys.executable, str(ROOT / "bench" / "abuse.py"), "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads(out.read_text())
    assert data["meta"]["smoke"] is True and len(data["rows"]) >= 15
    wrong = [(r["attack"], r["status"], r["expected"]) for r in data["rows"] if r["status"] != r["expected"]]
    assert not wrong, wrong
    stored = [r["attack"] for r in data["rows"] if r["stored_nothing"] is False]
    assert not stored, stored
