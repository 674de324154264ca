"""Launches per block-scaled FP8 Linear (MXFP8, FP8 block scaling) on the GPU path, counted on the CPU.

The layer runs its CUDA path on CPU tensors: the block-quantize launcher (``triton.block_quantize``) as
registered on CUDA, its Triton kernels replaced by stubs that count one launch each and run nothing; the
block-scaled GEMM on the paths of an sm_90 GPU (FP8 block scaling's native ``scaled_mm``, a counted stub;
MXFP8 emulated, which Hopper has no GEMM for). ``LaunchCounter`` counts every other ATen op that would
launch work on a device, and ``_local_scalar_dense`` (a value read on the host) would show as one.

The budgets are what the layer needs now (``bench/block_host.py`` prints the same counts beside a bfloat16
``nn.Linear`` and a delayed-scaling layer); when the statistics were folded in eager ops, the same layer took
348 (MXFP8) and 311 (FP8 block scaling) launches and 12 / 10 host reads at this shape.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import fp8_kernels
import fp8_trainer
import fp8_trainer.block_gemm as block_gemm
from fp8_kernels.triton import cross_build
from fp8_kernels.triton.cross_build import LaunchCounter
from fp8_trainer import fp8_autocast
from fp8_trainer.recipe import Float8BlockScaling, MXFP8BlockScaling

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def block_gpu_path(monkeypatch):
    """The CUDA dispatch of the block recipes on the CPU (module docstring)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install .[dev])")
    from fp8_kernels.triton import block_quantize as triton_block_quantize

    counter = LaunchCounter()

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                counter.ops[f"kernel:{self.name}"] += 1

            return run

    for name in ("_block_quantize_kernel", "_block_fold_kernel"):  # (a launcher without a fold: none)
        monkeypatch.setattr(triton_block_quantize, name, Stub(name.strip("_")), raising=False)
    tile = triton_block_quantize.block_tile
    monkeypatch.setattr(triton_block_quantize, "block_tile", lambda device, b: tile(cross_build.CUDA, b))
    fp8_kernels.register("cpu", block_quantize=triton_block_quantize.block_quantize_triton)
    monkeypatch.setattr(block_gemm, "native_kinds", lambda device: frozenset({block_gemm.BLOCK}))

    def native(args):
        counter.ops["kernel:scaled_mm"] += 1
        return torch.empty((args.mat_a.shape[0], args.mat_b.shape[1]), dtype=args.output_dtype)

    monkeypatch.setattr(block_gemm, "_call_native", native)
    yield counter
    fp8_kernels.register("cpu")


def _step_ops(counter, recipe, n_layers: int) -> collections.Counter:
    # 256 tokens and features: two blocks of 128 along every contracted dimension, as a real layer has more
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(n_layers)]).to(torch.bfloat16)
    model = fp8_trainer.convert_to_fp8(model, recipe=recipe)
    x = torch.randn(256, 256, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):  # the last step is counted (the first ones fill caches, as on a GPU)
        model.zero_grad(set_to_none=True)
        x.grad = None
        counter.ops.clear()
        with counter:
            with fp8_autocast(fp8_recipe=recipe):
                y = model(x)
            y.sum().backward()
    return collections.Counter(counter.ops)


# per layer, forward + backward: the input, weight and grad_output quantized (1-D blocks: a row-wise and a
# column-wise launch each, the column-wise one reading the transposed tensor in place; 2-D weight blocks:
# one launch, the transposed copy for dgrad made from it), one statistics fold per recorded tensor; the
# three GEMMs; the output and gradients cast to bfloat16, the bias added and its gradient
MXFP8_LAYER = {
    "kernel:block_quantize_kernel": 6,
    "kernel:block_fold_kernel": 3,
    # the emulated GEMM, three times: both operands dequantized (FP8 to float32, E8M0 codes to int32 for
    # the table lookup, the lookup, the product), one float32 matmul
    "_to_copy": 3 * 4 + 4,  # + out, grad_input and grad_weight to bfloat16, the bias to float32
    "index_select": 6,
    "mul": 6,
    "mm": 3,
    "add": 1,
    "sum": 1,
}
BLOCK_LAYER = {
    "kernel:block_quantize_kernel": 5,  # x, g: row-wise and column-wise; w: one 128x128-block launch
    "kernel:block_fold_kernel": 3,
    "kernel:scaled_mm": 3,  # all three native on sm_90 (E4M3 operands)
    # the weight's transposed copy (data and scales) for dgrad. The 1x128 scales come out of the kernel in
    # the GEMM's outer-dim-major layout: no copy
    "clone": 2,
    "new_zeros": 2,  # the 128x128 scales padded to 16 bytes per row (fprop, dgrad)
    "copy_": 2,
    "_to_copy": 4,
    "add": 1,
    "sum": 1,
}


@pytest.mark.parametrize(
    "recipe, per_layer",
    [(MXFP8BlockScaling(), MXFP8_LAYER), (Float8BlockScaling(), BLOCK_LAYER)],
    ids=["mxfp8", "block"],
)
def test_block_launches_per_layer(block_gpu_path, recipe, per_layer):
    one = _step_ops(block_gpu_path, recipe, 1)
    five = _step_ops(block_gpu_path, recipe, 5)
    measured = {op: (five[op] - one[op]) / 4 for op in five | one if five[op] != one[op]}
    assert "_local_scalar_dense" not in five, "a value read on the host"
    assert sorted(measured.items()) == sorted(per_layer.items()), str(sorted(measured.items()))
    assert sum(per_layer.values()) == {"mxfp8": 42, "block": 23}[recipe.scaling]
