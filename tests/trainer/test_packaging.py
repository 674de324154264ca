"""Installing fp8scope as a library: the runtime and client need neither the service stack nor a particular
torch (an installed torch from 2.11 on is kept), the service is the "server" extra, and importing the client
loads nothing of the service."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

from tests.support.http import loopback

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
        "import sys, fp8_trainer, fp8_trainer.monitor, fp8_trainer.app.cli; "
        f"print(sorted(m for m in {sorted(SERVER_ONLY)!r} if m.replace('-', '_') in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


#: what `fp8-monitor upload` imports beyond the standard library: the client install's httpx and orjson
CLIENT_UPLOAD_DISTS = ("httpx", "httpcore", "h11", "anyio", "idna", "certifi", "orjson", "typing_extensions")


def _client_only_venv(tmp_path):
    """A fresh venv with fp8scope's wheel (built from this tree, console scripts included) and the client's
    upload dependencies linked in from this environment, none of the server extra."""
    import shutil
    import sysconfig
    import venv
    from importlib.metadata import distribution
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    # built from a copy: a build writes build/ and *.egg-info next to its sources
    source = tmp_path / "source"
    skip = shutil.ignore_patterns(
        ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", "*.db*", "results"
    )
    shutil.copytree(root, source, ignore=skip, symlinks=True)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(source)], check=True, capture_output=True)  # fmt: skip
    env_dir = tmp_path / "client-venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    (wheel,) = wheels.glob("fp8scope-*.whl")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)  # fmt: skip
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(
        subprocess.run(
            [str(python), "-c", purelib], check=True, capture_output=True, text=True
        ).stdout.strip()
    )
    ours = Path(sysconfig.get_paths()["purelib"])
    for name in CLIENT_UPLOAD_DISTS:
        dist = distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            if (ours / top).exists() and not (site / top).exists():
                (site / top).symlink_to(ours / top)
    assert shutil.which("fp8-monitor", path=str(env_dir / "bin"))
    return env_dir


def test_the_client_install_uploads_a_spool_to_the_url_in_the_environment(tmp_path):
    import os

    from fp8_trainer import Monitor
    from tests.support.server import free_port, running_server
    from tests.trainer.monitor_utils import FAST, tiny_model, train

    env_dir = _client_only_venv(tmp_path)
    check = (
        "import importlib.util as u; print([m for m in ('pydantic', 'fastapi', 'torch') if u.find_spec(m)])"
    )
    out = subprocess.run([str(env_dir / "bin" / "python"), "-c", check], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out  # really without the server extra
    spool = tmp_path / "run.jsonl"
    model, recipe = tiny_model()
    with Monitor(
        f"http://127.0.0.1:{free_port()}", "offline", model, recipe, spool_path=spool, **FAST
    ) as mon:
        train(model, recipe, mon, 5)  # a dead service: everything spooled
    with running_server(f"sqlite:///{tmp_path / 'm.db'}") as server:
        env = {**os.environ, "FP8SCOPE_URL": server.url}
        done = subprocess.run([str(env_dir / "bin" / "fp8-monitor"), "upload", str(spool)], env=env,
                              capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "5 new steps stored" in done.stdout
        (run,) = loopback.get(f"{server.url}/api/v1/runs").json()
        assert run["name"] == "offline" and run["steps_stored"] == 5
    serve = subprocess.run([str(env_dir / "bin" / "fp8-monitor"), "serve"], capture_output=True, text=True)
    assert serve.returncode == 2 and "Traceback" not in serve.stderr
    assert "pip install 'fp8scope[server]'" in serve.stderr, serve.stderr
