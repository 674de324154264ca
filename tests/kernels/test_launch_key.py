"""``triton_launch.launch_key``: what a cached Triton launch handle is looked up by. Two launches may share a
compiled kernel only where Triton would have compiled the same one, so the key must change with everything
Triton specialises on (a wrong key would run a kernel compiled for aligned pointers on a misaligned one)."""

import pytest
import torch
from fp8_kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install .[dev])")


def _key(*args, **kwargs):
    from fp8_kernels.triton_launch import launch_key

    return launch_key(torch.device("cpu"), args, kwargs)


def test_same_metadata_same_key_whatever_the_values_and_sizes():
    a, b = torch.zeros(64), torch.ones(128)
    assert _key(a, 1008, BLOCK=16) == _key(b, 2000, BLOCK=16)


def test_key_changes_with_what_triton_specialises_on():
    x = torch.zeros(64)
    base = _key(x, 32, BLOCK=16)
    assert _key(x[1:], 32, BLOCK=16) != base  # pointer 4 bytes off a 16-byte boundary
    assert _key(x.to(torch.bfloat16), 32, BLOCK=16) != base  # dtype
    assert _key(x, 33, BLOCK=16) != base  # not a multiple of 16
    assert _key(x, 1, BLOCK=16) != _key(x, 3, BLOCK=16)  # an integer equal to 1 is a constant to Triton
    assert _key(x, 2**31 + 32, BLOCK=16) != base  # int64 instead of int32
    assert _key(x, 32, BLOCK=32) != base  # a constexpr
    assert _key(x, 32, BLOCK=16, num_warps=8) != _key(x, 32, BLOCK=16, num_warps=4)  # a launch option
