"""FP8 recipes: which formats to use and how scales are chosen.

Recipes are frozen dataclasses, validated on construction (a bad field raises ``ValueError`` naming the
field and the reason) and serialisable to JSON through ``to_dict`` / ``from_dict``: the monitor stores
and edits them. ``recipe_from_dict`` rebuilds either kind from its dict (it dispatches on ``"type"``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .formats import E4M3, E5M2, FP8Format

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "CurrentScaling",
    "DelayedScaling",
    "Format",
    "Recipe",
    "recipe_from_dict",
    "validate_setting",
]

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
SCALINGS = ("delayed", "current")


class Format(enum.Enum):
    """Which FP8 encoding each role uses.

    ``E4M3``: E4M3 everywhere. ``HYBRID``: E4M3 for input and weight (forward), E5M2 for grad_output
    (backward), the usual choice for training. ``E5M2`` (E5M2 everywhere) exists as a name, but recipes
    refuse it, as Transformer Engine's do.
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    def for_role(self, role: str) -> FP8Format:
        """The encoding used for ``role`` (``"input"``, ``"weight"`` or ``"grad_output"``)."""
        if self is Format.E4M3:
            return E4M3
        if self is Format.E5M2:
            return E5M2
        return E5M2 if role == "grad_output" else E4M3

    @classmethod
    def parse(cls, value: Format | str) -> Format:
        """Accept a ``Format`` or its name in any case (``"hybrid"``)."""
        if isinstance(value, Format):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(f"fp8_format: unknown format {value!r}; expected one of {list(cls.__members__)}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_setting(name: str, value: Any) -> Any:
    """Validate one recipe setting and return its normalised value.

    Raises:
        ValueError: naming the field and why the value is not allowed.
    """
    if name == "margin":
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"margin: must be a finite number, got {value!r}")
        if value < 0:
            raise ValueError(f"margin: must be >= 0, got {value!r}")
        return int(value) if float(value).is_integer() else float(value)
    if name == "interval":
        if not _is_int(value) or value < 1:
            raise ValueError(f"interval: must be an integer >= 1, got {value!r}")
        return value
    if name == "amax_history_len":
        if not _is_int(value) or value < 1:
            raise ValueError(f"amax_history_len: must be an integer >= 1, got {value!r}")
        return value
    if name == "amax_compute_algo":
        if value not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"amax_compute_algo: must be one of {AMAX_COMPUTE_ALGOS}, got {value!r}")
        return value
    if name == "scaling":
        if value not in SCALINGS:
            raise ValueError(f"scaling: must be one of {SCALINGS}, got {value!r}")
        return value
    if name in ("reduce_amax", "fp8_enabled"):
        if not isinstance(value, bool):
            raise ValueError(f"{name}: must be a bool, got {value!r}")
        return value
    if name == "fp8_format":
        fmt = Format.parse(value)
        if fmt is Format.E5M2:
            raise ValueError(
                "fp8_format: pure E5M2 training is not supported (Transformer Engine refuses it too): E5M2 "
                "keeps two mantissa bits for activations and weights; use HYBRID (E4M3 forward, E5M2 "
                "gradients) or E4M3"
            )
        return fmt
    raise ValueError(f"{name}: unknown recipe field")


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling (Transformer Engine semantics).

    Per tensor an ``amax_history`` of ``amax_history_len`` steps; at the end of each optimizer step the
    step's amax enters the history and, every ``interval`` steps,

        amax  = max(amax_history)            if amax_compute_algo == "max"
              = amax_history[newest]         if amax_compute_algo == "most_recent"
        scale = (FP8_MAX / amax) / 2 ** margin

    A zero or non-finite amax keeps the previous scale; a scale that would overflow float32 is clamped to
    the float32 maximum. The initial scale is 1. With ``reduce_amax`` and torch.distributed initialised,
    the amaxes are all-reduced (MAX) across ranks before the update.
    """

    margin: int | float = 0
    interval: int = 1
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        for name in (
            "margin",
            "interval",
            "fp8_format",
            "amax_history_len",
            "amax_compute_algo",
            "reduce_amax",
        ):
            object.__setattr__(self, name, validate_setting(name, getattr(self, name)))

    @property
    def scaling(self) -> str:
        return "delayed"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict; ``DelayedScaling.from_dict`` (or ``recipe_from_dict``) inverts it."""
        d = asdict(self)
        d["fp8_format"] = self.fp8_format.value
        return {"type": "delayed", **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DelayedScaling:
        """Build from ``to_dict``'s output (unknown keys raise ``ValueError``)."""
        return cls(**_fields(d, cls, "delayed"))


@dataclass(frozen=True)
class CurrentScaling:
    """Current (just-in-time) scaling: ``scale = FP8_MAX / amax`` of this tensor in this step.

    No history and no margin; NaN elements are ignored by the amax (as in Transformer Engine); a zero or
    non-finite amax gives scale 1 (the tensor is then quantized without scaling and its statistics show why).
    ``power_2_scale`` rounds each scale down to a power of two (Transformer Engine's ``power_2_scale``,
    torchao's ``round_scales_to_power_of_2``): scaling then changes no mantissa bit, at the cost of up to
    one binade of headroom.
    """

    fp8_format: Format = field(default=Format.HYBRID)
    power_2_scale: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", validate_setting("fp8_format", self.fp8_format))
        if not isinstance(self.power_2_scale, bool):
            raise ValueError(f"power_2_scale: must be a bool, got {self.power_2_scale!r}")

    @property
    def scaling(self) -> str:
        return "current"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict; ``CurrentScaling.from_dict`` (or ``recipe_from_dict``) inverts it."""
        return {"type": "current", "fp8_format": self.fp8_format.value, "power_2_scale": self.power_2_scale}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CurrentScaling:
        """Build from ``to_dict``'s output (unknown keys raise ``ValueError``)."""
        return cls(**_fields(d, cls, "current"))


Recipe = DelayedScaling | CurrentScaling


def _fields(d: dict[str, Any], cls: type, kind: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ValueError(f"recipe: expected a dict, got {type(d).__name__}")
    d = dict(d)
    t = d.pop("type", d.pop("scaling", kind))
    if t != kind:
        raise ValueError(f"type: expected {kind!r}, got {t!r}")
    allowed = set(cls.__dataclass_fields__)
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown field for {cls.__name__}")
    return d


def recipe_from_dict(d: dict[str, Any]) -> Recipe:
    """Rebuild a recipe from its dict, dispatching on ``"type"`` (or ``"scaling"``): delayed | current."""
    if not isinstance(d, dict):
        raise ValueError(f"recipe: expected a dict, got {type(d).__name__}")
    kind = d.get("type", d.get("scaling", "delayed"))
    if kind == "delayed":
        return DelayedScaling.from_dict(d)
    if kind == "current":
        return CurrentScaling.from_dict(d)
    raise ValueError(f"type: unknown recipe type {kind!r}; expected 'delayed' or 'current'")
