"""Request bodies parsed without holding up the event loop.

orjson parses a body in one C call that holds the GIL throughout: a 4 MB body of 300,000 values holds it for
about 50 ms on an idle 2-core machine and four times that under load, and `/healthz` and every other request
wait that long. A body with more than `YIELDING_VALUES` JSON values is parsed instead by the standard
library's C scanner with a Python hook per object: slower in all (about three times), but the interpreter
can switch threads at every object, so no other request waits more than a few milliseconds. The two parsers
give the same values and refuse the same texts (`parse`; the tests compare them).
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from fp8_protocol.codec import WireError
from monitor_server.infra.wire import value_marks

#: a body with more JSON values than this is parsed by the yielding parser (orjson would hold the GIL for
#: several milliseconds)
YIELDING_VALUES = 50_000
#: bodies shorter than this are always parsed by orjson (they cannot hold enough values to matter)
_YIELDING_MIN_BYTES = 256 * 1024
#: a `\u` escape of a UTF-16 surrogate (a backslash before it may itself be escaped: checked by orjson then)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def value_bound(body: bytes | bytearray) -> int:
    """An upper bound on the JSON values in `body`, counted as the parse budget counts them."""
    return 1 + value_marks(body)


def parse(body: bytes | bytearray) -> Any:
    """The JSON value of `body`; malformed JSON raises WireError (``malformed JSON: ...``)."""
    if len(body) >= _YIELDING_MIN_BYTES and value_bound(body) > YIELDING_VALUES:
        return parse_yielding(body)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"malformed JSON: {exc}") from None


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # a Python frame per object: where the interpreter may hand the GIL to another thread
    return dict(pairs)


def _integer(text: str) -> int | float:
    # as orjson: an integer outside 64 bits becomes a float
    value = int(text)
    return value if -(2**63) <= value < 2**64 else float(text)


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(object_pairs_hook=_object, parse_int=_integer, parse_constant=_constant)


def parse_yielding(body: bytes | bytearray) -> Any:
    """`parse` by the standard library's scanner, letting other threads run between objects."""
    try:
        value = _DECODER.decode(bytes(body).decode("utf-8"))
    except RecursionError:
        raise WireError("malformed JSON: depth limit exceeded") from None  # as orjson says it
    except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError included
        raise WireError(f"malformed JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(body):
        # the standard library keeps a lone surrogate (not UTF-8, so never storable); orjson refuses it
        try:
            orjson.dumps(value)
        except TypeError as exc:  # orjson.JSONEncodeError: "str is not valid UTF-8: surrogates not allowed"
            raise WireError(f"malformed JSON: {exc}") from None
    return value
