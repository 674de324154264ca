"""The quality statistics of the Triton kernels under ``TRITON_INTERPRET=1`` against first principles
(``quality_cases_triton.py``, run by ``tests.support.interpreter``; the cases are
``test_quality_stats.py``'s). A module of readers only: see ``tests/conftest.py``."""

import pytest

from fp8_kernels import triton_available
from tests.kernels.test_quality_stats import _cases
from tests.support import interpreter


@pytest.mark.slow
@pytest.mark.interpreter("quality_cases")
@pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install '.[dev]')")
def test_triton_interpreted_matches_first_principles():
    done = interpreter.results("quality_cases")
    # every case, both formats, the 1-D and 2-D kernels, delayed and current scaling, accumulation
    assert len(done) >= 2 * len(_cases()) * 3, done
