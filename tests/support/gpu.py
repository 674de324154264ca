"""The marks of the tests that need a GPU with FP8 support and triton: ``pytestmark = FP8_GPU``."""

import pytest

import fp8_kernels

#: skip, with the reason, unless a CUDA GPU with FP8 support (sm_89+) and triton are here
FP8_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (fp8_kernels.fp8_gpu() and fp8_kernels.triton_available()),
        reason="needs a CUDA GPU with FP8 support (sm_89+) and triton",
    ),
]
