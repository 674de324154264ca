"""fp8_kernels dispatch: references on the CPU, the reference switch, no triton import, empty tensors."""

import subprocess
import sys

import fp8_kernels
import pytest
import torch
from fp8_kernels import (
    exponent_histogram,
    exponent_histogram_reference,
    fused_scale_update,
    quantize_with_stats,
    quantize_with_stats_reference,
    quantize_with_stats_transposed,
    reference_kernels,
    tensor_amax,
    use_reference,
)


def test_import_needs_no_triton():
    code = (
        "import sys\n"
        "import fp8_kernels\n"
        "assert 'triton' not in sys.modules, 'importing fp8_kernels imported triton'\n"
        "sys.modules['triton'] = None  # as if it were not installed\n"
        "import torch\n"
        "assert not fp8_kernels.triton_available()\n"
        "q, row = fp8_kernels.quantize_with_stats(torch.tensor([1.0, 500.0]), torch.tensor(1.0), "
        "torch.float8_e4m3fn)\n"
        "assert row.tolist() == [500.0, 1.0, 1, 0, 0, 2], row\n"
        "assert fp8_kernels.fused_scale_update('cuda') is None\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def _counting(calls, name, fn):
    def wrapper(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return wrapper


def test_reference_switch_bypasses_registered_kernels():
    calls = []
    fp8_kernels.register(
        "cpu",
        quantize=_counting(calls, "quantize", quantize_with_stats_reference),
        amax=_counting(calls, "amax", fp8_kernels.tensor_amax_reference),
        histogram=_counting(calls, "histogram", exponent_histogram_reference),
        scale_update=_counting(calls, "scale_update", lambda *a, **k: None),
    )
    x, s = torch.tensor([1.0, -3.0]), torch.tensor(1.0)
    try:
        quantize_with_stats(x, s, torch.float8_e4m3fn)
        tensor_amax(x)
        exponent_histogram(x)
        assert fused_scale_update("cpu") is not None
        assert calls == ["quantize", "amax", "histogram"]
        with reference_kernels():
            quantize_with_stats(x, s, torch.float8_e4m3fn)
            tensor_amax(x)
            exponent_histogram(x)
            assert fused_scale_update("cpu") is None
            assert use_reference(True) is True  # nested: the switch reports its state
        assert calls == ["quantize", "amax", "histogram"]
        assert use_reference(False) is False  # the context manager restored it
        quantize_with_stats(x, s, torch.float8_e4m3fn)
        assert calls[-1] == "quantize"
    finally:
        use_reference(False)
        fp8_kernels.register("cpu")
    assert fused_scale_update("cpu") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the dispatch of a machine without CUDA")
def test_no_cuda_registration_without_a_gpu():
    assert fused_scale_update("cuda") is None
    assert fused_scale_update(torch.device("cpu")) is None


def test_transposed_reference_fallback():
    x = torch.randn(5, 3) * 100
    q, qt, row = quantize_with_stats_transposed(x, torch.tensor(2.0), torch.float8_e5m2)
    q_ref, row_ref = quantize_with_stats_reference(x, torch.tensor(2.0), torch.float8_e5m2)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), q_ref.t().contiguous().view(torch.uint8)) and qt.is_contiguous()
    assert torch.equal(row, row_ref)
    with pytest.raises(ValueError, match="2-D"):
        quantize_with_stats_transposed(torch.ones(4), torch.tensor(1.0), torch.float8_e5m2)


def test_empty_tensor_statistics():
    for shape in [(0,), (0, 7)]:
        q, row = quantize_with_stats(torch.empty(shape), torch.tensor(4.0), torch.float8_e4m3fn)
        assert q.shape == shape and q.dtype == torch.float8_e4m3fn
        assert row.tolist() == [0.0, 4.0, 0, 0, 0, 0]
        assert tensor_amax(torch.empty(shape)).item() == 0.0
        assert int(exponent_histogram(torch.empty(shape)).sum()) == 0
    stats = torch.tensor([2.5, 1.0, 1, 2, 3, 9], dtype=torch.float64)
    quantize_with_stats(torch.empty(0), torch.tensor(4.0), torch.float8_e4m3fn, stats)
    assert stats.tolist() == [2.5, 4.0, 1, 2, 3, 9]  # an empty micro-batch adds nothing
