"""Host time and launches per FP8 Linear forward+backward on the GPU path, measured without a GPU.

A GPU trains at full speed only while its host thread launches work faster than the GPU runs it; an FP8
Linear that spends more Python per call than ``nn.Linear`` makes small and medium layers host-bound. This runs
a stack of layers on the CPU with the GPU path emulated:

* the real Triton launchers (``fp8_kernels.triton.quantize`` / ``triton.current`` / ``triton.scale_update``)
  registered for the CPU as they are for CUDA, each kernel replaced by a recorder
  (``fp8_kernels.triton.cross_build.recorded``) that counts the launch and runs nothing;
* ``uses_scaled_mm`` forced on, so the FP8 layers take their real-GEMM path (operand layouts, transposes
  written by the quantize pass, the argument checks), and ``torch._scaled_mm`` replaced by an allocation of
  its output (fp8scope and torchao alike);
* tiny shapes (``--tokens`` x ``--features``, default 16 x 16), so what ``nn.Linear`` computes on the CPU
  (its GEMMs are real) costs well under a microsecond per call and its time is its host path.

One step is the forward and backward of ``--layers`` layers plus, for the FP8 layers, the step's end (scale
update: one launch per step for the model); the table shows host microseconds per layer (the step's time
over the layers, median over interleaved rounds) and launches per layer (device work: recorded kernels, the
GEMM stand-ins, and every ATen op that is not a view or an allocation, counted by a dispatch mode in a
separate, untimed step), and the ratio to ``nn.Linear``.

Goals (issue "FP8 that pays"): delayed scaling <= 2x ``nn.Linear``'s host time per layer, current <= 2.5x.

The ``floor`` rows are what no FP8 Linear written in Python can go below on this path: an
``autograd.Function`` that makes the same prepared quantize calls (the same allocations and launches), GEMM
stand-ins and saved tensors as fp8scope's layer and nothing else (no recipe, region, step or cache logic,
no checks), with a step end of one scale update launch and a fresh statistics buffer.
fp8scope's distance to its floor is its own Python; the floor's distance to ``nn.Linear`` is the cost of
quantizing in separate launches from Python at all.

    .venv/bin/python bench/host_path.py [--layers 8] [--steps 200] [--rounds 7] [--out PATH]
    .venv/bin/python bench/host_path.py --smoke

Writes bench/results/host_path.json.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Column, layer_meta, layer_parser, table, write_report  # noqa: E402
from fp8_kernels.triton.cross_build import NO_LAUNCH, LaunchCounter  # noqa: E402

GOALS = {"fp8scope delayed": 2.0, "fp8scope current": 2.5}


class _Launches:
    """Stands in for a recorder's list of grids: counts them and holds none."""

    def __init__(self):
        self.n = 0

    def append(self, _grid) -> None:
        self.n += 1


_GEMMS = _Launches()  # the FP8 GEMMs launched (allocate-only stand-ins: not ATen ops the counter sees)


def _scaled_mm_alloc(a, b, scale_a=None, scale_b=None, bias=None, out_dtype=None, **_):
    _GEMMS.append(None)
    return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype, device=a.device)


@contextlib.contextmanager
def gpu_path():
    """The emulated GPU path (module docstring); yields the recorders, whose ``calls`` count launches."""
    import fp8_kernels
    import fp8_trainer.gemm
    import fp8_trainer.linear_ops
    from fp8_kernels.triton import cross_build
    from fp8_kernels.triton import current as triton_current
    from fp8_kernels.triton import quantize as triton_quantize
    from fp8_kernels.triton import scale_update as triton_scale_update

    saved = fp8_kernels.registered()
    patched = [
        (fp8_trainer.gemm, "uses_scaled_mm"),
        (fp8_trainer.linear_ops, "uses_scaled_mm"),
        (torch, "_scaled_mm"),
    ]
    undo = [(mod, attr, getattr(mod, attr)) for mod, attr in patched]
    kernels = [
        (triton_quantize, "_quantize_kernel", True),
        (triton_quantize, "_quantize_t_kernel", True),
        (triton_current, "_amax_kernel", None),
        (triton_scale_update, "_scale_update_kernel", None),
    ]
    with contextlib.ExitStack() as stack:
        recorders = [
            stack.enter_context(cross_build.recorded(module, name, saturating_cast=sat))
            for module, name, sat in kernels
        ]
        for rec in recorders:
            rec.launches = collections.deque(maxlen=1)  # hold only the latest launch's arguments
            rec.grids = _Launches()
        try:
            fp8_kernels.register(
                "cpu",
                quantize=triton_quantize.quantize_with_stats_triton,
                quantize_transposed=triton_quantize.quantize_with_stats_transposed_triton,
                current=triton_current.quantize_current_triton,
                current_transposed=triton_current.quantize_current_transposed_triton,
                scale_update=triton_scale_update.scale_update_triton,
            )
            fp8_trainer.gemm.uses_scaled_mm = lambda device: True
            fp8_trainer.linear_ops.uses_scaled_mm = lambda device: True
            torch._scaled_mm = _scaled_mm_alloc
            yield recorders
        finally:
            for mod, attr, value in undo:
                setattr(mod, attr, value)
            fp8_kernels.restore(saved)


class _FloorFn(torch.autograd.Function):
    """An FP8 Linear reduced to its device work: the same prepared quantize calls (allocations and
    launches), GEMM stand-ins and saved tensors as fp8scope's layer (``linear_ops``), and nothing else: no
    recipe, region or step bookkeeping, no plan or cache lookups, no checks. What an FP8 Linear written in
    Python cannot go below on this host path (``--floor`` rows)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        (qx, qxt, sx, _), (qw, qwt, sw, _) = (
            layer.qx(x, layer.sx, layer.rx),
            layer.qw(weight, layer.sw, layer.rw),
        )
        sx, sw = layer.sx if sx is None else sx, layer.sw if sw is None else sw
        out = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, bias=bias, out_dtype=x.dtype)
        ctx.save_for_backward(qxt, sx, qwt, sw)
        ctx.layer = layer
        return out

    @staticmethod
    def backward(ctx, grad):
        qxt, sx, qwt, sw = ctx.saved_tensors
        layer = ctx.layer
        qg, qgt, sg, grad_b = layer.qg(grad, layer.sg, layer.rg)
        sg = layer.sg if sg is None else sg
        grad_x = torch._scaled_mm(qg, qwt.t(), scale_a=sg, scale_b=sw, out_dtype=grad.dtype)
        grad_w = torch._scaled_mm(qgt, qxt.t(), scale_a=sg, scale_b=sx, out_dtype=grad.dtype)
        return grad_x, grad_w, grad_b, None


class _FloorLinear(nn.Linear):
    """``nn.Linear`` through ``_FloorFn``, its prepared calls made at the first forward."""

    current = False
    step_end = None  # the model's step end, set on the last layer (_floor_stack)

    def forward(self, x):
        if not hasattr(self, "qx"):
            self._prepare(x)
        out = _FloorFn.apply(x, self.weight, self.bias, self)
        if self.step_end is not None:
            out.register_hook(self.step_end)
        return out

    def _prepare(self, x) -> None:
        import fp8_kernels

        op = "current_transposed" if self.current else "quantize_transposed"
        for role, like, fp8, dbias in (
            ("x", x, torch.float8_e4m3fn, False),
            ("w", self.weight, torch.float8_e4m3fn, False),
            ("g", x.new_empty(x.shape[0], self.out_features), torch.float8_e5m2, True),
        ):
            row, scale = fp8_kernels.new_stats(device=x.device), torch.ones((), device=x.device)
            setattr(self, "r" + role, row)
            setattr(self, "s" + role, scale)
            prepared = fp8_kernels.prepare_quantize(op, like.detach(), fp8, row, scale, dbias=dbias)
            setattr(self, "q" + role, prepared)


def _floor_stack(current: bool, layers: int, features: int) -> nn.Module:
    """The ``_FloorLinear`` model; its step end (a hook on the last layer's output: run as backward starts,
    as good a time as its end for host time) is the fused scale update and the next step's statistics
    buffer, as ``FP8State.end_step`` must at the least (fp8scope keeps the amax history with current
    scaling too)."""
    import fp8_kernels

    torch.manual_seed(0)
    model = nn.Sequential(*(_FloorLinear(features, features) for _ in range(layers))).to(torch.bfloat16)
    n = 3 * layers
    for layer in model:
        layer.current = current
    update = fp8_kernels.fused_scale_update("cpu")
    hist, amax = torch.zeros(16, n), torch.zeros(n)
    settings = dict(
        fp8_max=torch.full((n,), 448.0),
        margin=torch.zeros(n),
        history_len=torch.full((n,), 16),
        most_recent=torch.zeros(n, dtype=torch.bool),
        interval=torch.ones(n, dtype=torch.int64),
        step=torch.ones((), dtype=torch.int64),
        enabled=torch.ones(n, dtype=torch.bool),
    )
    scale = fp8_kernels.aligned_scales(n).fill_(1.0)

    def step_end(grad):
        update(hist, amax, scale, **settings)
        fp8_kernels.new_stats(n)

    model[-1].step_end = step_end
    return model


def _stack(kind: str, layers: int, features: int) -> tuple[nn.Module, object]:
    """``(model, region factory)`` for one configuration."""
    import fp8_trainer

    torch.manual_seed(0)
    if kind.startswith("floor"):
        return _floor_stack(kind.endswith("current"), layers, features), contextlib.nullcontext
    model = nn.Sequential(*(nn.Linear(features, features) for _ in range(layers))).to(torch.bfloat16)
    if kind == "nn.Linear":
        return model, contextlib.nullcontext
    if kind == "torchao tensorwise":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)
        return model, contextlib.nullcontext
    recipe = fp8_trainer.DelayedScaling() if kind == "fp8scope delayed" else fp8_trainer.CurrentScaling()
    fp8_trainer.convert_to_fp8(model, recipe=recipe)
    return model, lambda: fp8_trainer.fp8_autocast(fp8_recipe=recipe)


def _step_fn(model: nn.Module, region, x: torch.Tensor, grad: torch.Tensor):
    def step() -> None:
        with region():
            out = model(x)
        out.backward(grad)

    return step


def measure(kinds, layers: int, tokens: int, features: int, steps: int, rounds: int) -> list[dict]:
    x = torch.randn(tokens, features, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, features, dtype=torch.bfloat16)
    with gpu_path() as recorders:
        fns, launches = {}, {}
        for kind in kinds:
            model, region = _stack(kind, layers, features)
            fn = _step_fn(model, region, x, grad)
            for _ in range(3):
                fn()  # warm: plans, caches, the first step's scale update
            before, gemms = sum(rec.grids.n for rec in recorders), _GEMMS.n
            with LaunchCounter(NO_LAUNCH | {"empty_like", "new_empty", "new_empty_strided"}) as ops:
                fn()
            kernels = sum(rec.grids.n for rec in recorders) - before
            aten = dict(ops.ops) | {"_scaled_mm": _GEMMS.n - gemms}
            launches[kind] = {"kernels": kernels, "aten": aten, "total": kernels + sum(aten.values())}
            fns[kind] = fn
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(rounds):
            for kind in kinds if r % 2 == 0 else list(reversed(kinds)):
                fn = fns[kind]
                t = time.perf_counter()
                for _ in range(steps):
                    fn()
                times[kind].append((time.perf_counter() - t) / steps / layers)
    base = statistics.median(times["nn.Linear"])
    rows = []
    for kind in kinds:
        us = statistics.median(times[kind]) * 1e6
        rows.append(
            {
                "config": kind,
                "host_us_per_layer": us,
                "ratio_to_nn_linear": us / (base * 1e6),
                "launches_per_layer": launches[kind]["total"] / layers,
                "launches": launches[kind],
                "goal_ratio": GOALS.get(kind),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = layer_parser(__doc__, "host_path.json", layers=8, tokens=16, features=16, steps=200, rounds=7)
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.rounds = 3, 2
    torch.set_num_threads(1)
    kinds = ["nn.Linear", "fp8scope delayed", "fp8scope current", "floor delayed", "floor current"]
    try:
        import torchao.float8  # noqa: F401

        kinds.append("torchao tensorwise")
    except ImportError:
        pass
    rows = measure(kinds, args.layers, args.tokens, args.features, args.steps, args.rounds)
    columns = [
        Column("per layer, fwd+bwd", "config", 22),
        Column("host us", "host_us_per_layer", 8, ".1f"),
        Column("x nn.Linear", "ratio_to_nn_linear", 11, ".2f"),
        Column("launches", "launches_per_layer", 9, ".2f"),
        Column("goal", lambda r: f"<= {r['goal_ratio']}" if r["goal_ratio"] else "", 6, align=">"),
    ]
    lines = table(rows, columns)
    heading = (
        f"GPU path emulated on the CPU: {args.layers} layers of {args.features}x{args.features}, "
        f"{args.tokens} tokens, bf16; median of {args.rounds} rounds of {args.steps} steps"
    )
    return write_report(args.out, heading, lines, rows, layer_meta(args))


if __name__ == "__main__":
    sys.exit(main())
