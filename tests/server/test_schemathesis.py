"""Property-based run over the OpenAPI schema: whatever the generated request, never a 5xx.

Bounded: a few examples per operation against a real server, on SQLite and on PostgreSQL (about 20 s each).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.support.http import loopback
from tests.support.server import API, ServerProcess, batch_body, random_stats, run_body

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def api_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server with one run holding some steps, an applied command and an alert, so ids 1 exist."""
    tmp = tmp_path_factory.mktemp("schemathesis")
    if request.param == "sqlite":
        db_url = f"sqlite:///{tmp / 'st.db'}"
    else:
        db_url = request.getfixturevalue("new_pg_schema")()
    server = ServerProcess(db_url, log_path=tmp / "server.log").start()
    rid = loopback.post(f"{server.url}{API}/runs", json=run_body(2)).json()["id"]
    stats = random_stats(np.random.default_rng(0), 30, 6)
    stats["nonfinite"][10, 2] = 1
    loopback.post(
        f"{server.url}{API}/runs/{rid}/telemetry", json=batch_body("a", range(30), stats, losses=[2.0] * 30)
    )
    loopback.post(f"{server.url}{API}/runs/{rid}/commands", json={"changes": {"margin": 1}})
    yield server
    server.stop()


def test_no_server_errors(api_server: ServerProcess):
    """Positive and negative examples for every operation (the SSE stream excepted: it never ends)."""
    schema = schemathesis.openapi.from_url(f"{api_server.url}/openapi.json")
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path.endswith("/stream"):
            continue
        operations += 1
        variants = [(GenerationMode.POSITIVE, None), (GenerationMode.NEGATIVE, None)]
        if "{run_id}" in operation.path:  # also aim at the run that exists, so requests get past the 404
            variants.append((GenerationMode.POSITIVE, {"run_id": 1}))
        for mode, path_parameters in variants:

            @given(case=operation.as_strategy(generation_mode=mode, path_parameters=path_parameters))
            @settings(
                max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
            )
            def check(case) -> None:
                response = case.call(timeout=30)
                if response.status_code >= 500:
                    failures.append(
                        f"{case.method} {case.formatted_path} {case.query} -> {response.status_code}: "
                        f"{response.text[:300]}"
                    )

            try:
                check()
            except Unsatisfiable:  # nothing to make invalid (e.g. an operation without parameters)
                assert mode is GenerationMode.NEGATIVE
    assert operations >= 15
    assert not failures, failures[:5]
    assert "Traceback" not in api_server.log_text()
