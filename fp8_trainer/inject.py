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

A fault that is FP8's (``fp8-train replay`` must call it so), with a high-precision twin that trains as if
nothing happened (the fault is undone in high precision, up to rounding):

    saturate:LAYER@STEP[xFACTOR]   an outlier channel: FACTOR (default 4096) added to channel 0 of the layer's
                                   input in STEP's forward, and FACTOR times the weight's column 0 taken off
                                   its output again (through autograd, so the gradients are unchanged too):
                                   the channel jumps far past the amax history, the stale E4M3 scale of
                                   delayed scaling saturates it (LAYER.input overflow > 0 at STEP), and the
                                   output keeps the correction without the offset it corrects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["DEFAULT_FACTORS", "Injection", "Injector", "check_injections", "parse_injection"]

DEFAULT_FACTORS = {"overflow": 1e4, "lr-spike": 100.0, "saturate": 4096.0}

_FACTOR = r"(?:x(?P<factor>[0-9.eE+-]+))?"
_PATTERNS = {
    "overflow": re.compile(rf"overflow:(?P<layer>[\w.]+)@(?P<step>\d+){_FACTOR}"),
    "nan": re.compile(r"nan:(?P<layer>[\w.]+)@(?P<step>\d+)"),
    "lr-spike": re.compile(rf"lr-spike@(?P<step>\d+){_FACTOR}"),
    "saturate": re.compile(rf"saturate:(?P<layer>[\w.]+)@(?P<step>\d+){_FACTOR}"),
}
USAGE = (
    "expected overflow:LAYER@STEP[xFACTOR], nan:LAYER@STEP, lr-spike@STEP[xFACTOR] "
    "or saturate:LAYER@STEP[xFACTOR]"
)


@dataclass(frozen=True)
class Injection:
    """One fault: ``kind`` at optimizer step ``step`` (1-based), on ``layer`` (None for lr-spike)."""

    kind: str
    step: int
    layer: str | None = None
    factor: float | None = None

    def describe(self) -> str:
        if self.kind == "overflow":
            return f"overflow: {self.layer}.weight x{self.factor:g} for this step"
        if self.kind == "nan":
            return f"nan: one NaN in {self.layer}.input"
        if self.kind == "saturate":
            return f"saturate: {self.layer}.input channel 0 + {self.factor:g}, undone on its output"
        return f"lr-spike: learning rate x{self.factor:g}"

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
        """Apply this step's faults; return those that fired (for printing and monitor events)."""
        fired = [inj for inj in self.injections if inj.step == step]
        for inj in fired:
            if inj.kind == "overflow":
                weight = self.model.get_submodule(inj.layer).weight
                with torch.no_grad():
                    self._restore.append((weight, weight.detach().clone()))
                    weight.mul_(inj.factor)
            elif inj.kind == "nan":
                module = self.model.get_submodule(inj.layer)
                self._hooks.append(module.register_forward_pre_hook(_nan_input))
            elif inj.kind == "saturate":
                self._hooks.extend(_saturate(self.model.get_submodule(inj.layer), inj.factor))
        return fired

    def end(self, step: int) -> None:
        """Undo this step's weight scaling and remove its NaN hooks."""
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
