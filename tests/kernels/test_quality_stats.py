"""Quality statistics (sum_sq, err_sq, subnormal, min_abs) of the quantize pass: the reference and the
Triton kernels (under TRITON_INTERPRET=1, in a subprocess) against a first-principles float64 computation
(``quality_reference.py``) on hand-built tensors, and the SQNR numbers of issue 17."""

import math

import pytest
import torch

from fp8_kernels import new_stats, quantize_current_reference, quantize_with_stats_reference
from fp8_protocol.stats import (
    ERR_SQ,
    MIN_ABS,
    NONFINITE,
    NUMEL,
    STAT_COLUMNS,
    SUBNORMAL,
    SUM_SQ,
    UNDERFLOW,
    sqnr_db,
    subnormal_fraction,
)
from tests.kernels.quality_reference import quality_first_principles

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN, INF = float("nan"), float("inf")
# the reference's squares are float32 (each within 2**-24 of the exact square of the same float32 value) and
# its differences q - |x*scale| exact in float32 but where saturation rounds them: within 2**-23 relative
RTOL = 2.0**-22


def _cases() -> dict[str, tuple[torch.Tensor, float]]:
    g = torch.Generator().manual_seed(17)
    bulk = torch.randn(3001, generator=g)
    spiky = bulk.clone()
    spiky[5] = 3e4  # one huge value: saturates at scale 1
    mixed = torch.randn(33, 31, generator=g) * torch.logspace(-7, 4, 31)  # odd shape, 11 decades
    mixed[0, :5] = torch.tensor([NAN, INF, -INF, 0.0, -0.0])
    return {
        "zeros": (torch.zeros(1025), 3.0),
        "one-huge-value": (spiky, 1.0),
        "nonfinite": (torch.tensor([1.5, NAN, -2.25, INF, -INF, 0.0, 1e-3]), 2.0),
        "all-nonfinite": (torch.tensor([NAN, INF, -INF]), 1.0),
        "subnormal-heavy": (bulk, 448.0 / 1e5),
        "mixed-decades": (mixed, 7.0),
        "bf16": (torch.randn(1000, generator=g).to(torch.bfloat16), 100.0),
    }


def _check(row: torch.Tensor, x: torch.Tensor, scale: float, fp8: torch.dtype, rtol: float) -> None:
    exp = quality_first_principles(x, scale, fp8)
    assert row.shape == (len(STAT_COLUMNS),)
    for col, name in ((SUM_SQ, "sum_sq"), (ERR_SQ, "err_sq")):
        assert math.isclose(row[col].item(), exp[name], rel_tol=rtol, abs_tol=0.0), (name, row.tolist(), exp)
    assert row[SUBNORMAL].item() == exp["subnormal"], (row.tolist(), exp)
    assert row[MIN_ABS].item() == exp["min_abs"], (row.tolist(), exp)


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name", list(_cases()))
def test_reference_matches_first_principles(name, fp8):
    x, scale = _cases()[name]
    _, row = quantize_with_stats_reference(x, torch.tensor(scale), fp8)
    _check(row, x, scale, fp8, RTOL)
    exp = quality_first_principles(x, scale, fp8)
    # the scaled-domain sum is Σx² up to the float32 rounding of each product
    assert math.isclose(row[SUM_SQ].item(), exp["sum_sq_exact"], rel_tol=2.0**-21) or exp["sum_sq_exact"] == 0


def test_edge_cases_by_hand():
    _, row = quantize_with_stats_reference(torch.zeros(10), torch.tensor(1.0), E4M3)
    assert row[SUM_SQ:].tolist() == [0.0, 0.0, 0.0, INF]  # no non-zero value: min_abs +inf
    assert sqnr_db(row[SUM_SQ].item(), row[ERR_SQ].item()) == math.inf  # all zero: nothing lost
    # exact values: no error, SQNR +inf
    _, row = quantize_with_stats_reference(torch.tensor([1.0, -2.0, 0.5, 448.0]), torch.tensor(1.0), E4M3)
    assert row[SUM_SQ:].tolist() == [1 + 4 + 0.25 + 448.0**2, 0.0, 0.0, 0.5]
    assert sqnr_db(row[SUM_SQ].item(), row[ERR_SQ].item()) == INF
    # NaN/Inf excluded from the sums and the min; counted as non-finite
    _, row = quantize_with_stats_reference(torch.tensor([NAN, INF, -INF, 3.0]), torch.tensor(1.0), E4M3)
    assert row[NONFINITE].item() == 3 and row[SUM_SQ].item() == 9.0 and row[ERR_SQ].item() == 0.0
    assert row[MIN_ABS].item() == 3.0
    # no finite element: sums of zero that measured nothing, so no SQNR (not the +inf of an exact trip),
    # where an all-zero tensor, measured and exact, keeps its +inf
    _, row = quantize_with_stats_reference(torch.tensor([NAN, INF, -INF]), torch.tensor(1.0), E4M3)
    args = [row[c].item() for c in (SUM_SQ, ERR_SQ, NUMEL, NONFINITE)]
    assert args[:2] == [0.0, 0.0] and math.isnan(sqnr_db(*args)) and sqnr_db(*args[:2]) == INF
    _, row = quantize_with_stats_reference(torch.zeros(3), torch.tensor(1.0), E4M3)
    assert sqnr_db(*[row[c].item() for c in (SUM_SQ, ERR_SQ, NUMEL, NONFINITE)]) == INF
    # saturation is error: 500 -> 448
    _, row = quantize_with_stats_reference(torch.tensor([500.0]), torch.tensor(1.0), E4M3)
    assert row[ERR_SQ].item() == 52.0**2
    # underflow is error: 2**-11 -> 0 in E4M3; 2**-9 survives as the smallest subnormal
    _, row = quantize_with_stats_reference(torch.tensor([2.0**-11, 2.0**-9]), torch.tensor(1.0), E4M3)
    assert row[UNDERFLOW].item() == 1 and row[SUBNORMAL].item() == 1 and row[ERR_SQ].item() == 2.0**-22
    # just below the smallest normal: the midpoint rounds up to it (even), so it is not a subnormal
    mid = 2.0**-6 - 2.0**-10
    _, row = quantize_with_stats_reference(torch.tensor([mid, mid - 2.0**-20]), torch.tensor(1.0), E4M3)
    assert row[SUBNORMAL].item() == 1


def test_issue_17_outlier_numbers():
    # a bulk of unit RMS quantized with the scale an outlier 1e5 x the RMS sets (delayed scaling after the
    # spike): 17% underflow, 83% subnormal, SQNR 18 dB; the same bulk well scaled: 31 dB
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g, dtype=torch.float64)
    x = (x / x.square().mean().sqrt()).float()
    _, bad = quantize_with_stats_reference(x, torch.tensor(448.0 / 1e5), E4M3)
    _, good = quantize_with_stats_reference(x, torch.tensor(448.0) / x.abs().max(), E4M3)
    assert bad[UNDERFLOW].item() / bad[NUMEL].item() == pytest.approx(0.17, abs=0.01)
    assert subnormal_fraction(bad[SUBNORMAL].item(), bad[NUMEL].item()) == pytest.approx(0.83, abs=0.01)
    assert sqnr_db(bad[SUM_SQ].item(), bad[ERR_SQ].item()) == pytest.approx(18.0, abs=0.5)
    assert sqnr_db(good[SUM_SQ].item(), good[ERR_SQ].item()) == pytest.approx(31.0, abs=1.0)
    assert good[SUBNORMAL].item() < 100  # well scaled: hardly any subnormal


def test_accumulation_merges_per_column():
    a, b = torch.tensor([0.25, -3.0, 100.0]), torch.tensor([0.125, 2.0])
    row = new_stats()
    quantize_with_stats_reference(a, torch.tensor(2.0), E4M3, row)
    quantize_with_stats_reference(b, torch.tensor(2.0), E4M3, row)
    _, ra = quantize_with_stats_reference(a, torch.tensor(2.0), E4M3)
    _, rb = quantize_with_stats_reference(b, torch.tensor(2.0), E4M3)
    assert row[SUM_SQ:MIN_ABS].tolist() == (ra[SUM_SQ:MIN_ABS] + rb[SUM_SQ:MIN_ABS]).tolist()
    assert row[MIN_ABS].item() == 0.125  # min, not sum
    # a micro-batch with no non-zero value leaves min_abs alone
    quantize_with_stats_reference(torch.zeros(4), torch.tensor(2.0), E4M3, row)
    assert row[MIN_ABS].item() == 0.125


def test_base_row_skips_quality_and_current_scaling_has_it():
    x = torch.randn(100)
    row6 = torch.zeros(6, dtype=torch.float64)
    quantize_with_stats_reference(x, torch.tensor(4.0), E4M3, row6)
    _, row10 = quantize_with_stats_reference(x, torch.tensor(4.0), E4M3)
    assert row6.tolist() == row10[:6].tolist()
    with pytest.raises(ValueError, match="row"):
        quantize_with_stats_reference(x, torch.tensor(4.0), E4M3, torch.zeros(8, dtype=torch.float64))
    q, scale, row = quantize_current_reference(x, E5M2)
    _check(row, x, scale.item(), E5M2, RTOL)
