"""fp8_kernels quantize-with-statistics reference: saturation, bits, counts, accumulation."""

import pytest
import torch

import fp8_kernels
from fp8_kernels import STAT_COLUMNS, dequantize, quantize_with_stats, quantize_with_stats_reference
from fp8_kernels.reference.quantize import overflow_threshold

FORMATS = [
    # dtype, max, min subnormal
    (torch.float8_e4m3fn, 448.0, 2.0**-9),
    (torch.float8_e5m2, 57344.0, 2.0**-16),
]
#: where a float32 value saturates in the cast (docs/fp8-semantics.md, "Known traps"): above 464 for E4M3
#: (464 ties to even: 448), at or above 61440 for E5M2 (61440 ties to even: 65536 = Inf)
SATURATES = {torch.float8_e4m3fn: lambda a: a > 464.0, torch.float8_e5m2: lambda a: a >= 61440.0}
NAN, INF = float("nan"), float("inf")


def reference_counts(x: torch.Tensor, scale: float, dtype: torch.dtype, fmax: float):
    """Element-by-element Python reference of the statistics row, from the definitions in
    docs/fp8-semantics.md: NaN elements ignored by the amax (counted as non-finite), overflow where the cast
    really saturated."""
    q = (x.double() * scale).clamp(-fmax, fmax).float().to(dtype)  # only used for underflow (value == 0)
    amax, ovf, unf, nonfin = 0.0, 0, 0, 0
    for v, qv in zip(x.tolist(), q.float().tolist(), strict=True):
        if v != v:
            nonfin += 1
            continue
        amax = max(amax, abs(v))
        if abs(v) == INF:
            nonfin += 1
            continue
        xs = torch.tensor(v, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)
        ovf += int(SATURATES[dtype](abs(xs.item())))
        unf += int(v != 0 and qv == 0)
    return amax, ovf, unf, nonfin


def test_overflow_threshold_from_the_format():
    assert overflow_threshold(torch.float8_e4m3fn) == (464.0, False)
    assert overflow_threshold(torch.float8_e5m2) == (61440.0, True)
    # E5M2 has Inf, so PyTorch's own cast shows where rounding leaves the finite range
    below, at = torch.tensor([61439.99609375, 61440.0]).to(torch.float8_e5m2).float().tolist()
    assert below == 57344.0 and at == INF


@pytest.mark.parametrize("dtype,fmax,min_sub", FORMATS)
def test_overflow_counts_only_real_saturation(dtype, fmax, min_sub):
    threshold, inclusive = overflow_threshold(dtype)
    up = torch.nextafter(torch.tensor(threshold), torch.tensor(INF)).item()
    down = torch.nextafter(torch.tensor(threshold), torch.tensor(0.0)).item()
    x = torch.tensor([fmax, -fmax * 1.01, down, threshold, -threshold, up, -up])
    _, row = quantize_with_stats(x, torch.tensor(1.0), dtype)
    # fmax*1.01 and just below the threshold round to FP8_MAX: no overflow; the threshold itself only
    # where its tie goes up (E5M2)
    assert row[2].item() == (4 if inclusive else 2)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_delayed_scale_of_a_frozen_weight_reports_no_overflow(dtype):
    # a weight that does not change: its scale is FP8_MAX / amax in float32, and for about one amax in
    # eleven amax * scale lands a float32 ulp above FP8_MAX. The cast rounds that to FP8_MAX, so nothing
    # saturated; the old "> FP8_MAX" rule reported an overflow every step
    fmax = torch.tensor(float(torch.finfo(dtype).max))
    amaxes = torch.linspace(1.0, 2.0, 4097)[1:]
    hits = amaxes[amaxes * (fmax / amaxes) > fmax]
    assert hits.numel() > 100
    for amax in hits[:: hits.numel() // 10]:
        w = torch.linspace(-1.0, 1.0, 513) * amax  # max |w| is amax
        scale = fmax / amax
        assert w.abs().max() == amax and (amax * scale).item() > fmax.item()
        _, row = quantize_with_stats(w, scale, dtype)
        assert row[0].item() == amax.item() and row[2].item() == 0, row.tolist()


@pytest.mark.parametrize("dtype,fmax,min_sub", FORMATS)
def test_saturation_never_nan(dtype, fmax, min_sub):
    x = torch.tensor([fmax, fmax * 1.01, 1e30, -1e30, 3.0e38, -3.0e38, INF, -INF, fmax * 1.2])
    q, row = quantize_with_stats(x, torch.tensor(1.0), dtype)
    assert q.dtype == dtype
    assert q.float().tolist() == [fmax, fmax, fmax, -fmax, fmax, -fmax, fmax, -fmax, fmax]
    # +-1e30, +-3e38, 1.2*max saturated; max itself is representable and 1.01*max rounds to it anyway
    assert row[2].item() == 5
    assert row[4].item() == 2  # +-inf


@pytest.mark.parametrize("dtype,fmax,min_sub", FORMATS)
def test_large_scale_overflow_to_inf_counts_as_overflow(dtype, fmax, min_sub):
    # finite x whose float32 product overflows to inf: saturated, an overflow, not a non-finite element
    scale = torch.tensor(torch.finfo(torch.float32).max)
    q, row = quantize_with_stats(torch.tensor([2.0, -2.0, 0.0]), scale, dtype)
    assert q.float().tolist() == [fmax, -fmax, 0.0]
    assert row.tolist()[2:6] == [2, 0, 0, 3]


@pytest.mark.parametrize("dtype,fmax,min_sub", FORMATS)
def test_underflow_boundary(dtype, fmax, min_sub):
    half = min_sub / 2
    # exactly half the smallest subnormal ties to even (zero); just above rounds up to min_sub
    x = torch.tensor([half, -half, half * 1.0001, min_sub, 0.0, -0.0, 1e-30])
    q, row = quantize_with_stats(x, torch.tensor(1.0), dtype)
    assert q.float().tolist() == [0.0, 0.0, min_sub, min_sub, 0.0, 0.0, 0.0]
    assert row[3].item() == 3  # +-half and 1e-30; the zeros are not underflows


@pytest.mark.parametrize("dtype,fmax,min_sub", FORMATS)
def test_nonfinite_counting_and_nan_amax(dtype, fmax, min_sub):
    x = torch.tensor([1.0, NAN, -2.0, INF, NAN, -INF])
    q, row = quantize_with_stats(x, torch.tensor(2.0), dtype)
    assert row[4].item() == 4
    assert row[0].item() == INF
    assert torch.isnan(q.float()[1]) and q.float()[0].item() == 2.0
    # NaN elements are ignored by the amax (TE's fmaxf), still counted as non-finite, never as underflow
    q, row = quantize_with_stats(torch.tensor([1.0, NAN, -3.0, NAN]), torch.tensor(2.0), dtype)
    assert row[:6].tolist() == [3.0, 2.0, 0, 0, 2, 4]
    _, row = quantize_with_stats(torch.full((5,), NAN), torch.tensor(2.0), dtype)
    assert row[:6].tolist() == [0.0, 2.0, 0, 0, 5, 5]  # all NaN: amax 0
    q, row = quantize_with_stats(torch.tensor([1.0, -INF]), torch.tensor(1.0), dtype)
    assert row[0].item() == INF


@pytest.mark.parametrize("dtype,fmax,min_sub", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 37.5, 2.0**-7, 1e4])
def test_bits_equal_torch_cast_of_preclamped_value(dtype, fmax, min_sub, scale):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(257, 33, generator=g) * torch.logspace(-8, 5, 33)  # odd shape, 13 decades
    x[0, :4] = torch.tensor([NAN, INF, -INF, 0.0])
    s = torch.tensor(scale)
    q, row = quantize_with_stats(x, s, dtype)
    expected = (x * s).clamp(-fmax, fmax).to(dtype)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    amax, ovf, unf, nonfin = reference_counts(x.flatten(), scale, dtype, fmax)
    assert row[0].item() == amax == INF
    assert row[1].item() == scale
    assert row[2:6].tolist() == [ovf, unf, nonfin, x.numel()]
    assert ovf > 0 or scale < 1  # the grid does exercise saturation at the larger scales
    assert unf > 0


def test_amax_of_unscaled_input_and_dtypes():
    x = torch.tensor([[0.5, -3.25], [2.0, 1.0]], dtype=torch.bfloat16)
    q, row = quantize_with_stats(x, torch.tensor(4.0), torch.float8_e4m3fn)
    assert row[0].item() == 3.25
    assert row.dtype == torch.float64 and row.shape == (len(STAT_COLUMNS),)
    assert dequantize(q, torch.tensor(0.25)).tolist() == [[0.5, -3.25], [2.0, 1.0]]


def test_accumulate_into_stats_row():
    stats = torch.zeros(6, dtype=torch.float64)
    quantize_with_stats(torch.tensor([1.0, 1000.0, 1e-9]), torch.tensor(1.0), torch.float8_e4m3fn, stats)
    quantize_with_stats(torch.tensor([-5.0, NAN]), torch.tensor(2.0), torch.float8_e4m3fn, stats)
    # the NaN micro-batch does not erase the amax, which keeps the scale that scaled it
    assert stats.tolist() == [1000.0, 1.0, 1, 1, 1, 5]
    # a NaN put in the row from outside: the max ignores it (fmax)
    stats = torch.tensor([NAN, 3.0, 0, 0, 0, 0], dtype=torch.float64)
    quantize_with_stats(torch.tensor([-5.0, 2.0]), torch.tensor(1.0), torch.float8_e4m3fn, stats)
    assert stats.tolist() == [5.0, 1.0, 0, 0, 0, 2]


def test_accumulated_amax_keeps_the_scale_that_scaled_it():
    # micro-batches with their own scales (current scaling): the row reports the largest amax beside the
    # scale of the micro-batch it came from, so amax * scale above the rounding threshold means overflow
    stats = torch.zeros(6, dtype=torch.float64)
    for amax, scale in [(1.0, 448.0), (50.0, 8.96), (1.0, 448.0), (50.0, 8.0)]:
        quantize_with_stats(torch.tensor([amax, -0.5]), torch.tensor(scale), torch.float8_e4m3fn, stats)
    assert stats.tolist()[:3] == [50.0, 8.0, 0]  # on a tie the later call's scale (the one it used last)
    stats = torch.zeros(6, dtype=torch.float64)
    quantize_with_stats(torch.tensor([3.0]), torch.tensor(4.0), torch.float8_e4m3fn, stats)
    quantize_with_stats(torch.tensor([NAN, 1.0]), torch.tensor(9.0), torch.float8_e4m3fn, stats)
    assert stats.tolist()[:2] == [3.0, 4.0]
    stats = torch.zeros(6, dtype=torch.float64)
    quantize_with_stats(torch.tensor([3.0]), torch.tensor(1.0), torch.float8_e5m2, stats)
    quantize_with_stats(torch.tensor([-7.0, 2.0]), torch.tensor(1.0), torch.float8_e5m2, stats)
    assert stats.tolist() == [7.0, 1.0, 0, 0, 0, 3]


def test_dispatch_routes_by_device_type():
    calls = []

    def fake(x, scale, dtype, stats=None, *, amax=None):
        calls.append(x.device.type)
        return quantize_with_stats_reference(x, scale, dtype, stats, amax=amax)

    fp8_kernels.register("cpu", quantize=fake)
    try:
        quantize_with_stats(torch.ones(3), torch.tensor(1.0), torch.float8_e4m3fn)
    finally:
        fp8_kernels.register("cpu")
    quantize_with_stats(torch.ones(3), torch.tensor(1.0), torch.float8_e4m3fn)
    assert calls == ["cpu"]
