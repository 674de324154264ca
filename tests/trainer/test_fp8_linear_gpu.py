"""GPU-only checks: real FP8 GEMMs (torch._scaled_mm) against float64, every GEMM's cuBLASLt arguments, the
quantize bits against the references on the device, and ``fp8-train --device cuda``.

How GEMMs are compared. A GEMM's inputs are FP8 tensors, so the reference is exact: the dequantized operands
(``q * scale_inv``, exact in float64) multiplied in float64. What remains is the GEMM's own accumulation
error, and Hopper's FP8 tensor cores do not accumulate in IEEE float32. ``gemm_rtol`` bounds it:

* The products of two FP8 values are exact (4-bit x 4-bit significands); all the error is in the sums.
* The tensor core adds products into an accumulator that keeps about 14 significant bits: the addends are
  aligned to the largest exponent and their low bits dropped (DeepSeek-V3 technical report, 2024, section
  3.3.2, measured on H800). So each addition errs by up to ``u = 2**-13`` of the running sum, with the sign
  of the (random-signed) addend.
* For K products of similar size ``s`` and random sign, the running sum after ``j`` terms is about
  ``s * sqrt(j)``, and the errors of ``L`` consecutive additions add up as a random walk:
  ``sqrt(sum_j (u * s * sqrt(j))**2) = u * s * L / sqrt(2)``, against a result of size ``s * sqrt(K)``.
* Fast accumulation (``use_fast_accum=True``, fprop) keeps all of K in the tensor core (``L = K``): relative
  error ``u * sqrt(K / 2)``. The default (split) accumulation, used for dgrad and wgrad, adds each MMA
  instruction's partial sum (K-step 32 for FP8 on Hopper) into float32, whose own sum of the K / 32 pieces
  adds almost nothing: ``L = min(K, 32)``, relative error ``u * sqrt(min(K, 32) / 2)`` for any K.
* Calibration, measured on an H200 at K = 4096 (max error over max |ref| against float64): 3.4e-3 with fast
  accumulation, which this model matches with an effective ``u`` of 0.6 * 2**-13; 1.9-3.4e-4 without, which
  the same ``u`` matches with L = 32 (not with 128, a promotion every four instructions).
* The bound allows sqrt(2) over the model for the spread between inputs and for data that is not Gaussian:
  ``u * sqrt(L)``. At K = 4096 that is 7.8e-3 with fast accumulation and 6.9e-4 without, 2.3x and 2x the
  measurements. An FP8 quantization error (2**-4 per element in E4M3), a wrong scale or a wrong layout is
  orders of magnitude above it; ``test_fp8_really_ran`` checks that the comparison can fail.
"""

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

import fp8_kernels
import fp8_trainer
from fp8_kernels import is_aligned_scale, quantize_with_stats, quantize_with_stats_reference
from fp8_trainer import CurrentScaling, DelayedScaling, fp8_autocast
from fp8_trainer.convert import get_fp8_state
from fp8_trainer.gemm import uses_scaled_mm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and uses_scaled_mm(torch.device("cuda"))),
        reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)",
    ),
]

RECIPES = {"delayed": DelayedScaling(), "current": CurrentScaling()}
ACC_UNIT = 2.0**-13  # relative precision of one addition in the FP8 tensor-core accumulator
SPLIT_CHUNK = 32  # products summed in the tensor core before the split accumulator moves them to float32


def gemm_rtol(k: int, fast_accum: bool) -> float:
    """Normwise relative error bound of an FP8 GEMM over K against float64 (module docstring)."""
    run = k if fast_accum else min(k, SPLIT_CHUNK)
    return ACC_UNIT * math.sqrt(run)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().double()
    assert bool(torch.isfinite(out).all()), "non-finite GEMM output"
    ref = ref.detach()
    return float((out - ref).norm() / ref.norm())


def dequantized(t: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``t`` quantized by the reference with ``scale``, dequantized exactly in float64."""
    s = torch.tensor(scale, dtype=torch.float32, device=t.device)
    q, _ = quantize_with_stats_reference(t.detach().float(), s, fp8_dtype)
    return q.double() * torch.reciprocal(s).double()  # the runtime's scale_inv is reciprocal(scale), float32


def test_quantize_bits_on_gpu_equal_references_on_gpu():
    x = (torch.randn(1023, 77) * torch.logspace(-6, 4, 77)).cuda()
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -1e6, 0.0])
    s = torch.tensor(3.0, device="cuda")
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q, row = quantize_with_stats(x, s, dtype)  # the Triton kernel
        with fp8_kernels.reference_kernels():
            q_ref, row_ref = quantize_with_stats(x, s, dtype)  # torch ops on the GPU
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), dtype
        assert torch.equal(row.nan_to_num(-1), row_ref.nan_to_num(-1)), dtype
        # the statistics are exact float32 arithmetic: the CPU reference agrees too
        _, row_cpu = quantize_with_stats_reference(x.cpu(), s.cpu(), dtype)
        assert torch.equal(row.cpu().nan_to_num(-1), row_cpu.nan_to_num(-1)), dtype


@pytest.mark.parametrize("fast_accum", [True, False], ids=["fast", "split"])
@pytest.mark.parametrize("k", [16, 4096])
def test_scaled_mm_accumulation_within_model(k, fast_accum, record_property):
    # the bare GEMM on random FP8 operands, the largest K the runtime's tests use and beyond
    g = torch.Generator(device="cuda").manual_seed(k)
    a = torch.randn(512, k, device="cuda", generator=g).mul(20).to(torch.float8_e4m3fn)
    b = torch.randn(384, k, device="cuda", generator=g).mul(20).to(torch.float8_e4m3fn).t()  # column-major
    sa, sb = torch.tensor(0.37, device="cuda"), torch.tensor(1.3, device="cuda")
    out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32, use_fast_accum=fast_accum)
    ref = (a.double() @ b.double()) * (sa.double() * sb.double())
    err = rel_err(out, ref)
    record_property("rel_err", err)
    assert err <= gemm_rtol(k, fast_accum), (
        f"K={k} fast={fast_accum}: {err:.3e} > {gemm_rtol(k, fast_accum):.3e}"
    )


def _step(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, recipe) -> torch.Tensor:
    with fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    y.backward(g)
    return y


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tokens", [16, 7, 129])
def test_fp8_linear_gemms_match_float64(tokens, recipe, record_property):
    # fprop (K = in, fast accumulation), dgrad (K = out) and wgrad (K = tokens, padded to 16 where needed)
    torch.manual_seed(tokens)
    layer = fp8_trainer.convert_to_fp8(nn.Linear(256, 128).cuda())
    x = torch.randn(tokens, 256, device="cuda", requires_grad=True)
    g = torch.randn(tokens, 128, device="cuda")
    w = layer.weight.detach().clone()
    y = _step(layer, x, g, RECIPES[recipe])
    state, stats = get_fp8_state(layer), fp8_trainer.step_stats(layer)
    scale = stats[:, 1].tolist()  # the scale each tensor was quantized with (input, weight, grad_output)
    dx, dw, dg = (dequantized(t, scale[i], state.dtypes[i]) for i, t in enumerate((x, w, g)))
    checks = {
        "fprop": (y, dx @ dw.t() + layer.bias.double(), 256, True),
        "dgrad": (x.grad, dg @ dw, 128, False),
        "wgrad": (layer.weight.grad, dg.t() @ dx, tokens, False),
    }
    for name, (out, ref, k, fast) in checks.items():
        err = rel_err(out, ref)
        record_property(f"{name}_rel_err", err)
        assert err <= gemm_rtol(k, fast), f"{name}: {err:.3e} > {gemm_rtol(k, fast):.3e} (K={k}, fast={fast})"


def test_fp8_really_ran():
    # the FP8 output is far from the unquantized product: the tolerance above could catch a wrong operand
    torch.manual_seed(0)
    layer = fp8_trainer.convert_to_fp8(nn.Linear(256, 128).cuda())
    x = torch.randn(64, 256, device="cuda")
    with fp8_autocast(fp8_recipe=CurrentScaling()), torch.no_grad():
        y = layer(x)
    exact = x.double() @ layer.weight.double().t() + layer.bias.double()
    assert rel_err(y, exact) > 5 * gemm_rtol(256, True)  # E4M3 rounding of x and w: about 3.5e-2


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_scaled_mm_gets_aligned_scales(recipe, monkeypatch):
    # Layers at index >= 1 hand _scaled_mm views of the shared scale buffers at non-zero offsets (the H200
    # failed every delayed-scaling GEMM with CUBLAS_STATUS_NOT_SUPPORTED when they sat at 4 * i bytes).
    calls = []
    real = torch._scaled_mm
    names = ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")

    def recording(*args, **kwargs):
        arg = {**dict(zip(names, args, strict=False)), **kwargs}
        calls.append(
            {
                "misaligned": [n for n in ("self", "mat2", "scale_a", "scale_b") if arg[n].data_ptr() % 16],
                "fast": bool(arg.get("use_fast_accum", False)),
            }
        )
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 64))
    model = fp8_trainer.convert_to_fp8(mlp.to("cuda", torch.bfloat16))
    state = get_fp8_state(model)
    x = torch.randn(5, 37, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # 185 tokens
    for step in range(2):  # the second step runs on the scales the first one's update wrote
        before = len(calls)
        with fp8_autocast(fp8_recipe=RECIPES[recipe]):
            loss = model(x).float().square().mean()
        forward = calls[before:]
        loss.backward()
        backward = calls[before + len(forward) :]
        assert len(forward) == 3 and len(backward) == 6, (step, len(forward), len(backward))
        assert all(c["fast"] for c in forward) and not any(c["fast"] for c in backward), calls[before:]
        assert not any(c["misaligned"] for c in calls), calls
        assert bool(torch.isfinite(loss)) and bool(torch.isfinite(x.grad).all())
        for p in model.parameters():
            assert bool(torch.isfinite(p.grad).all())
            p.grad = None
        x.grad = None
    stats = fp8_trainer.step_stats(model)
    assert bool((stats[:, 5] > 0).all()), stats[:, 5]  # every tensor of every layer was quantized
    assert all(is_aligned_scale(state.scale[i]) and is_aligned_scale(state.scale_inv[i]) for i in range(9))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_train_cli_on_cuda(recipe):
    cmd = [sys.executable, "-m", "fp8_trainer.app.cli", "--device", "cuda", "--recipe", recipe, "--steps",
           "5", "--log-interval", "1", "--no-progress"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "step     5" in proc.stdout, proc.stdout[-3000:]
    assert "non-finite" not in proc.stdout, proc.stdout[-3000:]
