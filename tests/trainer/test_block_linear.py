"""The block-scaled FP8 Linear against the reference in ``fp8_kernels.reference.block_quantize``: its
quantized operands and GEMM outputs bit for bit, its statistics against ``block_stats``, its gradients
against float64 within the SQNR the format allows (and below what float32 would give, so FP8 really ran)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import fp8_trainer
from fp8_kernels.reference.block_quantize import (
    block_amax,
    block_scaled_mm,
    block_stats,
    float8_block_quantize,
    mxfp8_quantize,
)
from fp8_protocol.stats import (
    AMAX,
    BLOCK_COLUMNS,
    ERR_SQ,
    MIN_ABS,
    NONFINITE,
    NUMEL,
    OVERFLOW,
    SCALE,
    SUM_SQ,
    UNDERFLOW,
    sqnr_db,
)
from fp8_trainer.block_linear import BlockSpec, block_specs, quantize_block_tensor
from fp8_trainer.recipe import Float8BlockScaling, Format, MXFP8BlockScaling

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
COL = {name: j for j, name in enumerate(BLOCK_COLUMNS)}


def _bits(q) -> torch.Tensor:
    return q.data.view(torch.uint8)


def _hand_built(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with the cases a block scale must survive: an all-zero block, one huge value, a NaN,
    an Inf, a tiny-valued block, a block spread over many binades."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[0] = 0.0  # all-zero blocks
    x[1, 5] = 3.0e4  # one huge value
    x[2, 40] = math.nan
    x[3, 70 % cols] = math.inf
    x[4] *= 1e-38  # tiny values: an E8M0 code 0 (v <= 2^-127), a float32 scale FP8_MAX / amax that overflows
    x[5, :32] = torch.logspace(-20, 3, 32)  # a wide block
    return x


# --- the quantized operands, bit for bit ------------------------------------------------------------------


@pytest.mark.parametrize("two_d", [False, True])
def test_mxfp8_copies_are_the_references(two_d):
    x = _hand_built(64, 96)
    spec = BlockSpec("e8m0", 32, two_d=two_d)
    row, col = quantize_block_tensor(x, E4M3, spec, rowwise=True, columnwise=True)
    ref = mxfp8_quantize(x, E4M3, two_d=two_d)
    assert torch.equal(_bits(row), _bits(ref.rowwise))
    torch.testing.assert_close(row.dequantize(), ref.rowwise.dequantize(), rtol=0, atol=0, equal_nan=True)
    # the column-wise copy is held transposed (blocks along the contracted dimension): the same values
    torch.testing.assert_close(
        col.dequantize().t(), ref.columnwise.dequantize(), rtol=0, atol=0, equal_nan=True
    )
    assert torch.equal(_bits(col).t(), _bits(ref.columnwise))


@pytest.mark.parametrize("shape", [(200, 72), (130, 257)])  # not multiples of 128
@pytest.mark.parametrize("dim", [1, 2])
def test_float8_block_copies_are_the_references(shape, dim):
    x = _hand_built(*shape)
    spec = BlockSpec("fp32", 128, two_d=dim == 2, power_2_scale=True)
    row, col = quantize_block_tensor(x, E4M3, spec, rowwise=True, columnwise=True)
    ref = float8_block_quantize(x, E4M3, block_scaling_dim=dim)
    for got, want in ((row, ref.rowwise), (col, ref.columnwise)):
        assert got.data.shape == want.data.shape
        assert torch.equal(_bits(got), _bits(want))
        assert torch.equal(got.scale_inv, want.scale_inv)


def _linear(recipe, in_f: int, out_f: int, seed: int = 0, bias: bool = True):
    torch.manual_seed(seed)
    model = fp8_trainer.convert_to_fp8(nn.Sequential(nn.Linear(in_f, out_f, bias=bias)), recipe=recipe)
    return model, model[0]


@pytest.mark.parametrize(
    "recipe",
    [
        MXFP8BlockScaling(),
        MXFP8BlockScaling(fp8_format=Format.HYBRID, enable_2d_quantization=True),
        Float8BlockScaling(),
        Float8BlockScaling(fp8_format=Format.HYBRID, fp8_quant_fwd_inp={"power_2_scale": False}),
    ],
    ids=["mxfp8", "mxfp8-hybrid-2d", "block", "block-hybrid-fp32-scales"],
)
def test_linear_gemms_are_the_reference_gemms(recipe):
    """Output, grad_input and grad_weight are exactly the reference GEMMs on the reference copies TE's
    layouts name: fprop row(x) row(w), dgrad row(g) col(w), wgrad col(g) col(x)."""
    in_f, out_f, tokens = (96, 64, 64) if recipe.scaling == "mxfp8" else (160, 144, 136)
    model, lin = _linear(recipe, in_f, out_f)
    g = torch.Generator().manual_seed(1)
    x = _hand_built(tokens, in_f, seed=2).requires_grad_()  # zero blocks, a huge value, NaN, Inf, tiny, wide
    grad_out = torch.randn(tokens, out_f, generator=g) * 1e-3
    with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
        y = model(x)
    y.backward(grad_out)

    specs = block_specs(recipe.scaling, recipe)
    fwd, bwd = recipe.fp8_format.for_role("input").dtype, recipe.fp8_format.for_role("grad_output").dtype

    def copies(t, dtype, spec):
        if recipe.scaling == "mxfp8":
            ref = mxfp8_quantize(t, dtype, two_d=spec.two_d)
            return ref.rowwise, ref.columnwise.t()
        dim = 2 if spec.two_d else 1
        qp = dict(power_2_scale=spec.power_2_scale, amax_epsilon=spec.amax_epsilon)
        ref = float8_block_quantize(t, dtype, block_scaling_dim=dim, **qp)
        return ref.rowwise, ref.columnwise

    rx, cx = copies(x.detach(), fwd, specs[0])
    rw, cw = copies(lin.weight.detach(), fwd, specs[1])
    rg, cg = copies(grad_out, bwd, specs[2])

    def same(got, want):  # bit for bit, NaN where the reference has NaN (the NaN and Inf inputs)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)

    same(y.detach(), block_scaled_mm(rx, rw) + lin.bias.detach())
    same(x.grad, block_scaled_mm(rg, cw))
    assert torch.isfinite(x.grad).all()  # dgrad never reads the input
    same(lin.weight.grad, block_scaled_mm(cg, cx))
    assert torch.isfinite(lin.weight.grad).any() and not torch.isfinite(lin.weight.grad).all()
    same(lin.bias.grad, grad_out.sum(0))  # high precision


# --- statistics -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), Float8BlockScaling()], ids=["mxfp8", "block"])
def test_statistics_are_block_stats_of_the_rowwise_copy(recipe):
    in_f, out_f, tokens = (256, 32, 96) if recipe.scaling == "mxfp8" else (208, 48, 72)
    model, lin = _linear(recipe, in_f, out_f)
    x = _hand_built(tokens, in_f)
    with torch.no_grad():
        lin.weight[0, 3] = 1e5  # one outlier weight
    x.requires_grad_()
    with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
        y = model(x)
    y.backward(torch.zeros_like(y))
    state = fp8_trainer.get_fp8_state(model)
    stats, blocks = state.last_stats, state.last_block_stats
    spec = block_specs(recipe.scaling, recipe)[0]
    x2 = x.detach()
    ref = quantize_block_tensor(x2, E4M3, spec, rowwise=True, columnwise=False)[0]
    per = block_stats(x2, ref, E4M3)
    finite = torch.isfinite(x2)

    row, brow = stats[0], blocks[0]
    assert row[AMAX] == math.inf  # the tensor's amax: the Inf (NaN ignored)
    assert row[NONFINITE] == 2 and row[NUMEL] == x2.numel()
    assert row[OVERFLOW] == per["overflow"].sum() and row[UNDERFLOW] == per["underflow"].sum()
    assert row[UNDERFLOW] > 0  # the wide block and the tiny one
    # scale: that of the block holding the amax (the Inf's: 2^-127 for E8M0, the fallback 1 for float32)
    assert row[SCALE] == (2.0**-127 if recipe.scaling == "mxfp8" else 1.0)
    xf = torch.where(finite, x2, 0.0).double()
    assert row[SUM_SQ] == pytest.approx(float(xf.square().sum()), rel=1e-12)
    deq = torch.where(finite, ref.dequantize(), 0.0).double()
    assert row[ERR_SQ] == pytest.approx(float((deq - xf).square().sum()), rel=1e-12)
    assert row[MIN_ABS] == float(xf.abs()[xf != 0].min())

    assert brow[COL["blocks"]] == ref.scale_inv.numel()
    # blocks per row: the zero row's have nothing to scale (blocks_zero), the tiny row's are at a limit
    n_row = ref.scale_inv.shape[1]
    if recipe.scaling == "mxfp8":
        at_limit = per["e8m0_at_min"] + per["e8m0_at_max"]  # code 0: zero and tiny blocks; 254: the Inf's
    else:  # a float32 scale falls back to 1 (zero amax, the Inf's) or is clamped (FP8_MAX / tiny overflows)
        amax = block_amax(x2, ref.block)
        limit = (amax == 0) | torch.isinf(amax) | torch.isinf(torch.tensor(448.0) / amax)
        at_limit = torch.count_nonzero(limit)
    assert brow[COL["blocks_zero"]] == per["zero_blocks"] == n_row
    assert brow[COL["blocks_at_limit"]] == at_limit - per["zero_blocks"] == n_row + 1
    assert brow[COL["blocks_overflow"]] == torch.count_nonzero(per["overflow"])
    assert brow[COL["blocks_underflow"]] == torch.count_nonzero(per["underflow"]) > 0
    assert brow[COL["block_range"]] == per["worst_dynamic_range"]
    assert brow[COL["block_range"]] > 70  # the block spread over 23 decades
    hist = brow[len(BLOCK_COLUMNS) :]
    assert torch.equal(hist, per["scale_exponent_hist"].double()) and hist.sum() == ref.scale_inv.numel()
    # the weight's row-wise copy: 2-D blocks for FP8 block scaling's weights count square blocks
    wspec = block_specs(recipe.scaling, recipe)[1]
    wq = quantize_block_tensor(lin.weight.detach(), E4M3, wspec, rowwise=True, columnwise=False)[0]
    assert blocks[1, COL["blocks"]] == wq.scale_inv.numel() == (out_f * in_f // 32 if not wspec.two_d else 2)
    wper = block_stats(lin.weight.detach(), wq, E4M3)
    assert stats[1, OVERFLOW] == wper["overflow"].sum() and stats[1, UNDERFLOW] == wper["underflow"].sum()
    assert blocks[1, COL["blocks_underflow"]] == torch.count_nonzero(wper["underflow"]) > 0  # the outlier's
    assert blocks[1, COL["block_range"]] == wper["worst_dynamic_range"]
    assert torch.equal(blocks[1, len(BLOCK_COLUMNS) :], wper["scale_exponent_hist"].double())


def test_micro_batches_merge_block_columns():
    """Two micro-batches of one step: counts and histograms summed, block_range and amax the max."""
    recipe = MXFP8BlockScaling()
    model, _ = _linear(recipe, 64, 32)
    xs = [_hand_built(32, 64, seed=s) for s in (1, 2)]
    xs[1][7, 9] = 1e6
    singles = []
    for x in xs:
        with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
            model(x).sum().backward()
        state = fp8_trainer.get_fp8_state(model)
        singles.append((state.last_stats.clone(), state.last_block_stats.clone()))
    for i, x in enumerate(xs):
        with fp8_trainer.fp8_autocast(fp8_recipe=recipe, step_boundary=i == 1):
            model(x).sum().backward()
    state = fp8_trainer.get_fp8_state(model)
    (s1, b1), (s2, b2) = singles
    got, blk = state.last_stats, state.last_block_stats
    assert torch.equal(got[0, AMAX], torch.fmax(s1[0, AMAX], s2[0, AMAX]))
    assert torch.equal(got[0, OVERFLOW:SUM_SQ], s1[0, OVERFLOW:SUM_SQ] + s2[0, OVERFLOW:SUM_SQ])
    r = COL["block_range"]
    assert torch.equal(blk[0, :r], b1[0, :r] + b2[0, :r])
    assert blk[0, r] == max(b1[0, r], b2[0, r])
    assert torch.equal(
        blk[0, len(BLOCK_COLUMNS) :], b1[0, len(BLOCK_COLUMNS) :] + b2[0, len(BLOCK_COLUMNS) :]
    )


# --- gradients against float64 ----------------------------------------------------------------------------

# SQNR of one round-to-nearest quantization of Gaussian values in the normal range, E4M3 (3 mantissa bits)
# and E5M2 (2): 6.02 * (m + 1) + 7.3 dB, i.e. 31.5 and 25.5 dB (docs/fp8-semantics.md); a GEMM of two
# independently quantized operands adds their noise: 3 dB less. Floors 2 dB under that, ceilings far below
# float32's (> 100 dB), so a GEMM that skipped FP8 fails.
_FLOOR = {E4M3: 31.5 - 3 - 2, E5M2: 25.5 - 3 - 2}


def _db(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(sqnr_db(float(want.square().sum()), float((got.double() - want).square().sum())))


@pytest.mark.parametrize(
    "recipe",
    [
        MXFP8BlockScaling(),
        MXFP8BlockScaling(fp8_format=Format.HYBRID),
        Float8BlockScaling(),
        Float8BlockScaling(fp8_format=Format.HYBRID),
    ],  # fmt: skip
    ids=["mxfp8-e4m3", "mxfp8-hybrid", "block-e4m3", "block-hybrid"],
)
def test_gradients_within_the_formats_sqnr(recipe):
    in_f, out_f, tokens = 256, 128, 192
    model, lin = _linear(recipe, in_f, out_f, seed=3, bias=False)  # a bias would hide the small rows' error
    g = torch.Generator().manual_seed(4)
    # rows of very different magnitudes: block scales keep each one at full precision
    x = (torch.randn(tokens, in_f, generator=g) * torch.logspace(-4, 4, tokens).unsqueeze(1)).requires_grad_()
    grad_out = torch.randn(tokens, out_f, generator=g)
    with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
        y = model(x)
    y.backward(grad_out)
    x64, w64, g64 = x.detach().double(), lin.weight.detach().double(), grad_out.double()
    want_y = x64 @ w64.T
    fwd, bwd = recipe.fp8_format.for_role("input").dtype, recipe.fp8_format.for_role("grad_output").dtype
    floor_fwd, floor_bwd = _FLOOR[fwd], _FLOOR[bwd]
    # per row of the output: each token's row keeps its SQNR whatever its magnitude
    for got, want, floor in ((y.detach(), want_y, floor_fwd), (x.grad, g64 @ w64, floor_bwd)):
        rows = [_db(got[i], want[i]) for i in range(0, tokens, 17)]
        assert min(rows) > floor and max(rows) < 45, rows
    db_w = _db(lin.weight.grad, g64.T @ x64)
    assert floor_bwd < db_w < 45, db_w


# --- sizes MXFP8 cannot take --------------------------------------------------------------------------------


def test_mxfp8_refuses_dimensions_not_divisible_by_32():
    with pytest.raises(
        ValueError, match=r"MXFP8 needs in_features and out_features divisible by 32; layer '0' is 48 -> 32"
    ):
        _linear(MXFP8BlockScaling(), 48, 32)
    model, _ = _linear(fp8_trainer.DelayedScaling(), 48, 32)
    with pytest.raises(ValueError, match="layer '0' is 48 -> 32"):
        fp8_trainer.set_layer_recipe(model, "0", scaling="mxfp8")
    assert fp8_trainer.get_layer_recipes(model)["0"]["scaling"] == "delayed"  # nothing changed
    fp8_trainer.set_layer_recipe(model, "0", scaling="block")  # FP8 block scaling takes any size
    model, _ = _linear(MXFP8BlockScaling(), 64, 32)
    with (
        fp8_trainer.fp8_autocast(fp8_recipe=MXFP8BlockScaling()),
        pytest.raises(
            ValueError, match=r"0.input: MXFP8 needs both dimensions divisible by 32, got \(40, 64\)"
        ),
    ):
        model(torch.randn(40, 64))


def test_per_tensor_layers_report_zero_block_columns():
    torch.manual_seed(0)
    model = fp8_trainer.convert_to_fp8(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32)))
    fp8_trainer.set_layer_recipe(model, "1", scaling="mxfp8")
    with fp8_trainer.fp8_autocast():
        model(torch.randn(32, 64)).sum().backward()
    state = fp8_trainer.get_fp8_state(model)
    blocks = state.last_block_stats.numpy()
    assert np.all(blocks[:3] == 0)  # layer 0: delayed
    assert np.all(blocks[3:, COL["blocks"]] > 0)
    assert state.newest_stats().shape == (6, 10 + len(BLOCK_COLUMNS) + 256)
