"""How the job was started, recorded in the run's config as ``fp8_run``: the command line (``argv``, the
values of options named like a token, secret, password or API key replaced by ``***``) and, when the working
directory is inside a git repository, the commit checked out (``git_commit``) and whether tracked files differ
from it (``git_dirty``; untracked files do not count).

Read once, on rank 0, when the ``Monitor`` is made. git is asked with a short timeout, and anything that goes
wrong (no git, not a repository, no commit yet, a slow file system) leaves the git keys out: it never stops
or stalls the job. ``Monitor(..., run_info=False)`` or ``FP8SCOPE_RUN_INFO=0`` records none of it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["ENV", "command_line", "git_state", "run_info", "wanted"]

#: the environment variable that turns the record off ("0", "false", "no" or "off")
ENV = "FP8SCOPE_RUN_INFO"
#: seconds git may take, both of its calls together
GIT_TIMEOUT_S = 2.0
_SECRET = re.compile(r"--?[\w-]*(token|secret|password|passwd|api[_-]?key)[\w-]*", re.IGNORECASE)
_PATH = re.compile(r".*[_-](file|path)", re.IGNORECASE)
_HIDDEN = "***"


def wanted(run_info: bool | None) -> bool:
    """Whether to record: `run_info` when given, else ``FP8SCOPE_RUN_INFO`` (default yes)."""
    if run_info is not None:
        if not isinstance(run_info, bool):
            raise ValueError(f"run_info: must be True, False or None, got {run_info!r}")
        return run_info
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def command_line(argv: Sequence[str]) -> list[str]:
    """`argv` with the values of secret options hidden (``--token X`` and ``--token=X``; a ``--token-file``
    names a file, and is kept)."""
    out: list[str] = []
    hide_next = False
    for arg in map(str, argv):
        if hide_next:
            out.append(_HIDDEN)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        if _SECRET.fullmatch(name) and not _PATH.fullmatch(name):
            out.append(f"{name}={_HIDDEN}" if eq else arg)
            hide_next = not eq
        else:
            out.append(arg)
    return out


def _git(args: list[str], cwd: str | None, timeout: float) -> str | None:
    """git's output, or None when it failed, is missing or took longer than `timeout` seconds."""
    if timeout <= 0:
        return None
    # no prompt, and no lock taken on the index (a `git status` beside the user's own git commands)
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0"}
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(cwd: str | None = None, timeout: float = GIT_TIMEOUT_S) -> dict[str, Any]:
    """``{"git_commit": ..., "git_dirty": ...}`` of the repository holding `cwd` (default: the working
    directory); ``{}`` outside one; ``git_dirty`` is None when git could not say in time."""
    deadline = time.monotonic() + timeout
    head = _git(["rev-parse", "--verify", "HEAD"], cwd, timeout)
    commit = (head or "").strip()
    if not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", commit):
        return {}
    status = _git(["status", "--porcelain", "--untracked-files=no"], cwd, deadline - time.monotonic())
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status.strip())}


def run_info(argv: Sequence[str] | None = None, cwd: str | None = None) -> dict[str, Any]:
    """The ``fp8_run`` entry of the run's config."""
    return {"argv": command_line(sys.argv if argv is None else argv), **git_state(cwd)}
