"""The README's "I already have a training script" examples run as written: each block is executed in its own
process against a real `fp8-monitor serve` (URL from FP8SCOPE_URL, as the README says), and its run is stored
with every step it trained."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.trainer.monitor_utils import get


def quickstart_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## I already have a training script", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


# (what the block needs, the run name it registers, steps, where its statistics come from, tensors)
EXPECTED = [
    (None, "my-loop", 100, "shadow", 6),
    ("transformers", "hf-example", 20, None, 42),
    ("lightning", "lightning-example", 50, None, 6),
]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(EXPECTED)), ids=[e[1] for e in EXPECTED])
def test_quickstart_example_runs(server, tmp_path, index):
    needs, name, steps, source, n_tensors = EXPECTED[index]
    if needs is not None:
        pytest.importorskip(needs)
    blocks = quickstart_blocks()
    assert len(blocks) == len(EXPECTED)
    script = tmp_path / "example.py"
    script.write_text(blocks[index])
    env = {**os.environ, "FP8SCOPE_URL": server.url, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    run = next(r for r in get(server.url, "/runs") if r["name"] == name)
    run = get(server.url, f"/runs/{run['id']}")
    assert run["status"] == "finished"
    assert run["steps_stored"] == steps and (run["first_step"], run["last_step"]) == (1, steps)
    assert run["config"].get("fp8_source") == source and run["num_tensors"] == n_tensors
    assert run["last_loss"] is not None
