"""fp8_kernels dispatch: references on the CPU, the reference switch, no triton import, empty tensors,
current scaling as one entry."""

import contextlib
import re
import subprocess
import sys

import pytest
import torch

import fp8_kernels
from fp8_kernels import (
    exponent_histogram,
    exponent_histogram_reference,
    fused_scale_update,
    has_kernel,
    quantize_current,
    quantize_current_transposed,
    quantize_with_stats,
    quantize_with_stats_reference,
    quantize_with_stats_transposed,
    reference_kernels,
    tensor_amax,
    tensor_amax_reference,
    use_reference,
)
from fp8_kernels.cpu.fused import fused_cpu_available
from fp8_trainer.scaling import current_scale
from tests.kernels.exact_checks import same_row


@pytest.mark.parametrize(
    ("capability", "fp8"), [((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True), ((7, 5), False)]
)
def test_fp8_gpu_is_compute_capability_8_9_and_later(monkeypatch, capability, fp8):
    # the one place that decides real FP8 GEMMs and the Triton kernels (its capability read is patched here)
    from fp8_kernels import device
    from fp8_trainer.gemm import uses_scaled_mm

    monkeypatch.setattr(device, "_capability", lambda index: capability if index == 1 else (0, 0))
    assert fp8_kernels.fp8_gpu(torch.device("cuda", 1)) is fp8
    assert uses_scaled_mm(torch.device("cuda", 1)) is (fp8 and hasattr(torch, "_scaled_mm"))
    assert not fp8_kernels.fp8_gpu(torch.device("cpu")) and not uses_scaled_mm(torch.device("cpu"))


def test_import_needs_no_triton():
    code = (
        "import sys\n"
        "import fp8_kernels\n"
        "assert 'triton' not in sys.modules, 'importing fp8_kernels imported triton'\n"
        "sys.modules['triton'] = None  # as if it were not installed\n"
        "import torch\n"
        "assert not fp8_kernels.triton_available()\n"
        "q, row = fp8_kernels.quantize_with_stats(torch.tensor([1.0, 500.0]), torch.tensor(1.0), "
        "torch.float8_e4m3fn)\n"
        "assert row.tolist()[:6] == [500.0, 1.0, 1, 0, 0, 2] and len(row) == 10, row\n"
        "assert fp8_kernels.fused_scale_update('cuda') is None\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def _counting(calls, name, fn):
    def wrapper(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return wrapper


def test_reference_switch_bypasses_registered_kernels():
    calls = []
    fp8_kernels.register(
        "cpu",
        quantize=_counting(calls, "quantize", quantize_with_stats_reference),
        amax=_counting(calls, "amax", fp8_kernels.tensor_amax_reference),
        histogram=_counting(calls, "histogram", exponent_histogram_reference),
        scale_update=_counting(calls, "scale_update", lambda *a, **k: None),
    )
    x, s = torch.tensor([1.0, -3.0]), torch.tensor(1.0)
    try:
        quantize_with_stats(x, s, torch.float8_e4m3fn)
        tensor_amax(x)
        exponent_histogram(x)
        assert fused_scale_update("cpu") is not None
        assert calls == ["quantize", "amax", "histogram"]
        with reference_kernels():
            quantize_with_stats(x, s, torch.float8_e4m3fn)
            tensor_amax(x)
            exponent_histogram(x)
            assert fused_scale_update("cpu") is None
            assert use_reference(True) is True  # nested: the switch reports its state
        assert calls == ["quantize", "amax", "histogram"]
        assert use_reference(False) is False  # the context manager restored it
        quantize_with_stats(x, s, torch.float8_e4m3fn)
        assert calls[-1] == "quantize"
    finally:
        use_reference(False)
        fp8_kernels.register("cpu")
    assert fused_scale_update("cpu") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the dispatch of a machine without CUDA")
def test_no_cuda_registration_without_a_gpu():
    assert fused_scale_update("cuda") is None
    assert fused_scale_update(torch.device("cpu")) is None


def test_transposed_reference_fallback():
    x = torch.randn(5, 3) * 100
    q, qt, row = quantize_with_stats_transposed(x, torch.tensor(2.0), torch.float8_e5m2)
    q_ref, row_ref = quantize_with_stats_reference(x, torch.tensor(2.0), torch.float8_e5m2)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), q_ref.t().contiguous().view(torch.uint8)) and qt.is_contiguous()
    # the quantize entry's row (the fused CPU kernel where it builds: the reference's within same_row's bound)
    assert torch.equal(row, quantize_with_stats(x, torch.tensor(2.0), torch.float8_e5m2)[1])
    same_row(row, row_ref, "transposed entry's row")
    with pytest.raises(ValueError, match="2-D"):
        quantize_with_stats_transposed(torch.ones(4), torch.tensor(1.0), torch.float8_e5m2)


def test_empty_tensor_statistics():
    for shape in [(0,), (0, 7)]:
        q, row = quantize_with_stats(torch.empty(shape), torch.tensor(4.0), torch.float8_e4m3fn)
        assert q.shape == shape and q.dtype == torch.float8_e4m3fn
        assert row.tolist() == [0.0, 4.0, 0, 0, 0, 0, 0, 0, 0, float("inf")]  # min_abs: none
        assert tensor_amax(torch.empty(shape)).item() == 0.0
        assert tensor_amax(torch.full((3,) + shape[1:], float("nan"))).item() == 0.0
        assert int(exponent_histogram(torch.empty(shape)).sum()) == 0
    stats = torch.tensor([2.5, 1.0, 1, 2, 3, 9], dtype=torch.float64)
    quantize_with_stats(torch.empty(0), torch.tensor(4.0), torch.float8_e4m3fn, stats)
    assert stats.tolist() == [2.5, 1.0, 1, 2, 3, 9]  # an empty micro-batch adds nothing, not even its scale


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_current_scaling_reference_is_the_torch_ops_it_replaces(fp8):
    # the CPU path of FP8State before current scaling had its own entry: amax, current_scale, quantize
    g = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(33, 17, generator=g) * torch.logspace(-30, 30, 17),
        torch.randn(64, generator=g).to(torch.bfloat16) * 1e-3,
        torch.tensor([1e-42, -3e-41]),  # FP8_MAX / amax overflows: clamped to the float32 maximum
        torch.zeros(5),  # zero amax: scale 1
        torch.tensor([1.0, float("nan"), 3.0]),  # NaN ignored by the amax: scale FP8_MAX / 3
        torch.tensor([float("nan")] * 3),  # all NaN: amax 0, scale 1
        torch.tensor([float("inf"), -2.0]),  # Inf amax: scale 1
        torch.empty(0, 3),
    ]
    for x, pow2 in [(x, pow2) for x in inputs for pow2 in (False, True)]:
        amax = tensor_amax_reference(x)
        scale_before = current_scale(amax, torch.tensor(torch.finfo(fp8).max), power_2_scale=pow2)
        stats, stats_before = torch.ones(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
        q_before, _ = quantize_with_stats_reference(x, scale_before, fp8, stats_before, amax=amax)
        q, scale, row = quantize_current(x, fp8, stats, power_2_scale=pow2)
        assert row is stats and _same(stats, stats_before), (x, stats, stats_before)
        assert scale.dtype == torch.float32 and torch.equal(scale, scale_before)
        assert torch.equal(q.view(torch.uint8), q_before.view(torch.uint8))
        if x.dim() == 2:
            q2, qt, scale_t, row_t = quantize_current_transposed(x, fp8, power_2_scale=pow2)
            assert qt.is_contiguous()
            assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
            assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale_t, scale)
            assert _same(row_t, quantize_current(x, fp8, power_2_scale=pow2)[2])
    # the NaN element no longer decides the tensor's scale; power_2_scale rounds it down (448/3 -> 128)
    fmax = torch.tensor(torch.finfo(fp8).max)
    assert quantize_current(inputs[4], fp8)[1].item() == (fmax / torch.tensor(3.0)).item()
    pow2_scale = quantize_current(inputs[4], fp8, power_2_scale=True)[1].item()
    assert pow2_scale == {torch.float8_e4m3fn: 128.0, torch.float8_e5m2: 16384.0}[fp8]
    with pytest.raises(ValueError, match="2-D"):
        quantize_current_transposed(torch.ones(4), fp8)


def test_current_scaling_dispatch_and_switch():
    calls = []

    def current(x, fp8_dtype, stats=None, *, power_2_scale=False, return_scale_inv=False):
        calls.append(("current", power_2_scale))
        return fp8_kernels.quantize_current_reference(
            x, fp8_dtype, stats, power_2_scale=power_2_scale, return_scale_inv=return_scale_inv
        )

    builtin = fused_cpu_available()  # the fused C kernel, where it builds, is the CPU's built-in entry
    assert has_kernel("current", "cpu") == builtin and not has_kernel("current_transposed", "cpu")
    fp8_kernels.register("cpu", current=current)
    try:
        assert has_kernel("current", "cpu") and not has_kernel("current_transposed", "cpu")
        x = torch.randn(6, 4)
        quantize_current(x, torch.float8_e4m3fn)
        # no transposed kernel: the entry (the keyword passed on), then q.t()
        quantize_current_transposed(x, torch.float8_e4m3fn, power_2_scale=True)
        assert calls == [("current", False), ("current", True)]
        with reference_kernels():
            assert not has_kernel("current", "cpu")
            quantize_current(x, torch.float8_e4m3fn)
        assert len(calls) == 2
    finally:
        fp8_kernels.register("cpu")
    assert has_kernel("current", "cpu") == builtin  # register(device) restores the built-in entry
    with pytest.raises(ValueError, match="unknown kernel op"):
        has_kernel("transpose", "cpu")


def test_persistent_grid_bounds_the_blocks_of_a_program():
    # the quantize kernels pack a program's per-element counts in 10-bit fields: no program may walk more
    # than MAX_BLOCKS_PER_PROGRAM blocks, however large the tensor or small the GPU
    pytest.importorskip("triton")
    from fp8_kernels.triton.launch import MAX_BLOCKS_PER_PROGRAM, grid_cap, persistent_grid

    assert MAX_BLOCKS_PER_PROGRAM < 2**10
    cpu = torch.device("cpu")
    for n_blocks in [0, 1, 2, 3, 4, 1023 * 3, 1023 * 3 + 1, 10**6, (2**31 - 2**24) // 1024 + 1]:
        g = persistent_grid(n_blocks, cpu)
        assert 1 <= g <= max(1, n_blocks) and -(-n_blocks // g) <= MAX_BLOCKS_PER_PROGRAM, (n_blocks, g)
        assert g == max(1, min(n_blocks, grid_cap(cpu))) or n_blocks > grid_cap(cpu) * MAX_BLOCKS_PER_PROGRAM


@pytest.mark.parametrize("kernels", ["builtin", "reference"])
def test_current_scaling_returns_scale_inv_when_asked(kernels):
    # the GEMM path asks every current kernel for scale_inv too: torch.reciprocal's bits, 16-byte aligned,
    # and nothing else changes (the CPU's built-in entry, then the references; the transposed call falls
    # back to the 1-D entry and q.t() here)
    x = torch.randn(24, 16) * torch.logspace(-2, 2, 16)
    fp8 = torch.float8_e4m3fn
    ctx = reference_kernels() if kernels == "reference" else contextlib.nullcontext()
    with ctx:
        q, scale, row = quantize_current(x, fp8, power_2_scale=True)
        q1, scale1, scale_inv1, row1 = quantize_current(x, fp8, power_2_scale=True, return_scale_inv=True)
        q2, qt2, scale2, scale_inv2, row2 = quantize_current_transposed(x, fp8, return_scale_inv=True)
    assert torch.equal(q1.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale1, scale)
    same_row(row1, row, "statistics row with scale_inv asked")
    assert torch.equal(scale_inv1, torch.reciprocal(scale)) and scale_inv1.dtype == torch.float32
    assert torch.equal(scale2, current_scale(x.abs().amax(), 448.0)) and scale2 != scale  # no pow2 here
    assert torch.equal(scale_inv2, torch.reciprocal(scale2))
    assert torch.equal(qt2.view(torch.uint8), q2.t().contiguous().view(torch.uint8))
    for s in (scale_inv1, scale_inv2):
        assert s.dim() == 0 and s.data_ptr() % 16 == 0


@pytest.mark.parametrize("kernels", ["builtin", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_dbias_is_the_column_sums_appended_to_every_quantize_entry(kernels, dtype):
    # the bias gradient of grad_output, from the quantize call: x.sum(0) accumulated in float32, in x's
    # dtype, as one more element of the result; q, qt, scale and the row are those of the call without it
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(37, 19, generator=g) * torch.logspace(-3, 3, 19)).to(dtype)
    x[3, 2], x[5, 4], x[6, 4] = float("nan"), float("inf"), float("-inf")  # propagate as in a sum
    expected = x.float().sum(0).to(dtype)
    fp8, scale = torch.float8_e5m2, torch.tensor(2.0)
    ctx = reference_kernels() if kernels == "reference" else contextlib.nullcontext()
    with ctx:
        plain = [
            quantize_with_stats(x, scale, fp8),
            quantize_with_stats_transposed(x, scale, fp8),
            quantize_current(x, fp8, return_scale_inv=True),
            quantize_current_transposed(x, fp8),
        ]
        with_dbias = [
            quantize_with_stats(x, scale, fp8, dbias=True),
            quantize_with_stats_transposed(x, scale, fp8, dbias=True),
            quantize_current(x, fp8, return_scale_inv=True, dbias=True),
            quantize_current_transposed(x, fp8, dbias=True),
        ]
    for before, after in zip(plain, with_dbias, strict=True):
        assert len(after) == len(before) + 1
        *rest, dbias = after
        assert dbias.dtype == dtype and dbias.shape == (19,)
        assert _same(dbias, expected), (dbias, expected)
        assert torch.isnan(dbias[2]) and torch.isnan(dbias[4]) and torch.isfinite(dbias[0])
        for a, b in zip(rest, before, strict=True):
            a, b = (a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == fp8 else (a, b)
            assert _same(a, b)


@pytest.mark.parametrize("kernels", ["builtin", "reference"])
def test_dbias_needs_a_2d_tensor(kernels):
    fp8, scale = torch.float8_e4m3fn, torch.tensor(1.0)
    for x in (torch.ones(4), torch.ones(2, 3, 4)):
        for call in (
            lambda x=x: quantize_with_stats(x, scale, fp8, dbias=True),
            lambda x=x: quantize_with_stats_transposed(x, scale, fp8, dbias=True),
            lambda x=x: quantize_current(x, fp8, dbias=True),
            lambda x=x: quantize_current_transposed(x, fp8, dbias=True),
        ):
            ctx = reference_kernels() if kernels == "reference" else contextlib.nullcontext()
            with ctx, pytest.raises(ValueError, match=re.escape(f"got shape {tuple(x.shape)}")):
                call()


@pytest.mark.parametrize("cap", [3, 528])  # the interpreter's grid cap; an H200's 4 programs x 132 SMs
def test_grid_2d_bounds_the_tiles_of_a_program(monkeypatch, cap):
    # the tiled kernel's programs form a PM x PN grid (tile columns pn, pn + PN, ...; rows pm, pm + PM, ...):
    # no program may take more than MAX_BLOCKS_PER_PROGRAM tiles (its packed 8-bit counts), for any shape
    pytest.importorskip("triton")
    from fp8_kernels.triton import launch as triton_launch

    monkeypatch.setattr(triton_launch, "grid_cap", lambda device: cap)
    cpu = torch.device("cpu")
    for tiles_m, tiles_n in [(0, 1), (1, 1), (2, 1), (1, 786), (128, 64), (128, 786), (4000, 1), (1, 20000)]:
        pm, pn = triton_launch.grid_2d(tiles_m, tiles_n, cpu)
        per_program = -(-max(tiles_m, 1) // pm) * -(-tiles_n // pn)
        assert pm >= 1 and pn >= 1 and per_program <= triton_launch.MAX_BLOCKS_PER_PROGRAM, (tiles_m, tiles_n)
        assert pn <= max(tiles_n, 1) and pm <= max(tiles_m, 1)
        if tiles_m * tiles_n >= cap:  # enough tiles: about the grid cap, no fewer programs than it allows
            assert pm * pn >= min(cap, tiles_m * tiles_n) // 2, (tiles_m, tiles_n, pm, pn)
