"""FP8 recipes: which formats to use and how scales are chosen.

Recipes are frozen dataclasses, validated on construction (a bad field raises ``ValueError`` naming the
field and the reason) and serialisable to JSON through ``to_dict`` / ``from_dict``: the monitor stores
and edits them. ``recipe_from_dict`` rebuilds either kind from its dict (it dispatches on ``"type"``).

The block-scaled recipes (``MXFP8BlockScaling``, ``Float8BlockScaling``, Transformer Engine's names and
defaults) have their numerics in ``fp8_kernels.reference.block_quantize``; the FP8 ``Linear`` runs them
(``fp8_trainer.block_linear``). They are ``Recipe``s like the others: ``recipe_from_dict`` rebuilds all four
kinds (``block_recipe_from_dict`` the two block kinds alone), and a layer's ``scaling`` setting may name
them (``"mxfp8"``, ``"block"``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Self, TypeVar

from .formats import E4M3, E5M2, FP8Format

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "BLOCK_SCALINGS",
    "BlockRecipe",
    "CurrentScaling",
    "DelayedScaling",
    "Float8BlockScaling",
    "Format",
    "MXFP8BlockScaling",
    "QParams",
    "Recipe",
    "LAYER_SETTINGS",
    "SCALINGS",
    "base_settings",
    "block_recipe_from_dict",
    "recipe_from_dict",
    "validate_setting",
]

_T = TypeVar("_T")

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
#: Settings that ``set_layer_recipe`` can change per layer (or for the whole model); ``validate_setting``
#: checks each.
LAYER_SETTINGS = ("margin", "amax_history_len", "amax_compute_algo", "interval", "scaling", "fp8_enabled")
#: A layer's ``scaling``: per-tensor ``"delayed"`` or ``"current"``, or block-scaled ``"mxfp8"`` (1x32 blocks,
#: E8M0 scales) or ``"block"`` (FP8 block scaling, 1x128 / 128x128 float32 scales).
SCALINGS = ("delayed", "current", "mxfp8", "block")
#: The block-scaled values of ``scaling``.
BLOCK_SCALINGS = ("mxfp8", "block")


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


def _fields(d: dict[str, Any], cls: type, kind: str) -> dict[str, Any]:
    """The fields of a recipe of type ``kind`` from its dict (``ValueError`` for another type or a field
    that ``cls`` does not have)."""
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


class _RecipeForm:
    """What every recipe shares: its ``scaling`` name (``_TYPE``, the ``"type"`` of its dict) and its JSON
    form, every field with the format by its name, which ``from_dict`` (or ``recipe_from_dict``) inverts.
    One home for them keeps the four kinds' dicts alike, as the monitor stores and edits them."""

    _TYPE: ClassVar[str]

    @property
    def scaling(self) -> str:
        return self._TYPE

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: ``{"type": scaling, **fields}``; ``from_dict`` (or ``recipe_from_dict``) inverts
        it."""
        d = asdict(self)  # the subclasses are dataclasses
        d["fp8_format"] = d["fp8_format"].value
        return {"type": self._TYPE, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        """Build from ``to_dict``'s output (unknown keys raise ``ValueError``)."""
        return cls(**_fields(d, cls, cls._TYPE))


@dataclass(frozen=True)
class DelayedScaling(_RecipeForm):
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

    _TYPE = "delayed"

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


@dataclass(frozen=True)
class CurrentScaling(_RecipeForm):
    """Current (just-in-time) scaling: ``scale = FP8_MAX / amax`` of this tensor in this step.

    No history and no margin; NaN elements are ignored by the amax (as in Transformer Engine); a zero or
    non-finite amax gives scale 1 (the tensor is then quantized without scaling and its statistics show why).
    ``power_2_scale`` rounds each scale down to a power of two (Transformer Engine's ``power_2_scale``,
    torchao's ``round_scales_to_power_of_2``): scaling then changes no mantissa bit, at the cost of up to
    one binade of headroom.
    """

    _TYPE = "current"

    fp8_format: Format = field(default=Format.HYBRID)
    power_2_scale: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", validate_setting("fp8_format", self.fp8_format))
        if not isinstance(self.power_2_scale, bool):
            raise ValueError(f"power_2_scale: must be a bool, got {self.power_2_scale!r}")


# --- block-scaled recipes (Transformer Engine 2.x names and defaults) --------------------------------------


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be a bool, got {value!r}")


@dataclass(frozen=True)
class MXFP8BlockScaling(_RecipeForm):
    """MXFP8 (Transformer Engine's ``MXFP8BlockScaling``): every 32 consecutive values along a row share
    one power-of-two scale stored as E8M0 (an 8-bit biased exponent), computed from the block's own amax
    in this step (no history):

        code      = clamp(ceil(log2(amax / FP8_MAX)) + 127, 0, 254)    (0 for an all-zero block)
        q         = fp8(x * 2^(127 - code))                            (round to nearest, saturating)
        x_dequant = q * 2^(code - 127)

    Each tensor gets a row-wise copy (1x32 blocks along its last dimension) and, when a backward GEMM
    contracts the other dimension, a column-wise copy (32x1 blocks), both quantized from the
    high-precision tensor. ``enable_2d_quantization`` gives weights 32x32 blocks (one scale for both
    copies). Both dimensions must be multiples of 32. Default format E4M3 everywhere (TE's default).
    """

    _TYPE = "mxfp8"

    fp8_format: Format = Format.E4M3
    enable_2d_quantization: bool = False

    block_size = 32

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", validate_setting("fp8_format", self.fp8_format))
        _check_bool("enable_2d_quantization", self.enable_2d_quantization)


@dataclass(frozen=True)
class QParams:
    """Quantization parameters of one role under ``Float8BlockScaling`` (Transformer Engine's ``QParams``,
    the fields that apply to FP8): ``power_2_scale`` rounds each block's scale down to a power of two;
    ``amax_epsilon`` is a floor for each block's amax before the scale is computed."""

    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        _check_bool("power_2_scale", self.power_2_scale)
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"amax_epsilon: must be a finite number >= 0, got {eps!r}")
        object.__setattr__(self, "amax_epsilon", float(eps))

    @classmethod
    def parse(cls, name: str, value: QParams | dict[str, Any]) -> QParams:
        if isinstance(value, QParams):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{name}: expected QParams or a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - {"power_2_scale", "amax_epsilon"})
        if unknown:
            raise ValueError(f"{name}.{unknown[0]}: unknown field for QParams")
        try:
            return cls(**value)
        except ValueError as e:
            raise ValueError(f"{name}.{e}") from None


def _of_role(role: str, input_: _T, weight: _T, grad_output: _T) -> _T:
    """The one of a per-role triple that belongs to ``role`` (KeyError for a name that is no role)."""
    return {"input": input_, "weight": weight, "grad_output": grad_output}[role]


@dataclass(frozen=True)
class Float8BlockScaling(_RecipeForm):
    """FP8 block scaling (Transformer Engine's ``Float8BlockScaling``, DeepSeek-V3's recipe): one float32
    scale per block, from the block's own amax in this step (no history):

        amax  = max(amax, amax_epsilon)
        scale = FP8_MAX / amax            (1 for a zero or Inf amax; the input dtype's max if it overflows)
        scale = 2^floor(log2(scale))      if power_2_scale (TE's default)
        q     = fp8(x * scale),  scale_inv = 1 / scale

    Blocks per role: ``x_block_scaling_dim`` (input), ``w_block_scaling_dim`` (weight),
    ``grad_block_scaling_dim`` (grad_output): 1 means 1x128 blocks (and 128x1 for the column-wise copy),
    2 means 128x128 blocks. Defaults as TE: 1x128 activations and gradients, 128x128 weights. At most one
    role may use 2-D blocks (a GEMM of two 2-D-scaled operands is not supported by TE's GEMMs). Sizes need not
    be multiples of 128. Default format E4M3 everywhere (TE's default); GEMMs accumulate with promotion
    (TE fixes ``use_split_accumulator=True`` for all three GEMMs).
    """

    _TYPE = "block"

    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = field(default_factory=QParams)
    fp8_quant_fwd_weight: QParams = field(default_factory=QParams)
    fp8_quant_bwd_grad: QParams = field(default_factory=QParams)
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    block_size = 128

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", validate_setting("fp8_format", self.fp8_format))
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            object.__setattr__(self, name, QParams.parse(name, getattr(self, name)))
        dims = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")
        for name in dims:
            v = getattr(self, name)
            if not _is_int(v) or v not in (1, 2):
                raise ValueError(f"{name}: must be 1 (1x128 blocks) or 2 (128x128 blocks), got {v!r}")
        two_d = [n for n in dims if getattr(self, n) == 2]
        if len(two_d) > 1:
            raise ValueError(
                f"{two_d[1]}: 2-D blocks for both {two_d[0]} and {two_d[1]} (a 2-D by 2-D block GEMM)"
            )

    def block_scaling_dim(self, role: str) -> int:
        """1 or 2 for ``role`` (``"input"``, ``"weight"`` or ``"grad_output"``)."""
        return _of_role(role, self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim)

    def qparams(self, role: str) -> QParams:
        """The ``QParams`` of ``role`` (``"input"``, ``"weight"`` or ``"grad_output"``)."""
        return _of_role(role, self.fp8_quant_fwd_inp, self.fp8_quant_fwd_weight, self.fp8_quant_bwd_grad)


BlockRecipe = MXFP8BlockScaling | Float8BlockScaling


def block_recipe_from_dict(d: dict[str, Any]) -> BlockRecipe:
    """Rebuild a block-scaled recipe from its dict, dispatching on ``"type"``: mxfp8 | block."""
    if not isinstance(d, dict):
        raise ValueError(f"recipe: expected a dict, got {type(d).__name__}")
    kind = d.get("type")
    if kind == "mxfp8":
        return MXFP8BlockScaling.from_dict(d)
    if kind == "block":
        return Float8BlockScaling.from_dict(d)
    raise ValueError(f"type: unknown block recipe type {kind!r}; expected 'mxfp8' or 'block'")


Recipe = DelayedScaling | CurrentScaling | MXFP8BlockScaling | Float8BlockScaling


def recipe_from_dict(d: dict[str, Any]) -> Recipe:
    """Rebuild a recipe from its dict, dispatching on ``"type"`` (or ``"scaling"``): delayed | current |
    mxfp8 | block."""
    if not isinstance(d, dict):
        raise ValueError(f"recipe: expected a dict, got {type(d).__name__}")
    kind = d.get("type", d.get("scaling", "delayed"))
    if kind == "delayed":
        return DelayedScaling.from_dict(d)
    if kind == "current":
        return CurrentScaling.from_dict(d)
    if kind in BLOCK_SCALINGS:
        return block_recipe_from_dict({**d, "type": kind})
    raise ValueError(f"type: unknown recipe type {kind!r}; expected one of {SCALINGS}")


def base_settings(recipe: Recipe) -> dict[str, Any]:
    """Every layer setting as ``recipe`` gives it (``FP8State``'s base, below the overrides); the history
    settings of a recipe without them (current, block) are ``DelayedScaling``'s, used if a layer is switched
    to delayed scaling."""
    d = recipe if isinstance(recipe, DelayedScaling) else DelayedScaling()
    return {
        "scaling": recipe.scaling,
        "fp8_format": recipe.fp8_format,
        "margin": d.margin,
        "interval": d.interval,
        "amax_history_len": d.amax_history_len,
        "amax_compute_algo": d.amax_compute_algo,
        "reduce_amax": getattr(recipe, "reduce_amax", True),
        "power_2_scale": getattr(recipe, "power_2_scale", False),
        "fp8_enabled": True,
    }
