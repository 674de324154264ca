"""Every answer is what its documented schema says: for a realistic run (alerts, incidents, a queued command,
small and large events, non-finite values), each JSON route's answer has exactly the keys of its OpenAPI
response schema, at every level, and validates against the response model the route declares.

The routes that serialize their answer themselves (large arrays, the heatmap's spliced matrix, the telemetry
answer) skip FastAPI's response validation, so these checks are what keeps them and their schema together.
"""

from __future__ import annotations

import importlib
import pkgutil
import struct
import typing
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel, TypeAdapter

from monitor_server.api import routes
from monitor_server.app import create_app
from monitor_server.core.config import Settings
from monitor_server.storage.query_schemas import (
    BlockHistogramPublic,
    HeatmapPackedHeader,
    HeatmapPublic,
    LayerHealth,
    SeriesMulti,
    SeriesPublic,
)
from monitor_server.storage.schemas import (
    AckAllResult,
    AlertPublic,
    CommandPublic,
    EventPublic,
    Health,
    IncidentDetail,
    IncidentPublic,
    RunPublic,
    TelemetryResult,
    WhoAmI,
)
from tests.support.server import API, batch_body, col, random_stats, run_body

BLOCK_STEPS = 40  # the block-scaled steps that follow the realistic run's first 300


def resolve(doc: dict, schema: dict) -> dict:
    """`schema` with its `$ref` (``#/components/schemas/X``, ``#/$defs/X``) followed within `doc`."""
    while "$ref" in schema:
        node: Any = doc
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def schema_mismatches(doc: dict, schema: dict, value: Any, where: str = "") -> tuple[list[str], int]:
    """Where `value` (parsed JSON) has other keys than `schema` (an OpenAPI / JSON schema, `$ref`s resolved
    in `doc`) lists, at any depth; and how many objects with listed properties were compared."""
    schema = resolve(doc, schema)
    if "anyOf" in schema:  # a union (most often `X | None`): the branch of the value's JSON type
        kind = {dict: "object", list: "array", type(None): "null"}.get(type(value))
        branches = [s for s in schema["anyOf"] if kind is not None and _json_type(doc, s) == kind]
        return schema_mismatches(doc, branches[0], value, where) if branches else ([], 0)
    problems: list[str] = []
    compared = 0
    if isinstance(value, dict) and "properties" in schema:
        listed = set(schema["properties"])
        if set(value) != listed:
            extra, absent = sorted(set(value) - listed), sorted(listed - set(value))
            problems.append(f"{where or '.'}: undeclared {extra}, absent {absent}")
        compared += 1
        for key in listed & set(value):
            p, n = schema_mismatches(doc, schema["properties"][key], value[key], f"{where}.{key}")
            problems += p
            compared += n
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            p, n = schema_mismatches(doc, schema["additionalProperties"], item, f"{where}[{key!r}]")
            problems += p
            compared += n
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            p, n = schema_mismatches(doc, schema["items"], item, f"{where}[{i}]")
            problems += p
            compared += n
    return problems, compared


def _json_type(doc: dict, schema: dict) -> str | None:
    schema = resolve(doc, schema)
    if "properties" in schema or "additionalProperties" in schema:
        return "object"
    return schema.get("type")


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def realistic(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A run of 300 steps with non-finite statistics and losses, a loss spike, a small and a large event,
    a command queued before its first step, and the alerts and incidents its detectors raised."""
    if request.param == "sqlite":
        db_url = f"sqlite:///{tmp_path_factory.mktemp('responses') / 'm.db'}"
    else:
        db_url = request.getfixturevalue("new_pg_schema")()
    app = create_app(Settings(db_url=db_url, allowed_hosts=["testserver"]))
    with TestClient(app) as client:
        rid = client.post(f"{API}/runs", json=run_body(3)).json()["id"]
        stats = random_stats(np.random.default_rng(0), 300, 9)
        stats["nonfinite"][100, 2] = 1
        stats["amax"][50, 1] = np.inf
        stats["amax"][60, 4] = np.nan
        losses = [2.0 - i * 0.001 for i in range(300)]
        losses[70], losses[80], losses[90] = float("nan"), float("inf"), 50.0
        client.post(f"{API}/runs/{rid}/commands", json={"changes": {"margin": 1}})
        events = [
            {"kind": "custom", "step": 5, "details": {"note": "x" * 5000, "n": 1}},
            {"kind": "loss_spike", "step": 90, "details": {"loss": 50.0, "z": 9.5}},
        ]
        answers = []
        for k in range(3):
            rows = slice(100 * k, 100 * (k + 1))
            body = batch_body(
                f"b{k}",
                range(100 * k, 100 * (k + 1)),
                {n: v[rows] for n, v in stats.items()},
                losses=losses[rows],
                events=events if k == 0 else [],
            )
            answers.append(client.post(f"{API}/runs/{rid}/telemetry", json=body))
        assert all(r.status_code == 200 for r in answers), answers[-1].text
        # then block statistics and histograms (the first layer block scaled, a NaN block range)
        blocks = random_stats(np.random.default_rng(1), BLOCK_STEPS, 9) | {
            "blocks": np.tile([128.0] * 3 + [0.0] * 6, (BLOCK_STEPS, 1)),
            "blocks_at_limit": np.tile([1.0] * 3 + [0.0] * 6, (BLOCK_STEPS, 1)),
            "blocks_overflow": np.zeros((BLOCK_STEPS, 9)),
            "blocks_underflow": np.tile([4.0] * 3 + [0.0] * 6, (BLOCK_STEPS, 1)),
            "block_range": np.tile([6.5] * 3 + [0.0] * 6, (BLOCK_STEPS, 1)),
        }
        blocks["block_range"][7, 1] = np.nan
        steps = [
            {
                "step": 300 + i,
                "stats": {n: col(v[i]) for n, v in blocks.items()},
                "block_hist": [[t, 118 + t, [1, 0, 127 - t, t]] for t in range(3)],
            }
            for i in range(BLOCK_STEPS)
        ]
        r = client.post(f"{API}/runs/{rid}/telemetry", json={"idempotency_key": "blocks", "steps": steps})
        assert r.status_code == 200, r.text
        yield {"client": client, "rid": rid, "doc": client.get("/openapi.json").json(), "telemetry": answers}


def check_answer(
    realistic: dict, method: str, path: str, response: Any, model: Any, prefix: str = API
) -> Any:
    """`response` (to `method path`, a path as the OpenAPI names it, after `prefix`) has the keys its
    documented schema lists and validates against `model`; returns the parsed answer."""
    assert response.status_code in (200, 201), response.text
    schema = realistic["doc"]["paths"][prefix + path][method]["responses"][str(response.status_code)]
    answer = response.json()
    problems, compared = schema_mismatches(
        realistic["doc"], schema["content"]["application/json"]["schema"], answer
    )
    assert problems == []
    assert compared > 0  # the answer held objects to compare (not an empty list)
    TypeAdapter(model).validate_python(answer)
    return answer


def get(realistic: dict, path: str, **params: Any) -> Any:
    rid = realistic["rid"]
    return realistic["client"].get(API + path.replace("{run_id}", str(rid)), params=params)


def test_telemetry_answer_matches_its_schema(realistic):
    answer = check_answer(
        realistic, "post", "/runs/{run_id}/telemetry", realistic["telemetry"][0], TelemetryResult
    )
    assert [c["changes"] for c in answer["commands"]] == [{"margin": 1}]
    assert answer["commands"][0]["created_at"].endswith("+00:00")  # as the event stream spells dates


@pytest.mark.parametrize(
    ("path", "params", "model"),
    [
        ("/runs/{run_id}/series", {"name": "loss"}, SeriesPublic),
        ("/runs/{run_id}/series", {"name": "loss", "max_points": 20}, SeriesPublic),
        ("/runs/{run_id}/series", {"name": "loss", "from": 5000}, SeriesPublic),
        ("/runs/{run_id}/series/multi", {"name": ["loss", "lr", "absent"], "max_points": 30}, SeriesMulti),
        ("/runs/{run_id}/series/multi", {"name": "loss", "from": 5000}, SeriesMulti),
    ],
    ids=["series", "series-downsampled", "series-empty", "series-multi", "series-multi-empty"],
)
def test_series_answers_match_their_schema(realistic, path, params, model):
    answer = check_answer(realistic, "get", path, get(realistic, path, **params), model)
    values = answer["values"] if "values" in answer else answer["series"]["loss"]["values"]
    if answer["from"] is not None:  # the non-finite losses travel as strings
        assert {"NaN", "Infinity"} <= {v for v in values if isinstance(v, str)}


@pytest.mark.parametrize(
    "params",
    [{"metric": "amax", "max_cols": 40}, {"metric": "headroom"}, {"from": 9000}],
    ids=["amax", "headroom", "empty"],
)
def test_heatmap_answer_matches_its_schema(realistic, params):
    path = "/runs/{run_id}/heatmap"
    answer = check_answer(realistic, "get", path, get(realistic, path, **params), HeatmapPublic)
    assert len(answer["values"]) == len(answer["tensors"]) == 9
    cells = [v for row in answer["values"] for v in row]
    if params.get("metric") == "amax":  # the spliced matrix spells non-finite cells as the model does
        assert {"NaN", "Infinity"} <= {v for v in cells if isinstance(v, str)}


@pytest.mark.parametrize("metric", ["block_at_limit", "block_range"])
def test_block_heatmap_answer_matches_its_schema(realistic, metric):
    path = "/runs/{run_id}/heatmap"
    answer = check_answer(realistic, "get", path, get(realistic, path, metric=metric), HeatmapPublic)
    assert answer["aggregation"] == "max" and sum(answer["bucket_steps"]) == BLOCK_STEPS
    if metric == "block_range":  # the NaN block range shows, spelled as the model says
        assert "NaN" in answer["values"][1]


@pytest.mark.parametrize(
    "params",
    [
        {"tensor": 1},
        {"tensor": "blocks.0.mlp.fc.input", "max_steps": 7},
        {"tensor": 5},
        {"tensor": 0, "from": 9000},
    ],
    ids=["by-index", "by-name-bucketed", "none-sent", "empty-range"],
)
def test_block_histogram_answer_matches_its_schema(realistic, params):
    path = "/runs/{run_id}/block-histogram"
    answer = check_answer(realistic, "get", path, get(realistic, path, **params), BlockHistogramPublic)
    assert set(answer) >= {"from", "to"}  # the range under its aliases, as the series answers
    if params["tensor"] == 1:
        assert answer["counts"] == [[1, 0, 126, 1]] * BLOCK_STEPS and answer["exponent_lo"] == 119
    elif params["tensor"] == 5 or "from" in params:
        assert answer["counts"] == [] and answer["exponent_lo"] is None
    else:
        assert len(answer["counts"]) <= 7 and sum(map(sum, answer["counts"])) == 128 * BLOCK_STEPS


def test_packed_heatmap_header_matches_its_model(realistic):
    r = get(realistic, "/runs/{run_id}/heatmap/packed", max_cols=40)
    assert r.status_code == 200
    (n,) = struct.unpack_from("<I", r.content)
    header = orjson.loads(r.content[4 : 4 + n])
    schema = HeatmapPackedHeader.model_json_schema()
    problems, compared = schema_mismatches(schema, schema, header)
    assert problems == [] and compared == 1 + 9  # the header and its tensors
    packed = HeatmapPackedHeader.model_validate(header)
    as_json = get(realistic, "/runs/{run_id}/heatmap", max_cols=40).json()
    assert packed.model_dump(exclude={"rows", "dtype", "cols"}) == {
        k: v for k, v in as_json.items() if k != "values"
    }
    assert (packed.rows, packed.cols) == (9, len(as_json["bucket_start"]))


def test_event_answers_match_their_schema(realistic):
    listed = check_answer(
        realistic, "get", "/runs/{run_id}/events", get(realistic, "/runs/{run_id}/events"), list[EventPublic]
    )
    assert [e["details_complete"] for e in listed] == [False, True]  # the large one as its summary
    for event in listed:
        path = "/runs/{run_id}/events/{event_id}"
        r = get(realistic, path.replace("{event_id}", str(event["id"])))
        whole = check_answer(realistic, "get", path, r, EventPublic)
        assert whole["details_complete"] is True and whole["created_at"] == event["created_at"]


def test_layer_health_answer_matches_its_schema(realistic):
    path = "/runs/{run_id}/layers"
    layers = check_answer(realistic, "get", path, get(realistic, path), list[LayerHealth])
    assert len(layers) == 3 and sum(len(layer["tensors"]) for layer in layers) == 9
    by_name = {layer["layer"]: layer for layer in layers}
    assert by_name["blocks.0.mlp.fc"]["block_range"] == 6.5  # the latest block step: no NaN in it
    assert by_name["blocks.0.mlp.fc"]["block_at_limit"] == 1 / 128
    assert by_name["blocks.1.mlp.fc"]["block_range"] == 0.0


def test_health_answers_match_their_schema(realistic):
    client = realistic["client"]
    for path in ("/healthz", "/readyz"):
        check_answer(realistic, "get", path, client.get(path), Health, prefix="")


def test_command_answers_match_their_schema(realistic):
    client, rid = realistic["client"], realistic["rid"]
    r = client.post(
        f"{API}/runs/{rid}/commands", json={"target": "blocks.1.mlp.fc", "changes": {"margin": 2}}
    )
    posted = check_answer(realistic, "post", "/runs/{run_id}/commands", r, CommandPublic)
    path = "/runs/{run_id}/commands"
    listed = check_answer(realistic, "get", path, get(realistic, path), list[CommandPublic])
    assert posted["id"] in [c["id"] for c in listed]


def test_whoami_and_run_answers_match_their_schema(realistic):
    check_answer(realistic, "get", "/whoami", get(realistic, "/whoami"), WhoAmI)
    check_answer(realistic, "get", "/runs/{run_id}", get(realistic, "/runs/{run_id}"), RunPublic)
    check_answer(realistic, "get", "/runs", get(realistic, "/runs"), list[RunPublic])


def test_alert_and_incident_answers_match_their_schema(realistic):
    client, rid = realistic["client"], realistic["rid"]
    alerts = check_answer(
        realistic, "get", "/runs/{run_id}/alerts", get(realistic, "/runs/{run_id}/alerts"), list[AlertPublic]
    )
    incidents = check_answer(
        realistic,
        "get",
        "/runs/{run_id}/incidents",
        get(realistic, "/runs/{run_id}/incidents"),
        list[IncidentPublic],
    )
    assert alerts and incidents
    iid = incidents[-1]["id"]
    path = "/runs/{run_id}/incidents/{incident_id}"
    detail = check_answer(
        realistic, "get", path, get(realistic, path.replace("{incident_id}", str(iid))), IncidentDetail
    )
    assert [a["id"] for a in detail["alerts_full"]] == [a["id"] for a in detail["alerts"]]
    # acknowledging answers too (idempotent: the answers keep their shape on a second call)
    aid = alerts[-1]["id"]
    path = "/runs/{run_id}/alerts/{alert_id}/ack"
    r = client.post(f"{API}/runs/{rid}/alerts/{aid}/ack")
    assert check_answer(realistic, "post", path, r, AlertPublic)["state"] == "acknowledged"
    path = "/runs/{run_id}/incidents/{incident_id}/ack"
    r = client.post(f"{API}/runs/{rid}/incidents/{iid}/ack")
    assert check_answer(realistic, "post", path, r, IncidentPublic)["state"] == "acknowledged"
    r = client.post(f"{API}/runs/{rid}/incidents/ack")
    check_answer(realistic, "post", "/runs/{run_id}/incidents/ack", r, AckAllResult)


def _models(annotation: Any) -> Iterator[type[BaseModel]]:
    """The pydantic models inside a response annotation (`X`, `list[X]`, `X | None`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models(arg)


def test_every_response_model_refuses_undeclared_fields():
    """A dict a route returns through its response model cannot carry a key the model does not document:
    FastAPI would drop it silently under the default `extra="ignore"`."""
    modules = [
        importlib.import_module(f"{routes.__name__}.{m.name}") for m in pkgutil.iter_modules(routes.__path__)
    ]
    routers = [m.router for m in modules]
    models = {
        m
        for r in routers
        for route in r.routes
        if isinstance(route, APIRoute)
        for m in _models(route.response_model)
    }
    assert len(models) >= 15
    assert sorted(m.__name__ for m in models if m.model_config.get("extra") != "forbid") == []
