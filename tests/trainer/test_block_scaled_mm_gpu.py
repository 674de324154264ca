"""GPU-only: PyTorch's block-scaled ``scaled_mm`` (``fp8_trainer.block_gemm``) against its emulation.

Each native call is compared with ``emulate_native_call`` on the same arguments, which multiplies the
dequantized FP8 operands in float64: exact up to 2**-53, so what remains is the GPU's own accumulation.
Model (``test_fp8_linear_gpu.py`` measured it for per-tensor scaling on an H200): the tensor core keeps about
14 significant bits per addition (``u = 2**-13``), and a block-scaled GEMM leaves the tensor core at least
once per K-block to apply the two block scales in float32 (cuBLASLt's block-scaled kernels run with the
split accumulator; TE fixes ``use_split_accumulator=True`` for these recipes). So at most 128 products are
summed at tensor-core precision, and the normwise error relative to the result is about ``u * sqrt(L / 2)``
with ``L <= 128``; the bound ``u * sqrt(128)`` (1.4e-3) allows sqrt(2) over that. A wrong scale or layout
errs by a power of two on whole blocks, orders of magnitude more, which ``test_a_wrong_layout_is_visible``
shows on the device. MXFP8 on sm_100 is held to the same bound (not measured here: the H200 has no MXFP8
GEMM, so those tests skip there).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fp8_trainer
from fp8_kernels.reference.block_quantize import BlockQuantized, float8_block_quantize, mxfp8_quantize
from fp8_trainer import block_gemm as bg
from fp8_trainer.recipe import Float8BlockScaling, Format, MXFP8BlockScaling
from tests.support.gpu import FP8_GPU

pytestmark = FP8_GPU

E4M3 = torch.float8_e4m3fn
ACC_UNIT = 2.0**-13  # relative precision of one addition in the FP8 tensor-core accumulator
PROMOTION = 128  # products summed in the tensor core before the block scales are applied in float32
RTOL = ACC_UNIT * math.sqrt(PROMOTION)


def _kinds() -> frozenset[str]:
    return bg.native_kinds(torch.device("cuda")) if torch.cuda.is_available() else frozenset()


needs_block = pytest.mark.skipif(bg.BLOCK not in _kinds(), reason="native FP8 block scaling: sm_90")
needs_mxfp8 = pytest.mark.skipif(bg.MXFP8 not in _kinds(), reason="native MXFP8: sm_100+")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    assert bool(torch.isfinite(out).all()), "non-finite GEMM output"
    return float((out - ref).norm() / ref.norm())


def _hand_built(rows: int, cols: int, block: int, seed: int) -> torch.Tensor:
    """Gaussian values with a magnitude per block (2^-4 .. 2^4), an all-zero block and one huge value."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, device="cuda", generator=g)
    mag = torch.exp2(torch.randint(-4, 5, (-(-rows // block), -(-cols // block)), device="cuda", generator=g))
    x *= mag.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    x[:block, :block] = 0.0
    x[3, cols // 2] = 3.0e3
    return x


def test_native_support_is_detected(record_property):
    """The support line the GPU check prints; on an sm_90 with PyTorch 2.10+ and CUDA 12.9+ the FP8
    block-scaling GEMM must be found (a detection that silently fell back would pass everything else)."""
    dev = torch.device("cuda")
    line = bg.describe_native_support(dev)
    print(f"block-scaled GEMM: {line}")
    record_property("native_support", line)
    if torch.cuda.get_device_capability() == (9, 0) and bg._api_available() and bg._cuda_version() >= (12, 9):
        assert bg.BLOCK in bg.native_kinds(dev)


def _quantized(rows: int, k: int, recipe: str, seed: int) -> BlockQuantized:
    if recipe == "1x32":
        return mxfp8_quantize(_hand_built(rows, k, 32, seed), E4M3, columnwise=False).rowwise
    dim = 2 if recipe == "128x128" else 1
    return float8_block_quantize(_hand_built(rows, k, 128, seed), E4M3, block_scaling_dim=dim).rowwise


BLOCK_CASES = [
    (pair, shape)
    for pair in [("1x128", "128x128"), ("1x128", "1x128"), ("128x128", "1x128")]
    # 3 and 10 K-blocks (the 128x128 scales padded to 4 and 12); M = 136 only where mat_a is 1x128
    for shape in [(256, 384, 512), (384, 256, 384), (136, 512, 1280)]
    if not (pair[0] == "128x128" and shape[0] % 128)
]


@needs_block
@pytest.mark.parametrize("pair, shape", BLOCK_CASES)
def test_block_scaled_mm_matches_its_emulation(pair, shape, record_property):
    m, n, k = shape
    a, b = _quantized(m, k, pair[0], 1), _quantized(n, k, pair[1], 2)
    assert bg.unsupported_reason(a, b, bg.native_kinds(a.data.device)) is None
    args = bg.prepare_native_args(a, b)
    bg.check_block_scaled_mm_args(args)
    err = rel_err(bg._call_native(args), bg.emulate_native_call(args))
    record_property("rel_err", err)
    assert err <= RTOL, f"{pair} {shape}: {err:.3e} > {RTOL:.3e}"


@needs_mxfp8
@pytest.mark.parametrize("shape", [(256, 384, 512), (160, 64, 96)])
def test_mxfp8_scaled_mm_matches_its_emulation(shape, record_property):
    m, n, k = shape
    a, b = _quantized(m, k, "1x32", 1), _quantized(n, k, "1x32", 2)
    args = bg.prepare_native_args(a, b)
    bg.check_block_scaled_mm_args(args)
    err = rel_err(bg._call_native(args), bg.emulate_native_call(args))
    record_property("rel_err", err)
    assert err <= RTOL, f"{shape}: {err:.3e} > {RTOL:.3e}"


@needs_block
def test_a_wrong_layout_is_visible():
    # the 128x128 scales of a square block grid handed over transposed (legal shape and strides): the native
    # result leaves the bound by far, so the comparisons above can fail
    a, b = _quantized(256, 512, "1x128", 1), _quantized(512, 512, "128x128", 2)
    args = bg.prepare_native_args(a, b)
    swapped = BlockQuantized(b.data, b.scale_inv.t().contiguous(), b.block, b.scale_format)
    wrong = bg.NativeArgs(**{**args.__dict__, "scale_b": bg.prepare_native_args(a, swapped).scale_b})
    bg.check_block_scaled_mm_args(wrong)
    assert rel_err(bg._call_native(wrong), bg.emulate_native_call(args)) > 100 * RTOL


def _step(recipe, in_f: int, out_f: int, tokens: int):
    torch.manual_seed(0)
    model = fp8_trainer.convert_to_fp8(nn.Sequential(nn.Linear(in_f, out_f)).cuda(), recipe=recipe)
    x = _hand_built(tokens, in_f, 128, 5).requires_grad_()
    g = _hand_built(tokens, out_f, 128, 6) * 1e-2
    with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
        y = model(x)
    y.backward(g)
    return y.detach(), x.grad, model[0].weight.grad


def _paths() -> dict[str, tuple[int, int]]:
    return {gemm: (r.native, r.emulated) for gemm, r in bg.gemm_paths().items()}


@pytest.mark.parametrize(
    "recipe, native",
    [
        pytest.param(Float8BlockScaling(), {"fprop", "dgrad", "wgrad"}, marks=needs_block, id="block"),
        pytest.param(Float8BlockScaling(fp8_format=Format.HYBRID), {"fprop"}, marks=needs_block, id="hybrid"),
        pytest.param(MXFP8BlockScaling(), {"fprop", "dgrad", "wgrad"}, marks=needs_mxfp8, id="mxfp8"),
    ],
)
def test_linear_native_path_matches_the_emulation_path(recipe, native, record_property):
    """One forward and backward through the native path, then the same step forced onto the emulation: the
    same FP8 operands (the quantization is deterministic), so the outputs differ by the GPU's accumulation.
    HYBRID's E5M2 gradients fall back (dgrad, wgrad) while fprop stays native."""
    sizes = (384, 256, 640)
    bg.reset_gemm_paths()
    got = _step(recipe, *sizes)
    paths = _paths()
    record_property("paths", str(paths))
    print(f"{recipe.scaling} {recipe.fp8_format.value}: {paths} {bg.describe_native_support(got[0].device)}")
    assert paths == {g: ((1, 0) if g in native else (0, 1)) for g in ("fprop", "dgrad", "wgrad")}
    bg.reset_gemm_paths()
    with bg.emulated_block_gemms():
        want = _step(recipe, *sizes)
    assert _paths() == {g: (0, 1) for g in ("fprop", "dgrad", "wgrad")}
    for name, o, w in zip(("output", "grad_input", "grad_weight"), got, want, strict=True):
        err = rel_err(o, w)
        record_property(f"{name}_rel_err", err)
        assert err <= RTOL, f"{name}: {err:.3e} > {RTOL:.3e}"
