"""The native block-scaled GEMM path checked on the CPU (``fp8_trainer.block_gemm``).

For every GEMM of a real block-scaled Linear (forward and backward, MXFP8 and FP8 block scaling, each block
combination the recipes allow), the arguments prepared for ``torch.nn.functional.scaled_mm`` pass our
checker and PyTorch's own shape/stride rules (its meta kernel, which runs without a GPU), and what the call
computes from them (``emulate_native_call``, which reads each scale through the layout handed over) equals
the emulation the Linear runs today (``block_scaled_mm``) within float32's accumulation bound. A scale
layout transposed, unpadded or unswizzled fails one of the two.

The bound: ``block_scaled_mm`` sums K float32 products of float32 dequantized values (exact for power-of-two
scales, one rounding each otherwise), so each output element errs by at most ``(K + 2) u / (1 - (K + 2) u)``
times ``sum_k |a_k b_k|`` with ``u = 2**-24`` (the standard worst-case bound for a length-K dot product,
plus the two dequantizations); the float64 emulation adds ``(K + 1) 2**-53`` of the same.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fp8_trainer
import fp8_trainer.block_linear
from fp8_kernels.reference.block_quantize import (
    BlockQuantized,
    block_scaled_mm,
    float8_block_quantize,
    mxfp8_quantize,
)
from fp8_trainer import block_gemm as bg
from fp8_trainer.recipe import Float8BlockScaling, Format, MXFP8BlockScaling

pytestmark = pytest.mark.usefixtures("one_thread")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ALL_KINDS = frozenset({bg.BLOCK, bg.MXFP8})
RECIPES = {
    "mxfp8": MXFP8BlockScaling(),
    "mxfp8-2d-weights": MXFP8BlockScaling(enable_2d_quantization=True),
    "block": Float8BlockScaling(),  # fprop, dgrad (1x128, 128x128); wgrad (1x128, 1x128)
    "block-2d-input": Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),  # (128x128, 1x128)
    "block-2d-grad": Float8BlockScaling(w_block_scaling_dim=1, grad_block_scaling_dim=2),
    "block-fp32-scales": Float8BlockScaling(fp8_quant_fwd_inp={"power_2_scale": False}),
}


@pytest.fixture(autouse=True)
def fresh_paths(monkeypatch):
    monkeypatch.setattr(bg, "_REFUSED", {})
    bg.reset_gemm_paths()
    yield
    bg.reset_gemm_paths()


def _hand_built(rows: int, cols: int, block: int, seed: int) -> torch.Tensor:
    """Gaussian values whose magnitude changes from block to block (2^-8 .. 2^8, so a scale read from the
    wrong block is off by a power of two), with an all-zero block, one huge value and a tiny block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    rb, cb = -(-rows // block), -(-cols // block)
    mag = torch.exp2(torch.randint(-8, 9, (rb, cb), generator=g).float())
    x *= mag.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    x[:block, :block] = 0.0  # an all-zero block
    x[min(5, rows - 1), cols // 2] = 3.0e4  # one huge value
    x[-1, :block] *= 1e-30  # a tiny block
    return x


def _record_gemms(monkeypatch) -> list[tuple[str, BlockQuantized, BlockQuantized, torch.Tensor]]:
    """Every GEMM of the block-scaled Linear: ``(name, a, b, output)``."""
    calls = []
    real = fp8_trainer.block_linear.block_gemm

    def recording(a, b, gemm="gemm"):
        out = real(a, b, gemm)
        calls.append((gemm, a, b, out))
        return out

    monkeypatch.setattr(fp8_trainer.block_linear, "block_gemm", recording)
    return calls


def _run_linear(recipe, in_f: int, out_f: int, tokens: int, seed: int = 0):
    """One forward and backward of a block-scaled Linear on hand-built input, weight and grad_output."""
    torch.manual_seed(seed)
    model = fp8_trainer.convert_to_fp8(nn.Sequential(nn.Linear(in_f, out_f)), recipe=recipe)
    lin = model[0]
    block = 32 if recipe.scaling == "mxfp8" else 128
    with torch.no_grad():
        lin.weight.copy_(_hand_built(out_f, in_f, block, seed + 1) * 0.05)
    x = _hand_built(tokens, in_f, block, seed + 2).requires_grad_()
    grad_out = _hand_built(tokens, out_f, block, seed + 3) * 1e-3
    with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
        y = model(x)
    y.backward(grad_out)
    return lin, x, y


def _sizes(recipe) -> tuple[int, int, int]:
    # FP8 block scaling: multiples of 128, with K-block counts 3 and 5 so the 128x128 scales need padding;
    # MXFP8: 3 K-blocks (the 128x4 tile pads them) and 160 rows (pads to 256)
    return (96, 64, 160) if recipe.scaling == "mxfp8" else (384, 256, 640)


def _bound(a: BlockQuantized, b: BlockQuantized) -> torch.Tensor:
    """The elementwise bound of the module docstring for ``A @ B.T``."""
    k = a.data.shape[1]
    u = 2.0**-24
    gamma = (k + 2) * u / (1 - (k + 2) * u) + (k + 1) * 2.0**-53
    return gamma * (a.dequantize().double().abs() @ b.dequantize().double().abs().t())


def _within_bound(got: torch.Tensor, a: BlockQuantized, b: BlockQuantized) -> bool:
    want = block_scaled_mm(a, b).double()
    return bool(((got.double() - want).abs() <= _bound(a, b)).all())


def _meta_scaled_mm(args: bg.NativeArgs) -> torch.Tensor:
    """PyTorch's own argument rules for the call (the meta kernel of ``_scaled_mm_v2``: shapes, strides,
    dtypes, swizzle; no GPU needed)."""
    f = torch.nn.functional
    recipes = {"1x128": "BlockWise1x128", "128x128": "BlockWise128x128", "1x32": "BlockWise1x32"}
    swizzle = f.SwizzleType.SWIZZLE_32_4_4 if args.swizzle else None
    m = {n: getattr(args, n).to("meta") for n in ("mat_a", "mat_b", "scale_a", "scale_b")}
    assert all(m[n].stride() == getattr(args, n).stride() for n in m)
    return f.scaled_mm(
        m["mat_a"], m["mat_b"], m["scale_a"], getattr(f.ScalingType, recipes[args.recipe_a]),
        m["scale_b"], getattr(f.ScalingType, recipes[args.recipe_b]), swizzle_a=swizzle, swizzle_b=swizzle,
        output_dtype=args.output_dtype,
    )  # fmt: skip


# --- every GEMM of a real Linear ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_gemm_arguments_pass_the_checks_and_compute_the_emulation(name, monkeypatch):
    recipe = RECIPES[name]
    calls = _record_gemms(monkeypatch)
    _run_linear(recipe, *_sizes(recipe))
    assert [c[0] for c in calls] == ["fprop", "dgrad", "wgrad"]
    pairs = set()
    for gemm, a, b, out in calls:
        assert bg.unsupported_reason(a, b, ALL_KINDS) is None, gemm
        args = bg.prepare_native_args(a, b)
        pairs.add((args.recipe_a, args.recipe_b))
        bg.check_block_scaled_mm_args(args)
        assert _meta_scaled_mm(args).shape == out.shape
        native = bg.emulate_native_call(args)
        assert native.dtype == torch.float32 and native.shape == out.shape
        assert torch.equal(out, block_scaled_mm(a, b))  # on the CPU the Linear ran the emulation
        assert _within_bound(native, a, b), gemm
    expected = {
        "block": {("1x128", "128x128"), ("1x128", "1x128")},
        "block-2d-input": {("128x128", "1x128"), ("1x128", "1x128"), ("1x128", "128x128")},
        "block-2d-grad": {("1x128", "1x128"), ("128x128", "1x128")},
    }
    assert pairs == expected.get(name, {("1x32", "1x32")} if "mxfp8" in name else expected["block"])


def test_the_bound_is_tight_enough_to_see_one_wrong_block_scale():
    # the same comparison with one block scale of mat_a doubled: the outputs of that row leave the bound
    # (a 128-long partial dot product of Gaussian values against a bound of ~1e-5 of the row's sum of
    # |products|: all but a rare near-zero partial sum), no other output does
    g = torch.Generator().manual_seed(1)
    a = float8_block_quantize(torch.randn(256, 512, generator=g), E4M3, block_scaling_dim=1).rowwise
    b = float8_block_quantize(torch.randn(384, 512, generator=g), E4M3, block_scaling_dim=2).rowwise
    args = bg.prepare_native_args(a, b)
    assert _within_bound(bg.emulate_native_call(args), a, b)
    scale_a = args.scale_a.clone()
    scale_a[7, 2] *= 2
    got = bg.emulate_native_call(_with(args, scale_a=scale_a))
    off = (got.double() - block_scaled_mm(a, b).double()).abs() > _bound(a, b)
    assert off[7].float().mean() > 0.99 and not off[:7].any() and not off[8:].any()


# --- a wrong layout is caught ----------------------------------------------------------------------------


def _block_pair(m=256, n=512, k=512, a_dim=1, b_dim=2, dtype_a=E4M3):
    a = float8_block_quantize(_hand_built(m, k, 128, 3), dtype_a, block_scaling_dim=a_dim).rowwise
    b = float8_block_quantize(_hand_built(n, k, 128, 4), E4M3, block_scaling_dim=b_dim).rowwise
    return a, b


def _with(args: bg.NativeArgs, **changes) -> bg.NativeArgs:
    return bg.NativeArgs(**{**args.__dict__, **changes})


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values and strides in storage that starts 4 bytes past a 16-byte boundary."""
    store = torch.empty(t.untyped_storage().nbytes() // t.element_size() + 1, dtype=t.dtype)[1:]
    out = store.as_strided(t.shape, t.stride())
    out.copy_(t)
    return out


_REJECTED = {
    # 1x128 scales row-major instead of outer-dim-major
    "scale_a row-major": (lambda a, b, args: _with(args, scale_a=args.scale_a.contiguous()), "scale_a"),
    # the 128x128 storage handed over as is, not transposed: same shape here (4 x 4), wrong strides
    "scale_b not transposed": (lambda a, b, args: _with(args, scale_b=args.scale_b.t()), "scale_b"),
    "scale_b contiguous": (lambda a, b, args: _with(args, scale_b=args.scale_b.contiguous()), "scale_b"),
    "scale_a float64": (lambda a, b, args: _with(args, scale_a=args.scale_a.double()), "scale_a"),
    "scale_a 4 bytes off": (lambda a, b, args: _with(args, scale_a=_misaligned(args.scale_a)), "scale_a"),
    "mat_b row-major": (lambda a, b, args: _with(args, mat_b=args.mat_b.contiguous()), "mat_b"),
    "mat_a E5M2": (lambda a, b, args: _with(args, mat_a=args.mat_a.to(E5M2)), "mat_a"),
    "two 128x128": (lambda a, b, args: _with(args, recipe_a="128x128"), "recipe_a"),
    "swizzled block scales": (lambda a, b, args: _with(args, swizzle=True), "swizzle"),
    "fast accumulation": (lambda a, b, args: _with(args, use_fast_accum=True), "use_fast_accum"),
    "float64 output": (lambda a, b, args: _with(args, output_dtype=torch.float64), "output_dtype"),
}


@pytest.mark.parametrize("what", list(_REJECTED))
def test_checker_rejects(what):
    a, b = _block_pair()
    args = bg.prepare_native_args(a, b)
    bg.check_block_scaled_mm_args(args)
    mutate, name = _REJECTED[what]
    with pytest.raises(ValueError, match=name):
        bg.check_block_scaled_mm_args(mutate(a, b, args))


def test_checker_rejects_unpadded_128x128_scales():
    a, b = _block_pair(k=384)  # 3 K-blocks: the 128x128 scale rows must be padded to 4
    args = bg.prepare_native_args(a, b)
    assert args.scale_b.shape == (4, 4) and args.scale_b.stride() == (1, 4)
    bg.check_block_scaled_mm_args(args)
    unpadded = b.scale_inv.t()  # (3, 4), stride (1, 3): the layout torch._scaled_mm's inference takes
    with pytest.raises(ValueError, match="scale_b"):
        bg.check_block_scaled_mm_args(_with(args, scale_b=unpadded))


@pytest.mark.parametrize(
    "m, n, k, a_dim, message",
    [
        (250, 512, 512, 1, "M \\(250\\) of a 1x128"),
        (256, 512, 400, 1, "K \\(400\\)"),
        (256, 512, 136, 1, "K \\(136\\)"),
        (256, 208, 512, 1, "N \\(208\\) of a 128x128"),  # a partial row of 128x128 weight blocks
        (136, 512, 512, 2, "M \\(136\\) of a 128x128"),
    ],
)
def test_sizes_outside_the_rules_fall_back(m, n, k, a_dim, message):
    a, b = _block_pair(m=m, n=n, k=k, a_dim=a_dim, b_dim=3 - a_dim)
    assert bg.unsupported_reason(a, b, ALL_KINDS) is not None
    args = bg.prepare_native_args(a, b)
    with pytest.raises(ValueError, match=message):
        bg.check_block_scaled_mm_args(args)


def test_a_transposed_block_grid_with_legal_strides_is_caught_by_the_emulation():
    # the weight's 4 x 4 grid of 128x128 scales transposed: shapes and strides pass, the values do not
    a, b = _block_pair()
    args = bg.prepare_native_args(a, b)
    swapped = BlockQuantized(b.data, b.scale_inv.t().contiguous(), b.block, b.scale_format)
    wrong = _with(args, scale_b=bg.prepare_native_args(a, swapped).scale_b)
    bg.check_block_scaled_mm_args(wrong)
    assert not torch.equal(wrong.scale_b, args.scale_b)
    assert _within_bound(bg.emulate_native_call(args), a, b)
    assert not _within_bound(bg.emulate_native_call(wrong), a, b)


def test_unswizzled_mx_scales_are_caught_by_the_emulation():
    a = mxfp8_quantize(_hand_built(160, 96, 32, 5), E4M3).rowwise
    b = mxfp8_quantize(_hand_built(64, 96, 32, 6), E4M3, two_d=True).rowwise
    args = bg.prepare_native_args(a, b)
    flat = torch.zeros(256, 4, dtype=torch.uint8)  # padded like the swizzled form, but row-major
    flat[:160, :3] = a.scale_inv
    wrong = _with(args, scale_a=flat.reshape(-1).view(torch.float8_e8m0fnu))
    bg.check_block_scaled_mm_args(wrong)  # same count, contiguous: only the values tell
    assert _within_bound(bg.emulate_native_call(args), a, b)
    assert not _within_bound(bg.emulate_native_call(wrong), a, b)


def test_swizzle_places_each_code_at_cublas_offset():
    codes = torch.randint(0, 255, (130, 5), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    flat = bg.swizzle_mx_scales(codes).view(torch.uint8)
    assert flat.numel() == 256 * 8  # rows padded to 128, columns to 4
    seen = torch.zeros_like(flat, dtype=torch.bool)
    for r in range(130):
        for c in range(5):
            tile = (r // 128) * 2 + c // 4  # two 4-wide column tiles per 128-row band
            offset = tile * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4
            assert flat[offset] == codes[r, c]
            seen[offset] = True
    assert not flat[~seen].any()  # padding is zero
    assert flat[1 * 16 + 1 * 4 + 1] == codes[33, 1]  # row 33 is the second 32-row group's row 1


# --- the path the Linear takes ---------------------------------------------------------------------------


def test_cpu_runs_the_emulation_and_says_why():
    assert bg.native_kinds(torch.device("cpu")) == frozenset()
    assert "emulated" in bg.describe_native_support(torch.device("cpu"))
    _run_linear(Float8BlockScaling(), 256, 128, 128)
    paths = bg.gemm_paths()
    assert set(paths) == {"fprop", "dgrad", "wgrad"}
    for rec in paths.values():
        assert (rec.native, rec.emulated) == (0, 1) and "cpu" in rec.reason


@pytest.fixture
def pretend_native(monkeypatch):
    """``block_gemm`` on its native path on the CPU: every kind available, the call computed by
    ``emulate_native_call`` (after the real preparation and check); the calls recorded."""
    calls = []

    def native(args):
        calls.append(args)
        return bg.emulate_native_call(args)

    monkeypatch.setattr(bg, "native_kinds", lambda device: frozenset() if bg._force_emulation else ALL_KINDS)
    monkeypatch.setattr(bg, "_call_native", native)
    return calls


@pytest.mark.parametrize("name", ["mxfp8", "block"])
def test_linear_on_the_native_path_uses_its_result(name, pretend_native, monkeypatch):
    recipe = RECIPES[name]
    calls = _record_gemms(monkeypatch)
    lin, x, y = _run_linear(recipe, *_sizes(recipe))
    assert len(pretend_native) == 3
    assert {g: (r.native, r.emulated) for g, r in bg.gemm_paths().items()} == {
        "fprop": (1, 0), "dgrad": (1, 0), "wgrad": (1, 0),
    }  # fmt: skip
    outs = {}
    for gemm, a, b, out in calls:
        assert torch.equal(out, bg.emulate_native_call(bg.prepare_native_args(a, b)))
        assert _within_bound(out, a, b)
        outs[gemm] = out
    assert torch.equal(y.detach(), outs["fprop"] + lin.bias.detach())
    assert torch.equal(x.grad, outs["dgrad"]) and torch.equal(lin.weight.grad, outs["wgrad"])
    # the same layer forced onto the emulation: the same operands, today's GEMM
    bg.reset_gemm_paths()
    calls.clear()
    with bg.emulated_block_gemms():
        _run_linear(recipe, *_sizes(recipe))
    assert all(r.native == 0 and r.emulated == 1 for r in bg.gemm_paths().values())
    for gemm, a, b, out in calls:
        assert _within_bound(outs[gemm], a, b) and torch.equal(out, block_scaled_mm(a, b))


def test_hybrid_gradients_fall_back(pretend_native):
    # E5M2 grad_output: PyTorch's block-scaled GEMMs take E4M3 only, so dgrad and wgrad are emulated
    _run_linear(Float8BlockScaling(fp8_format=Format.HYBRID), 256, 128, 128)
    paths = bg.gemm_paths()
    assert (paths["fprop"].native, paths["fprop"].emulated) == (1, 0)
    for g in ("dgrad", "wgrad"):
        assert (paths[g].native, paths[g].emulated) == (0, 1) and "E4M3" in paths[g].reason


def test_a_refused_call_falls_back_once_with_a_warning(monkeypatch):
    tries = []

    def refuse(args):
        tries.append(args)
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore")

    monkeypatch.setattr(bg, "native_kinds", lambda device: ALL_KINDS)
    monkeypatch.setattr(bg, "_call_native", refuse)
    calls = _record_gemms(monkeypatch)
    with pytest.warns(UserWarning, match="CUBLAS_STATUS_NOT_SUPPORTED"):
        _run_linear(Float8BlockScaling(), 256, 128, 128)
    assert len(tries) == 3  # fprop; dgrad and wgrad have shapes of their own
    for gemm, a, b, out in calls:
        assert torch.equal(out, block_scaled_mm(a, b)), gemm
        assert "refused" in bg.gemm_paths()[gemm].reason
    _run_linear(Float8BlockScaling(), 256, 128, 128)  # the same shapes: not tried again, no warning
    assert len(tries) == 3 and bg.gemm_paths()["fprop"].emulated == 2


def test_a_layout_bug_is_raised_not_emulated(pretend_native, monkeypatch):
    real = bg.prepare_native_args
    monkeypatch.setattr(bg, "prepare_native_args", lambda a, b: _with(real(a, b), swizzle=True))
    with pytest.raises(ValueError, match="swizzle"):
        _run_linear(Float8BlockScaling(), 256, 128, 128)


def test_e8m0_scale_bytes_keep_their_codes():
    # the swizzle moves bytes; the dtype view must not convert values (code 0 is 2^-127, 254 is 2^127)
    codes = torch.tensor([[0, 127, 254, 255]], dtype=torch.uint8)
    flat = bg.swizzle_mx_scales(codes)
    assert flat.dtype == torch.float8_e8m0fnu
    assert flat.view(torch.uint8)[:4].tolist() == [0, 127, 254, 255]
    assert math.isnan(float(bg._scale_per_element(flat, "1x32", 1, 128)[0, 96]))


def test_the_paths_script_names_each_gemm_and_its_path(capsys):
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "block_gemm_paths.py"
    runpy.run_path(str(script), run_name="block_gemm_paths")["main"]()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("block-scaled GEMM: cpu") and "emulated" in lines[0]
    assert len(lines) == 4  # one line per recipe: block E4M3, block HYBRID, mxfp8
    for line in lines[1:]:
        assert all(f"{g} emulated (no native" in line for g in ("fprop", "dgrad", "wgrad")), line
