"""Answers the routes build themselves: JSON serialized from the response models
(`monitor_server.storage.schemas`), and the server-sent event streams.

Returning a model lets FastAPI validate it once more and write datetimes with a "Z"; the routes whose
answers have always carried `datetime.isoformat`'s "+00:00" (as the event stream and the webhook do), or
that are large (series, heatmaps), build the model and hand back its bytes: orjson writes datetimes as
`isoformat` does and is several times faster than FastAPI's encoder. Non-finite floats are strings in the
models already (`WireFloat`: "NaN", "Infinity", "-Infinity").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from fastapi import HTTPException, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from monitor_server.api.context import AppContext
from monitor_server.infra.events import StreamLimit, stream_events


def model_json(model: BaseModel) -> bytes:
    """The model as JSON bytes (fields by their alias, e.g. `from`)."""
    return orjson.dumps(model.model_dump(by_alias=True))


def json_response(value: BaseModel | Sequence[BaseModel] | bytes, status_code: int = 200) -> Response:
    """An `application/json` answer: a model, a list of models, or bytes already serialized from one."""
    if isinstance(value, BaseModel):
        body = model_json(value)
    elif isinstance(value, bytes):
        body = value
    else:
        body = orjson.dumps([m.model_dump(by_alias=True) for m in value])
    return Response(body, status_code=status_code, media_type="application/json")


#: the route decorator's arguments for a server-sent event stream (its OpenAPI entry)
EVENT_STREAM: dict[str, Any] = {
    "response_class": StreamingResponse,
    "responses": {
        200: {"content": {"text/event-stream": {}}, "description": "server-sent events"},
        429: {"description": "the token holds sse_streams_per_token streams already (Retry-After)"},
    },
}


def event_stream(ctx: AppContext, key: Any, owner: str) -> StreamingResponse:
    """Server-sent events of the broker's subscription `key` (a run id, or `events.ALL_RUNS`) for the token
    named `owner`, with keep-alive comments, not buffered by proxies; 429 when the token holds
    ``sse_streams_per_token`` streams already."""
    try:
        sub = ctx.broker.subscribe(key, owner)
    except StreamLimit as exc:
        raise HTTPException(429, str(exc), headers={"Retry-After": "5"}) from None
    return StreamingResponse(
        stream_events(sub, ctx.settings.sse_keepalive_seconds),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
