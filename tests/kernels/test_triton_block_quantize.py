"""The block-scaled quantize kernel (``triton.block_quantize``): its cases (``block_cases.py``) under
``TRITON_INTERPRET=1`` on the CPU (``test_block_interpreted.py``); its sm_90 PTX
(compiled here, no GPU: ``test_ptx.py``'s machinery) reading and writing 16-byte vectors; and on a CUDA GPU
the same cases compiled (among them the block-scaled Linear's quantize and statistics through the dispatch
against the reference path)."""

from __future__ import annotations

import pytest
import torch

from fp8_kernels import triton_available
from fp8_kernels.triton import cross_build
from tests.kernels import block_cases
from tests.kernels.test_ptx import _global, _per_thread, _ptx, record, sm90  # noqa: F401 (fixtures)
from tests.support.gpu import FP8_GPU

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="triton is not installed (pip install .[dev])"
)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ----- sm_90 PTX, compiled on the CPU -----
@pytest.fixture
def block_record(record, monkeypatch):  # noqa: F811
    """The quantize kernel's launches recorded (the statistics fold's too, apart), with the CUDA tile
    sizes."""
    from fp8_kernels.triton import block_quantize as tbq

    tile = tbq.block_tile
    monkeypatch.setattr(tbq, "block_tile", lambda device, block: tile(cross_build.CUDA, block))
    record(tbq, "_block_fold_kernel")
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
    from fp8_kernels.triton.block_quantize import block_quantize_triton, block_tile

    x = torch.zeros(512 + 7, 1024, dtype=dtype)  # an edge tile row: the size is no part of the kernel
    block_quantize_triton(x, fp8, block, fmt, **(_rows() if stats else {}))
    ptx = _ptx(sm90, block_record)
    tile_m, warps = block_tile(cross_build.CUDA, block)
    elems = _per_thread(tile_m * block[1], warps)
    loads, stores = _global(ptx, "ld"), _global(ptx, "st")
    # per thread: its elements of x in 16-byte loads, its FP8 outputs in one 16-byte store (16 elements)
    assert loads[128] >= elems * x.element_size() // 16, loads
    assert stores[128] >= elems // 16, stores


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("block,fmt", [((1, 32), "e8m0"), ((1, 128), "fp32")])
def test_transposed_input_is_read_in_vectors(sm90, block_record, block, fmt):  # noqa: F811
    """A column-wise copy's input, the transpose of a row-major tensor, is read in place with 16-byte loads
    (along the tile's rows) and the FP8 data stored in 16-byte vectors, as from a row-major input."""
    from fp8_kernels.triton.block_quantize import block_quantize_triton, block_tile

    x = torch.zeros(1024, 512 + 16, dtype=torch.bfloat16).t()  # (528, 1024), strides (1, 528)
    block_quantize_triton(x, E4M3, block, fmt)
    ptx = _ptx(sm90, block_record)
    args, kwargs = block_record.launches[0]
    assert kwargs["X_T"] and args[0].is_contiguous(), "the input was copied"
    tile_m, warps = block_tile(cross_build.CUDA, block)
    elems = _per_thread(tile_m * block[1], warps)
    assert _global(ptx, "ld")[128] >= elems * x.element_size() // 16, _global(ptx, "ld")
    assert _global(ptx, "st")[128] >= elems // 16, _global(ptx, "st")


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 1), (3, 33), (129, 200)])
def test_block_quantize_odd_shapes_compile(sm90, block_record, shape):  # noqa: F811
    from fp8_kernels.triton.block_quantize import block_quantize_triton

    block_quantize_triton(torch.zeros(shape, dtype=torch.bfloat16), E5M2, (1, 128), "fp32", **_rows())
    assert "st.global" in _ptx(sm90, block_record)


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("fmt,block,quality", [("e8m0", (1, 32), True), ("fp32", (128, 128), False)])
def test_block_fold_compiles(sm90, record, fmt, block, quality):  # noqa: F811
    """The statistics fold (one program: float64 reductions, ``log2`` of a float64, the rows' stores)
    builds for sm_90, and stores into both rows."""
    from fp8_kernels.triton import block_quantize as tbq

    fold = record(tbq, "_block_fold_kernel")
    record(tbq, "_block_quantize_kernel")
    x = torch.zeros(300, 256, dtype=torch.bfloat16)
    tbq.block_quantize_triton(x, E4M3, block, fmt, **_rows(quality))
    assert len(fold.launches) == 1 and fold.grids == [(1,)]
    ptx = _ptx(sm90, fold)
    assert _global(ptx, "st")[64] >= (10 if quality else 6) + 6, _global(ptx, "st")


@needs_triton
@pytest.mark.parametrize("block,fmt", [((1, 32), "e8m0"), ((1, 128), "fp32"), ((128, 128), "fp32")])
def test_launcher_reads_nothing_on_the_host(block_record, block, fmt):
    """A call allocates its outputs and launches: no value read on the host, no tensor made from a Python
    number, no op that would launch work on a device; what a call shape decides is built once."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp8_kernels.triton import block_quantize as tbq

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.randn(256, 384).to(torch.bfloat16)
    rows = _rows()
    tbq.block_quantize_triton(x, E4M3, block, fmt, amax_epsilon=1e-6, **rows)  # the shape's first call
    plans = len(tbq._PLANS)
    with Ops() as ops:
        for _ in range(3):
            tbq.block_quantize_triton(x, E4M3, block, fmt, amax_epsilon=1e-6, **rows)
    assert len(tbq._PLANS) == plans, "a call shape's plan was built again"
    allocations_and_views = {
        "empty",
        "empty_strided",
        "view",
        "t",
        "transpose",
        "slice",
        "as_strided",
        "detach",
    }
    assert set(ops.names) <= allocations_and_views, sorted(set(ops.names) - allocations_and_views)
    assert len(block_record.launches) == 4  # one quantize launch per call (the folds recorded apart)
    tbq.block_quantize_triton(x[:128], E4M3, block, fmt, amax_epsilon=1e-6, **rows)  # another shape
    assert len(tbq._PLANS) == plans + 1


def _rows(quality: bool = True) -> dict:
    """A step's statistics row and block row (``block_quantize_triton``'s ``stats`` and ``block_stats``)."""
    from fp8_trainer.block_linear import new_block_stats

    stats = torch.zeros(10 if quality else 6, dtype=torch.float64)
    return {"stats": stats, "block_stats": new_block_stats(1)[0]}


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
