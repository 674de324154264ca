"""docker-compose.yml and Dockerfile: no docker engine runs here, so check what they would run.

The compose file must wire PostgreSQL and the monitor service together, keep the data in a named volume,
take the tokens from the environment, and run the real `fp8-monitor` CLI with flags it accepts.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
import yaml

from fp8_trainer.app.cli import prepare
from monitor_server.cli import build_parser, build_settings
from monitor_server.core.config import parse_token
from tests.support import ROOT


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _expand(value: str) -> str:
    """Expand ${VAR:-default} the way compose does when VAR is unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def test_services_ports_and_volume(compose):
    services = compose["services"]
    assert {"postgres", "monitor"} <= set(services)
    assert services["postgres"]["image"].startswith("postgres:")
    # published on the host's loopback only: plain HTTP carries bearer tokens (TLS belongs to a proxy)
    assert services["monitor"]["ports"] == ["127.0.0.1:8000:8000"]
    assert services["proxy"]["ports"] == ["127.0.0.1:8080:80"]
    # the database lives in a named volume, declared at top level
    mounts = [m.split(":")[0] for m in services["postgres"]["volumes"]]
    assert mounts and all(m in compose["volumes"] for m in mounts)
    assert services["postgres"]["volumes"][0].endswith(":/var/lib/postgresql/data")
    # the monitor waits for a healthy database
    assert services["monitor"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])


def test_monitor_runs_the_real_cli_against_postgres(compose, monkeypatch):
    monitor = compose["services"]["monitor"]
    command = [_expand(str(part)) for part in monitor["command"]]
    # the console script exists in the distribution
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert command[0] == "fp8-monitor" and scripts["fp8-monitor"] == "monitor_server.cli:main"
    args = build_parser().parse_args(command[1:])
    assert args.command == "serve"
    monkeypatch.setenv("FP8SCOPE_TOKENS", "trainer:ingest:secret-one")
    # the database URL (with its password) comes from the environment, never the command line
    assert not any("postgresql" in part or "--db" in part for part in command)
    monkeypatch.setenv("FP8SCOPE_DB_URL", _expand(monitor["environment"]["FP8SCOPE_DB_URL"]))
    settings = build_settings(args)
    assert settings.auth_enabled
    assert settings.db_url.startswith("postgresql+psycopg://")
    pg = compose["services"]["postgres"]["environment"]
    assert f"@postgres:5432/{pg['POSTGRES_DB']}" in settings.db_url
    assert f"//{pg['POSTGRES_USER']}:" in settings.db_url
    assert settings.host == "0.0.0.0" and settings.port == 8000


def test_tokens_come_from_the_environment(compose):
    env = compose["services"]["monitor"]["environment"]
    # required (":?"): the service refuses a non-loopback address without tokens
    assert env["FP8SCOPE_TOKENS"].startswith("${FP8SCOPE_TOKENS:?")
    example = re.search(r"e\.g\. ([^}]+)\}", env["FP8SCOPE_TOKENS"]).group(1)
    assert [parse_token(t).name for t in example.split(",")] == ["trainer", "dashboard"]


def _stages() -> dict[str, str]:
    """Dockerfile stages by name, in order, each with its text."""
    text = (ROOT / "Dockerfile").read_text()
    parts = re.split(r"^FROM \S+ AS (\S+)\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _cmd(stage: str) -> list[str]:
    cmd = re.search(r"^CMD \[(.*)\]", stage, flags=re.M).group(1)
    return [part.strip().strip('"') for part in cmd.split(",")]


def test_dockerfile_copies_existing_paths_and_runs_the_clis(compose):
    stages = _stages()
    assert list(stages)[-1] == "monitor"  # `docker build .` builds the service
    for name, stage in stages.items():
        for src in re.findall(r"^COPY (\S+)", stage, flags=re.M):
            if not src.startswith("--"):
                assert (ROOT / src).exists(), f"Dockerfile stage {name} copies missing path {src}"
    argv = _cmd(stages["monitor"])
    assert argv[0] == "fp8-monitor"
    assert build_parser().parse_args(argv[1:]).command == "serve"
    argv = _cmd(stages["trainer"])
    assert argv[0] == "fp8-train"
    prepare(argv[1:])  # exits 2 on a flag fp8-train rejects
    assert "torch==" in stages["trainer"] and "whl/cpu" in stages["trainer"]  # the CPU build, pinned
    # a C compiler (fp8_kernels/cpu/fused.py looks for cc, gcc or clang) and C headers for the fused kernel
    assert re.search(r"apt-get install [^\n]*\bgcc\b[^\n]*\blibc6-dev\b", stages["trainer"])
    for service in compose["services"].values():
        if "build" in service:
            assert service["build"]["target"] in stages


def test_example_trainer_streams_into_the_monitor_with_valid_flags(compose):
    trainer, monitor = compose["services"]["trainer"], compose["services"]["monitor"]
    assert trainer["depends_on"]["monitor"]["condition"] == "service_healthy"
    command = [str(part) for part in trainer["command"]]
    token = trainer["environment"]["FP8SCOPE_TOKEN"]
    assert token.startswith("${FP8SCOPE_TRAINER_TOKEN:?")  # a secret from the environment, never a default
    assert "--token" not in command  # never on the command line (the process list)
    assert command[0] == "fp8-train"
    args, _ = prepare(command[1:])  # the real parser and checks: flags, injected layer names, URL
    port = monitor["ports"][0].split(":")[-1]
    assert args.monitor_url == f"http://monitor:{port}" and args.recipe in ("delayed", "current")
    assert args.inject and args.steps >= 100


def test_service_image_needs_no_torch():
    """The image installs the dependencies minus torch: the service must not import it."""
    code = "import sys, monitor_server.app, monitor_server.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
