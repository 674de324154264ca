"""Every Triton kernel under TRITON_INTERPRET=1 against its PyTorch reference (the cases: kernel_cases.py).

The interpreter is chosen when triton is imported and holds for the whole process, so the cases run in one
subprocess with the variable set (started in the background when collection ends: tests.support.interpreter);
this process (and any GPU test in it) keeps the compiled path. Each case is one parametrised test here,
failing with the case's own traceback. A module of readers only (see ``tests/conftest.py``); the runner's
own checks are ``test_interpreter_runner.py``'s.
"""

import pytest

from fp8_kernels import triton_available
from tests.kernels import kernel_cases
from tests.support import interpreter

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install '.[dev]')"),
]


@pytest.fixture(scope="module")
def results() -> dict:
    return interpreter.results("kernel_cases")


@pytest.mark.interpreter("kernel_cases")
@pytest.mark.parametrize("case", kernel_cases.case_names("cpu"))
def test_kernel_case_interpreted(case, results):
    assert case in results, f"{case}: not run by the interpreter runner"
    error = results[case]["error"]
    if error:
        pytest.fail(f"{case} (interpreted):\n{error}", pytrace=False)


@pytest.mark.interpreter("kernel_cases")
def test_runner_ran_exactly_the_cases(results):
    assert sorted(results) == sorted(kernel_cases.case_names("cpu"))
    assert len(results) > 80


@pytest.mark.interpreter("kernel_cases")
def test_the_runs_started_when_collection_ended(request):
    # started beside the rest of the suite (by the xdist controller, under xdist), not by the first test
    # that reads them, and read at the end
    assert "kernel_cases" in interpreter.started()
    items = request.session.items
    readers = [i for i, item in enumerate(items) if item.get_closest_marker("interpreter")]
    assert readers == list(range(len(items) - len(readers), len(items)))
