"""Answers serialized from the response models (`monitor_server.schemas`) by the routes themselves.

Returning a model lets FastAPI validate it once more and write datetimes with a "Z"; the routes whose
answers have always carried `datetime.isoformat`'s "+00:00" (as the event stream and the webhook do), or
that are large (series, heatmaps), build the model and hand back its bytes: orjson writes datetimes as
`isoformat` does and is several times faster than FastAPI's encoder. Non-finite floats are strings in the
models already (`WireFloat`: "NaN", "Infinity", "-Infinity").
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from fastapi import Response
from pydantic import BaseModel


def model_json(model: BaseModel) -> bytes:
    """The model as JSON bytes (fields by their alias, e.g. `from`)."""
    return orjson.dumps(model.model_dump(by_alias=True))


def json_response(value: BaseModel | Sequence[BaseModel] | bytes) -> Response:
    """An `application/json` answer: a model, a list of models, or bytes already serialized from one."""
    if isinstance(value, BaseModel):
        body = model_json(value)
    elif isinstance(value, bytes):
        body = value
    else:
        body = orjson.dumps([m.model_dump(by_alias=True) for m in value])
    return Response(body, media_type="application/json")
