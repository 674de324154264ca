"""fp8_kernels quantize-with-statistics reference: saturation, bits, counts, accumulation."""

import fp8_kernels
import pytest
import torch
from fp8_kernels import STAT_COLUMNS, dequantize, quantize_with_stats, quantize_with_stats_reference

FORMATS = [
    # dtype, max, min subnormal
    (torch.float8_e4m3fn, 448.0, 2.0**-9),
    (torch.float8_e5m2, 57344.0, 2.0**-16),
]
NAN, INF = float("nan"), float("inf")


def reference_counts(x: torch.Tensor, scale: float, dtype: torch.dtype, fmax: float):
    """Element-by-element Python reference of the statistics row, from the definitions in DESIGN.md."""
    q = (x.double() * scale).clamp(-fmax, fmax).float().to(dtype)  # only used for underflow (value == 0)
    amax, ovf, unf, nonfin = 0.0, 0, 0, 0
    for v, qv in zip(x.tolist(), q.float().tolist(), strict=True):
        if v != v:
            amax, nonfin = NAN, nonfin + 1
            continue
        if amax == amax:
            amax = max(amax, abs(v))
        if abs(v) == INF:
            nonfin += 1
            continue
        xs = torch.tensor(v, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)
        ovf += int(abs(xs.item()) > fmax)
        unf += int(v != 0 and qv == 0)
    return amax, ovf, unf, nonfin


@pytest.mark.parametrize("dtype,fmax,min_sub", FORMATS)
def test_saturation_never_nan(dtype, fmax, min_sub):
    x = torch.tensor([fmax, fmax * 1.01, 1e30, -1e30, 3.0e38, -3.0e38, INF, -INF])
    q, row = quantize_with_stats(x, torch.tensor(1.0), dtype)
    assert q.dtype == dtype
    assert q.float().tolist() == [fmax, fmax, fmax, -fmax, fmax, -fmax, fmax, -fmax]
    assert row[2].item() == 5  # 1.01*max, +-1e30, +-3e38 saturated; max itself is representable
    assert row[4].item() == 2  # +-inf


@pytest.mark.parametrize("dtype,fmax,min_sub", FORMATS)
def test_large_scale_overflow_to_inf_counts_as_overflow(dtype, fmax, min_sub):
    # finite x whose float32 product overflows to inf: saturated, an overflow, not a non-finite element
    scale = torch.tensor(torch.finfo(torch.float32).max)
    q, row = quantize_with_stats(torch.tensor([2.0, -2.0, 0.0]), scale, dtype)
    assert q.float().tolist() == [fmax, -fmax, 0.0]
    assert row.tolist()[2:] == [2, 0, 0, 3]


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
    assert torch.isnan(row[0])  # NaN propagates into amax (the scale update then keeps the old scale)
    assert torch.isnan(q.float()[1]) and q.float()[0].item() == 2.0
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
    assert torch.isnan(row[0]) and amax != amax
    assert row[1].item() == scale
    assert row[2:].tolist() == [ovf, unf, nonfin, x.numel()]
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
    assert torch.isnan(stats[0])
    assert stats[1:].tolist() == [2.0, 1, 1, 1, 5]
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
