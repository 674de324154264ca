"""A run's ``config`` as the service stores it: JSON, made from what training scripts log.

What people pass as a run's config is rarely plain JSON: a Hugging Face ``PretrainedConfig`` or its
``to_dict()`` (``id2label`` has integer keys), dataclasses, numpy and torch scalars, enums, paths. Each is
turned into its JSON form here, once, when the ``Monitor`` is made; anything else is refused there with a
``ValueError`` that names where it sits, instead of stopping the telemetry later on the sender thread.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["jsonable_config"]

#: how deep a config may nest (the service bounds JSON nesting; a cycle would never end)
MAX_DEPTH = 32


def jsonable_config(config: Any) -> dict[str, Any]:
    """``config`` as a JSON object: keys as strings, values as JSON values (see the module docstring).

    Raises:
        ValueError: ``config`` is not a mapping (or an object with ``to_dict()``, or a dataclass), or holds a
            value with no JSON form, nests deeper than ``MAX_DEPTH``, or has two keys that read the same as
            strings (``1`` and ``"1"``).
    """
    if config is None:
        return {}
    out = _value(config, "config", 0)
    if not isinstance(out, dict):
        raise ValueError(
            f"config: expected a mapping (a dict, a dataclass, a PretrainedConfig), got {_kind(config)}"
        )
    return out


def _kind(value: Any) -> str:
    return type(value).__module__ + "." + type(value).__qualname__


def _value(value: Any, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: nested more than {MAX_DEPTH} deep (a cycle?)")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # an IntEnum or a bool subclass as the plain number
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else str(value)  # JSON has no NaN / Inf: "nan", "inf"
    if isinstance(value, enum.Enum):
        return _value(value.value, where, depth + 1)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return _mapping(value, where, depth)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return _mapping(fields, where, depth)
    to_dict = getattr(value, "to_dict", None)  # transformers' PretrainedConfig, TrainingArguments, ...
    if callable(to_dict) and not isinstance(value, type):
        return _value(to_dict(), where, depth + 1)
    item = getattr(value, "item", None)  # numpy and torch scalars (0-d arrays and tensors too)
    if callable(item) and getattr(value, "ndim", 0) == 0 and getattr(value, "shape", ()) == ():
        return _value(item(), where, depth + 1)
    tolist = getattr(value, "tolist", None)  # small numpy arrays and tensors
    if callable(tolist) and getattr(value, "ndim", None) is not None:
        return _value(tolist(), where, depth + 1)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [_value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(items)]
    raise ValueError(
        f"{where}: {_kind(value)} has no JSON form; pass its value as a number, string, list or dict"
    )


def _mapping(value: Mapping, where: str, depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in value.items():
        if isinstance(key, enum.Enum):
            key = key.value
        if not isinstance(key, (str, int, float, bool)) and key is not None:
            raise ValueError(f"{where}: key {key!r} ({_kind(key)}) is not a string or a number")
        name = key if isinstance(key, str) else str(key).lower() if isinstance(key, bool) else str(key)
        if name in out:
            raise ValueError(f"{where}: keys {key!r} and {name!r} both read {name!r} as JSON")
        out[name] = _value(v, f"{where}[{key!r}]", depth + 1)
    return out
