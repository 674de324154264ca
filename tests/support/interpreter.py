"""The Triton-interpreter runners, started in the background as soon as pytest knows it needs them.

The interpreter is chosen when triton is imported and holds for a whole process, so the kernels' interpreted
cases run in subprocesses with ``TRITON_INTERPRET=1`` (``python -m tests.kernels.kernel_cases`` and two more).
They take minutes of one core each. Run inside the test that reads them, the suite would wait for them
with its second core idle; started when collection ends (``tests/conftest.py``), one after the other on a
thread of this process, they run beside the rest of the suite, and the tests that read them are moved to
the end of the run.

A test module names the runs it reads with ``pytest.mark.interpreter("kernel_cases")`` (and is listed in
:data:`READERS`) and gets a run's JSON with :func:`results`. A run nobody collected is never started;
:func:`results` starts one that the hook did not (a test run by its node id without the hook's help, say)
and waits for it.

Under pytest-xdist (``scripts/test.sh`` runs two workers) the runs start once, in the controller, as soon
as a worker's collection names a reader module; each run leaves its JSON and its outcome in a folder the
workers are given (:data:`shared`), where a reader on any worker waits for them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.support import ROOT
from tests.support.polling import wait_until

#: each run's module under tests/kernels and the arguments it takes ({out}: the JSON it writes)
RUNS: dict[str, list[str]] = {
    "kernel_cases": ["tests.kernels.kernel_cases", "--json", "{out}"],
    "block_cases": ["tests.kernels.block_cases", "--json", "{out}"],
    "quality_cases": ["tests.kernels.quality_cases_triton", "{out}"],
}
#: the test modules that read each run: the xdist controller, which sees node ids only, starts a run when
#: one of them is collected. tests/conftest.py refuses a reader module missing here, and one that holds
#: any test but readers: xdist (--dist loadscope) schedules a module whole, where its first test stands, so
#: only a module of readers alone is scheduled last.
READERS: dict[str, tuple[str, ...]] = {
    "kernel_cases": ("tests/kernels/test_triton_interpreter.py",),
    "block_cases": ("tests/kernels/test_block_interpreted.py",),
    "quality_cases": ("tests/kernels/test_quality_interpreted.py",),
}
#: how long one run may take, from its own start (the slowest, kernel_cases, takes minutes of one core; on
#: a slow 2-core machine, beside the suite's two workers, it was killed at 1800 s in a 55-minute run): a
#: guard against a hung run, inside the 90 minutes a whole run of the suite may take
RUN_TIMEOUT_S = 3600


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    out: Path

    @classmethod
    def read(cls, path: Path) -> Outcome:
        """An outcome :meth:`write` left at `path`."""
        fields = json.loads(path.read_text())
        return cls(fields["returncode"], fields["stdout"], fields["stderr"], Path(fields["out"]))

    def write(self, path: Path) -> None:
        """This outcome at `path` (its output's tails), whole or not at all: a reader polls for the file."""
        fields = {**asdict(self), "stdout": self.stdout[-3000:], "stderr": self.stderr[-6000:]}
        fields["out"] = str(self.out)
        part = path.with_suffix(".part")
        part.write_text(json.dumps(fields))
        os.replace(part, path)

    def failure(self) -> str | None:
        """What went wrong, with the tail of the run's output, or None when it wrote its JSON and exited 0."""
        if self.returncode == 0 and self.out.exists():
            return None
        return f"rc {self.returncode}:\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"


#: the runs tests/conftest.py started when collection ended (a test checks it did, through `started`)
started_at_collection: list[str] = []
#: in an xdist worker: the controller's folder, where its runs leave `{name}.json` and `{name}.outcome`
shared: Path | None = None
_folder: Path | None = None
_done: dict[str, threading.Event] = {}
_outcomes: dict[str, Outcome] = {}
_running: set[subprocess.Popen] = set()
_stopped = False
_lock = threading.Lock()


def start(names: list[str]) -> None:
    """Start the named runs that this session has not started, in this order, one at a time, on one thread."""
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        raise ValueError(f"unknown interpreter runs {unknown}; known: {sorted(RUNS)}")
    with _lock:
        names = [n for n in dict.fromkeys(names) if n not in _done]
        if not names:
            return
        for name in names:
            _done[name] = threading.Event()
    threading.Thread(target=_chain, args=(names, folder()), name="interpreter-runs", daemon=True).start()


def folder() -> Path:
    """This process's folder of run outputs (made on first use; `stop` removes it)."""
    global _folder
    with _lock:
        if _folder is None:
            _folder = Path(tempfile.mkdtemp(prefix="fp8scope-interp-"))
        return _folder


def module_of(node_id: str) -> str:
    """The test module a node id names (``tests/kernels/test_x.py``), as `READERS` lists it."""
    return node_id.split("::", 1)[0]


def needed(node_ids: Iterable[str]) -> list[str]:
    """The runs (in `RUNS` order) that the collected `node_ids` read, by their modules (`READERS`)."""
    modules = {module_of(node_id) for node_id in node_ids}
    return [name for name in RUNS if modules.intersection(READERS[name])]


def start_shared(names: list[str]) -> None:
    """The xdist controller's `start`: the runs start here and the workers are told which (`started`)."""
    start(names)
    where = folder()
    with _lock:
        started_at_collection.extend(n for n in names if n not in started_at_collection)
        (where / "started.part").write_text(json.dumps(started_at_collection))
        os.replace(where / "started.part", where / "started.json")


def started() -> list[str]:
    """The runs started when collection ended: by this process's hook, or by the xdist controller's."""
    if shared is None:
        return list(started_at_collection)
    listed = shared / "started.json"
    return json.loads(listed.read_text()) if listed.exists() else []


def _chain(names: list[str], where: Path) -> None:
    for name in names:
        out = where / f"{name}.json"
        try:
            _outcomes[name] = _run(name, out)
        except Exception as exc:  # the run could not start: its readers fail with this
            _outcomes[name] = Outcome(-1, "", f"{name}: {exc!r}", out)
        finally:
            _outcomes[name].write(where / f"{name}.outcome")  # for the readers in xdist workers
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

    if shared is not None and name in started():
        ended = _shared_outcome(shared / f"{name}.outcome")
    else:
        start([name])
        _done[name].wait()
        ended = _outcomes[name]
    failure = ended.failure()
    if failure is not None:
        pytest.fail(f"interpreter runner {name} failed ({failure})", pytrace=False)
    return json.loads(ended.out.read_text())


def _shared_outcome(path: Path) -> Outcome:
    """The outcome the controller's run leaves at `path`, once it is there (polled: another process)."""
    limit = RUN_TIMEOUT_S * len(RUNS)
    if not wait_until(path.exists, timeout=limit, interval=0.5):
        return Outcome(-1, "", f"no outcome at {path} after {limit} s", path)
    return Outcome.read(path)


def stop() -> None:
    """Kill a run still going (the session is ending)."""
    global _stopped
    _stopped = True
    for proc in list(_running):
        proc.kill()
    if _folder is not None:
        shutil.rmtree(_folder, ignore_errors=True)
