"""Session-wide hooks: the Triton-interpreter runs start in the background once collection knows which are
needed, and the tests that read them go last (``tests.support.interpreter``)."""

from __future__ import annotations

import pytest

from fp8_kernels import triton_available
from tests.support import interpreter


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "interpreter(*runs): reads these Triton-interpreter runs (tests.support.interpreter.RUNS); they "
        "start in the background when collection ends and the test runs last",
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    readers, others, runs = [], [], []
    for item in items:
        marker = item.get_closest_marker("interpreter")
        if marker is None:
            others.append(item)
            continue
        readers.append(item)
        runs += [run for run in marker.args if run not in runs]
    if not runs or config.option.collectonly or not triton_available():
        return  # (without triton the readers skip)
    # the run the first reader needs comes first; the readers keep their order, after every other test
    items[:] = others + readers
    # the first reader of a run may wait for all of it: the runs' own limit, not the suite's per-test one
    for item in readers:
        item.add_marker(pytest.mark.timeout(interpreter.RUN_TIMEOUT_S * len(runs)))
    interpreter.start(runs)
    interpreter.started_at_collection[:] = runs


def pytest_sessionfinish(session: pytest.Session) -> None:
    interpreter.stop()
