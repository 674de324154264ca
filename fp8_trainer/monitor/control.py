"""Applying recipe commands from the service at a step boundary, and acknowledging them.

Commands arrive in telemetry responses on the sender thread and wait in ``CommandInbox``; ``Monitor.step``
applies them in the training thread through ``set_layer_recipe(model, target, **changes)``, between two
optimizer steps. A rollback is applied the same way: its ``changes`` are the values it restores.

The ack's ``step`` is the first optimizer step that runs under the new settings: commands applied in the
``monitor.step(S)`` call (right after optimizer step S) take effect from step ``S + 1``. A command that
``set_layer_recipe`` refuses (unknown layer, invalid value) is acked ``rejected`` with its message.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from torch import nn

from ..convert import set_layer_recipe

__all__ = ["CommandInbox", "apply_commands", "commands_applier"]


class CommandInbox:
    """Commands delivered to the sender thread, waiting for the next step boundary (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[dict[str, Any]] = []
        self._seen: set[int] = set()

    def add(self, commands: list[dict[str, Any]]) -> None:
        with self._lock:
            for c in commands:
                if c.get("id") not in self._seen:  # a duplicate-batch answer may repeat one
                    self._seen.add(c.get("id"))
                    self._items.append(c)

    def peek(self) -> list[dict[str, Any]]:
        """The waiting commands, left waiting."""
        with self._lock:
            return list(self._items)

    def take(self) -> list[dict[str, Any]]:
        if not self._items:  # unlocked peek: the common case costs nothing
            return []
        with self._lock:
            items, self._items = self._items, []
        return items


def apply_commands(model: nn.Module, commands: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """Apply ``commands`` in order after optimizer step ``step``; returns their acks. Each one is also said
    in one line on the job's terminal (stderr): a change to the numerics should not go unseen there."""
    acks = []
    for c in commands:
        cid = c.get("id")
        target = c.get("target") or "model"
        changes = c.get("changes")
        try:
            if not isinstance(changes, dict) or not changes:
                raise ValueError(f"changes: expected a non-empty object, got {changes!r}")
            previous = set_layer_recipe(model, None if target == "model" else target, **changes)
        except TypeError as exc:  # an unknown setting name reaches set_layer_recipe as a keyword
            acks.append({"command_id": cid, "state": "rejected", "reason": f"changes: {exc}"})
        except ValueError as exc:
            acks.append({"command_id": cid, "state": "rejected", "reason": str(exc)})
        else:
            acks.append({"command_id": cid, "state": "applied", "step": step + 1})
            say(c, f"applied from step {step + 1}: {target} " + _changed(changes, previous))
            continue
        say(c, f"rejected: {acks[-1]['reason']}")
    return acks


def _changed(changes: dict[str, Any], previous: dict[str, Any]) -> str:
    return ", ".join(f"{key} {previous.get(key)!r} -> {value!r}" for key, value in changes.items())


def say(command: dict[str, Any], what: str) -> None:
    """One line on the job's terminal about a recipe command: its id, its author, what became of it."""
    kind = "rollback" if command.get("rollback_of") is not None else "recipe change"
    by = f" by {command['created_by']}" if command.get("created_by") else ""
    print(f"fp8scope: {kind} {command.get('id')}{by} {what}", file=sys.stderr, flush=True)


def commands_applier(model: nn.Module, recipe, caller):
    """How a Monitor's run applies commands, ``(commands, step) -> acks``: through the statistics source
    when it is not fp8scope's own layers (the caller's statistics, Transformer Engine's state), rejected
    for a run without FP8 layers, else ``apply_commands`` on the model."""
    if caller is not None:

        def through_caller(commands, step):
            acks = caller.apply_commands(commands, step)
            for c, ack in zip(commands, acks, strict=False):
                applied = ack.get("state") == "applied"
                say(
                    c, f"applied from step {ack.get('step')}" if applied else f"rejected: {ack.get('reason')}"
                )
            return acks

        return through_caller
    if recipe is None:
        reason = "this run has no FP8 layers (Monitor recipe=None): recipe changes do not apply"
        return lambda commands, step: [
            {"command_id": c.get("id"), "state": "rejected", "reason": reason} for c in commands
        ]
    return lambda commands, step: apply_commands(model, commands, step)
