"""A step's scalars (loss, lr, anything passed to ``Monitor.step``) read one step late, like its statistics.

``capture`` takes them in the step that produced them without a host sync: device tensors are stacked into
one tensor whose host copy starts at once (``fp8_trainer.hostcopy.HostCopy``); ``read`` turns the holder into
floats a step later, when that copy has long completed.
"""

from __future__ import annotations

from typing import Any

import torch

from ..hostcopy import HostCopy

__all__ = ["capture", "read"]


def capture(values: dict[str, Any]):
    """Scalars of this step without a host sync: device tensors start a pinned copy read next step."""
    if not values:
        return None
    dev = [k for k, v in values.items() if isinstance(v, torch.Tensor) and v.device.type != "cpu"]
    if not dev:
        return ({k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}, None)
    rest = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in values.items() if k not in dev}
    stacked = torch.stack([values[k].detach().reshape(()).to(torch.float64) for k in dev])
    return (rest, (dev, HostCopy(stacked)))


def read(holder, log_once) -> dict[str, float]:
    """The floats of a ``capture`` holder (a step later: the device copy is complete by then)."""
    if holder is None:
        return {}
    rest, dev = holder
    out = {}
    for k, v in rest.items():
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError, RuntimeError):
            log_once(f"scalar-{k}", "fp8scope monitor: scalar %r is not a number (%r); it is left out", k, v)
    if dev is not None:
        names, copy = dev
        out.update(zip(names, copy.wait().tolist(), strict=True))
    return out
