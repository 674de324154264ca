"""The events a job sends beside its steps (`fp8_protocol.client_events`), the tensor record a run
registers (`fp8_protocol.tensors`), and the API prefix both sides and the dashboard use: each checked
against the service's own declaration (its OpenAPI models) or the dashboard's."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from pathlib import Path

import numpy as np
import pytest

from fp8_protocol.api import API_PREFIX
from fp8_protocol.client_events import (
    CUSTOM_EVENT,
    EVENT_FIELDS,
    EVENT_KINDS,
    LOSS_SPIKE_EVENT,
    NONFINITE_EVENT,
    RANK_AMAX_EVENT,
    parse_rank_amax,
    rank_amax_details,
)
from fp8_protocol.tensors import ROLES, TensorInfo
from monitor_server.storage.schemas import EventKind, Role, TensorSpec

ROOT = Path(__file__).resolve().parents[2]


def test_the_kinds_are_the_four_the_service_declares():
    assert EVENT_KINDS == (LOSS_SPIKE_EVENT, NONFINITE_EVENT, RANK_AMAX_EVENT, CUSTOM_EVENT)
    assert EVENT_KINDS == ("loss_spike", "nonfinite", "rank_amax", "custom")
    assert set(typing.get_args(EventKind)) == set(EVENT_KINDS)  # the OpenAPI schema's spelling
    assert {"kind", "step", "details"} == EVENT_FIELDS


def test_rank_amax_details_read_back_as_the_matrix_written_non_finite_included():
    amax = np.array([[1.0, 0.0, math.inf], [2.5, math.nan, -0.0]])
    details = json.loads(json.dumps(rank_amax_details(amax.tolist()), allow_nan=False))
    assert details["world_size"] == 2 and details["amax"][0][2] == "Infinity"
    back = parse_rank_amax(details, 3)
    assert back.shape == (2, 3) and np.array_equal(back, amax, equal_nan=True)


@pytest.mark.parametrize(
    ("details", "message"),
    [
        ({"amax": [[1.0, 2.0]]}, "at least two per-rank lists"),
        ({"world_size": 3, "amax": [[1.0, 2.0], [1.0, 2.0]]}, "world_size 3 but 2 rows"),
        ({"world_size": True, "amax": [[1.0, 2.0], [1.0, 2.0]]}, "world_size True"),
        ({"amax": [[1.0, 2.0], [1.0]]}, "row 1 must hold 2 values"),
        ({"amax": [[1.0, None], [1.0, 2.0]]}, "row 0 holds a value that is not a number"),
        ({"amax": [[1.0, 2.0], [False, 2.0]]}, "row 1 holds a value that is not a number"),
        ({"amax": [[1.0, "inf"], [1.0, 2.0]]}, "row 0 holds a value that is not a number"),
        ({"amax": [[1.0, [2.0]], [1.0, 2.0]]}, "row 0 holds a value that is not a number"),
    ],
)
def test_a_malformed_rank_amax_event_is_refused(details, message):
    with pytest.raises(ValueError, match=message):
        parse_rank_amax(details, 2)


def test_the_dashboard_calls_the_api_under_the_same_prefix():
    js = (ROOT / "web" / "js" / "api.js").read_text()
    assert re.findall(r'^const API = "([^"]*)";$', js, flags=re.M) == [API_PREFIX]
    assert API_PREFIX.startswith("/") and not API_PREFIX.endswith("/")


def test_the_tensor_record_is_the_one_the_service_validates():
    fields = [f.name for f in dataclasses.fields(TensorInfo)]
    assert fields == ["index", "name", "layer", "role", "format"]
    assert list(TensorSpec.model_fields) == fields
    assert typing.get_args(Role) == ROLES == ("input", "weight", "grad_output")
    info = TensorInfo(4, "blocks.1.fc.weight", "blocks.1.fc", "weight", "e4m3")
    assert TensorSpec.model_validate(info.to_dict()).model_dump() == info.to_dict()
    assert TensorInfo(**info.to_dict()) == info
