"""The Triton kernels inside the FP8 ``Linear``: current scaling through its one dispatch entry, and the
transposed FP8 operands of the backward GEMMs written by the quantize pass. Registered in
``case_registry.py`` with the cases of ``kernel_cases.py`` (which imports this module), so they run under
``TRITON_INTERPRET=1`` on the CPU (kernels registered for the CPU device) and compiled on CUDA where a case
allows it.

What is compared exactly: statistics rows and scales against the references on the same inputs; outputs
and gradients against GEMMs of the kernels' own FP8 tensors; whole runs against the references where every
cast is exact (the interpreter rounds some float8 casts wrongly, docs/fp8-semantics.md "Known traps"); and
fused transposes against the transposing copies they replace, with the same kernels.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

import fp8_kernels
import fp8_trainer
import fp8_trainer.gemm
import fp8_trainer.linear_ops
from fp8_kernels import quantize_current_reference, reference_kernels
from fp8_trainer.gemm import fp8_mm, gemm_operand
from tests.kernels.case_registry import case
from tests.kernels.exact_checks import same, same_row


@contextmanager
def _triton_kernels(device: torch.device, log: list, transposes: bool = True) -> Iterator[None]:
    """The Triton quantize kernels registered for ``device`` (interpreted on the CPU), each call logged as
    ``(op, args, result)``; ``transposes=False`` leaves the transposing ones out. The scale update stays on
    its reference (it is tested on its own, and interpreted it costs most of a step). The dispatch table is
    restored afterwards (on CUDA: the compiled kernels registered there before)."""
    from fp8_kernels.triton.current import quantize_current_transposed_triton, quantize_current_triton
    from fp8_kernels.triton.quantize import quantize_with_stats_transposed_triton, quantize_with_stats_triton

    impls = {"quantize": quantize_with_stats_triton, "current": quantize_current_triton}
    if transposes:
        impls.update(
            quantize_transposed=quantize_with_stats_transposed_triton,
            current_transposed=quantize_current_transposed_triton,
        )

    def logged(op, fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            log.append((op, args, out))
            return out

        return wrapper

    fp8_kernels.has_kernel("quantize", device.type)  # CUDA registers lazily: do it before the snapshot
    saved = fp8_kernels.registered()
    fp8_kernels.register(device.type, **{op: logged(op, fn) for op, fn in impls.items()})
    try:
        yield
    finally:
        fp8_kernels.restore(saved)


def _by_row(log: list, op: str) -> dict[int, tuple]:
    """``{tensor index: (input, result)}`` of the logged ``op`` calls (the index from their stats row)."""
    calls = {
        args[-1].storage_offset() // args[-1].numel(): (args[0], out) for name, args, out in log if name == op
    }
    assert len(calls) == sum(name == op for name, _, _ in log), "two calls recorded into one row"
    return calls


def _step(model, x: torch.Tensor, grad_y: torch.Tensor, recipe) -> torch.Tensor:
    with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
        y = model(x)
    y.backward(grad_y)
    return y.detach()


def _layer_results(y: torch.Tensor, x: torch.Tensor, layer) -> dict[str, torch.Tensor]:
    grads = {"grad_input": x.grad, "grad_weight": layer.weight.grad, "grad_bias": layer.bias.grad}
    return {"output": y, **grads, "statistics": fp8_trainer.step_stats(layer)}


def same_results(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys()
    for key in a:
        check = same_row if key == "statistics" else same
        check(a[key], b[key], f"{key}: {what}")


@case("fp8_linear-current-scaling-uses-kernels", devices=("cpu",))
def _current_linear(device: torch.device) -> None:
    def build():
        torch.manual_seed(0)
        return fp8_trainer.convert_to_fp8(nn.Sequential(nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 16)))

    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 32, generator=g) * torch.logspace(-3, 3, 32)
    grad_y = torch.randn(9, 16, generator=g)
    model, log, recipe = build(), [], fp8_trainer.CurrentScaling()
    with _triton_kernels(device, log):
        y = _step(model, x, grad_y, recipe)
    ops = [name for name, _, _ in log]
    # one dispatch call per quantized tensor (its amax pass inside), nothing else; no transposes for the
    # emulated GEMMs
    assert ops == ["current"] * 6, ops
    state, stats = fp8_trainer.get_fp8_state(model), fp8_trainer.step_stats(model)
    calls = _by_row(log, "current")
    assert sorted(calls) == list(range(6))
    for i, (xi, out) in calls.items():  # the state asks for scale_inv too (and grad_output's column sums)
        scale, scale_inv = out[1], out[2]
        _, scale_ref, row_ref = quantize_current_reference(xi, state.dtypes[i])
        same(scale, scale_ref, f"tensor {i}: current scale")
        same(scale_inv, torch.reciprocal(scale_ref), f"tensor {i}: scale_inv written by the kernel")
        same_row(stats[i], row_ref, f"tensor {i}: statistics row")
    # the GEMMs consumed exactly the kernels' q and the scale_inv they wrote (the bits of q itself are
    # checked on a GPU: the interpreter's float8 rounding, docs/fp8-semantics.md "Known traps")
    a = {i: gemm_operand(out[0]) for i, (_, out) in calls.items()}
    s = {i: out[2] for i, (_, out) in calls.items()}
    same(y, fp8_mm(a[3], s[3], a[4].t(), s[4], torch.float32, model[2].bias), "output")
    same(model[2].weight.grad, fp8_mm(a[5].t(), s[5], a[3], s[3], torch.float32), "layer 1 wgrad")
    same(model[0].weight.grad, fp8_mm(a[2].t(), s[2], a[0], s[0], torch.float32), "layer 0 wgrad")
    # the bias gradients are the column sums the grad_output quantize returned (tensors 2 and 5)
    for i, layer in ((2, model[0]), (5, model[2])):
        assert len(calls[i][1]) == 5, f"tensor {i}: no column sums from the grad_output quantize"
        same(layer.bias.grad, calls[i][1][-1], f"tensor {i}: grad_bias from the quantize pass")
    # against a run on the references: rows whose input both runs share (model input, weights) are equal
    ref = build()
    with reference_kernels():
        _step(ref, x, grad_y, recipe)
    ref_stats = fp8_trainer.step_stats(ref)
    for i in (0, 1, 4):
        same_row(stats[i], ref_stats[i], f"tensor {i}: statistics row vs the reference run")


def _on_fp8_grid(shape: tuple[int, ...], fp8: torch.dtype, seed: int) -> torch.Tensor:
    """Random finite FP8 values (one of them -FP8_MAX) times 2**-3: current scaling's scale is then exactly
    8 and every scaled value an FP8 value, so every cast is exact and the interpreter's rounding trap
    cannot fire."""
    bits = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    v = bits.view(fp8).to(torch.float32)
    v = torch.where(torch.isfinite(v), v, torch.zeros(()))
    v.view(-1)[0] = -torch.finfo(fp8).max
    return v * 2.0**-3


@case("fp8_linear-current-scaling-exact-casts-equal-reference", devices=("cpu",))
def _current_linear_exact(device: torch.device) -> None:
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    x0, grad_y = _on_fp8_grid((13, 32), e4m3, 6), _on_fp8_grid((13, 16), e5m2, 7)  # HYBRID: E5M2 gradient
    runs = []
    for triton in (True, False):
        torch.manual_seed(0)
        layer = fp8_trainer.Linear(32, 16)
        with torch.no_grad():
            layer.weight.copy_(_on_fp8_grid((16, 32), e4m3, 8))
        x, log = x0.clone().requires_grad_(True), []
        with _triton_kernels(device, log) if triton else reference_kernels():
            y = _step(layer, x, grad_y, fp8_trainer.CurrentScaling())
        if triton:
            assert [name for name, _, _ in log].count("current") == 3, log
            assert all(out[1].item() == 8.0 for _, (_, out) in _by_row(log, "current").items())
        runs.append(_layer_results(y, x, layer))
    # grad_bias: float32 column sums of grad_output in the kernel's order and in torch's, each within
    # (n - 1) * 2**-24 * sum|g| of the exact sum (first order, 2**-24 the unit roundoff), so within twice
    # that of each other; everything else exactly
    bound = 2 * (grad_y.shape[0] - 1) * 2.0**-24 * grad_y.double().abs().sum(0)
    diff = (runs[0].pop("grad_bias").double() - runs[1].pop("grad_bias").double()).abs()
    assert bool((diff <= bound).all()), f"grad_bias: off by {diff.max().item()} (bound {bound.min().item()})"
    same_results(*runs, "Triton kernels vs references")


@contextmanager
def _real_fp8_gemms(device: torch.device, gemms: list) -> Iterator[None]:
    """The FP8 GEMMs as ``torch._scaled_mm``, each call checked against cuBLASLt's FP8 layout rule (first
    operand row-major, second column-major) and its operands logged. On the CPU, where ``torch._scaled_mm``
    also runs (slowly: tiny shapes only) but accepts any layout, the FP8 Linear is switched to the path it
    takes on an FP8 GPU."""
    real = torch._scaled_mm

    def checked(a, b, **kwargs):
        assert a.is_contiguous() and b.t().is_contiguous(), f"layouts: a {a.stride()}, b {b.stride()}"
        gemms.append((a, b, kwargs["scale_a"], kwargs["scale_b"]))
        return real(a, b, **kwargs)

    patches = [(torch, "_scaled_mm", checked)]
    if device.type == "cpu":
        patches += [(fp8_trainer.gemm, "uses_scaled_mm", lambda d: True)]
        patches += [(fp8_trainer.linear_ops, "uses_scaled_mm", lambda d: True)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


@case("fp8_linear-fused-transposes-feed-scaled-mm")
def _fused_transposes(device: torch.device) -> None:
    g = torch.Generator().manual_seed(9)
    for recipe in (fp8_trainer.DelayedScaling(), fp8_trainer.CurrentScaling()):
        op = "current" if recipe.scaling == "current" else "quantize"
        op_t = f"{op}_transposed"
        for tokens in (32, 9):  # 9: the token dim is padded to 16, keeping the operand layouts
            x0 = (torch.randn(tokens, 32, generator=g) * 4).to(device)
            grad_y = torch.randn(tokens, 16, generator=g).to(device)
            runs = []
            for transposes in (True, False):
                torch.manual_seed(0)
                layer = fp8_trainer.Linear(32, 16).to(device)
                x, log, gemms = x0.clone().requires_grad_(True), [], []
                with _triton_kernels(device, log, transposes), _real_fp8_gemms(device, gemms):
                    y = _step(layer, x, grad_y, recipe)
                where = f"{recipe.scaling} scaling, {tokens} tokens"
                ops = [name for name, _, _ in log]
                assert ops == [op_t if transposes else op] * 3, (where, transposes, ops)
                assert len(gemms) == 3, (where, transposes)
                if transposes and tokens % 16 == 0:
                    # no copy anywhere: each GEMM reads the buffers the quantize pass wrote
                    out = {i: res for i, (_, res) in _by_row(log, op_t).items()}
                    (qx, qxt), (qw, qwt), (qg, qgt) = (out[i][:2] for i in range(3))
                    expected = [(qx, qw), (qg, qwt), (qgt, qxt)]  # fprop, dgrad, wgrad
                    for k, ((a, b, *_), (qa, qb)) in enumerate(zip(gemms, expected, strict=True)):
                        assert (a.data_ptr(), b.data_ptr()) == (qa.data_ptr(), qb.data_ptr()), (where, k)
                    if op == "current":  # and the scale_inv each quantize pass wrote, not a reciprocal of it
                        sx, sw, sg = (out[i][3] for i in range(3))  # (q, qt, scale, scale_inv, row)
                        expected = [(sx, sw), (sg, sw), (sg, sx)]
                        for k, ((*_, s_a, s_b), (e_a, e_b)) in enumerate(zip(gemms, expected, strict=True)):
                            assert (s_a.data_ptr(), s_b.data_ptr()) == (e_a.data_ptr(), e_b.data_ptr()), (
                                where,
                                k,
                            )
                runs.append(_layer_results(y, x, layer))
            same_results(*runs, f"fused transposes vs transposing copies ({where})")
        # only the transposes a backward GEMM reads: weight (dgrad), input and grad_output (wgrad)
        for x_grad, w_grad, expected in ((False, True, [op_t, op, op_t]), (True, False, [op, op_t, op])):
            layer = fp8_trainer.Linear(32, 16).to(device)
            layer.weight.requires_grad_(w_grad)
            x, log, gemms = x0.clone().requires_grad_(x_grad), [], []
            with _triton_kernels(device, log), _real_fp8_gemms(device, gemms):
                _step(layer, x, grad_y, recipe)
            rows = {args[-1].storage_offset() // args[-1].numel(): name for name, args, _ in log}
            assert [rows.get(i) for i in range(3)] == expected, (recipe.scaling, x_grad, w_grad, rows)
            assert len(gemms) == 2 and len(log) == 3


# ----- prepared quantize calls (fp8_kernels.prepare_quantize): the FP8 Linear's fast path -----
@case("prepared-quantize-equals-the-full-launch")
def _prepared_equals_launch(device: torch.device) -> None:
    """Every prepared form (delayed and current scaling; flat, transposed, with column sums; bfloat16 and
    float32 input; rows with and without the quality columns) writes exactly what the full call writes on
    the same operands: q, qt, the statistics row, scale_inv, the column sums; a second call of the same
    prepared object on other values too (nothing of the first call's tensors is kept)."""
    from fp8_kernels.reference.quantize import BASE_COLUMNS, STAT_COLUMNS, new_stats
    from fp8_kernels.triton.current import quantize_current_transposed_triton, quantize_current_triton
    from fp8_kernels.triton.quantize import quantize_with_stats_transposed_triton, quantize_with_stats_triton

    full = {
        "quantize": quantize_with_stats_triton,
        "quantize_transposed": quantize_with_stats_transposed_triton,
        "current": quantize_current_triton,
        "current_transposed": quantize_current_transposed_triton,
    }
    saved = fp8_kernels.registered()
    fp8_kernels.register(device.type, **full)
    try:
        g = torch.Generator().manual_seed(3)
        for op, fn in full.items():
            current, transposed = op.startswith("current"), op.endswith("transposed")
            for dtype, width in ((torch.bfloat16, len(STAT_COLUMNS)), (torch.float32, len(BASE_COLUMNS))):
                for dbias in (False, True):
                    what = f"{op} {dtype} dbias={dbias} width={width}"
                    fp8 = torch.float8_e5m2 if dbias else torch.float8_e4m3fn
                    scale = torch.tensor(3.0, device=device)
                    like = torch.randn(24, 40, generator=g).to(device, dtype)
                    row = new_stats(device=device, quality=width == len(STAT_COLUMNS))
                    prepared = fp8_kernels.prepare_quantize(op, like, fp8, row, scale, dbias=dbias)
                    assert prepared is not None, f"{what}: no prepared form"
                    for seed in (1, 2):
                        x = (torch.randn(24, 40, generator=g) * 4.0**seed).to(device, dtype)
                        row_p = new_stats(device=device, quality=width == len(STAT_COLUMNS))
                        row_f = row_p.clone()
                        q, qt, sinv, sums = prepared(x, scale, row_p)
                        extra = {"dbias": True} if dbias else {}
                        if current:
                            ref = fn(x, fp8, row_f, return_scale_inv=True, **extra)
                            ref_q, ref_qt = ref[0], ref[1] if transposed else None
                            same(sinv, ref[3] if transposed else ref[2], f"{what}: scale_inv")
                        else:
                            ref = fn(x, scale, fp8, row_f, **extra)
                            ref_q, ref_qt = ref[0], ref[1] if transposed else None
                            assert sinv is None, f"{what}: delayed scaling returns no scale_inv"
                        same(q.view(torch.uint8), ref_q.view(torch.uint8), f"{what}: q")
                        if transposed:
                            same(qt.view(torch.uint8), ref_qt.view(torch.uint8), f"{what}: qt")
                        else:
                            assert qt is None, f"{what}: a transpose nobody asked for"
                        same(row_p, row_f, f"{what}: statistics row")
                        if dbias:
                            same(sums, ref[-1], f"{what}: column sums")
                        else:
                            assert sums is None
        # routing changes invalidate what was prepared under the old one
        before = fp8_kernels.generation()
        with reference_kernels():
            assert fp8_kernels.generation() != before
            like = torch.randn(4, 4, device=device)
            row = fp8_kernels.new_stats(device=device)
            scale = torch.tensor(1.0, device=device)
            assert fp8_kernels.prepare_quantize("quantize", like, torch.float8_e4m3fn, row, scale) is None
    finally:
        fp8_kernels.restore(saved)


@case("fp8_linear-prepared-path-equals-the-full-path", devices=("cpu",))
def _prepared_linear(device: torch.device) -> None:
    """Training steps of a model whose layers take the prepared quantize calls equal, bit for bit (losses,
    gradients, statistics, scales), the same steps with every quantize through the full dispatch call;
    delayed and current scaling."""
    from fp8_kernels.triton.current import quantize_current_transposed_triton, quantize_current_triton
    from fp8_kernels.triton.quantize import quantize_with_stats_transposed_triton, quantize_with_stats_triton

    def run(recipe, prepared: bool):
        torch.manual_seed(0)
        model = fp8_trainer.convert_to_fp8(nn.Sequential(nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 16)))
        calls = []
        original = fp8_trainer.linear_ops.prepare_quantize

        def spy(*args, **kwargs):
            out = original(*args, **kwargs) if prepared else None
            calls.append(out)
            return out

        fp8_trainer.linear_ops.prepare_quantize = spy
        try:
            g = torch.Generator().manual_seed(1)
            out = []
            for _ in range(2):  # the second step runs under the scales the first one set
                x = torch.randn(9, 32, generator=g)
                with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
                    loss = model(x).square().mean()
                loss.backward()
                out.append((loss.detach(), fp8_trainer.step_stats(model).clone()))
        finally:
            fp8_trainer.linear_ops.prepare_quantize = original
        if prepared:  # prepared once per tensor (and statistics width), then reused
            assert all(c is not None for c in calls) and len(calls) == 6, calls
        state = fp8_trainer.get_fp8_state(model)
        grads = [p.grad for p in model.parameters()]
        return out, grads, state.scale.clone()

    saved = fp8_kernels.registered()
    fp8_kernels.register(
        device.type,
        quantize=quantize_with_stats_triton,
        quantize_transposed=quantize_with_stats_transposed_triton,
        current=quantize_current_triton,
        current_transposed=quantize_current_transposed_triton,
    )
    try:
        for recipe in (fp8_trainer.DelayedScaling(), fp8_trainer.CurrentScaling()):
            (steps_p, grads_p, scale_p), (steps_f, grads_f, scale_f) = run(recipe, True), run(recipe, False)
            for n, ((lp, sp), (lf, sf)) in enumerate(zip(steps_p, steps_f, strict=True)):
                same(lp, lf, f"{recipe}: loss of step {n}")
                same_row(sp, sf, f"{recipe}: statistics of step {n}")
            for a, b in zip(grads_p, grads_f, strict=True):
                same(a, b, f"{recipe}: gradients")
            same(scale_p, scale_f, f"{recipe}: scales")
    finally:
        fp8_kernels.restore(saved)
