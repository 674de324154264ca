"""Installing fp8scope as a library: the runtime and client need neither the service stack nor a particular
torch (an installed torch from 2.11 on is kept), the service is the "server" extra, and importing the client
loads nothing of the service."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

SERVER_ONLY = {"fastapi", "uvicorn", "sqlalchemy", "alembic", "psycopg", "pydantic", "pydantic-settings",
               "prometheus-client", "plotly"}  # fmt: skip


def _requirements() -> tuple[list[Requirement], list[Requirement]]:
    reqs = [Requirement(r) for r in requires("fp8scope")]
    core = [r for r in reqs if r.marker is None]
    server = [r for r in reqs if r.marker is not None and r.marker.evaluate({"extra": "server"})]
    return core, server


def test_core_install_is_the_runtime_and_client_only():
    core, server = _requirements()
    names = {r.name for r in core}
    assert not names & SERVER_ONLY, names & SERVER_ONLY
    assert {r.name for r in server} >= SERVER_ONLY
    (torch,) = [r for r in core if r.name == "torch"]
    for installed in ("2.11.0", "2.12.1", "2.13.0", "2.14.0"):  # the GPU machine's, CI's, and later ones
        assert torch.specifier.contains(installed), (torch, installed)


def test_importing_the_client_loads_nothing_of_the_service():
    code = (
        "import sys, fp8_trainer, fp8_trainer.monitor, fp8_trainer.cli; "
        f"print(sorted(m for m in {sorted(SERVER_ONLY)!r} if m.replace('-', '_') in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
