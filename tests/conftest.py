"""Session-wide hooks: the Triton-interpreter runs start in the background once collection knows which are
needed, and the tests that read them go last (``tests.support.interpreter``). Under pytest-xdist the
controller starts them, once, when the first worker has collected, and tells the workers where they write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fp8_kernels import triton_available
from tests.support import interpreter

#: the key of `workerinput` that carries the controller's folder of interpreter runs to the workers
SHARED = "fp8scope_interpreter_folder"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "interpreter(*runs): reads these Triton-interpreter runs (tests.support.interpreter.RUNS); they "
        "start in the background when collection ends and the test runs last",
    )
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and SHARED in workerinput:
        interpreter.shared = Path(workerinput[SHARED])


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:  # xdist's WorkerController
    """xdist's controller, before a worker starts: where the runs this controller starts write."""
    node.workerinput[SHARED] = str(interpreter.folder())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """xdist's controller, as each worker's collection ends: start the runs its node ids read (once)."""
    config = node.config
    if config.option.collectonly or not triton_available():
        return
    interpreter.start_shared(interpreter.needed(ids))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    readers, others, runs = [], [], []
    for item in items:
        marker = item.get_closest_marker("interpreter")
        if marker is None:
            others.append(item)
            continue
        readers.append(item)
        module = interpreter.module_of(item.nodeid)
        for run in marker.args:
            if module not in interpreter.READERS.get(run, ()):
                raise pytest.UsageError(f"{module} reads the interpreter run {run!r}: list it in READERS")
            if run not in runs:
                runs.append(run)
    mixed = sorted(
        {interpreter.module_of(i.nodeid) for i in readers} & {interpreter.module_of(i.nodeid) for i in others}
    )
    if mixed:  # xdist schedules a module whole, where its first test stands: readers alone go last
        raise pytest.UsageError(f"{mixed}: a module that reads interpreter runs holds readers only")
    if not runs or config.option.collectonly or not triton_available():
        return  # (without triton the readers skip)
    # the run the first reader needs comes first; the readers keep their order, after every other test
    items[:] = others + readers
    # the first reader of a run may wait for all of it: the runs' own limit, not the suite's per-test one
    for item in readers:
        item.add_marker(pytest.mark.timeout(interpreter.RUN_TIMEOUT_S * len(runs)))
    if interpreter.shared is None:  # not an xdist worker: this process runs them
        interpreter.start(runs)
        interpreter.started_at_collection[:] = runs


def pytest_sessionfinish(session: pytest.Session) -> None:
    interpreter.stop()
