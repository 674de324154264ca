"""The Triton kernels compiled on a CUDA GPU: the interpreter's cases plus the FP8 bits, dispatch, training
(delayed and current scaling, backward GEMMs fed by the fused transposes) equal to the references bit for
bit, the FP8 GEMMs on kernel-quantized operands against float64 (a tolerance derived from the tensor cores'
accumulation, not float32's), and a training step with statistics that never synchronises with the host.
Skips without an sm_89+ GPU."""

import math

import pytest
import torch
from torch import nn

import fp8_kernels
import fp8_trainer
from fp8_kernels import quantize_with_stats_reference
from fp8_trainer.convert import get_fp8_state
from fp8_trainer.linear import fused_transposes
from tests.kernels import kernel_cases
from tests.support.gpu import FP8_GPU

RECIPES = {"delayed": fp8_trainer.DelayedScaling(), "current": fp8_trainer.CurrentScaling()}

pytestmark = FP8_GPU


@pytest.mark.parametrize("case", kernel_cases.case_names("cuda"))
def test_kernel_case_compiled(case):
    # on CUDA the cases also compare the FP8 bits with torch's cast of the pre-cast values
    kernel_cases.CASES[case][0](torch.device("cuda"))


def test_cuda_tensors_dispatch_to_triton():
    from fp8_kernels.dispatch import _BUILTIN
    from fp8_kernels.triton.quantize import quantize_with_stats_triton

    x = torch.randn(300, 77, device="cuda") * 100
    s = torch.tensor(2.5, device="cuda")
    q, row = fp8_kernels.quantize_with_stats(x, s, torch.float8_e4m3fn)
    assert _BUILTIN["quantize"]["cuda"] is quantize_with_stats_triton
    assert fp8_kernels.fused_scale_update("cuda") is not None
    with fp8_kernels.reference_kernels():
        assert fp8_kernels.fused_scale_update("cuda") is None
        q_ref, row_ref = fp8_kernels.quantize_with_stats(x, s, torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(row, row_ref)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
    return fp8_trainer.convert_to_fp8(mlp)


def _train(model: nn.Module, steps: int, x: torch.Tensor, recipe=None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):
        with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("recipe", RECIPES)
def test_training_with_kernels_equals_references_bitwise(recipe):
    # kernels: one fused call per quantized tensor, backward GEMMs fed by the transposes it wrote;
    # references: torch ops, and the GEMM wrapper's transposing copies
    x = torch.randn(193, 256, device="cuda")
    kern, ref = _model(), _model()
    _train(kern, 3, x, RECIPES[recipe])
    with fp8_kernels.reference_kernels():
        assert not fused_transposes(get_fp8_state(ref), 0, x.device)
        _train(ref, 3, x, RECIPES[recipe])
    assert fused_transposes(get_fp8_state(kern), 0, x.device)
    sk, sr = get_fp8_state(kern), get_fp8_state(ref)
    assert torch.equal(sk.last_stats.nan_to_num(-1), sr.last_stats.nan_to_num(-1))
    assert torch.equal(sk.amax_history, sr.amax_history)
    assert torch.equal(sk.scale, sr.scale) and torch.equal(sk.scale_inv, sr.scale_inv)
    for pk, pr in zip(kern.parameters(), ref.parameters(), strict=True):
        assert torch.equal(pk, pr)


@pytest.mark.parametrize("recipe", RECIPES)
def test_training_step_with_statistics_does_not_synchronise(recipe):
    model = _model()
    x = torch.randn(128, 256, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step():
        with fp8_trainer.fp8_autocast(fp8_recipe=RECIPES[recipe]):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # compile the kernels, warm the allocator
        step()
    torch.cuda.synchronize()
    steps_before = get_fp8_state(model).steps
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    state = get_fp8_state(model)
    assert state.steps == steps_before + 2
    stats = fp8_trainer.step_stats(model)
    assert stats.device.type == "cuda" and bool((stats[:, 5] > 0).all())


# Hopper's FP8 tensor cores accumulate with about 2**-13 relative precision per addition, not in float32; the
# derivation of this bound is in tests/trainer/test_fp8_linear_gpu.py (``gemm_rtol``): fprop uses fast
# accumulation, whose normwise error against float64 stays below 2**-13 * sqrt(K).
def _fprop_rtol(k: int) -> float:
    return 2.0**-13 * math.sqrt(k)


def test_fp8_linear_forward_matches_float64_with_kernels():
    # each layer's FP8 GEMM, fed by the Triton-quantized operands, against float64 on the same FP8 values
    # (the reference quantization of the layer's actual input and weight with the scales it used)
    model = _model(1)
    inputs, outputs = {}, {}

    def keep(i):
        def hook(module, args, out):
            inputs[i], outputs[i] = args[0], out

        return hook

    hooks = [m.register_forward_hook(keep(i)) for i, m in enumerate(model) if isinstance(m, nn.Linear)]
    x = torch.randn(64, 256, device="cuda")
    with fp8_trainer.fp8_autocast():
        model(x)
    for h in hooks:
        h.remove()
    state = get_fp8_state(model)
    assert sorted(outputs) == [0, 2]
    for k, i in enumerate(sorted(outputs)):
        layer = model[i]
        deq = []
        for r, t in ((0, inputs[i]), (1, layer.weight)):
            scale = state.stats[3 * k + r, 1].to(torch.float32)  # the scale this step quantized with
            q, _ = quantize_with_stats_reference(t.detach(), scale, state.dtypes[3 * k + r])
            deq.append(q.double() * torch.reciprocal(scale).double())
        ref = deq[0] @ deq[1].t() + layer.bias.detach().double()
        out = outputs[i].detach().double()
        err = float((out - ref).norm() / ref.norm())
        assert err <= _fprop_rtol(layer.in_features), (i, err)


def test_current_scaling_is_one_fused_call_per_tensor():
    from fp8_kernels.dispatch import _BUILTIN
    from fp8_kernels.triton.current import quantize_current_transposed_triton, quantize_current_triton

    x = torch.randn(300, 77, device="cuda") * 100
    q, scale, row = fp8_kernels.quantize_current(x, torch.float8_e5m2)
    assert _BUILTIN["current"]["cuda"] is quantize_current_triton
    assert _BUILTIN["current_transposed"]["cuda"] is quantize_current_transposed_triton
    _, qt, scale_t, row_t = fp8_kernels.quantize_current_transposed(x, torch.float8_e5m2)
    with fp8_kernels.reference_kernels():
        q_ref, scale_ref, row_ref = fp8_kernels.quantize_current(x, torch.float8_e5m2)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), q_ref.t().contiguous().view(torch.uint8))
    assert torch.equal(scale, scale_ref) and torch.equal(scale_t, scale_ref)
    assert torch.equal(row, row_ref) and torch.equal(row_t, row_ref)


def test_cached_launch_matches_the_generic_launch_bit_for_bit():
    """Launches after the first of a specialisation skip Triton's generic path (``triton.launch.launch``):
    their outputs equal the first launch's, for the 1-D and the transposed kernel, a misaligned view (another
    specialisation) included, and the handle is kept per specialisation."""
    from fp8_kernels.triton import launch as triton_launch
    from fp8_kernels.triton.quantize import launch_quantize

    triton_launch._HANDLES.clear()
    torch.manual_seed(0)
    base = torch.randn(4097 * 33 + 1, device="cuda", dtype=torch.bfloat16) * 50
    scale = torch.tensor(3.0, device="cuda")
    aligned, offset = base[:-1].view(4097, 33)[:, :32].contiguous(), base[1:].view(4097, 33)  # 2 B off
    for x in (aligned, offset):
        for transpose in (False, True):
            first = launch_quantize(x, scale, torch.float8_e4m3fn, None, transpose=transpose)
            n_handles = len(triton_launch._HANDLES)
            again = [
                launch_quantize(x, scale, torch.float8_e4m3fn, None, transpose=t) for t in [transpose] * 3
            ]
            assert len(triton_launch._HANDLES) == n_handles  # no new specialisation: the cached handle ran
            for out in again:
                assert torch.equal(out[0].view(torch.uint8), first[0].view(torch.uint8))
                if transpose:
                    assert torch.equal(out[1].view(torch.uint8), first[1].view(torch.uint8))
                assert torch.equal(out[2], first[2])
    assert len(triton_launch._HANDLES) == 4  # two kernels x (aligned, misaligned input)


@pytest.mark.parametrize("quality", [True, False], ids=["quality", "base"])
def test_pipelined_loads_give_the_shipped_bits(monkeypatch, quality):
    """The quantize kernels with their loads in Triton's software pipeline (``prefetch`` off: the form
    ``bench/kernels.py`` times beside the shipped one) write the same FP8 bits, transposes and statistics as
    the shipped register prefetch, on sizes with full blocks, a tail, edge tiles and a single element."""
    from fp8_kernels import new_stats
    from fp8_kernels.triton import quantize as triton_quantize
    from fp8_kernels.triton.quantize import launch_quantize
    from fp8_protocol.stats import ERR_SQ, SUM_SQ

    torch.manual_seed(0)
    scale = torch.tensor(3.0, device="cuda")
    shapes = [(4096, 1024), (3000, 1030), (129, 65), (1, 1), (8192, 2048)]
    for m, n in shapes:
        x = (torch.randn(m, n, device="cuda") * 60).to(torch.bfloat16)
        x.view(-1)[:: max(1, x.numel() // 7)] = float("nan")
        for transpose in (False, True):
            outs = []
            for pre in (True, False):
                monkeypatch.setattr(triton_quantize, "prefetch", lambda device, p=pre: p)
                outs.append(
                    launch_quantize(x, scale, torch.float8_e4m3fn, new_stats(device="cuda", quality=quality),
                                    transpose=transpose)
                )  # fmt: skip
            (q, qt, row, _), (q_p, qt_p, row_p, _) = outs
            assert torch.equal(q_p.view(torch.uint8), q.view(torch.uint8)), (m, n, transpose)
            if transpose:
                assert torch.equal(qt_p.view(torch.uint8), qt.view(torch.uint8)), (m, n)
            # every column exactly but the sums of squares: float64 atomic adds of per-program sums,
            # whose order across programs is the GPU's
            sums = [SUM_SQ, ERR_SQ] if quality else []
            exact = [c for c in range(row.shape[0]) if c not in sums]
            assert torch.equal(row_p[exact].nan_to_num(-1), row[exact].nan_to_num(-1)), (m, n, row, row_p)
            assert torch.allclose(row_p[sums], row[sums], rtol=1e-12, atol=0), (m, n, row, row_p)
            ref_q, _ = quantize_with_stats_reference(x, scale, torch.float8_e4m3fn, None)
            assert torch.equal(q_p.view(torch.uint8), ref_q.view(torch.uint8)), (m, n)
