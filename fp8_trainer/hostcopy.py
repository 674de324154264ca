"""One-step-late host copies: start a device-to-host copy now, read it a step later without a stall.

Everything the runtime and the monitor read from a GPU on the host (statistics, losses, per-rank amaxes,
scalars) goes through ``HostCopy``: a non-blocking copy into pinned memory, followed by an event recorded on
the current stream *of the tensor's device* (the stream the copy was queued on; the current device may be
another one in a multi-GPU process). ``wait()`` a step later finds the event complete and returns at once.
CPU tensors are cloned (a snapshot, as the copy would be). ``LateCopy`` is the one-step-late pipeline built
on it: one copy in flight, swapped for the next each step.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HostCopy", "LateCopy"]


class HostCopy:
    """A copy of ``t`` on the host, started without a synchronisation; ``wait()`` returns it."""

    __slots__ = ("_event", "host")

    def __init__(self, t: torch.Tensor):
        t = t.detach()
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            stream = torch.cuda.current_stream(t.device)
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(stream)
        else:
            self.host, self._event = t.clone(), None

    def ready(self) -> bool:
        """True once the copy has landed (always for a CPU tensor)."""
        return self._event is None or self._event.query()

    def wait(self) -> torch.Tensor:
        """The host tensor, after the copy (a step after it started, this returns at once)."""
        if self._event is not None:
            self._event.synchronize()
        return self.host


class LateCopy:
    """At most one ``HostCopy`` in flight, with a tag saying what it holds (a step number, a count).

    ``swap(t, tag)`` starts copying ``t`` and hands back ``(tag, host tensor)`` of the copy the previous
    swap started, which a step later has long completed; ``t`` None starts nothing (the pipeline empties).
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: tuple[Any, HostCopy] | None = None

    def swap(self, t: torch.Tensor | None, tag: Any = None) -> tuple[Any, torch.Tensor] | None:
        previous = self._held
        self._held = None if t is None else (tag, HostCopy(t))  # started before the previous is read
        if previous is None:
            return None
        return previous[0], previous[1].wait()

    def flush(self) -> tuple[Any, torch.Tensor] | None:
        """The copy in flight, waited for (nothing new started)."""
        return self.swap(None)

    def clear(self) -> None:
        """Drop the copy in flight unread."""
        self._held = None
