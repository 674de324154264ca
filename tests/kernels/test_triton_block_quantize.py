"""The block-scaled quantize kernel (``triton_block_quantize``): its cases (``block_cases.py``) under
``TRITON_INTERPRET=1`` on the CPU, in a subprocess as ``test_triton_interpreter.py`` does; its sm_90 PTX
(compiled here, no GPU: ``test_ptx.py``'s machinery) reading and writing 16-byte vectors; and on a CUDA GPU
the same cases compiled (among them the block-scaled Linear's quantize and statistics through the dispatch
against the reference path)."""

from __future__ import annotations

import pytest
import torch
from fp8_kernels import cross_build, triton_available

from tests.kernels import block_cases
from tests.kernels.test_ptx import _global, _per_thread, _ptx, record, sm90  # noqa: F401 (fixtures)
from tests.support import interpreter
from tests.support.gpu import FP8_GPU

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="triton is not installed (pip install .[dev])"
)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ----- the interpreter on the CPU -----
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
    assert len(results) == 4 * 3 * 2 + 4  # recipes x input dtypes x FP8 formats, and four more cases


# ----- sm_90 PTX, compiled on the CPU -----
@pytest.fixture
def block_record(record, monkeypatch):  # noqa: F811
    """The kernel's launches recorded, with the CUDA tile sizes."""
    from fp8_kernels import triton_block_quantize as tbq

    tile = tbq.block_tile
    monkeypatch.setattr(tbq, "block_tile", lambda device, block: tile(cross_build.CUDA, block))
    return record(tbq, "_block_quantize_kernel")


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize(
    "block,fmt,dtype,fp8",
    [
        ((1, 32), "e8m0", torch.bfloat16, E4M3),
        ((1, 128), "fp32", torch.bfloat16, E4M3),
        ((1, 32), "e8m0", torch.float32, E5M2),
        ((128, 128), "fp32", torch.float16, E4M3),
    ],
)
@pytest.mark.parametrize("stats", [True, False])
def test_block_quantize_vectorised(sm90, block_record, block, fmt, dtype, fp8, stats):  # noqa: F811
    from fp8_kernels.triton_block_quantize import block_quantize_triton, block_tile

    x = torch.zeros(512 + 7, 1024, dtype=dtype)  # an edge tile row: the size is no part of the kernel
    block_quantize_triton(x, fp8, block, fmt, stats=stats)
    ptx = _ptx(sm90, block_record)
    tile_m, warps = block_tile(cross_build.CUDA, block)
    elems = _per_thread(tile_m * block[1], warps)
    loads, stores = _global(ptx, "ld"), _global(ptx, "st")
    # per thread: its elements of x in 16-byte loads, its FP8 outputs in one 16-byte store (16 elements)
    assert loads[128] >= elems * x.element_size() // 16, loads
    assert stores[128] >= elems // 16, stores


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 1), (3, 33), (129, 200)])
def test_block_quantize_odd_shapes_compile(sm90, block_record, shape):  # noqa: F811
    from fp8_kernels.triton_block_quantize import block_quantize_triton

    block_quantize_triton(torch.zeros(shape, dtype=torch.bfloat16), E5M2, (1, 128), "fp32", stats=True)
    assert "st.global" in _ptx(sm90, block_record)


# ----- compiled on a CUDA GPU -----
def gpu(fn):
    """The marks of a GPU test (``tests.support.gpu.FP8_GPU``: skipped, with the reason, without one)."""
    for mark in FP8_GPU:
        fn = mark(fn)
    return fn


@gpu
@pytest.mark.parametrize("case", block_cases.case_names())
def test_block_case_compiled(case):
    block_cases.CASES[case](torch.device("cuda"))
