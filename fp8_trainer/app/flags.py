"""Command-line flags made from a frozen settings dataclass: each field says, in its metadata, how its flag
reads in ``--help`` (``flag``), and ``add_flags`` builds the argparse groups by walking the fields.

What a field's type and default already say is not repeated in its metadata:

- the flag is ``--`` and the field's name with dashes (``batch_size``: ``--batch-size``);
- a ``bool`` field that is off by default is turned on by its flag (``store_true``); one that is on by
  default is turned off by ``--no-`` and its name (``progress``: ``--no-progress``);
- a ``tuple`` field is a repeatable flag, each use adding one value (``append``);
- an ``int`` or ``float`` field, ``None`` allowed or not, parses its value as one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Iterable
from typing import Any

__all__ = ["Flag", "add_flags", "config_from_args", "flag"]

#: the key of a field's metadata that holds its ``Flag``
FLAG = "flag"


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one field's flag reads: its argparse group, help text and whatever the field cannot say."""

    group: str
    help: str | None = None
    choices: Iterable[str] | None = None
    metavar: str | None = None
    #: the flag where it is not ``--`` and the field's name (``--tag`` for ``tags``)
    name: str | None = None
    #: an environment variable whose value, when set and not empty, is the flag's default instead
    env: str | None = None


def flag(
    default: Any,
    group: str,
    *,
    help: str | None = None,
    choices: Iterable[str] | None = None,
    metavar: str | None = None,
    name: str | None = None,
    env: str | None = None,
) -> Any:
    """A dataclass field with ``default`` whose flag is described by the other arguments (see ``Flag``).

    Typed ``Any`` as ``dataclasses.field`` is, so that ``x: int = flag(1, ...)`` type-checks."""
    spec = Flag(group=group, help=help, choices=choices, metavar=metavar, name=name, env=env)
    return dataclasses.field(default=default, metadata={FLAG: spec})


def add_flags(parser: argparse.ArgumentParser, settings: type) -> None:
    """Add a flag for every field of the dataclass ``settings``, in field order, each to its group (the
    groups in the order their first fields come). A field without a ``flag`` is an error: every setting
    can be given on the command line."""
    hints = typing.get_type_hints(settings)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for field in dataclasses.fields(settings):
        spec = field.metadata.get(FLAG)
        if not isinstance(spec, Flag):
            raise TypeError(f"{settings.__name__}.{field.name} has no flag: declare it with flag(...)")
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group)
        option, kwargs = _argument(field, spec, hints[field.name])
        groups[spec.group].add_argument(option, **kwargs)


def config_from_args(settings: type, args: argparse.Namespace) -> Any:
    """The ``settings`` dataclass made from the flags ``add_flags`` parsed: a repeatable flag's list
    becomes the field's tuple (a frozen configuration holds no mutable values)."""
    return settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items()})


def _argument(field: dataclasses.Field[Any], spec: Flag, hint: Any) -> tuple[str, dict[str, Any]]:
    """The option string and ``add_argument`` keywords of one field's flag."""
    kind = _value_type(hint)
    default: Any = field.default
    if spec.env:
        default = os.environ.get(spec.env) or default
    dashed = field.name.replace("_", "-")
    option = spec.name or ("--no-" if kind is bool and default else "--") + dashed
    kwargs: dict[str, Any] = {"dest": field.name}
    if kind is bool:
        kwargs["action"] = "store_false" if default else "store_true"
    elif kind is tuple:
        kwargs.update(action="append", default=list(default))  # argparse appends to a copy of it
    else:
        kwargs["default"] = default
        if kind in (int, float):
            kwargs["type"] = kind
    for key in ("choices", "metavar", "help"):
        if getattr(spec, key) is not None:
            kwargs[key] = getattr(spec, key)
    return option, kwargs


def _value_type(hint: Any) -> Any:
    """The type a field's flag parses: ``int | None`` is ``int``, ``tuple[str, ...]`` is ``tuple``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return typing.get_origin(hint) or hint
