"""Registering a run with the service: the run's description, its spool file, and the sender that posts
it (``sender.py``). Only rank 0 registers; with ``fail_fast`` a refusal raises ``MonitorRefused``."""

from __future__ import annotations

import re
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .sender import Sender, SenderConfig
from .spool import SpoolWriter
from .system import SystemSampler

__all__ = ["MonitorRefused", "run_body", "start_sender"]


class MonitorRefused(RuntimeError):
    """The service refused the run (``Monitor(..., fail_fast=True)``); the message says why."""


def _recipe_dict(recipe) -> dict[str, Any]:
    if recipe is None:
        return {}
    # the service's effective recipe needs the scaling mode spelled out (its default is "delayed")
    return {**recipe.to_dict(), "scaling": recipe.scaling}


def _source_config(model: nn.Module, caller) -> dict[str, Any]:
    """Where the run's statistics come from, when not from fp8scope's FP8 layers, and the linear layers left
    out of FP8 with the reason (the dashboard shows both in the run's config)."""
    if caller is not None:
        return {"fp8_source": caller.source}
    state = getattr(model, "_fp8_state", None)
    source = getattr(state, "source", None)
    out = {"fp8_source": source} if source else {}
    left = getattr(state, "ineligible", None)
    if left:
        out["fp8_left_out"] = dict(left)
    return out


def run_body(
    run_name: str,
    model: nn.Module,
    recipe,
    caller,
    *,
    config: dict[str, Any] | None,
    tags: list[str],
    world_size: int,
    tensors: list[dict[str, Any]],
    started: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run as ``POST /runs`` (and the spool file's header) describes it; `started`: how the job was
    started (``run_info.run_info``), None to leave it out."""
    # the recipe in force, every parameter spelled out (filterable and diffable like any config key), and
    # the command line and git commit; a key of the caller's own config of either name wins
    used = {"fp8_recipe": _recipe_dict(recipe)} if recipe is not None else {}
    if started is not None:
        used["fp8_run"] = started
    body = {
        "name": run_name,
        "config": {**used, **dict(config or {}), **_source_config(model, caller)},
        "recipe": _recipe_dict(recipe),
        "world_size": world_size,
        "host": socket.gethostname()[:200],
        "tensors": tensors,
    }
    if tags:  # only when used: a service from before tags registers the run as it always did
        body["tags"] = tags
    return body


def _default_spool_path(run_name: str, client_key: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", run_name)[:80] or "run"
    return Path("fp8scope-spool") / f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{client_key[:6]}.jsonl"


def start_sender(
    url: str,
    token: str | None,
    body: dict[str, Any],
    model: nn.Module,
    *,
    cfg: SenderConfig,
    on_commands,
    spool_path: str | Path | None,
    fail_fast: bool,
) -> Sender:
    """The run's sender thread, started (it registers the run, then posts batches).

    Args:
        on_commands: called on the sender thread with the commands a response delivers.
        spool_path: where to spool (None: ``./fp8scope-spool/<run_name>-<time>-<key>.jsonl``).
        fail_fast: register before returning; raise ``MonitorRefused`` if the service refuses the run.
    """
    client_key = uuid.uuid4().hex
    if spool_path is None:
        spool_path = _default_spool_path(body["name"], client_key)
    spool = SpoolWriter(spool_path, body, client_key)
    sender = Sender(url, token, body, client_key, spool, cfg, on_commands)
    device = next((p.device for p in model.parameters()), None)
    gpu = None
    if device is not None and device.type == "cuda":
        gpu = device.index if device.index is not None else torch.cuda.current_device()
    sender.sampler = SystemSampler(gpu)
    if fail_fast and not sender.register_now() and sender.refused:
        sender.http.close()
        raise MonitorRefused(f"fp8scope monitor: {sender.refused}")
    sender.start()
    return sender
