"""Where a client finds the service and its token when none is passed: ``FP8SCOPE_URL``,
``FP8SCOPE_TOKEN`` and ``FP8SCOPE_TOKEN_FILE``. The training job's ``Monitor``, the read client and
``fp8-monitor upload`` all read them here, so a job and the command it prints for its spool agree."""

from __future__ import annotations

import os
import re


def env_token() -> str | None:
    """``FP8SCOPE_TOKEN``, else the first line of the file named by ``FP8SCOPE_TOKEN_FILE``."""
    token = os.environ.get("FP8SCOPE_TOKEN")
    if token:
        return token
    path = os.environ.get("FP8SCOPE_TOKEN_FILE")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip() or None
    except OSError as e:
        raise ValueError(f"FP8SCOPE_TOKEN_FILE: cannot read {path!r} ({e.strerror})") from None


def service_url(url: str | None) -> str:
    """`url`, else ``FP8SCOPE_URL``; ValueError unless it looks like ``http(s)://host[:port]``."""
    url = url if url is not None else os.environ.get("FP8SCOPE_URL")
    if not isinstance(url, str) or not re.match(r"https?://[^/\s]+", url):
        raise ValueError(
            f"url: expected the service root like 'http://127.0.0.1:8000' (or in FP8SCOPE_URL), got {url!r}"
        )
    return url
