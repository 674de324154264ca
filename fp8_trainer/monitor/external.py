"""Statistics that do not come from fp8scope's own FP8 layers: the caller's, shadow mode's, torchao's.

``Monitor`` reads statistics through one interface (``StatsReader``'s: ``take``, ``poll``, ``flush``,
``read_now``, ``close``, ``merged``). Shadow mode and the torchao watcher keep an ``FP8State`` on the model
like a converted one, so the ordinary ``StatsReader`` serves them; this module adds

* ``CallerStats``: the generic path for any other runtime. The tensors are declared when the Monitor is
  made (``Monitor(..., tensors=[...])``) and each step's block is passed to ``monitor.step(step,
  stats=block)``: shape ``(n_tensors, 6)``, rows in declaration order, columns ``BASE_COLUMNS`` =
  ``amax`` (max |x| before scaling), ``scale`` (the scale that scaled it), ``overflow`` (elements that
  saturated), ``underflow`` (non-zero elements that became zero), ``nonfinite`` (NaN/Inf elements),
  ``numel``; or ``(n_tensors, 10)`` with the quality columns too (``STAT_COLUMNS``: ``sum_sq``, ``err_sq``,
  ``subnormal``, ``min_abs``, as ``fp8_protocol.stats`` defines them). A source without quality statistics
  sends the base columns, and the Monitor then leaves the quality columns out of the step (never NaN
  placeholders). A torch tensor on any device (copied to the host without a synchronisation and read a
  step later, like the runtime's own statistics) or a numpy array;
* ``attach_source``: which of these a Monitor's arguments ask for.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from fp8_kernels import STAT_COLUMNS
from fp8_protocol.stats import BASE_COLUMNS, QUALITY_COLUMNS

from ..formats import ROLES
from ..merge import merge_step_stats
from ..stats import LateReader

__all__ = ["CallerStats", "attach_source", "declare_tensors"]

_FORMATS = ("e4m3", "e5m2")


def declare_tensors(tensors) -> list[dict[str, Any]]:
    """The tensor table of a ``Monitor(..., tensors=...)`` run, indices in the order given.

    Each entry is ``"<layer>.<role>"`` (role ``input`` / ``weight`` / ``grad_output``; format E4M3 for the
    forward tensors, E5M2 for ``grad_output``, as HYBRID), a dict with ``name``, ``layer``, ``role`` and
    ``format`` (``"e4m3"`` / ``"e5m2"``), or a ``fp8_trainer.TensorInfo``.
    """
    if isinstance(tensors, (str, bytes)) or not hasattr(tensors, "__iter__"):
        raise ValueError(f"tensors: expected a list of tensor names or dicts, got {tensors!r}")
    out = []
    for i, t in enumerate(tensors):
        if hasattr(t, "to_dict"):
            t = t.to_dict()
        if isinstance(t, str):
            layer, _, role = t.rpartition(".")
            t = {"name": t, "layer": layer, "role": role}
        if not isinstance(t, dict):
            raise ValueError(f"tensors[{i}]: expected a name or a dict, got {t!r}")
        role = t.get("role")
        if role not in ROLES:
            raise ValueError(f"tensors[{i}]: role must be one of {ROLES}, got {role!r} ({t.get('name')!r})")
        fmt = t.get("format") or ("e5m2" if role == "grad_output" else "e4m3")
        if fmt not in _FORMATS:
            raise ValueError(f"tensors[{i}]: format must be one of {_FORMATS}, got {fmt!r}")
        name, layer = t.get("name"), t.get("layer")
        if not isinstance(name, str) or not name or not isinstance(layer, str) or not layer:
            raise ValueError(f"tensors[{i}]: needs a non-empty name and layer, got {t!r}")
        out.append({"index": i, "name": name, "layer": layer, "role": role, "format": fmt})
    if len({t["name"] for t in out}) != len(out):
        raise ValueError("tensors: names must be unique")
    return out


class CallerStats(LateReader):
    """Per-step statistics blocks handed to ``Monitor.step(step, stats=...)``, read one step late.

    Two blocks put before one poll (a step per micro-batch) are merged as the runtime merges steps
    (``merge_step_stats``: amax max with the scale that scaled it, counts summed).
    """

    def __init__(self, tensors):
        super().__init__()
        self.tensors = declare_tensors(tensors)
        self.source = "caller"
        self.n = len(self.tensors)
        self._box: torch.Tensor | None = None
        self._n_box = 0
        self._last: torch.Tensor | None = None
        self.merged = 0

    def put(self, stats) -> None:
        """One step's block (see the module docstring); raises ValueError on a wrong shape."""
        t = (
            torch.from_numpy(np.asarray(stats, dtype=np.float64))
            if not isinstance(stats, torch.Tensor)
            else stats
        )
        widths = (len(BASE_COLUMNS), len(STAT_COLUMNS))
        if t.dim() != 2 or t.shape[0] != self.n or t.shape[1] not in widths:
            raise ValueError(
                f"stats: expected shape ({self.n}, {widths[0]}) (tensors x {BASE_COLUMNS}) or ({self.n}, "
                f"{widths[1]}) (with the quality columns {QUALITY_COLUMNS}), got {tuple(t.shape)}"
            )
        t = t.detach().to(torch.float64)
        if self._box is not None and self._box.shape != t.shape:
            raise ValueError(
                f"stats: a ({self.n}, {t.shape[1]}) block after a ({self.n}, {self._box.shape[1]}) one in "
                "the same step; a source sends the quality columns in every step or in none"
            )
        self._box = t if self._box is None else merge_step_stats(self._box, t.to(self._box.device))
        self._n_box += 1
        self._last = t

    # ----- StatsReader's interface -----
    def take(self) -> tuple[torch.Tensor, int] | None:
        if self._box is None:
            return None
        got, self._box, self._n_box = (self._box, self._n_box), None, 0
        return got

    def _hand_out(self, n: int, host: torch.Tensor) -> tuple[int, torch.Tensor]:
        self.merged = n
        return 0, host  # the caller's blocks carry no step number

    # poll, advance (as ``StatsReader.advance``: whether a block was put since the last call, the previous
    # copy) and flush: ``LateReader``'s
    def read_now(self) -> tuple[int, torch.Tensor] | None:
        return None if self._last is None else (0, self._last.to("cpu", copy=True))

    def close(self) -> None:
        self._box = None
        self._late.clear()

    def apply_commands(self, commands: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        reason = (
            "this run's statistics come from the training script (Monitor tensors=...): fp8scope cannot "
            "apply recipe changes to it"
        )
        return [{"command_id": c.get("id"), "state": "rejected", "reason": reason} for c in commands]


def attach_source(model: nn.Module, recipe, *, tensors=None, shadow=None) -> tuple[Any, Any]:
    """Resolve a Monitor's statistics source: ``(recipe, reader)``, ``reader`` None for a model whose
    ``FP8State`` the ordinary ``StatsReader`` reads.

    ``tensors`` given: the caller's statistics (``CallerStats``). ``shadow`` given: shadow mode is attached
    to the model with that recipe. Otherwise a model without fp8scope FP8 layers is checked for another
    runtime's: torchao's ``Float8Linear`` (watched through an ``FP8State``, its recipe returned) or
    Transformer Engine's modules (``TEStats``, read from TE's own state).
    """
    if tensors is not None and shadow is not None:
        raise ValueError("tensors, shadow: give one (the caller's statistics, or shadow mode's)")
    if tensors is not None:
        return recipe, CallerStats(tensors)
    if shadow is not None:
        from ..shadow import shadow as attach_shadow

        state = getattr(model, "_fp8_state", None)
        if state is None or getattr(state, "source", None) != "shadow":
            attach_shadow(model, shadow)
        return shadow, None
    state = getattr(model, "_fp8_state", None)
    if state is not None and state.n_layers:
        # no recipe given: the one the model was converted with (or shadowed / watched under); a converted
        # model passed without it reported nothing at all
        return (state.recipe if recipe is None else recipe), None
    from ..integrations.torchao import has_torchao_layers, watch_torchao

    if has_torchao_layers(model):
        return watch_torchao(model).recipe, None
    from ..integrations.transformer_engine import TEStats, has_te_layers

    if has_te_layers(model):
        return recipe, TEStats(model)
    return recipe, None
