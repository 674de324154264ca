"""How the job was started goes into the run's config as ``fp8_run``: the command line (secret values hidden)
and, inside a git repository, the commit and whether the tree has changes; a missing or hanging git never
stops or stalls the job; ``run_info=False`` or ``FP8SCOPE_RUN_INFO=0`` records none of it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8_trainer import Monitor
from fp8_trainer.monitor import run_info
from tests.trainer.monitor_utils import FAST, get, tiny_model, train


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True, timeout=60)
    return done.stdout.strip()


def _repo(path: Path) -> str:
    """A git repository at `path` with one commit of train.py; returns the commit."""
    path.mkdir()
    _git(path, "init", "-q")
    (path / "train.py").write_text("print('training')\n")
    _git(path, "add", "train.py")
    _git(
        path, "-c", "user.name=fp8scope", "-c", "user.email=fp8scope@example.invalid", "commit", "-qm", "one"
    )
    return _git(path, "rev-parse", "HEAD")


@pytest.fixture
def started_in(tmp_path, monkeypatch):
    """Run the job from a directory (git looks no higher than tmp_path) with the record on by default."""
    monkeypatch.delenv(run_info.ENV, raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    return monkeypatch.chdir


def _config(server, tmp_path, **kwargs) -> dict:
    """The config the service stores for a Monitor made with `kwargs` (registered at once, closed)."""
    model, recipe = tiny_model()
    with Monitor(server.url, "run-info", model, recipe, config={"lr": 0.1}, spool_path=tmp_path / "s.jsonl",
                 fail_fast=True, **FAST, **kwargs) as mon:  # fmt: skip
        pass
    return get(server.url, f"/runs/{mon.run_id}")["config"]


def test_a_run_started_in_a_git_repo_stores_its_commit_and_command_line(
    server, tmp_path, monkeypatch, started_in
):
    repo = tmp_path / "repo"
    commit = _repo(repo)
    (repo / "train.py").write_text("print('changed')\n")  # a change not committed: the tree is dirty
    started_in(repo)
    argv = ["train.py", "--lr", "0.1", "--token", "s3cret", "--api-key=abc", "--token-file", "tok.txt"]
    monkeypatch.setattr(sys, "argv", argv)
    model, recipe = tiny_model()
    with Monitor(server.url, "in-git", model, recipe, config={"lr": 0.1}, spool_path=tmp_path / "s.jsonl",
                 **FAST) as mon:  # fmt: skip
        train(model, recipe, mon, 2)
    config = get(server.url, f"/runs/{mon.run_id}")["config"]
    assert config["fp8_run"] == {
        "argv": ["train.py", "--lr", "0.1", "--token", "***", "--api-key=***", "--token-file", "tok.txt"],
        "git_commit": commit,
        "git_dirty": True,
    }
    assert config["lr"] == 0.1 and "fp8_recipe" in config
    # found like any config value
    found = get(server.url, "/runs", config=f"fp8_run.git_commit={commit}")
    assert [r["id"] for r in found] == [mon.run_id]
    _git(repo, "checkout", "--", "train.py")
    assert _config(server, tmp_path)["fp8_run"]["git_dirty"] is False


def test_outside_a_repository_only_the_command_line(server, tmp_path, monkeypatch, started_in):
    plain = tmp_path / "plain"
    plain.mkdir()
    started_in(plain)
    monkeypatch.setattr(sys, "argv", ["job.py", "--steps=3"])
    assert _config(server, tmp_path)["fp8_run"] == {"argv": ["job.py", "--steps=3"]}


def test_the_record_can_be_turned_off(server, tmp_path, monkeypatch, started_in):
    started_in(tmp_path)
    assert "fp8_run" not in _config(server, tmp_path, run_info=False)
    monkeypatch.setenv(run_info.ENV, "0")
    assert "fp8_run" not in _config(server, tmp_path)
    assert "fp8_run" in _config(server, tmp_path, run_info=True)  # the argument wins
    with pytest.raises(ValueError, match="run_info: must be True, False or None"):
        Monitor(server.url, "bad", *tiny_model(), run_info="yes", spool_path=tmp_path / "t")


def test_a_hanging_or_missing_git_never_stalls_the_job(server, tmp_path, monkeypatch, started_in):
    repo = tmp_path / "repo"
    _repo(repo)
    started_in(repo)
    hanging = tmp_path / "bin"
    hanging.mkdir()
    (hanging / "git").write_text("#!/bin/sh\nexec sleep 60\n")
    (hanging / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{hanging}:{os.environ['PATH']}")
    began = time.monotonic()
    config = _config(server, tmp_path)
    assert time.monotonic() - began < 30  # git's 2 s, not its 60; a loaded machine has room to spare
    assert config["fp8_run"] == {"argv": sys.argv}
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # no git at all
    assert run_info.git_state() == {}
