"""Block-scaled FP8 (fp8_kernels.reference.block_quantize) against a first-principles reference written here.

The reference works one block at a time in Python floats (float64) and numpy float32 scalars where TE computes
in float32: E8M0 as ``clamp(ceil(log2(amax * float32(1/FP8_MAX))) + 127, 0, 254)``, the float32 block scale
as ``FP8_MAX / amax`` (power-of-two: the largest power of two not above it), and the FP8 cast as round to
nearest even on the format's grid with saturation. Comparisons are exact (values and scale bits).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8_kernels.reference.block_quantize import (
    E8M0_NAN,
    BlockQuantized,
    block_scaled_mm,
    block_stats,
    e8m0_from_amax,
    e8m0_to_scale_inv,
    float8_block_quantize,
    mxfp8_quantize,
    quantize_blocks,
)
from fp8_kernels.reference.quantize import quantize_current_reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (max finite, smallest normal exponent, mantissa bits)
FMT = {E4M3: (448.0, -6, 3), E5M2: (57344.0, -14, 2)}
F32 = np.float32


# --- the reference ----------------------------------------------------------------------------------------


def ref_fp8(v: float, fmt: torch.dtype) -> float:
    """Round a float to ``fmt`` (nearest even), saturating finite values and Inf to +-max; NaN stays."""
    fmax, emin, mbits = FMT[fmt]
    if math.isnan(v):
        return math.nan
    if math.isinf(v):
        return math.copysign(fmax, v)
    a = abs(v)
    if a == 0:
        return math.copysign(0.0, v)
    e = max(math.frexp(a)[1] - 1, emin)
    quantum = 2.0 ** (e - mbits)
    r = round(a / quantum) * quantum  # Python's round: half to even; a / quantum is exact
    return math.copysign(min(r, fmax), v)


def ref_amax(block: list[float]) -> float:
    finite_or_inf = [abs(v) for v in block if not math.isnan(v)]
    return max(finite_or_inf, default=0.0)


def ref_e8m0(amax: float, fmt: torch.dtype) -> int:
    v = float(F32(amax) * F32(1.0 / FMT[fmt][0]))
    if math.isnan(v):
        return 255
    if math.isinf(v):
        return 254
    if v == 0:
        return 0
    m, e = math.frexp(v)  # v = m * 2^e, m in [0.5, 1)
    ceil_log2 = e - 1 if m == 0.5 else e
    return min(max(ceil_log2 + 127, 0), 254)


def ref_fp32_scale(amax: float, fmt: torch.dtype, pow2: bool, eps: float, in_max: float) -> float:
    amax = max(amax, eps)
    if amax == 0 or math.isinf(amax):
        return 1.0
    with np.errstate(over="ignore", divide="ignore"):
        s = float(F32(FMT[fmt][0]) / F32(amax))
    if math.isinf(s):
        s = in_max
    if pow2:
        s = 2.0 ** (math.frexp(s)[1] - 1)
    return s


def ref_quantize(x: torch.Tensor, fmt, block, kind, *, pow2=True, eps=0.0):
    """Per block, by loops: (q values float64 array, per-block scale_inv float64 array)."""
    xs = x.to(torch.float64).tolist()
    rows, cols = len(xs), len(xs[0])
    bm, bn = block
    gm, gn = -(-rows // bm), -(-cols // bn)
    q = np.zeros((rows, cols))
    sinv = np.zeros((gm, gn))
    in_max = float(torch.finfo(x.dtype).max)
    for i in range(gm):
        for j in range(gn):
            idx = [
                (r, c)
                for r in range(i * bm, min(rows, i * bm + bm))
                for c in range(j * bn, min(cols, j * bn + bn))
            ]
            amax = ref_amax([xs[r][c] for r, c in idx])
            if kind == "e8m0":
                code = ref_e8m0(amax, fmt)
                mult, sinv[i, j] = 2.0 ** (127 - code), 2.0 ** (code - 127)
            else:
                mult = ref_fp32_scale(amax, fmt, pow2, eps, in_max)
                sinv[i, j] = float(F32(1.0) / F32(mult))
            for r, c in idx:
                with np.errstate(over="ignore", invalid="ignore"):
                    q[r, c] = ref_fp8(float(F32(xs[r][c]) * F32(mult)), fmt)
    return q, sinv


def assert_same(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    g = got.to(torch.float64).numpy()
    ok = (g == want) | (np.isnan(g) & np.isnan(want))
    ok &= np.signbit(g) == np.signbit(want)
    assert ok.all(), f"{what}: {int((~ok).sum())} differ; first {np.argwhere(~ok)[:3].tolist()}"


def check_against_reference(x, fmt, block, kind, *, pow2=True, eps=0.0) -> BlockQuantized:
    got = quantize_blocks(x, fmt, block, kind, power_2_scale=pow2, amax_epsilon=eps)
    q_ref, sinv_ref = ref_quantize(x, fmt, block, kind, pow2=pow2, eps=eps)
    assert_same(got.data, q_ref, "q")
    sinv = e8m0_to_scale_inv(got.scale_inv) if kind == "e8m0" else got.scale_inv
    assert_same(sinv, sinv_ref, "scale_inv")
    return got


# --- hand-built blocks ----------------------------------------------------------------------------------


def hand_built(block_len: int) -> torch.Tensor:
    """One row per case, each ``block_len`` long (float32)."""
    n = block_len
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n, generator=g)
    rows = {
        "zeros": torch.zeros(n),
        "one huge": torch.cat([torch.tensor([3.0e38]), base[1:]]),
        "nan among normals": torch.cat([torch.tensor([math.nan]), base[1:]]),
        "all nan": torch.full((n,), math.nan),
        "inf among normals": torch.cat([torch.tensor([-math.inf]), base[1:]]),
        "subnormal heavy": base * 2.0**-140,  # float32 subnormals
        "tiny normal": base * 2.0**-120,
        "exact power of two amax": torch.cat([torch.tensor([448.0 * 2.0**-3]), base[1:] * 0.01]),
        "one ulp above": torch.cat([torch.tensor([float(np.nextafter(F32(56.0), F32(100)))]), base[1:]]),
        "wide range": base * torch.logspace(-30, 30, n),
        "negative zero": -torch.zeros(n),
    }
    return torch.stack(list(rows.values()))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_mxfp8_hand_built_blocks_rowwise_and_columnwise(fmt):
    x = hand_built(32)
    check_against_reference(x, fmt, (1, 32), "e8m0")
    check_against_reference(x.t().contiguous(), fmt, (32, 1), "e8m0")


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [True, False])
def test_float8_block_hand_built_blocks(fmt, pow2):
    x = hand_built(128)
    check_against_reference(x, fmt, (1, 128), "fp32", pow2=pow2)
    check_against_reference(x.t().contiguous(), fmt, (128, 1), "fp32", pow2=pow2)


def test_hand_built_edge_cases_give_te_scales():
    """The cases named in TE's source, spelled out (E4M3)."""
    x = hand_built(32)
    mx = quantize_blocks(x, E4M3, (1, 32), "e8m0")
    codes = mx.scale_inv.flatten().tolist()
    assert codes[0] == 0  # all-zero block: code 0, i.e. 2^-127 ...
    assert (mx.data[0].to(torch.float32) == 0).all()  # ... and zeros stay zeros
    assert codes[3] == 0  # all NaN: NaN ignored by the amax -> zero amax, not the NaN code
    assert torch.isnan(mx.data[3].to(torch.float32)).all()
    assert codes[4] == 254  # an Inf saturates the exponent; the block's finite values all flush to 0
    assert mx.data[4, 0].to(torch.float32) == -448 and (mx.data[4, 1:].to(torch.float32) == 0).all()
    assert codes[7] == 127 - 3  # amax / 448 exactly 2^-3: no rounding up
    assert codes[8] == 127 - 2  # one float32 ulp above 56 = 448 * 2^-3: up one binade
    assert E8M0_NAN not in codes
    fb = quantize_blocks(hand_built(128), E4M3, (1, 128), "fp32")
    s = fb.scale_inv.flatten().tolist()
    assert s[0] == 1.0 and s[4] == 1.0  # zero and Inf amax: scale 1
    assert s[5] == 2.0**-127  # 448 / amax overflows: float32 max, rounded down to 2^127


def test_e8m0_limits_and_rounding():
    amax = torch.tensor(
        [
            0.0,
            448.0 * 2.0**-127,  # v = 2^-127 exactly: code 0
            # one ulp above: the float32 product is subnormal and rounds back to 2^-127, code 0
            float(np.nextafter(F32(448.0 * 2.0**-127), F32(1))),
            448.0 * 0.75 * 2.0**-126,  # v = 0.75 * 2^-126, a subnormal above 2^-127: code 1
            1e-45,  # smallest float32 subnormal: code 0
            448.0,  # code 127
            float(np.nextafter(F32(448.0), F32(1000))),  # code 128
            float(np.finfo(np.float32).max),  # ~2^119.2: code 247
            math.inf,
            math.nan,
        ],
        dtype=torch.float32,
    )
    got = e8m0_from_amax(amax, E4M3).tolist()
    want = [ref_e8m0(float(a), E4M3) for a in amax.tolist()]
    assert got == want
    assert got == [0, 0, 0, 1, 0, 127, 128, 247, 254, 255]
    # dequantization factors: code 0 is the float32 subnormal 2^-127, 255 is NaN
    s = e8m0_to_scale_inv(torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8))
    assert s[:4].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0**127] and math.isnan(s[4])


def test_e8m0_from_amax_sweep_matches_reference():
    """Every binade of float32 at a few mantissas, for both formats."""
    mant = [1.0, float(np.nextafter(F32(1), F32(2))), 1.5, float(np.nextafter(F32(2), F32(1)))]
    vals = [m * 2.0**e for e in range(-149, 128) for m in mant]
    vals = [v for v in vals if math.isfinite(float(F32(v))) and float(F32(v)) > 0]
    amax = torch.tensor(vals, dtype=torch.float32)
    for fmt in (E4M3, E5M2):
        assert e8m0_from_amax(amax, fmt).tolist() == [ref_e8m0(float(a), fmt) for a in amax.tolist()]


# --- sizes not divisible by the block -------------------------------------------------------------------


@pytest.mark.parametrize("block_scaling_dim", [1, 2])
def test_float8_block_non_divisible_sizes(block_scaling_dim):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(131, 259, generator=g) * torch.logspace(-3, 3, 259)
    x[130, 258] = 1e4  # alone in its partial corner block
    pair = float8_block_quantize(x, E4M3, block_scaling_dim=block_scaling_dim)
    blk = (1, 128) if block_scaling_dim == 1 else (128, 128)
    q_ref, s_ref = ref_quantize(x, E4M3, blk, "fp32")
    assert_same(pair.rowwise.data, q_ref, "rowwise q")
    assert_same(pair.rowwise.scale_inv, s_ref, "rowwise scale_inv")
    assert pair.rowwise.scale_inv.shape == (-(-131 // blk[0]), 3)
    # the column-wise copy is stored transposed (TE's GEMM-ready layout), blocks along the original rows
    q_ref_t, s_ref_t = ref_quantize(
        x.t().contiguous(), E4M3, (1, 128) if block_scaling_dim == 1 else blk, "fp32"
    )
    assert pair.columnwise.data.shape == (259, 131)
    assert_same(pair.columnwise.data, q_ref_t, "columnwise q")
    assert_same(pair.columnwise.scale_inv, s_ref_t, "columnwise scale_inv")


def test_partial_e8m0_blocks_and_mxfp8_refusal():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 70, generator=g)
    check_against_reference(x, E4M3, (1, 32), "e8m0")
    check_against_reference(x, E4M3, (32, 1), "e8m0")
    with pytest.raises(ValueError, match="divisible by 32"):
        mxfp8_quantize(x, E4M3)
    with pytest.raises(ValueError, match="divisible by 32"):
        mxfp8_quantize(torch.zeros(32, 48), E4M3)


def test_mxfp8_copies_and_2d_weights():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-4, 4, 96)
    pair = mxfp8_quantize(x, E4M3)
    assert pair.rowwise.data.shape == pair.columnwise.data.shape == (64, 96)  # not transposed
    assert pair.rowwise.scale_inv.shape == (64, 3) and pair.columnwise.scale_inv.shape == (2, 96)
    assert not torch.equal(pair.rowwise.data.view(torch.uint8), pair.columnwise.data.view(torch.uint8))
    sq = mxfp8_quantize(x, E4M3, two_d=True)
    q_ref, s_ref = ref_quantize(x, E4M3, (32, 32), "e8m0")
    for copy in (sq.rowwise, sq.columnwise):
        assert_same(copy.data, q_ref, "2d q")
        assert_same(copy.dequantize(), q_ref * np.kron(s_ref, np.ones((32, 32))), "2d dequantized")


def test_bfloat16_input_uses_its_own_max_for_an_overflowing_scale():
    x = torch.full((1, 128), 1e-38, dtype=torch.bfloat16)  # 448 / 1e-38 overflows float32
    q = quantize_blocks(x, E4M3, (1, 128), "fp32", power_2_scale=False)
    assert q.scale_inv.item() == float(F32(1) / F32(torch.finfo(torch.bfloat16).max))
    check_against_reference(x, E4M3, (1, 128), "fp32", pow2=False)


def test_amax_epsilon_floors_the_amax():
    x = torch.full((1, 128), 1e-6)
    q = quantize_blocks(x, E4M3, (1, 128), "fp32", power_2_scale=False, amax_epsilon=1e-3)
    assert q.scale_inv.item() == float(F32(1) / (F32(448) / F32(1e-3)))
    check_against_reference(x, E4M3, (1, 128), "fp32", pow2=False, eps=1e-3)


# --- statistics -----------------------------------------------------------------------------------------


def codes_at(q: BlockQuantized, row: int) -> int:
    return int(q.scale_inv[row, 0])


def test_block_stats_on_hand_built_blocks():
    x = hand_built(32)
    q = quantize_blocks(x, E4M3, (1, 32), "e8m0")
    st = block_stats(x, q, E4M3)
    q_ref, _ = ref_quantize(x, E4M3, (1, 32), "e8m0")
    xs = x.double().numpy()
    finite = np.isfinite(xs)
    want_under = (finite & (xs != 0) & (q_ref == 0)).sum(axis=1)
    assert st["underflow"].flatten().tolist() == want_under.tolist()
    assert st["underflow"][4].item() == 31  # the Inf wiped out its block
    # float32-subnormal inputs: the scale stops at E8M0's 2^-127 (code 0) and every element underflows;
    # a block of tiny normals (2^-120) is still within reach of the scale and keeps its values
    assert codes_at(q, 5) == 0 and st["underflow"][5].item() == 32
    assert codes_at(q, 6) == 0 and st["underflow"][6].item() == want_under[0] == 0
    assert st["nonfinite"].flatten().tolist() == (~finite).sum(axis=1).tolist()
    assert st["overflow"].sum().item() == 0  # E8M0 rounds up: a finite block never saturates
    assert st["zero_blocks"].item() == 3  # zeros, all NaN, negative zeros
    assert st["nonfinite_blocks"].item() == 3
    codes = q.scale_inv.flatten().tolist()
    assert st["e8m0_at_min"].item() == codes.count(0) and st["e8m0_at_max"].item() == codes.count(254) == 1
    hist = st["scale_exponent_hist"]
    assert hist.shape == (256,) and hist.sum().item() == len(codes)
    assert all(hist[c].item() == codes.count(c) for c in set(codes))
    wide = [abs(v) for v in xs[9] if v != 0]
    assert st["dynamic_range"][9].item() == float(F32(math.log2(max(wide) / min(wide))))  # float32 storage
    assert st["worst_dynamic_range"].item() == st["dynamic_range"].max().item() > 17.8


@pytest.mark.parametrize(("fmt", "flush_at"), [(E4M3, -137), (torch.float8_e5m2, -144)])
def test_a_subnormal_block_at_code_0_loses_only_values_at_or_below_half_a_subnormal(fmt, flush_at):
    # code 0 scales by 2^127: a float32 subnormal 2^e becomes 2^(e + 127), which flushes to zero at or below
    # half the format's smallest subnormal (E4M3 2^-10: e <= -137; E5M2 2^-17: e <= -144; the half itself
    # rounds to the even zero) and survives above it
    exps = torch.arange(-149, -126)  # every float32 subnormal binade
    x = torch.cat([torch.ldexp(torch.ones(len(exps)), exps), torch.zeros(32 - len(exps))]).reshape(1, 32)
    q = quantize_blocks(x, fmt, (1, 32), "e8m0")
    assert q.scale_inv.flatten().tolist() == [0]  # the amax 2^-127 and below: code 0
    st = block_stats(x, q, fmt)
    lost = int((exps <= flush_at).sum())
    assert st["underflow"].item() == lost and 0 < lost < len(exps)
    assert (q.data.float().flatten()[: len(exps)] != 0).tolist() == (exps > flush_at).tolist()


def test_block_stats_counts_real_saturation_with_float32_scales():
    # non-power-of-two scales: amax * scale can round above 448, still <= 464, so it is no overflow
    x = torch.tensor([[1.0, 3.0, 7.0] + [0.0] * 125])
    q = quantize_blocks(x, E4M3, (1, 128), "fp32", power_2_scale=False)
    assert block_stats(x, q, E4M3)["overflow"].item() == 0
    # an Inf amax leaves scale 1: finite elements above 464 really saturate and are counted
    y = torch.tensor([[math.inf, 1000.0, 465.0, 464.0] + [1.0] * 124])
    qy = quantize_blocks(y, E4M3, (1, 128), "fp32")
    st = block_stats(y, qy, E4M3)
    assert st["overflow"].item() == 2 and st["nonfinite"].item() == 1
    assert st["scale_exponent_hist"][127].item() == 1  # scale_inv 1 is binade [1, 2)


# --- SQNR -----------------------------------------------------------------------------------------------


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return (10 * torch.log10((x**2).sum() / ((x - y) ** 2).sum())).item()


# Round to nearest with m mantissa bits, on values spread log-uniformly within a binade, leaves a relative
# error of mean square 2^(-2m) / 12 * E[1/f^2] (f in [1, 2) log-uniform: E = 3 / (8 ln 2)): 31.5 dB for
# E4M3 (m=3), 25.5 dB for E5M2. Block scales keep every Gaussian block in the normal range, so the SQNR
# sits at that figure; the floor allows 0.5 dB, the ceiling proves the values really went through FP8.
@pytest.mark.parametrize(("fmt", "floor", "ceiling"), [(E4M3, 31.0, 32.0), (E5M2, 25.0, 26.0)])
def test_sqnr_on_gaussian(fmt, floor, ceiling):
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(4))
    copies = {
        "mxfp8 rowwise": mxfp8_quantize(x, fmt).rowwise,
        "mxfp8 columnwise": mxfp8_quantize(x, fmt).columnwise,
        "block 1x128": float8_block_quantize(x, fmt, block_scaling_dim=1).rowwise,
        "block 128x128": float8_block_quantize(x, fmt, block_scaling_dim=2).rowwise,
    }
    for name, q in copies.items():
        assert floor <= sqnr_db(x, q.dequantize()) <= ceiling, name


def test_block_scaling_beats_per_tensor_on_row_outliers():
    """Rows spread over 12 decades (per-token magnitudes): one per-tensor scale sends the small rows into
    E4M3's subnormals and to zero; per-block scales follow each row. Worst-row SQNR: per tensor ~0 dB."""
    x = (
        torch.randn(128, 256, generator=torch.Generator().manual_seed(5))
        * torch.logspace(-6, 6, 128)[:, None]
    )

    def worst_row(y: torch.Tensor) -> float:
        return min(sqnr_db(x[i], y[i]) for i in range(x.shape[0]))

    q, scale, _ = quantize_current_reference(x, E4M3)
    per_tensor = worst_row(q.to(torch.float32) / scale)
    mx = worst_row(mxfp8_quantize(x, E4M3).rowwise.dequantize())
    blk = worst_row(float8_block_quantize(x, E4M3, block_scaling_dim=1).rowwise.dequantize())
    assert per_tensor < 1.0
    assert mx >= 29.0 and blk >= 29.0


# --- GEMM -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["mxfp8", "block"])
def test_block_scaled_mm_within_float32_bound(recipe):
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(64, 256, generator=g), torch.randn(96, 256, generator=g) * 0.02
    if recipe == "mxfp8":
        qx, qw = mxfp8_quantize(x, E4M3).rowwise, mxfp8_quantize(w, E4M3).rowwise
    else:
        qx = float8_block_quantize(x, E4M3, block_scaling_dim=1).rowwise
        qw = float8_block_quantize(w, E4M3, block_scaling_dim=2).rowwise
    exact = qx.dequantize().double() @ qw.dequantize().double().t()
    k, u = x.shape[1], 2.0**-24
    bound = (k * u / (1 - k * u)) * (qx.dequantize().double().abs() @ qw.dequantize().double().abs().t())
    for mode in ("dequantize", "blockwise"):
        y = block_scaled_mm(qx, qw, accumulate=mode)
        assert y.dtype == torch.float32 and y.shape == (64, 96)
        assert ((y.double() - exact).abs() <= bound).all(), mode
    # and the product really is an FP8 one: close to, but not equal to, the high-precision product
    ref = x.double() @ w.double().t()
    assert 25.0 <= sqnr_db(ref, block_scaled_mm(qx, qw)) <= 40.0


def test_block_stats_on_a_partial_block():
    """The elements past the edge are not zeros of the block: they neither shrink its range nor count."""
    x = torch.tensor([[1.0] * 31 + [2.0**-4] + [4.0] * 5])  # blocks: 32 elements, then 5
    q = quantize_blocks(x, E4M3, (1, 32), "e8m0")
    st = block_stats(x, q, E4M3)
    assert st["dynamic_range"].flatten().tolist() == [4.0, 0.0]
    assert st["zero_blocks"].item() == 0 and st["underflow"].sum().item() == 0
    assert st["scale_exponent_hist"].sum().item() == 2


def linear_gemms(recipe: str, x, w, dy):
    """fprop, dgrad, wgrad of ``y = x @ w.T`` from the copies TE feeds each GEMM (docs: "Which copy feeds
    which GEMM"): fprop row-wise x and w; dgrad column-wise w, row-wise dy; wgrad column-wise x and dy."""
    if recipe == "mxfp8":
        px, pw, pdy = (mxfp8_quantize(t, E4M3) for t in (x, w, dy))
        w_col, x_col, dy_col = pw.columnwise.t(), px.columnwise.t(), pdy.columnwise.t()
    else:
        px = float8_block_quantize(x, E4M3, block_scaling_dim=1)
        pw = float8_block_quantize(w, E4M3, block_scaling_dim=2)
        pdy = float8_block_quantize(dy, E4M3, block_scaling_dim=1)
        w_col, x_col, dy_col = pw.columnwise, px.columnwise, pdy.columnwise  # stored transposed
    fprop = block_scaled_mm(px.rowwise, pw.rowwise, accumulate="blockwise")  # x @ w.T
    dgrad = block_scaled_mm(pdy.rowwise, w_col, accumulate="blockwise")  # dy @ w
    wgrad = block_scaled_mm(dy_col, x_col, accumulate="blockwise")  # dy.T @ x
    return fprop, dgrad, wgrad


@pytest.mark.parametrize("recipe", ["mxfp8", "block"])
def test_linear_gemms_from_the_te_copies(recipe):
    """Each operand carries about 31.5 dB of E4M3 noise; a product of two such operands about 3 dB less."""
    g = torch.Generator().manual_seed(7)
    x, w, dy = (torch.randn(*s, generator=g) for s in ((256, 384), (160, 384), (256, 160)))
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    want = (x64 @ w64.t(), dy64 @ w64, dy64.t() @ x64)
    for name, got, ref in zip(("fprop", "dgrad", "wgrad"), linear_gemms(recipe, x, w, dy), want, strict=True):
        assert got.shape == ref.shape, name
        assert 27.5 <= sqnr_db(ref, got) <= 30.5, name
