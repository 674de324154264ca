"""Flight-recorder histograms: the exponent histograms an event about some tensors carries.

A weight's exponent histogram is taken at once (the weight after the step in which the event was seen). For
an ``input`` or ``grad_output`` tensor a one-shot hook on its layer captures the tensor at the next forward
(input) or backward (gradient of the layer's output, i.e. the grad_output before quantization) and sends
its histogram as a follow-up ``custom`` event ``{"histogram_for": kind, "event_step", "tensor", "captured":
"next forward"|"next backward", "histogram"}``: keeping a copy of every activation just in case would cost
memory on every step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fp8_kernels import exponent_histogram, histogram_to_dict
from fp8_protocol.client_events import CUSTOM_EVENT

from ..linear import Linear

__all__ = ["Histograms"]


class Histograms:
    """Exponent histograms of a run's tensors, for the events about them.

    Args:
        tensors: the run's tensor table (dicts with ``name``, ``layer``, ``role``).
        model: the model the layers are looked up in.
        sender: where a follow-up histogram event goes.
        log_once: ``Notices.once``: a failed histogram is said once, never raised.
    """

    def __init__(self, tensors: list[dict[str, Any]], model: nn.Module, sender, log_once):
        self.tensors = tensors
        self._modules = dict(model.named_modules())
        self._sender = sender
        self._log_once = log_once

    def for_event(self, kind: str, step: int, involved: list[int]) -> dict[str, Any]:
        """Exponent histograms of the involved weights now; one-shot hooks for inputs and gradients."""
        out = {}
        for i in involved:
            info = self.tensors[i]
            module = self._modules.get(info["layer"])
            if module is None:
                continue
            try:
                if info["role"] == "weight":
                    out[info["name"]] = histogram_to_dict(exponent_histogram(module.weight))
                else:
                    self._capture_once(module, kind, step, info)
            except Exception:
                self._log_once("histogram", "fp8scope monitor: exponent histogram failed", exc=True)
        return out

    def _capture_once(self, module: nn.Module, kind: str, step: int, info: dict[str, Any]) -> None:
        sender = self._sender

        def send(x: torch.Tensor, captured: str) -> None:
            try:  # runs inside the user's forward / backward: never raise there
                details = {
                    "histogram_for": kind,
                    "event_step": step,
                    "tensor": info["name"],
                    "captured": captured,
                    "histogram": histogram_to_dict(exponent_histogram(x)),
                }
                sender.put_event({"kind": CUSTOM_EVENT, "step": step, "details": details})
            except Exception:
                self._log_once("histogram", "fp8scope monitor: exponent histogram failed", exc=True)

        state = getattr(module, "_fp8_state", None)
        if isinstance(module, Linear) and state is not None:  # the FP8 layer captures it (compiled too)
            state.capture_once(
                info["index"],
                lambda t: send(t, "next forward" if info["role"] == "input" else "next backward"),
            )
            return
        # other sources: hooks, run as they do eagerly under torch.compile too (not traced: a graph break
        # each)
        if info["role"] == "input":

            @torch.compiler.disable
            def pre_hook(m, args):
                if not torch.is_grad_enabled():  # an evaluation forward: wait for the next training one
                    return
                handle.remove()
                if args and isinstance(args[0], torch.Tensor):
                    send(args[0], "next forward")

            handle = module.register_forward_pre_hook(pre_hook)
        else:

            @torch.compiler.disable
            def fwd_hook(m, args, output):
                if not torch.is_grad_enabled():  # an evaluation forward has no backward
                    return
                handle.remove()
                if isinstance(output, torch.Tensor) and output.requires_grad:

                    def grad_hook(g):
                        send(g, "next backward")

                    output.register_hook(grad_hook)

            handle = module.register_forward_hook(fwd_hook)
