"""The interpreter runner of ``test_triton_interpreter.py`` (``kernel_cases.py``) kept apart from this
process: the interpreter setting does not leak here, and the runner refuses to run the kernels compiled."""

import os
import subprocess
import sys

import pytest

from fp8_kernels import triton_available
from tests.support import ROOT, interpreter

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install '.[dev]')"),
]

RUNNER = [sys.executable, "-m", interpreter.RUNS["kernel_cases"][0]]  # run from ROOT


def test_interpreter_did_not_leak_into_this_process():
    assert os.environ.get("TRITON_INTERPRET") != "1"
    if "triton" in sys.modules:
        from triton import knobs

        assert not knobs.runtime.interpret


def test_runner_refuses_to_run_compiled(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [*RUNNER, "--json", str(tmp_path / "r.json"), "--only", "quantize-fp32-e4m3-17"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "TRITON_INTERPRET=1" in proc.stderr
