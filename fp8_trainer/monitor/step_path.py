"""What a step path is wired to, whether the job has one rank (``single_rank.py``) or several
(``multi_rank.py``): both take a step's statistics from the same reader, its commands from the same inbox,
and hand the results to the same reporter and sender. ``Monitor`` builds these parts once and gives them to
the path the job needs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .control import CommandInbox
from .notices import Notices

__all__ = ["StepParts", "StepPath"]


class StepParts(NamedTuple):
    """The parts every step path is wired to.

    Fields:
        reader: the statistics reader (``StatsReader`` or one with its interface), None for a run without
            FP8 layers.
        inbox: the commands from the service.
        apply: ``(commands, step) -> acks`` (``control.commands_applier``).
        report: ``(step, host statistics or None, scalars holder)`` (``StepReporter.report``).
        sender: where the acks go; None on a rank that does not report.
        notices: the run's ``Notices``.
    """

    reader: Any
    inbox: CommandInbox
    apply: Any
    report: Any
    sender: Any
    notices: Notices


class StepPath:
    """What every step path does with its ``StepParts``; subclasses add ``step``, ``close`` and
    ``unapplied``, and a path that can report its steps before the next one (one rank's) ``flush``."""

    def __init__(self, parts: StepParts):
        self._reader, self._inbox, self._apply, self._report, self._sender, self._notices = parts

    def apply_waiting(self, first_step: int) -> list[dict]:
        """Apply the commands waiting in the inbox so that optimizer step ``first_step`` is the first to run
        under them (their acks say so); the acks, also handed to the sender."""
        commands = self._inbox.take()
        acks = self._apply(commands, first_step - 1) if commands else []
        if self._sender is not None:
            for ack in acks:
                self._sender.put_ack(ack)
        return acks
