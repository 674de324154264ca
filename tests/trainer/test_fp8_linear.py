"""FP8 Linear numerics: SQNR against float32, and agreement with torchao's emulated Float8Linear."""

import copy

import pytest
import torch
from torch import nn

import fp8_trainer
from fp8_trainer import CurrentScaling, DelayedScaling, Linear, fp8_autocast

# (leading dims of the input, in_features, out_features): weight dims multiples of 16; token counts odd,
# prime or 3-D; square and non-square weights
# (the grid also covers every place the emulated GEMM can apply the dequantization scales: output, a, b)
SHAPES = [
    ((16,), 32, 32),
    ((7,), 48, 16),
    ((3, 5), 64, 32),
    ((129,), 256, 80),
    ((1,), 16, 112),
    ((257,), 16, 32),
]


def sqnr(ref: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    return (20 * torch.log10(ref.norm() / (ref - actual).norm())).item()


def run_layer(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, **autocast):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    if autocast:
        with fp8_autocast(**autocast):
            y = layer(x)
    else:
        y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def make(lead, k, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ref = nn.Linear(k, n)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        ref.bias.copy_(torch.randn(n, generator=gen))
    x = torch.randn(*lead, k, generator=gen) * 3
    g = torch.randn(*lead, n, generator=gen) * 1e-3  # typical gradient magnitudes (scale 1 would underflow)
    return ref, x, g


@pytest.mark.parametrize("lead,k,n", SHAPES)
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_sqnr_against_float32(lead, k, n, recipe):
    ref, x, g = make(lead, k, n)
    layer = fp8_trainer.convert_to_fp8(copy.deepcopy(ref))
    r = CurrentScaling() if recipe == "current" else DelayedScaling(amax_history_len=4)
    if recipe == "delayed":  # one step to learn the amaxes (the initial scale is 1)
        run_layer(layer, x, g, fp8_recipe=r)
    y, dx, dw, db = run_layer(layer, x, g, fp8_recipe=r)
    y_ref, dx_ref, dw_ref, db_ref = run_layer(ref, x, g)
    assert y.shape == y_ref.shape and dx.shape == x.shape
    assert sqnr(y_ref, y) >= 20
    assert sqnr(dx_ref, dx) >= 15
    assert sqnr(dw_ref, dw) >= 15
    assert torch.equal(db, db_ref)  # bias gradient stays in high precision
    assert sqnr(y_ref, y) < 60  # and the output really went through FP8


def test_outside_autocast_is_plain_linear():
    ref, x, g = make((9,), 32, 48)
    layer = fp8_trainer.convert_to_fp8(copy.deepcopy(ref))
    for got, want in zip(run_layer(layer, x, g), run_layer(ref, x, g), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(run_layer(layer, x, g, enabled=False), run_layer(ref, x, g), strict=True):
        assert torch.equal(got, want)
    assert fp8_trainer.step_stats(layer) is None  # nothing was recorded


def test_bf16_input_gives_bf16_output():
    layer = Linear(32, 16).to(torch.bfloat16)
    x = torch.randn(5, 32, dtype=torch.bfloat16, requires_grad=True)
    with fp8_autocast():
        y = layer(x)
    y.float().sum().backward()
    assert (
        y.dtype == torch.bfloat16
        and x.grad.dtype == torch.bfloat16
        and layer.weight.grad.dtype == torch.bfloat16
    )


def test_rejects_unaligned_dims():
    with pytest.raises(ValueError, match="multiples of 16"):
        Linear(24, 32)


@pytest.mark.parametrize("lead,k,n", SHAPES)
def test_matches_torchao_emulated_current_scaling(lead, k, n):
    """With current scaling both runtimes compute the same scale (448/amax; torchao divides in float64 and
    rounds to float32, which equals the float32 quotient because double rounding of a quotient from 53 to
    24 bits is innocuous) and the same saturated casts, so the FP8 operands are bit-identical. They differ
    only in where dequantization happens: torchao divides each operand by its scale before a float32 GEMM,
    fp8scope multiplies the float32 GEMM of the FP8 values by scale_inv_a * scale_inv_b once. That moves each
    product by a few float32 ulps, so we allow 1e-5 relative to the output's magnitude, 100x float32 eps
    and still ~4 orders below the FP8 error (E4M3's relative step is 2^-3)."""
    # skips this test alone where torchao is missing, not the module's others
    torchao_float8 = pytest.importorskip(
        "torchao.float8", reason="torchao is a test dependency (pip install .[dev])"
    )
    from torchao.float8.float8_linear import Float8Linear  # not re-exported by torchao.float8

    ref, x, g = make(lead, k, n, seed=3)
    ours = fp8_trainer.convert_to_fp8(copy.deepcopy(ref))
    theirs = Float8Linear.from_float(
        copy.deepcopy(ref), config=torchao_float8.Float8LinearConfig(emulate=True)
    )
    got = run_layer(ours, x, g, fp8_recipe=CurrentScaling())
    want = run_layer(theirs, x, g)
    for a, b, what in zip(got, want, ("output", "grad_input", "grad_weight", "grad_bias"), strict=True):
        tol = 1e-5 * b.abs().max().item()
        assert (a - b).abs().max().item() <= tol, what
    # and the comparison is not vacuous: FP8 differs from float32 far beyond that tolerance
    y_ref = run_layer(ref, x, g)[0]
    assert (y_ref - want[0]).abs().max().item() > 100 * 1e-5 * want[0].abs().max().item()


def test_a_deep_copied_model_has_its_own_state_handle_and_plans():
    """``copy.deepcopy`` of a trained FP8 model: its state is found by its own handle (the custom operators
    look states up by it: a shared handle would record the copy's statistics into the original), and it
    starts without the original's layer plans (caches made under the original's conditions)."""
    from fp8_trainer import linear_ops

    torch.manual_seed(0)
    model = fp8_trainer.convert_to_fp8(nn.Sequential(nn.Linear(32, 16)))
    with fp8_trainer.fp8_autocast():
        model(torch.randn(4, 32)).sum().backward()
    state = fp8_trainer.get_fp8_state(model)
    assert state.linear_plans
    twin = copy.deepcopy(model)
    twin_state = fp8_trainer.get_fp8_state(twin)
    assert twin_state is not state and twin_state.handle != state.handle
    assert linear_ops._STATES[twin_state.handle] is twin_state and linear_ops._STATES[state.handle] is state
    assert twin_state.linear_plans == {}
    assert torch.equal(twin_state.scale, state.scale)
    assert torch.equal(twin_state.amax_history, state.amax_history)
    with fp8_trainer.fp8_autocast():
        twin(torch.randn(4, 32)).sum().backward()
    assert twin_state.steps == state.steps + 1
