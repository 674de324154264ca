"""GPU-only checks: real FP8 GEMMs (torch._scaled_mm) and the quantize bits on the device."""

import copy

import pytest
import torch
from torch import nn

import fp8_trainer
from fp8_trainer import CurrentScaling, fp8_autocast
from fp8_trainer.gemm import uses_scaled_mm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and uses_scaled_mm(torch.device("cuda"))),
        reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)",
    ),
]


def test_quantize_bits_on_gpu_equal_cpu_reference():
    from fp8_kernels import quantize_with_stats

    x = torch.randn(1023, 77) * torch.logspace(-6, 4, 77)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q_cpu, row_cpu = quantize_with_stats(x, torch.tensor(3.0), dtype)
        q_gpu, row_gpu = quantize_with_stats(x.cuda(), torch.tensor(3.0, device="cuda"), dtype)
        assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
        assert torch.equal(row_gpu.cpu(), row_cpu)


@pytest.mark.parametrize("tokens", [16, 7, 129])
def test_scaled_mm_matches_emulation(tokens):
    torch.manual_seed(0)
    ref = nn.Linear(256, 128).cuda()
    layer = fp8_trainer.convert_to_fp8(copy.deepcopy(ref))
    x = torch.randn(tokens, 256, device="cuda", requires_grad=True)
    with fp8_autocast(fp8_recipe=CurrentScaling()):
        y = layer(x)
    y.backward(torch.ones_like(y))
    cpu = fp8_trainer.convert_to_fp8(copy.deepcopy(ref).cpu())
    xc = x.detach().cpu().requires_grad_(True)
    with fp8_autocast(fp8_recipe=CurrentScaling()):
        yc = cpu(xc)
    yc.backward(torch.ones_like(yc))
    # same FP8 operands; only the accumulation order of the GEMMs differs (float32 both)
    torch.testing.assert_close(y.cpu(), yc, rtol=1e-5, atol=1e-5 * yc.abs().max().item())
    torch.testing.assert_close(x.grad.cpu(), xc.grad, rtol=1e-5, atol=1e-5 * xc.grad.abs().max().item())
    torch.testing.assert_close(
        layer.weight.grad.cpu(), cpu.weight.grad, rtol=1e-5, atol=1e-5 * cpu.weight.grad.abs().max().item()
    )
