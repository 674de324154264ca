"""The GPU GEMM path checked on the CPU: every argument the FP8 Linear hands ``torch._scaled_mm`` meets
cuBLASLt's rules (``fp8_trainer.gemm.check_scaled_mm_args``), and the scales live in 16-byte-aligned storage.

On an H200 the default recipe crashed in every FP8 GEMM because layer k's scale was a 0-dim view at byte
offset 4·(3k+r) of one packed float32 buffer: the CPU ``_scaled_mm`` accepts that, cuBLASLt does not. Here the
Linear is switched onto its real-FP8-GEMM path on the CPU (``torch._scaled_mm`` runs there too, slowly: tiny
shapes only), so the checker sees exactly what a GPU would get.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fp8_trainer
import fp8_trainer.gemm
import fp8_trainer.linear_ops
from fp8_kernels import SCALE_STRIDE, aligned_scales, is_aligned_scale
from fp8_trainer import CurrentScaling, DelayedScaling, fp8_autocast
from fp8_trainer.gemm import check_scaled_mm_args, fp8_mm

pytestmark = pytest.mark.usefixtures("one_thread")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8(shape, dtype=E4M3, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _scale(value=1.0):
    return aligned_scales(torch.tensor([value, 1.0, 1.0]))[0]


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """The Linear on its real-FP8-GEMM path on the CPU; every ``torch._scaled_mm`` call recorded."""
    calls = []
    real = torch._scaled_mm

    def recording(a, b, **kw):
        calls.append((a, b, kw))
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    monkeypatch.setattr(fp8_trainer.gemm, "uses_scaled_mm", lambda device: True)
    monkeypatch.setattr(fp8_trainer.linear_ops, "uses_scaled_mm", lambda device: True)
    return calls


# ----- the checker itself -----


def test_checker_accepts_what_cublaslt_takes():
    a, b = _fp8((13, 32)), _fp8((48, 32), seed=1).t()  # M = 13: any M is fine
    check_scaled_mm_args(a, b, _scale(), _scale(), torch.bfloat16, torch.zeros(48, dtype=torch.bfloat16))
    check_scaled_mm_args(a, _fp8((48, 32), E5M2).t(), _scale(), _scale(), torch.float32)


@pytest.mark.parametrize(
    "what, args, message",
    [
        (
            "scale at byte 4",
            lambda: (_fp8((16, 32)), _fp8((16, 32)).t(), torch.ones(4)[1], _scale()),
            "scale_a",
        ),
        (
            "scale_b at byte 8",
            lambda: (_fp8((16, 32)), _fp8((16, 32)).t(), _scale(), torch.ones(4)[2]),
            "scale_b",
        ),
        ("K not /16", lambda: (_fp8((16, 24)), _fp8((16, 24)).t(), _scale(), _scale()), "multiples of 16"),
        ("N not /16", lambda: (_fp8((16, 32)), _fp8((24, 32)).t(), _scale(), _scale()), "multiples of 16"),
        (
            "a column-major",
            lambda: (_fp8((32, 16)).t(), _fp8((16, 32)).t(), _scale(), _scale()),
            "a: expected row",
        ),
        ("b row-major", lambda: (_fp8((16, 32)), _fp8((32, 16)), _scale(), _scale()), "b: expected column"),
        ("E5M2 x E5M2", lambda: (_fp8((16, 32), E5M2), _fp8((16, 32), E5M2).t(), _scale(), _scale()), "E5M2"),
        (
            "bf16 operand",
            lambda: (torch.ones(16, 32, dtype=torch.bfloat16), _fp8((16, 32)).t(), _scale(), _scale()),
            "a: expected an FP8",
        ),
        (
            "float64 scale",
            lambda: (_fp8((16, 32)), _fp8((16, 32)).t(), torch.ones((), dtype=torch.float64), _scale()),
            "float32 scalar",
        ),
    ],
)
def test_checker_rejects_what_cublaslt_refuses(what, args, message):
    a, b, sa, sb = args()
    with pytest.raises(ValueError, match=message):
        check_scaled_mm_args(a, b, sa, sb, torch.bfloat16)


def test_checker_rejects_float64_output_and_float32_bias():
    a, b = _fp8((16, 32)), _fp8((16, 32)).t()
    with pytest.raises(ValueError, match="out_dtype"):
        check_scaled_mm_args(a, b, _scale(), _scale(), torch.float64)
    with pytest.raises(ValueError, match="bias: not supported with a float32 output"):
        check_scaled_mm_args(a, b, _scale(), _scale(), torch.float32, torch.zeros(16))


def test_float64_output_is_computed_in_float32_and_cast(scaled_mm_calls):
    a, b = _fp8((5, 32)), _fp8((16, 32), seed=1).t()
    out = fp8_mm(a, _scale(0.5), b, _scale(2.0), torch.float64)
    assert out.dtype == torch.float64
    assert scaled_mm_calls[0][2]["out_dtype"] == torch.float32
    ref = a.to(torch.float64) @ b.to(torch.float64)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_hot_path_checks_every_call_not_only_the_first(scaled_mm_calls):
    # the full check runs once per layout; a later call with the same layout but a scale 4 bytes off its
    # 16-byte boundary (a packed vector's second element) must still be refused, naming the argument
    a, b = _fp8((5, 32)), _fp8((16, 32), seed=1).t()
    fp8_mm(a, _scale(), b, _scale(), torch.bfloat16)
    packed = torch.ones(4)  # 16-byte aligned buffer: element 1 sits at byte offset 4
    with pytest.raises(ValueError, match="scale_b: data pointer at byte offset 4"):
        fp8_mm(a, _scale(), b, packed[1], torch.bfloat16)
    assert len(scaled_mm_calls) == 1
    # and a new layout gets the whole check: K not a multiple of 16 in an operand of another shape
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_mm(_fp8((5, 32)), _scale(), _fp8((24, 32), seed=2).t(), _scale(), torch.bfloat16)


# ----- the model's state -----


def test_every_tensors_scale_starts_a_16_byte_block():
    model = fp8_trainer.convert_to_fp8(nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]))
    state = fp8_trainer.get_fp8_state(model)
    x = torch.randn(4, 16, requires_grad=True)
    for _ in range(2):  # after end_step too (the reference update returns packed vectors)
        for t in (state.scale, state.scale_inv):
            assert t.stride() == (SCALE_STRIDE,)
            assert all(is_aligned_scale(t[i]) for i in range(state.n_tensors))
        with fp8_autocast():
            model(x).sum().backward()
    loaded = fp8_trainer.convert_to_fp8(nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]))
    loaded.load_state_dict(model.state_dict())
    state = fp8_trainer.get_fp8_state(loaded)
    assert all(is_aligned_scale(state.scale_inv[i]) for i in range(state.n_tensors))
    assert torch.equal(state.scale, fp8_trainer.get_fp8_state(model).scale)


# ----- the whole Linear on the GPU path -----


@pytest.mark.parametrize(
    "recipe", [DelayedScaling(amax_history_len=4), CurrentScaling()], ids=["delayed", "current"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_layers_forward_backward_pass_the_checker(scaled_mm_calls, recipe, dtype):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32), nn.GELU(), nn.Linear(32, 16))
    ref = ref.to(dtype)
    gpu_path = fp8_trainer.convert_to_fp8(copy.deepcopy(ref), recipe=recipe)
    x0 = torch.randn(13, 32, dtype=dtype)  # 13 tokens: fprop and dgrad take M = 13 as it is, wgrad pads K
    for step in range(3):  # step 0 runs with scale 1; later steps with scales at offsets 16·i
        scaled_mm_calls.clear()
        x = x0.clone().requires_grad_(True)
        with fp8_autocast(fp8_recipe=recipe):
            y = gpu_path(x)
        y.float().square().sum().backward()
        assert len(scaled_mm_calls) == 9, step  # fprop, dgrad, wgrad per layer (all checked before the call)
        for _, _, kw in scaled_mm_calls:
            assert is_aligned_scale(kw["scale_a"]) and is_aligned_scale(kw["scale_b"])
        fprops = [c for c in scaled_mm_calls if c[2]["use_fast_accum"]]
        assert len(fprops) == 3 and all(a.shape[0] == 13 for a, _, _ in fprops)  # fprop: fast, M unpadded
        dgrads = [c for c in scaled_mm_calls if not c[2]["use_fast_accum"] and c[0].shape[0] == 13]
        assert len(dgrads) == 3 and all(a.shape[1] % 16 == 0 for a, _, _ in dgrads)
        wgrads = [c for c in scaled_mm_calls if not c[2]["use_fast_accum"] and c[0].shape[0] != 13]
        assert len(wgrads) == 3 and all(a.shape[1] == 16 for a, _, _ in wgrads)  # K = 13 padded to 16
        if dtype == torch.bfloat16:
            assert all(kw["bias"] is not None for _, _, kw in fprops)  # bias in the GEMM's epilogue


def test_gpu_path_equals_emulation(scaled_mm_calls, monkeypatch):
    torch.manual_seed(0)
    model = fp8_trainer.convert_to_fp8(
        nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)),
        recipe=DelayedScaling(amax_history_len=2),
    )
    x0 = torch.randn(13, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # scales away from 1 first (the same for both runs below)
        with fp8_autocast():
            model(x0).square().sum().backward()
    assert not torch.all(fp8_trainer.get_fp8_state(model).scale == 1)
    results, first_outputs = [], []
    scaled_mm_calls.clear()
    for real_gemm in (True, False):
        if not real_gemm:
            monkeypatch.setattr(fp8_trainer.gemm, "uses_scaled_mm", lambda device: False)
            monkeypatch.setattr(fp8_trainer.linear_ops, "uses_scaled_mm", lambda device: False)
        m = copy.deepcopy(model)
        m.zero_grad(set_to_none=True)
        m[0].register_forward_hook(lambda _m, _i, out: first_outputs.append(out.detach()))
        x = x0.clone().requires_grad_(True)
        with fp8_autocast():
            y = m(x)
        y.square().sum().backward()
        results.append((y.detach(), x.grad, m[0].weight.grad, m[2].weight.grad))
    assert len(scaled_mm_calls) == 6  # the first run really went through torch._scaled_mm
    # each GEMM against the emulation's arithmetic on the same FP8 operands and scales: only the float32
    # accumulation order differs
    for a, b, kw in list(scaled_mm_calls):
        got = torch._scaled_mm(a, b, **kw).float()
        want = (a.float() * kw["scale_a"]) @ (b.float() * kw["scale_b"])
        if kw.get("bias") is not None:
            want = want + kw["bias"].float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # end to end, the first layer's output (the same operands in both runs) agrees to that order too; what
    # follows is requantized, where a last-bit difference may round an FP8 value the other way
    (y_real, *_), (y_emulated, *_) = results
    assert y_real.shape == y_emulated.shape
    torch.testing.assert_close(first_outputs[0], first_outputs[1], rtol=1e-5, atol=1e-6)
