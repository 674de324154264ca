"""Launches and host time per FP8 Linear forward + backward on the GPU path, emulated on the CPU: what the
Python side of a block-scaled layer (MXFP8, FP8 block scaling) costs the training step's host thread, beside
a bfloat16 ``nn.Linear`` and a delayed-scaling FP8 layer, measured without a GPU.

The layers run their CUDA code paths on CPU tensors, with the device's work left out:

* every Triton launcher runs (checks, output allocations, launch arguments) with its kernels replaced by a
  stub that counts one launch and runs nothing (the CUDA dispatch table registered for the CPU: the fused
  quantize-with-transpose kernels for delayed scaling, the block-quantize kernels for the block recipes;
  the once-per-step scale update stays the reference, which the per-layer difference cancels);
* GEMMs are counted and not computed: ``torch._scaled_mm`` (delayed scaling) and PyTorch's block-scaled
  ``scaled_mm`` are stubs, and the CPU kernels of ``mm`` / ``addmm`` (the bfloat16 layer's matmuls, the
  emulated GEMM's) are replaced for the run (``torch.library``), each returning an uninitialised output of
  the right shape. The block-scaled GEMM takes the path it takes on an H100 / H200 (sm_90): the native one
  for FP8 block scaling with E4M3 operands, the emulation (dequantize both operands, one float32 matmul)
  for MXFP8, which Hopper has no GEMM for;
* every other ATen op runs for real on small tensors and counts as one launch, except those that only make
  views or allocate (``NO_LAUNCH``); ``_local_scalar_dense`` (a value read on the host: ``.item()``,
  ``float(tensor)``) is counted apart, as ``host reads``.

Rows: ``bf16`` (``nn.Linear``), ``delayed`` (per-tensor delayed scaling), ``mxfp8`` and ``block`` (the
statistics folded by the block-quantize kernel: the shipped path), and ``mxfp8 eager stats`` / ``block eager
stats``: the same layers with the kernel quantizing and the statistics computed in eager ops
(``block_linear.block_tensor_stats``, the CPU path), measured in the same run: an eager fold like the one
the GPU path had before, which folded per-block kernel outputs in eager ops and read constants on the host
(348 launches and 12 host reads per MXFP8 layer, 311 and 10 per FP8 block-scaling layer, in this emulation
at the default shape).

Per layer: a model of ``L + 1`` layers minus one of 1 layer, over ``L`` (the per-step work, scale update and
loss, cancels). Host time: the median over rounds of a step's CPU time on its thread (another process's
work on a shared machine does not count), the same difference. It includes the CPU arithmetic of the ops
that run for real, which on a GPU is device time: the FP8 conversions and products of the MXFP8 GEMM
emulation, and in the eager-stats rows the statistics over every element. The default 256 tokens x 256
features (two 128-blocks along every contracted dimension, the shape
``tests/trainer/test_block_launch_budget.py`` counts) keep it small next to the dispatch but not nil.

    .venv/bin/python bench/block_host.py [--layers 4] [--steps 20] [--rounds 5] [--out PATH]
    .venv/bin/python bench/block_host.py --smoke     # a few steps: exercises the script only

Writes bench/results/block_host.json.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Column, layer_meta, layer_parser, table, write_report  # noqa: E402
from fp8_kernels.triton.cross_build import NO_LAUNCH, LaunchCounter  # noqa: E402
from fp8_trainer.recipe import DelayedScaling, Float8BlockScaling, MXFP8BlockScaling  # noqa: E402


def launch_counter() -> LaunchCounter:
    """Counts launches, ``lift_fresh`` (a Python value made a tensor: an upload, not a kernel) left out."""
    return LaunchCounter(NO_LAUNCH | {"lift_fresh"})


#: a value read on the host (a device synchronisation on a GPU)
HOST_READ = "_local_scalar_dense"


class _Stub:
    """A Triton kernel that counts its launches and runs nothing."""

    def __init__(self, counter: LaunchCounter, name: str):
        self.counter, self.name = counter, name

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.counter.ops[f"kernel:{self.name}"] += 1

        return run


def _addmm(bias, a, b, *, beta=1, alpha=1):
    return torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype)


@contextlib.contextmanager
def emulated_gpu(counter: LaunchCounter, eager_stats: bool = False):
    """The CUDA dispatch on the CPU (module docstring): Triton launchers with counting stubs for kernels,
    the CUDA block sizes, the GEMM paths of an sm_90 GPU."""
    import triton

    import fp8_kernels
    import fp8_trainer.block_gemm as block_gemm
    import fp8_trainer.block_linear as block_linear
    import fp8_trainer.gemm
    import fp8_trainer.linear
    from fp8_kernels.triton import block_quantize as triton_block_quantize
    from fp8_kernels.triton import cross_build
    from fp8_kernels.triton import quantize as triton_quantize

    undo = []
    gemms = None

    def patch(module, attr, value):
        undo.append((module, attr, getattr(module, attr)))
        setattr(module, attr, value)

    try:
        cross_build.cuda_sizes(patch)
        patch(triton_quantize, "saturating_cast", lambda device: True)
        tile = triton_block_quantize.block_tile
        patch(triton_block_quantize, "block_tile", lambda device, block: tile(cross_build.CUDA, block))
        for module in (triton_quantize, triton_block_quantize):
            for attr, value in list(vars(module).items()):
                if isinstance(value, triton.runtime.jit.JITFunction) and attr.endswith("_kernel"):
                    patch(module, attr, _Stub(counter, attr.strip("_")))
        fp8_kernels.register(
            "cpu",
            quantize=triton_quantize.quantize_with_stats_triton,
            quantize_transposed=triton_quantize.quantize_with_stats_transposed_triton,
            block_quantize=triton_block_quantize.block_quantize_triton,
        )
        for module in (fp8_trainer.gemm, fp8_trainer.linear):
            if hasattr(module, "uses_scaled_mm"):
                patch(module, "uses_scaled_mm", lambda device: True)
        # sm_90: FP8 block scaling's GEMM is native (a counted stub), MXFP8's emulated
        patch(block_gemm, "native_kinds", lambda device: frozenset({block_gemm.BLOCK}))

        def native(args):
            counter.ops["kernel:scaled_mm (block)"] += 1
            return torch.empty((args.mat_a.shape[0], args.mat_b.shape[1]), dtype=args.output_dtype)

        patch(block_gemm, "_call_native", native)

        def scaled_mm(a, b, *args, out_dtype=None, **kwargs):  # the tensorwise FP8 GEMM (delayed scaling)
            counter.ops["kernel:_scaled_mm"] += 1
            return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype or torch.bfloat16)

        patch(torch, "_scaled_mm", scaled_mm)
        if eager_stats:  # the kernel quantizes, the statistics are folded in eager ops (block_tensor_stats)
            quantize = block_linear._quantize
            patch(
                block_linear,
                "_quantize",
                lambda t, dtype, spec, block, rows=None: quantize(t, dtype, spec, block),
            )
        # the high-precision matmuls (the bfloat16 layer's, the MXFP8 emulation's): allocated, not computed
        gemms = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            gemms.impl("mm", lambda a, b: torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype), "CPU")
            gemms.impl("addmm", _addmm, "CPU")
        yield
    finally:
        if gemms is not None:
            gemms._destroy()
        fp8_kernels.register("cpu")
        for module, attr, value in reversed(undo):
            setattr(module, attr, value)


KINDS = ("bf16", "delayed", "mxfp8", "mxfp8 eager stats", "block", "block eager stats")


RECIPES = {
    "delayed": lambda: DelayedScaling(amax_history_len=16),
    "mxfp8": lambda: MXFP8BlockScaling(),
    "block": lambda: Float8BlockScaling(),
}


def _recipe_step(kind: str, n_layers: int, tokens: int, features: int):
    """One training step of ``n_layers`` bfloat16 Linears (``features`` -> ``features``, with bias) on
    ``tokens`` tokens, converted for ``kind`` (``"bf16"``: left as they are)."""
    import fp8_trainer

    model = nn.Sequential(*[nn.Linear(features, features) for _ in range(n_layers)]).to(torch.bfloat16)
    recipe = RECIPES[kind.split()[0]]() if kind != "bf16" else None
    if recipe is not None:
        model = fp8_trainer.convert_to_fp8(model, recipe=recipe)
    x = torch.randn(tokens, features, dtype=torch.bfloat16, requires_grad=True)

    def step():
        model.zero_grad(set_to_none=True)
        x.grad = None
        with fp8_trainer.fp8_autocast(fp8_recipe=recipe) if recipe is not None else contextlib.nullcontext():
            y = model(x)
        y.sum().backward()

    return step


def count_step(kind: str, n_layers: int, tokens: int, features: int) -> collections.Counter:
    """The ops of one step (the third: the first ones fill caches, as on a GPU)."""
    counter = launch_counter()
    with emulated_gpu(counter, eager_stats=kind.endswith("eager stats")):
        step = _recipe_step(kind, n_layers, tokens, features)
        for _ in range(3):
            counter.ops.clear()
            with counter:
                step()
    return counter.ops


def time_step(kind: str, n_layers: int, tokens: int, features: int, steps: int) -> float:
    """CPU seconds of this thread per step (a shared machine's other work does not count; autograd runs a
    CPU backward on the calling thread), outside the dispatch mode (whose Python would be timed too)."""
    with emulated_gpu(launch_counter(), eager_stats=kind.endswith("eager stats")):
        step = _recipe_step(kind, n_layers, tokens, features)
        for _ in range(3):
            step()
        t = time.thread_time()
        for _ in range(steps):
            step()
        return (time.thread_time() - t) / steps


def measure(layers: int, tokens: int, features: int, steps: int, rounds: int) -> list[dict]:
    rows = []
    for kind in KINDS:
        one, many = count_step(kind, 1, tokens, features), count_step(kind, layers + 1, tokens, features)
        per_layer = collections.Counter({op: (many[op] - one[op]) / layers for op in many | one})
        per_layer = {op: n for op, n in sorted(per_layer.items()) if n}
        times = {1: [], layers + 1: []}
        for r in range(rounds):
            for n in (1, layers + 1) if r % 2 == 0 else (layers + 1, 1):
                times[n].append(time_step(kind, n, tokens, features, steps))
        t1, tn = statistics.median(times[1]), statistics.median(times[layers + 1])
        rows.append(
            {
                "layer": kind,
                "launches_per_layer": sum(n for op, n in per_layer.items() if op != HOST_READ),
                "kernel_launches_per_layer": sum(
                    n for op, n in per_layer.items() if op.startswith("kernel:")
                ),
                "host_reads_per_layer": per_layer.get(HOST_READ, 0),
                "host_us_per_layer": (tn - t1) / layers * 1e6,
                "ops_per_layer": per_layer,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    per_layer = "L: per layer is (L + 1 layers - 1 layer) / L"
    ap = layer_parser(
        __doc__,
        "block_host.json",
        layers=4,
        tokens=256,
        features=256,
        steps=20,
        rounds=5,
        layers_help=per_layer,
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.steps, args.rounds = 1, 2, 1
    torch.set_num_threads(1)
    rows = measure(args.layers, args.tokens, args.features, args.steps, args.rounds)
    columns = [
        Column("layer", "layer", 18),
        Column("launches", "launches_per_layer", 9, ".1f"),
        Column("kernels", "kernel_launches_per_layer", 8, ".1f"),
        Column("host reads", "host_reads_per_layer", 11, ".1f"),
        Column("host us", "host_us_per_layer", 9, ".1f"),
    ]
    lines = table(rows, columns, "(per Linear fwd+bwd)")
    lines.append(
        "host us: the Python and dispatch of every op, plus the CPU arithmetic of the ops that run for real "
        "(the eager-stats rows compute their statistics over every element here, which a GPU does on the "
        "device: their host us is an upper bound; launch counts are exact)"
    )
    heading = (
        f"GPU path emulated on the CPU (kernels and GEMMs counted, not run), {args.tokens} tokens, "
        f"{args.features} -> {args.features}, median of {args.rounds} rounds"
    )
    return write_report(args.out, heading, lines, rows, layer_meta(args))


if __name__ == "__main__":
    sys.exit(main())
