"""The block-scaled quantize kernel's cases (``block_cases.py``) under ``TRITON_INTERPRET=1`` on the CPU, in
a subprocess (``tests.support.interpreter``) as ``test_triton_interpreter.py``'s. A module of readers only:
see ``tests/conftest.py``."""

import pytest

from fp8_kernels import triton_available
from tests.kernels import block_cases
from tests.support import interpreter

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="triton is not installed (pip install .[dev])"
)


@pytest.fixture(scope="module")
def results() -> dict:
    return interpreter.results("block_cases")


@needs_triton
@pytest.mark.interpreter("block_cases")
@pytest.mark.parametrize("case", block_cases.case_names())
def test_block_case_interpreted(case, results):
    assert case in results, f"{case}: not run by the interpreter runner"
    if results[case]["error"]:
        pytest.fail(f"{case} (interpreted):\n{results[case]['error']}", pytrace=False)


@needs_triton
@pytest.mark.interpreter("block_cases")
def test_runner_ran_every_case(results):
    assert sorted(results) == sorted(block_cases.case_names())
    assert len(results) == 4 * 3 * 2 + 5  # recipes x input dtypes x FP8 formats, and five more cases
