"""One-step-late host copies: start a device-to-host copy now, read it a step later without a stall.

Everything the runtime and the monitor read from a GPU on the host (statistics, losses, per-rank amaxes,
scalars) goes through ``HostCopy``: a non-blocking copy into pinned memory, followed by an event recorded on
the current stream *of the tensor's device* (the stream the copy was queued on; the current device may be
another one in a multi-GPU process). ``wait()`` a step later finds the event complete and returns at once.
CPU tensors are cloned (a snapshot, as the copy would be).
"""

from __future__ import annotations

import torch

__all__ = ["HostCopy"]


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
