"""The FP8 copy of each layer's weight, made once per optimizer step and reused by the step's micro-batches.

Between the micro-batches of one optimizer step neither a weight nor its scale changes, so its FP8 copy is
the same: the step's first recording forward quantizes the weight (and records its statistics), the later
forwards take that copy. Transformer Engine keeps a copy the same way, but only when the caller says
``is_first_microbatch``; fp8scope keeps it without being told, so it must see every way a weight can
change. A held copy is used again only while all of these hold:

* the weight is an ``nn.Parameter`` (a leaf), or a view of one (an FP8 ``Conv1D``'s transpose). A computed
  weight (a parametrization, a weight built in ``forward``, ``torch.func.functional_call``'s tensors) is a
  new tensor at every forward, often in the same recycled block of memory with a fresh version counter: it
  is quantized at every forward;
* no optimizer has stepped since (``torch.optim.optimizer.register_optimizer_step_post_hook``, global:
  every ``torch.optim.Optimizer``, whatever it writes through: ``AdamW(fused=True)`` and the foreach
  implementations update parameters without bumping their version counters);
* the parameter's version counter is unchanged (every in-place op on the parameter bumps it: ``p.mul_()``
  under ``torch.no_grad()``, ``load_state_dict``);
* the parameter still has the storage the copy was made from (``p.data = other``). The entry holds an
  alias of that storage, so its address cannot be handed to a new tensor while the entry lives;
* the scaling state's buffers were not replaced (``FP8State.version``: a recipe change, a checkpoint load,
  a device move) and the copy is of the same kind (``variant``: which transposes or block copies);
* the step is still open: ``end_step`` empties the cache.

Not seen: an in-place write through ``p.data`` (``p.data.mul_()``, ``p.data.copy_()``), which bumps the
version counter of a temporary alias, not the parameter's, made between two forwards of one step with no
optimizer step between them. Write such updates in place on the parameter under ``torch.no_grad()``, or
call ``weights_changed()`` after them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["PreQuantizedWeight", "WeightCache", "optimizer_steps", "weights_changed"]

_epoch = 0  # bumped by every optimizer step (and weights_changed), in any thread
_hook = None


def _count_step(optimizer, args, kwargs) -> None:
    global _epoch
    _epoch += 1


def weights_changed() -> None:
    """Tell every FP8 model that weights changed in a way it cannot see (an in-place write through
    ``p.data``): their next forward quantizes the weights again."""
    _count_step(None, None, None)


def optimizer_steps() -> int:
    """How many optimizer steps (and ``weights_changed`` calls) this process has seen since the first
    ``WeightCache`` was made."""
    return _epoch


def _watch_optimizers() -> None:
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_count_step)


_NOT_RECORDED = object()


def _owner(weight: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage and version counter ``weight`` shares: itself, or the base of a view."""
    return weight if weight._base is None else weight._base


class PreQuantizedWeight(torch.Tensor):
    """A weight that arrives already in FP8 (FSDP2's FP8 all-gather, ``fp8_trainer.fsdp``): the layer takes
    its ``fp8_copies`` instead of quantizing it, and no copy of it is held here."""


class WeightCache:
    """Per layer, its weight's FP8 copy and what it was made from (module docstring).

    ``quantized`` runs a quantization through it (``lookup``, then ``store``); ``first_record`` tells a
    recorder (shadow mode too) whether the weight was already recorded in this step.
    """

    def __init__(self) -> None:
        _watch_optimizers()
        self.enabled = True  # off only to measure what the cache saves (bench/weight_cache.py)
        self._held: dict[int, tuple[tuple, torch.Tensor, Any]] = {}
        self._recorded: dict[int, Any] = {}  # per layer, what its weight was when recorded in this step

    def quantized(
        self, state: Any, k: int, weight: torch.Tensor, variant: Any, record: bool, quantize
    ) -> Any:
        """Layer ``k``'s weight as ``quantize(record)`` makes it, quantized once per step while the weight
        stays as it was (the module docstring says when a held copy is used again); ``state`` is the layer's
        ``FP8State`` (``FP8State.quantized_weight`` calls this). ``variant`` names what ``quantize`` makes
        (which copies), so a forward that needs another one quantizes again. A forward that records nothing
        (evaluation) neither fills the cache nor needs it. The weight's statistics are recorded once per step
        and value (``first_record``): a later quantization of the same value in the same step (another
        variant, or a copy the cache could not keep: FSDP2 gathers the weight into a fresh tensor for every
        micro-batch, a computed weight is made at every forward) quantizes without recording, so a step's
        counts are one weight's, not one per micro-batch; a weight changed within the step (an in-place op,
        an optimizer step) records again. A weight that arrives in FP8 (``PreQuantizedWeight``: FSDP2's FP8
        all-gather) is taken as it is."""
        if isinstance(weight, PreQuantizedWeight):
            return weight.fp8_copies(state, k, variant, record)
        key = self.key(weight, state.version, variant)
        got = self.lookup(k, key)
        if got is None:
            got = quantize(record and self.first_record(k, weight))
            if record:
                self.store(k, key, weight, got)
        return got

    def key(self, weight: torch.Tensor, state_version: int, variant: Any) -> tuple | None:
        """What a copy of ``weight`` is valid for; ``None`` where no copy may be kept. A view of a parameter
        (an FP8 ``Conv1D``'s transposed weight) is kept like the parameter: the same storage and version
        counter, and its place in the storage in the key."""
        base = _owner(weight)
        # the exact type first: isinstance against nn.Parameter runs its metaclass's Python check
        if not self.enabled or (type(base) is not nn.Parameter and not isinstance(base, nn.Parameter)):
            return None
        view = (weight.data_ptr(), tuple(weight.shape), weight.stride())
        return (base.data_ptr(), base._version, view, state_version, _epoch, variant)

    def lookup(self, k: int, key: tuple | None) -> Any:
        """Layer ``k``'s held value for ``key``, or ``None``."""
        held = self._held.get(k)
        if key is None or held is None or held[0] != key:
            return None
        return held[2]

    def store(self, k: int, key: tuple | None, weight: torch.Tensor, value: Any) -> None:
        """Hold ``value`` for layer ``k`` (nothing where ``key`` is ``None``)."""
        if key is not None:
            # the alias keeps the weight's storage alive: its address cannot be recycled while held
            self._held[k] = (key, weight.detach(), value)

    def first_record(self, k: int, weight: torch.Tensor | None = None) -> bool:
        """Whether layer ``k``'s weight records its statistics now: once per step, and again in the same step
        only where ``weight`` changed in a way ``key`` also sees as a change of the value (an in-place op, an
        optimizer step, ``weights_changed``), not where it is the same value in another tensor (FSDP2
        gathers the weight into fresh storage for every micro-batch, with its version counter kept; a
        computed weight is a fresh tensor at every forward). ``weight`` None: once per step (a weight that
        arrives in FP8, ``fp8_trainer.fsdp``)."""
        token = None
        if weight is not None:
            base = _owner(weight)
            token = (base._version, _epoch)
        if self._recorded.get(k, _NOT_RECORDED) == token:
            return False
        self._recorded[k] = token
        return True

    def clear(self) -> None:
        self._held.clear()
        self._recorded.clear()

    def __len__(self) -> int:
        return len(self._held)

    def values(self) -> dict[int, Any]:
        """Each layer's held value (tests and benchmarks look at them)."""
        return {k: held[2] for k, held in self._held.items()}
