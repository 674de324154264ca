"""The detectors' shared base: persistent state declared as dataclass fields, its JSON form derived from
those fields, and the registry the engine runs.

A detector is a dataclass that subclasses `Detector`, names its entry in the engine's state (``key``) and
its place among the detectors (``order``: the order of their findings within a step), and marks the fields
that persist between batches with `array_state`, `value_state` or `nested_state`::

    @dataclass(eq=False)
    class UnderflowExcessDetector(Detector, key="underflow", order=60):
        run: np.ndarray = array_state(np.int64)  # allocated in __post_init__, sized by `tensors`

        def observe(self, view: BatchView) -> list[Finding]: ...

`state_dict()` encodes exactly those fields, in declaration order, under their names (or ``stored_as``),
and `load_state_dict()` restores them. Everything else a detector holds is derived from `config` and
`tensors`, or lives within one batch (names starting with "_"); a test round-trips every registered
detector and compares all its other attributes, so state left undeclared fails it.

Defining the class registers it; the package imports every detector module, so the engine runs and
persists every detector there is, in ``order``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from fp8_protocol.tensors import TensorInfo
from monitor_server.core.detector_config import DetectorConfig

from .state import decode_array, encode_array
from .types import Finding

__all__ = [
    "BatchView",
    "Detector",
    "Stateful",
    "array_state",
    "nested_state",
    "registered",
    "state_fields",
    "value_state",
]

_META = "fp8scope_state"  # the dataclass field metadata key that marks persistent state

#: key -> detector class; filled by `Detector.__init_subclass__`, read through `registered`
REGISTRY: dict[str, type[Detector]] = {}


@dataclass(frozen=True)
class _Codec:
    encode: Callable[[Any], Any]
    decode: Callable[[Any, Any], Any]  # (stored value, current value) -> restored value
    stored_as: str | None = None  # the key in the state dict; None: the field's name
    optional: bool = False  # a state saved without the key keeps the current (fresh) value
    flatten: bool = False  # a nested state whose keys sit beside the owner's own


def _state_field(codec: _Codec, **kwargs: Any) -> Any:
    # init=False: persistent state is never a constructor argument; it starts fresh (a default, or
    # allocated in __post_init__) and is restored by load_state_dict
    return field(init=False, repr=False, metadata={_META: codec}, **kwargs)


def array_state(
    dtype: Any,
    *,
    as_list: bool = False,
    keep_on_reshape: bool = False,
    stored_as: str | None = None,
    optional: bool = False,
    **kwargs: Any,
) -> Any:
    """A numpy array field stored with `encode_array` and restored as `dtype`.

    Args:
        as_list: the field holds a Python list (stored as an array, restored as a list).
        keep_on_reshape: a stored array of another shape than the fresh one is dropped (its shape comes
            from the config, e.g. a window length that has changed since: the window starts again).
        stored_as: the key in the state dict, when it is not the field's name.
        optional: a state without the key keeps the fresh value.
        kwargs: ``default`` / ``default_factory`` of the field.
    """

    def encode(value: Any) -> Any:
        return encode_array(np.asarray(value, dtype=dtype))

    def decode(stored: Any, current: Any) -> Any:
        a = decode_array(stored, dtype)
        if keep_on_reshape and a.shape != np.shape(current):
            return current
        return a.tolist() if as_list else a

    return _state_field(_Codec(encode, decode, stored_as, optional), **kwargs)


def value_state(
    convert: Callable[[Any], Any] | None = None,
    *,
    stored_as: str | None = None,
    optional: bool = False,
    **kwargs: Any,
) -> Any:
    """A JSON-able value (number, bool, None, str, or a dict / list of them), stored as it is and restored
    through `convert` when given (e.g. ``bool``). `stored_as`, `optional`, `kwargs`: as in `array_state`."""
    decode = (lambda stored, _: stored) if convert is None else (lambda stored, _: convert(stored))
    return _state_field(_Codec(lambda value: value, decode, stored_as, optional), **kwargs)


def nested_state(*, flatten: bool = False, stored_as: str | None = None, **kwargs: Any) -> Any:
    """A `Stateful` object's state, under its own key, or with ``flatten=True`` merged into the owner's
    state dict (a layout that predates the object); restored in place."""

    def decode(stored: Any, current: Stateful) -> Stateful:
        current.load_state_dict(stored)
        return current

    codec = _Codec(lambda value: value.state_dict(), decode, stored_as, flatten=flatten)
    return _state_field(codec, **kwargs)


def state_fields(cls: type) -> list[tuple[str, Any]]:
    """(name, codec) of each persistent field of a dataclass, in declaration order."""
    return [(f.name, f.metadata[_META]) for f in dataclasses.fields(cls) if _META in f.metadata]


class Stateful:
    """Mixin for a dataclass whose persistent fields are marked with `array_state`, `value_state` or
    `nested_state`: their JSON-able state dict, derived from those fields."""

    def state_dict(self) -> dict[str, Any]:
        """The marked fields as JSON (non-finite floats as "NaN" / "Infinity" / "-Infinity")."""
        out: dict[str, Any] = {}
        for name, codec in state_fields(type(self)):
            value = codec.encode(getattr(self, name))
            if codec.flatten:
                out.update(value)
            else:
                out[codec.stored_as or name] = value
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; a missing key raises KeyError unless its field is optional."""
        for name, codec in state_fields(type(self)):
            if codec.flatten:
                stored = state
            else:
                key = codec.stored_as or name
                if codec.optional and key not in state:
                    continue
                stored = state[key]
            setattr(self, name, codec.decode(stored, getattr(self, name)))


@dataclass(frozen=True)
class BatchView:
    """The new steps of one batch as every detector sees them; built once per batch by the engine.

    Attributes:
        steps: (S,) int64, the steps not processed before, ascending.
        stats: statistic column -> (S, T) float64, the columns the batch carried.
        loss: (S,) float64, or None when the batch carried no loss.
        bad: (S, T) bool, tensor non-finite (non-finite count > 0 or amax NaN/±inf) and FP8 on.
        loss_bad: (S,) bool, the loss non-finite where the step carried one.
        nonfinite: (S, T) float64 non-finite counts, 0 where unknown.
        enabled: (1, T) bool, the tensor is registered and FP8 is on for it.
        watched: (S, T) bool, enabled and past the tensor's warm-up.
        margin: (T,) float64, the recipe's margin per tensor.
        window: (T,) int64, the amax growth window per tensor (`recipe.growth_window`).
    """

    steps: np.ndarray
    stats: dict[str, np.ndarray]
    loss: np.ndarray | None
    bad: np.ndarray
    loss_bad: np.ndarray
    nonfinite: np.ndarray
    enabled: np.ndarray
    watched: np.ndarray
    margin: np.ndarray
    window: np.ndarray

    def column_or_nan(self, name: str) -> np.ndarray:
        """A statistic column, NaN where the batch did not carry it."""
        col = self.stats.get(name)
        return col if col is not None else np.full(self.bad.shape, np.nan)


@dataclass(eq=False)
class Detector(Stateful):
    """Base of the engine's detectors: built from the run's config and tensors, fed each batch's new steps
    by `observe`, persistent state declared as fields (see the module docstring).

    Subclasses pass ``key`` (their entry in the engine's state dict) and ``order`` (where their findings
    sit within a step, lowest first) as class keywords; a subclass without them is not registered.
    """

    config: DetectorConfig
    tensors: list[TensorInfo] = field(default_factory=list, repr=False)

    key: ClassVar[str]
    order: ClassVar[int]

    def __init_subclass__(cls, *, key: str | None = None, order: int | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if key is None:
            return
        if order is None:
            raise TypeError(f"{cls.__qualname__}: a registered detector needs an order")
        for other in REGISTRY.values():
            same_class = (other.__module__, other.__qualname__) == (cls.__module__, cls.__qualname__)
            if not same_class and (other.key == key or other.order == order):  # a reload replaces itself
                raise TypeError(
                    f"{cls.__qualname__} (key {key!r}, order {order}) clashes with {other.__qualname__} "
                    f"(key {other.key!r}, order {other.order})"
                )
        cls.key, cls.order = key, order
        REGISTRY[key] = cls

    def observe(self, view: BatchView) -> list[Finding]:
        """This detector's findings for a batch's new steps (any order; the engine sorts by step)."""
        raise NotImplementedError


def registered() -> list[type[Detector]]:
    """Every registered detector class, in ``order``."""
    return sorted(REGISTRY.values(), key=lambda cls: cls.order)
