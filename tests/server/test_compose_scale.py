"""docker-compose.yml with several monitor instances behind a reverse proxy (no docker engine runs here, so
check what it would run): the replicas are the same service on the same database, the proxy reaches each of
them, leaves server-sent events unbuffered and lets telemetry bodies as large as the service accepts through,
and PostgreSQL takes the connections they all open."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from monitor_server.cli import build_parser
from monitor_server.core.config import Settings
from monitor_server.core.db import LOCK_POOL_OVERFLOW, LOCK_POOL_SIZE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _instances(compose: dict) -> dict[str, dict]:
    """The services that run `fp8-monitor serve`."""
    return {
        name: service
        for name, service in compose["services"].items()
        if [str(p) for p in service.get("command", [])][:2] == ["fp8-monitor", "serve"]
    }


def _proxy_config(compose: dict) -> tuple[dict, str]:
    proxy = compose["services"]["proxy"]
    mounts = [m.split(":") for m in proxy["volumes"]]
    source = next(src for src, dst, *_ in mounts if dst == "/etc/nginx/nginx.conf")
    path = ROOT / source
    assert path.is_file(), f"the proxy mounts {source}, which is not in the repository"
    return proxy, path.read_text()


def _size(value: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([kKmMgG]?)", value).groups()
    return int(number) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[unit.lower()]


def test_two_replicas_of_one_service_on_one_database(compose):
    instances = _instances(compose)
    assert len(instances) >= 2, sorted(instances)
    first, *others = instances.values()
    for other in others:
        for key in ("build", "command", "environment", "depends_on", "restart"):
            assert other[key] == first[key], key
        assert not other.get("ports"), "a replica is reached through the proxy, not on a host port"
    for service in instances.values():
        build_parser().parse_args([str(p) for p in service["command"][1:]])
        # several processes share PostgreSQL (its URL from the environment: a password on the command
        # line would show in the process list)
        assert service["environment"]["FP8SCOPE_DB_URL"].startswith("postgresql+psycopg://")


def test_proxy_reaches_every_instance_and_streams_events(compose):
    proxy, config = _proxy_config(compose)
    assert proxy["image"].startswith("nginx:")
    assert any(str(p).endswith(":80") for p in proxy["ports"])
    instances = _instances(compose)
    assert {name: dep["condition"] for name, dep in proxy["depends_on"].items()} == {
        name: "service_healthy" for name in instances
    }
    upstream = re.search(r"upstream\s+(\S+)\s*\{([^}]*)\}", config)
    assert upstream, "no upstream block"
    servers = re.findall(r"^\s*server\s+([^\s;]+)", upstream.group(2), flags=re.M)
    expected = []
    for name, service in instances.items():
        command = [str(p) for p in service["command"]]
        expected.append(f"{name}:{command[command.index('--port') + 1]}")
    assert sorted(servers) == sorted(expected)
    assert re.search(rf"proxy_pass\s+http://{upstream.group(1)}\s*;", config)
    # one run's requests go to one instance (its detector engine stays cached there): a consistent hash of
    # the run id taken from the path
    affinity = re.search(r"^\s*hash\s+\$(\w+)\s+consistent\s*;", upstream.group(2), flags=re.M)
    assert affinity, "no consistent hash in the upstream"
    mapped = re.search(rf"map\s+\$uri\s+\${affinity.group(1)}\s*\{{([^}}]*)\}}", config)
    assert mapped and re.search(r"/api/v1/runs/", mapped.group(1))
    # SSE: no response buffering, and an open stream outlives the keep-alive interval by far
    assert re.search(r"proxy_buffering\s+off\s*;", config)
    timeout = re.search(r"proxy_read_timeout\s+(\d+)([smh]?)\s*;", config)
    seconds = int(timeout.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[timeout.group(2)]
    assert seconds >= 10 * Settings().sse_keepalive_seconds
    # HTTP/1.1 to the upstream (keep-alive connections; chunked SSE)
    assert re.search(r"proxy_http_version\s+1\.1\s*;", config)
    # a telemetry body the service accepts passes the proxy (nginx's default is 1 MiB)
    body = re.search(r"client_max_body_size\s+(\w+)\s*;", config)
    assert body and _size(body.group(1)) >= Settings().max_body_bytes


def test_postgres_takes_the_connections_of_every_instance(compose):
    command = [str(p) for p in compose["services"]["postgres"].get("command", [])]
    flags = dict(a.split("=", 1) for a in command if "=" in a)
    max_connections = int(flags.get("max_connections", 100))
    # sessions (pool 16 + overflow 16), run locks, the event listener and sender, per instance
    per_instance = 32 + LOCK_POOL_SIZE + LOCK_POOL_OVERFLOW + 2
    assert max_connections >= per_instance * len(_instances(compose)) + 10


def test_readme_says_how_to_run_several_instances():
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^### Several instances\n(.*?)(?=^#)", readme, flags=re.M | re.S)
    assert section, "README: no 'Several instances' section"
    text = section.group(1)
    for needed in ("PostgreSQL", "LISTEN/NOTIFY", "deploy/nginx.conf", "docker compose", "proxy_buffering"):
        assert needed in text, needed
