"""Launches per FP8 Linear on the GPU path, counted on the CPU.

On a GPU the host cost of an FP8 Linear is dominated by how many kernels and small ops it dispatches. Here
the Linear runs its GPU path on the CPU (real FP8 GEMM calls, the quantize-with-transposes and scale-update
entries registered as they are on CUDA, each counted as one launch), and a dispatch mode counts every ATen op
that would launch work on a device (views and allocations do not). The budget below is what the runtime
needs today; an extra op per layer or per step fails here first.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import fp8_kernels
import fp8_trainer
import fp8_trainer.gemm
import fp8_trainer.linear_ops
from fp8_kernels.triton.cross_build import LaunchCounter
from fp8_trainer import CurrentScaling, DelayedScaling, fp8_autocast
from fp8_trainer.scaling import scale_update_reference

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def gpu_path(monkeypatch):
    """The CUDA dispatch on the CPU: one counted launch per kernel entry, whatever its reference does."""
    counter = LaunchCounter()

    def kernel(name, fn):
        def launch(*args, **kwargs):
            counter.ops[f"kernel:{name}"] += 1
            counter.muted += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.muted -= 1

        return launch

    def quantize_t(x, scale, dtype, stats=None, **kw):  # kw: amax, dbias
        q, *rest = fp8_kernels.quantize_with_stats_reference(x, scale, dtype, stats, **kw)
        return (q, q.t().contiguous(), *rest)

    def current_t(x, dtype, stats=None, **kw):
        q, *rest = fp8_kernels.quantize_current_reference(x, dtype, stats, **kw)
        return (q, q.t().contiguous(), *rest)

    def scale_update(*args, **kwargs):  # the Triton kernel writes the aligned layout itself
        hist, scale, scale_inv = scale_update_reference(*args, **kwargs)
        return hist, fp8_kernels.aligned_scales(scale), fp8_kernels.aligned_scales(scale_inv)

    fp8_kernels.register("cpu", quantize=kernel("quantize", fp8_kernels.quantize_with_stats_reference),
                         quantize_transposed=kernel("quantize", quantize_t),
                         current=kernel("current", fp8_kernels.quantize_current_reference),
                         current_transposed=kernel("current", current_t),
                         scale_update=kernel("scale_update", scale_update))  # fmt: skip
    monkeypatch.setattr(fp8_trainer.gemm, "uses_scaled_mm", lambda device: True)
    monkeypatch.setattr(fp8_trainer.linear_ops, "uses_scaled_mm", lambda device: True)
    yield counter
    fp8_kernels.register("cpu")


@pytest.mark.parametrize(
    "recipe, per_layer",
    [
        # 3 fused quantize+transpose kernels, 3 GEMMs (bias in fprop's epilogue); the bias gradient comes
        # from grad_output's quantize kernel (cast-transpose-dbias): 6 launches per layer with a bias
        (DelayedScaling(amax_history_len=16), {"kernel:quantize": 3, "_scaled_mm": 3}),
        # current scaling: one kernel entry per tensor (amax pass + quantize pass inside, the latter also
        # writing scale_inv and, for grad_output, the bias gradient), the same GEMMs
        (CurrentScaling(), {"kernel:current": 3, "_scaled_mm": 3}),
    ],
    ids=["delayed", "current"],
)
def test_launches_per_layer_and_per_step(gpu_path, recipe, per_layer):
    n_layers = 4
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(n_layers)]).to(torch.bfloat16)
    model = fp8_trainer.convert_to_fp8(model, recipe=recipe)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):  # the last step is counted (the first ones warm caches, as on a GPU)
        model.zero_grad(set_to_none=True)
        x.grad = None
        gpu_path.ops.clear()
        with gpu_path:
            with fp8_autocast(fp8_recipe=recipe):
                y = model(x)
            y.sum().backward()
    # once per step: the scale update (also where every layer uses current scaling), the new statistics
    # buffer, its min_abs column (+inf) and its scale column, the amax column as float32, the step
    # counter; the loss: its sum and the ones its backward starts from
    per_step = {"kernel:scale_update": 1, "zeros": 1, "fill_": 1, "copy_": 1, "_to_copy": 1, "add": 1}
    loss = {"sum": 1, "ones_like": 1}
    expected = collections.Counter()
    for table, times in ((per_layer, n_layers), (per_step, 1), (loss, 1)):
        for op, n in table.items():
            expected[op] += n * times
    assert sorted(gpu_path.ops.items()) == sorted(expected.items()), str(sorted(gpu_path.ops.items()))
