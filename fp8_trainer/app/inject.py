"""Fault injection for demos and tests (``fp8-train --inject``), each firing at one optimizer step.

Grammar (``LAYER`` is a module path as ``tensor_table`` names it, e.g. ``blocks.1.mlp.fc``)::

    overflow:LAYER@STEP[xFACTOR]   the layer's weight times FACTOR (default 1e4) for step STEP: its FP8
                                   weight saturates (overflow count of LAYER.weight > 0 at STEP). The weight
                                   is restored before the optimizer step, so the fault lasts one step, like a
                                   corrupted read; delayed scaling then shrinks the scale and the weight
                                   underflows until the spike leaves the amax history.
    nan:LAYER@STEP                 one NaN in the layer's input activation in STEP's forward (nonfinite count
                                   of LAYER.input at STEP > 0); it propagates, as a real one would.
    lr-spike@STEP[xFACTOR]         the learning rate of step STEP times FACTOR (default 100): the loss
                                   spikes after it.
    gradblowup:LAYER@STEP[xFACTOR] the gradient arriving at the layer's output times FACTOR (default 2**20)
                                   in STEP's backward, never undone: a gradient blow-up in any precision
                                   (a loss-scaling bug), which saturates the layer's E5M2 grad_output cast
                                   as gradspike does, and is not FP8's.

A fault that is FP8's (``fp8-train replay`` must call it so), with a high-precision twin that trains as if
nothing happened (the fault is undone in high precision, up to rounding):

    saturate:LAYER@STEP[xFACTOR]   an outlier channel: FACTOR (default 4096) added to channel 0 of the layer's
                                   input in STEP's forward, and FACTOR times the weight's column 0 taken off
                                   its output again (through autograd, so the gradients are unchanged too):
                                   the channel jumps far past the amax history, the stale E4M3 scale of
                                   delayed scaling saturates it (LAYER.input overflow > 0 at STEP), and the
                                   output keeps the correction without the offset it corrects.
    jump:LAYER@STEP[xFACTOR]       a distribution jump: from STEP on, the layer's input times FACTOR (> 1,
                                   default 16), and FACTOR - 1 times the layer's own product ``x @ W.T`` taken
                                   off its output again (a high-precision GEMM beside the layer's, through
                                   autograd). Delayed scaling scales STEP's input with the amax history of the
                                   distribution before the jump: the stale E4M3 scale saturates it
                                   (LAYER.input overflow > 0 at STEP) and the output misses what was cut off,
                                   FACTOR times over. The next step's scale has seen the jump ("max" over the
                                   history): the loss comes back, with the layer's input rounding amplified
                                   FACTOR times (an error FACTOR times larger), which the model bears.
    gradspike:LAYER@STEP[xFACTOR]  the gradient arriving at the layer's output times FACTOR (default 2**20)
                                   in STEP's backward, and the layer's input and parameter gradients divided
                                   by FACTOR again (autograd hooks, exact in high precision for a power of
                                   two): only the E5M2 cast of grad_output sees the spike, and its stale
                                   scale saturates it (LAYER.grad_output overflow > 0 at STEP: all but its
                                   zeros at the default). This runtime saturates (never Inf), so the layer's
                                   gradients come out FACTOR times too small for one step, and AdamW takes
                                   that in its stride: the loss does not move (measured on the tiny preset),
                                   so the loss-based capture has nothing to replay. A statistics fault.
    lowprec:LAYER@STEP[xRANGE]     an SQNR collapse: from STEP on, the layer's input divided by RANGE (default
                                   2**20) and an anchor added to channel 0 of every token (a half to three
                                   quarters of the input's amax: inside the scale the tensor had, so nothing
                                   saturates); the anchors' share taken off the output (through autograd)
                                   and the rest times RANGE again. The tensor's dynamic range is then beyond
                                   E4M3's: the scale follows the anchors, the shrunken input underflows
                                   (LAYER.input underflow at STEP), the anchors round by up to 1/16, and
                                   the undo amplifies the rounding of both the input and the weight RANGE
                                   times: the output loses the signal (SQNR far below 0 dB), with delayed and
                                   current scaling alike. Its twin is a float32 run (in bf16 the undo's own
                                   rounding, amplified RANGE times, is as large).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DEFAULT_FACTORS",
    "FP8_FAULTS",
    "PERSISTENT",
    "Injection",
    "Injector",
    "check_injections",
    "parse_injection",
]

DEFAULT_FACTORS = {
    "overflow": 1e4,
    "lr-spike": 100.0,
    "gradblowup": 2.0**20,
    "saturate": 4096.0,
    "jump": 16.0,
    "gradspike": 2.0**20,
    "lowprec": 2.0**20,
}
#: faults that last from their step on (the others fire in their step only)
PERSISTENT = frozenset({"jump", "lowprec"})
#: faults that only FP8 feels (a high-precision run with them trains as without, up to rounding)
FP8_FAULTS = frozenset({"saturate", "jump", "gradspike", "lowprec"})

_FACTOR = r"(?:x(?P<factor>[0-9.eE+-]+))?"
_PATTERNS = {
    "overflow": re.compile(rf"overflow:(?P<layer>[\w.]+)@(?P<step>\d+){_FACTOR}"),
    "nan": re.compile(r"nan:(?P<layer>[\w.]+)@(?P<step>\d+)"),
    "lr-spike": re.compile(rf"lr-spike@(?P<step>\d+){_FACTOR}"),
    **{
        kind: re.compile(rf"{kind}:(?P<layer>[\w.]+)@(?P<step>\d+){_FACTOR}")
        for kind in ("saturate", "jump", "gradspike", "lowprec", "gradblowup")
    },
}
USAGE = (
    "expected overflow:LAYER@STEP[xFACTOR], nan:LAYER@STEP, lr-spike@STEP[xFACTOR], "
    "gradblowup:LAYER@STEP[xFACTOR] "
    "or FP8's own saturate:, jump:, gradspike:, lowprec:LAYER@STEP[xFACTOR]"
)


#: what each fault does, in one line (``Injection.describe``)
_DESCRIPTIONS = {
    "overflow": "overflow: {layer}.weight x{factor:g} for this step",
    "nan": "nan: one NaN in {layer}.input",
    "saturate": "saturate: {layer}.input channel 0 + {factor:g}, undone on its output",
    "jump": "jump: {layer}.input x{factor:g} from this step on, undone on its output",
    "gradspike": "gradspike: {layer}.grad_output x{factor:g}, undone after its backward",
    "gradblowup": "gradblowup: {layer}.grad_output x{factor:g}, not undone",
    "lowprec": (
        "lowprec: {layer}.input / {factor:g} beside an anchor in channel 0 of every token, from this step "
        "on, undone on its output"
    ),
    "lr-spike": "lr-spike: learning rate x{factor:g}",
}


@dataclass(frozen=True)
class Injection:
    """One fault: ``kind`` at optimizer step ``step`` (1-based), on ``layer`` (None for lr-spike)."""

    kind: str
    step: int
    layer: str | None = None
    factor: float | None = None

    def active(self, step: int) -> bool:
        """Whether the fault acts in optimizer step ``step`` (from its step on, for ``PERSISTENT`` kinds)."""
        return step >= self.step if self.kind in PERSISTENT else step == self.step

    def describe(self) -> str:
        """One line saying what the fault does (``_DESCRIPTIONS``), as the training log prints it."""
        template = _DESCRIPTIONS.get(self.kind, _DESCRIPTIONS["lr-spike"])
        return template.format(layer=self.layer, factor=self.factor)

    def details(self) -> dict:
        """JSON-able fields for a monitor event."""
        d = {"injection": self.kind}
        if self.layer is not None:
            d["layer"] = self.layer
        if self.factor is not None:
            d["factor"] = self.factor
        return d


def parse_injection(spec: str) -> Injection:
    """Parse one ``--inject`` value. Raises ``ValueError`` naming the spec."""
    kind = spec.split(":", 1)[0].split("@", 1)[0]
    pattern = _PATTERNS.get(kind)
    m = pattern.fullmatch(spec) if pattern else None
    if m is None:
        raise ValueError(f"--inject {spec!r}: {USAGE}")
    step = int(m["step"])
    if step < 1:
        raise ValueError(f"--inject {spec!r}: STEP must be >= 1")
    factor = None
    if kind in DEFAULT_FACTORS:
        factor = DEFAULT_FACTORS[kind]
        if m["factor"] is not None:
            try:
                factor = float(m["factor"])
            except ValueError:
                raise ValueError(f"--inject {spec!r}: FACTOR {m['factor']!r} is not a number") from None
            if not (factor > 0 and factor != float("inf")):
                raise ValueError(f"--inject {spec!r}: FACTOR must be a finite number > 0")
            if kind == "jump" and factor <= 1:  # the stale scale must see a larger input
                raise ValueError(f"--inject {spec!r}: a jump's FACTOR must be > 1")
    return Injection(kind, step, m.groupdict().get("layer"), factor)


def check_injections(injections: list[Injection], layers: list[str], steps: int, first_step: int = 1) -> None:
    """Every injection names a known layer and a step in ``[first_step, steps]``; ``ValueError`` otherwise."""
    for inj in injections:
        if inj.layer is not None and inj.layer not in layers:
            leaf = inj.layer.split(".")[-1]
            near = [name for name in layers if name.split(".")[-1] == leaf][:4] or layers[:4]
            raise ValueError(
                f"--inject {inj.kind}:{inj.layer}@{inj.step}: unknown layer {inj.layer!r}; the FP8 layers "
                f"are {', '.join(near)}, ... ({len(layers)} in all)"
            )
        if inj.step > steps:
            raise ValueError(f"--inject {inj.kind}@{inj.step}: step {inj.step} is beyond --steps {steps}")
        if inj.step < first_step:
            raise ValueError(
                f"--inject {inj.kind}@{inj.step}: step {inj.step} is before the resumed run's first step "
                f"{first_step}, so it would never fire"
            )


class Injector:
    """Applies injections to ``model`` (the unwrapped model) around each optimizer step.

    The loop calls ``begin(step)`` before the step's first forward, ``lr_factor(step)`` for its learning
    rate and ``end(step)`` after its last backward, before the optimizer step.
    """

    def __init__(self, model: nn.Module, injections: list[Injection]):
        self.model = model
        self.injections = list(injections)
        self._restore: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hooks = []

    def lr_factor(self, step: int) -> float:
        f = 1.0
        for inj in self.injections:
            if inj.kind == "lr-spike" and inj.step == step:
                f *= inj.factor
        return f

    def begin(self, step: int) -> list[Injection]:
        """Apply the faults active in this step; return those that start in it (for printing and monitor
        events: a persistent fault is announced once)."""
        for inj in self.injections:
            if not inj.active(step):
                continue
            if inj.kind == "overflow":
                weight = self.model.get_submodule(inj.layer).weight
                with torch.no_grad():
                    self._restore.append((weight, weight.detach().clone()))
                    weight.mul_(inj.factor)
            elif inj.kind == "nan":
                module = self.model.get_submodule(inj.layer)
                self._hooks.append(module.register_forward_pre_hook(_nan_input))
            elif inj.kind in _HOOKS:
                self._hooks.extend(_HOOKS[inj.kind](self.model.get_submodule(inj.layer), inj.factor))
        return [inj for inj in self.injections if inj.step == step]

    def end(self, step: int) -> None:
        """Undo this step's weight scaling and remove its hooks."""
        with torch.no_grad():
            for weight, saved in self._restore:
                weight.copy_(saved)
        self._restore.clear()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _nan_input(module: nn.Module, args: tuple) -> tuple | None:
    if not torch.is_grad_enabled():  # only the training forward, never an evaluation in between
        return None
    x = args[0].clone()
    x.view(-1)[0] = float("nan")
    return (x, *args[1:])


def _saturate(module: nn.Module, offset: float) -> list:
    """Hooks, in training forwards: ``offset`` added to channel 0 of the input, ``offset`` times the weight's
    column 0 taken off the output (through autograd: the weight's gradient is unchanged as well)."""

    def pre(mod, args):
        if not torch.is_grad_enabled():
            return None
        x = args[0].clone()
        x[..., 0] += offset
        return (x, *args[1:])

    def post(mod, args, out):
        if not torch.is_grad_enabled():
            return None
        weight = mod.gemm_weight() if hasattr(mod, "gemm_weight") else mod.weight  # (out, in)
        return out - offset * weight[:, 0]

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def _bias_free(mod: nn.Module, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = getattr(mod, "bias", None)
    return (out - bias if bias is not None else out), bias


def _jump(module: nn.Module, factor: float) -> list:
    """Hooks, in training forwards: the input times ``factor``, and ``factor - 1`` times the layer's own
    product ``x @ W.T`` taken off the output again (through autograd, a high-precision GEMM beside the
    layer's, so the gradients are undone as well). In FP8 the part of ``factor * x`` that the stale scale
    cuts off is missing from the output, times ``factor``; once the scale has caught up, the input's
    rounding is amplified ``factor`` times (SQNR about 6 dB lower per doubling), which the model tolerates."""

    def pre(mod, args):
        if not torch.is_grad_enabled():
            return None
        return (args[0] * factor, *args[1:])

    def post(mod, args, out):
        if not torch.is_grad_enabled():
            return None
        weight = mod.gemm_weight() if hasattr(mod, "gemm_weight") else mod.weight  # (out, in)
        x = args[0] / factor  # the input before the jump (exact for a power of two)
        return out - (factor - 1) * F.linear(x.to(out.dtype), weight.to(out.dtype))

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


class _ScaleGrad(torch.autograd.Function):
    """The identity in the forward; the gradient times ``factor`` in the backward."""

    @staticmethod
    def forward(ctx, t, factor):
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _gradspike(module: nn.Module, factor: float) -> list:
    """Hooks, in training forwards: the output's gradient times ``factor`` before the layer's backward,
    the input's and the parameters' gradients divided by it after (a power of two: exact in high
    precision), so that only the layer's grad_output cast sees the spike."""

    def pre(mod, args):
        if not torch.is_grad_enabled():
            return None
        return (_ScaleGrad.apply(args[0], 1.0 / factor), *args[1:])

    def post(mod, args, out):
        if not torch.is_grad_enabled():
            return None
        return _ScaleGrad.apply(out, factor)

    hooks = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    for p in (module.weight, getattr(module, "bias", None)):
        if p is not None and p.requires_grad:
            hooks.append(p.register_hook(lambda g: g / factor))
    return hooks


def _gradblowup(module: nn.Module, factor: float) -> list:
    """A hook, in training forwards: the output's gradient times ``factor``, kept (in any precision)."""

    def post(mod, args, out):
        return _ScaleGrad.apply(out, factor) if torch.is_grad_enabled() else None

    return [module.register_forward_hook(post)]


def _lowprec(module: nn.Module, shrink: float) -> list:
    """Hooks, in training forwards: the input divided by ``shrink``, and an anchor added to channel 0 of
    every token, between a half and three quarters of the input's amax (varying over the tokens, and inside
    the scale the tensor already had, so nothing saturates); the output less the anchors' share (through
    autograd, as for ``saturate``) and its bias times ``shrink`` again. E4M3's three mantissa bits resolve
    neither the shrunken rest (it underflows) nor the anchors (each rounds by up to 1/16 of itself, which
    the undo amplifies ``shrink`` times): the layer's output loses the signal."""
    anchors: list[torch.Tensor] = []

    def pre(mod, args):
        if not torch.is_grad_enabled():
            return None
        x = args[0]
        tokens = x.numel() // x.shape[-1]
        ramp = torch.arange(tokens, device=x.device, dtype=torch.float32).remainder(17) / 64
        anchor = (x.detach().abs().amax().float() * (0.5 + ramp)).to(x.dtype)  # 0.5 .. 0.75 of the amax
        anchors.append(anchor)
        x = (x / shrink).clone()
        x.view(-1, x.shape[-1])[:, 0] += anchor
        return (x, *args[1:])

    def post(mod, args, out):
        if not torch.is_grad_enabled():
            return None
        anchor = anchors.pop()
        weight = mod.gemm_weight() if hasattr(mod, "gemm_weight") else mod.weight  # (out, in)
        y, bias = _bias_free(mod, out)
        share = anchor.to(y.dtype)[:, None] * weight[:, 0].to(y.dtype)[None, :]  # (tokens, out)
        y = (y - share.view_as(y)) * shrink
        return y + bias if bias is not None else y

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


_HOOKS = {
    "saturate": _saturate,
    "jump": _jump,
    "gradspike": _gradspike,
    "gradblowup": _gradblowup,
    "lowprec": _lowprec,
}
