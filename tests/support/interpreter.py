"""The Triton-interpreter runners, started in the background as soon as pytest knows it needs them.

The interpreter is chosen when triton is imported and holds for a whole process, so the kernels' interpreted
cases run in subprocesses with ``TRITON_INTERPRET=1`` (``python -m tests.kernels.kernel_cases`` and two more).
They take minutes of one core each. Run inside the test that reads them, the suite would wait for them
with its second core idle; started when collection ends (``tests/conftest.py``), one after the other on a
thread of this process, they run beside the rest of the suite, and the tests that read them are moved to
the end of the run.

A test module names the runs it reads with ``pytest.mark.interpreter("kernel_cases")`` and gets a run's
JSON with :func:`results`. A run nobody collected is never started; :func:`results` starts one that the
hook did not (a test run by its node id without the hook's help, say) and waits for it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from tests.support import ROOT

#: each run's module under tests/kernels and the arguments it takes ({out}: the JSON it writes)
RUNS: dict[str, list[str]] = {
    "kernel_cases": ["tests.kernels.kernel_cases", "--json", "{out}"],
    "block_cases": ["tests.kernels.block_cases", "--json", "{out}"],
    "quality_cases": ["tests.kernels.quality_cases_triton", "{out}"],
}
#: how long one run may take, from its own start (the slowest, kernel_cases, takes minutes of one core)
RUN_TIMEOUT_S = 1800


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    out: Path

    def failure(self) -> str | None:
        """What went wrong, with the tail of the run's output, or None when it wrote its JSON and exited 0."""
        if self.returncode == 0 and self.out.exists():
            return None
        return f"rc {self.returncode}:\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"


#: the runs tests/conftest.py started when collection ended (a test checks it did)
started_at_collection: list[str] = []
_folder: Path | None = None
_done: dict[str, threading.Event] = {}
_outcomes: dict[str, Outcome] = {}
_running: set[subprocess.Popen] = set()
_stopped = False
_lock = threading.Lock()


def start(names: list[str]) -> None:
    """Start the named runs that this session has not started, in this order, one at a time, on one thread."""
    global _folder
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        raise ValueError(f"unknown interpreter runs {unknown}; known: {sorted(RUNS)}")
    with _lock:
        names = [n for n in dict.fromkeys(names) if n not in _done]
        if not names:
            return
        if _folder is None:
            _folder = Path(tempfile.mkdtemp(prefix="fp8scope-interp-"))
        for name in names:
            _done[name] = threading.Event()
    threading.Thread(target=_chain, args=(names, _folder), name="interpreter-runs", daemon=True).start()


def _chain(names: list[str], folder: Path) -> None:
    for name in names:
        out = folder / f"{name}.json"
        try:
            _outcomes[name] = _run(name, out)
        except Exception as exc:  # the run could not start: its readers fail with this
            _outcomes[name] = Outcome(-1, "", f"{name}: {exc!r}", out)
        finally:
            _done[name].set()


def _run(name: str, out: Path) -> Outcome:
    if _stopped:
        return Outcome(-1, "", f"{name}: not run, the session ended first", out)
    argv = [sys.executable, "-m", *(a.replace("{out}", str(out)) for a in RUNS[name])]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _running.add(proc)
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        stderr += f"\n{name}: killed after {RUN_TIMEOUT_S} s"
    finally:
        _running.discard(proc)
    return Outcome(proc.returncode, stdout, stderr, out)


def results(name: str) -> dict:
    """The JSON the named run wrote, once it has ended (started here if nobody has started it); fails the
    calling test with the run's output if it did not finish."""
    import pytest

    start([name])
    _done[name].wait()
    ended = _outcomes[name]
    failure = ended.failure()
    if failure is not None:
        pytest.fail(f"interpreter runner {name} failed ({failure})", pytrace=False)
    return json.loads(ended.out.read_text())


def stop() -> None:
    """Kill a run still going (the session is ending)."""
    global _stopped
    _stopped = True
    for proc in list(_running):
        proc.kill()
    if _folder is not None:
        shutil.rmtree(_folder, ignore_errors=True)
