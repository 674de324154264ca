"""From one step's host data to what the service hears about it: client detection, the flight recorder, and
the events they raise (``detect.py`` holds the rules), queued on the sender after the step itself.
``custom_event`` is the event the caller sends (``Monitor.event``), its details made fit for JSON."""

from __future__ import annotations

from typing import Any

import numpy as np

from fp8_protocol.client_events import CUSTOM_EVENT, LOSS_SPIKE_EVENT, NONFINITE_EVENT
from fp8_protocol.codec import jsonable
from fp8_protocol.stats import BLOCK_COLUMNS, STAT_COLUMNS

from ..block_linear import split_block_stats
from . import scalars
from .detect import DetectConfig, Detector, FlightRecorder, amax_movers
from .histograms import Histograms
from .sender import StepRecord

__all__ = ["StepReporter", "custom_event"]


class StepReporter:
    """Rank 0's step pipeline after the host copy: ``report`` runs detection on a step, keeps it in the
    flight recorder, and queues the step and then its events on the sender.

    Args:
        tensors: the run's tensor table (dicts with ``index``, ``name``, ``role``, ``layer``).
        detect_cfg: the detection and flight-recorder settings.
        histograms: exponent histograms for the events.
        sender: the run's sender.
        log_once: ``Notices.once``.
    """

    def __init__(
        self,
        tensors: list[dict[str, Any]],
        detect_cfg: DetectConfig,
        histograms: Histograms,
        sender,
        log_once,
    ):
        self.n_tensors = len(tensors)
        self._names = [t["name"] for t in tensors]
        # tensors in the order a step reaches them: the forward ones, then the gradients backwards
        forward = [t["index"] for t in tensors if t["role"] != "grad_output"]
        backward = [t["index"] for t in reversed(tensors) if t["role"] == "grad_output"]
        self.detector = Detector(detect_cfg, forward + backward)
        self.recorder = FlightRecorder(detect_cfg.flight_steps)
        self.cfg = detect_cfg
        self.histograms = histograms
        self.sender = sender
        self._log_once = log_once

    def report(self, step: int, stats, holder) -> None:
        """One step's host data (``stats`` None: no FP8 statistics, its scalars only) -> detection, flight
        recorder, the sender queue."""
        if stats is None:  # no FP8 layer ran in this step (or the run has none): its scalars only
            arr = np.zeros((0, len(STAT_COLUMNS))) if self.n_tensors == 0 else None
        elif isinstance(stats, np.ndarray):
            arr = stats
        else:
            arr = stats.numpy()
        arr, block = split_block_stats(arr)
        rec = StepRecord(step, arr, scalars.read(holder, self._log_once))
        if block is not None:  # the run has block-scaled layers: columns and histograms ride along
            rec.block, rec.block_hist = block[:, : len(BLOCK_COLUMNS)], block[:, len(BLOCK_COLUMNS) :]
        events = self.detector.check(rec)
        movers = None
        if any(kind == LOSS_SPIKE_EVENT for kind, _, _ in events):  # against the history before this step
            movers = amax_movers(self.recorder, rec, min(3, self.cfg.max_involved))
        self.recorder.push(rec)
        events_out = []
        for kind, details, involved in events:
            if kind == LOSS_SPIKE_EVENT:
                involved = movers
            if "tensor_index" in details:
                details["tensor"] = self._names[details["tensor_index"]]
            details = {
                **details,
                "tensors": [self._names[i] for i in involved],
                "last_steps": self.recorder.last_steps(),
                "flight_recorder": self.recorder.dump(self._names, involved),
                "histograms": self.histograms.for_event(kind, step, involved),
            }
            events_out.append({"kind": kind, "step": step, "details": details})
        # the step first: the service then sees its statistics no later than the events about it
        self.sender.put_step(rec)
        for event in events_out:
            self.sender.put_event(event)


def custom_event(kind: str, step: int, details: dict[str, Any]) -> dict[str, Any]:
    """The event ``Monitor.event`` sends: ``"loss_spike"`` or ``"nonfinite"`` as such, anything else as a
    ``custom`` event with ``details["name"] = kind``; details made JSON-safe
    (`fp8_protocol.codec.jsonable`, anything of another type, a Path or an object, as its ``str``)."""
    kind = str(kind)
    if kind not in (LOSS_SPIKE_EVENT, NONFINITE_EVENT):
        details = {"name": kind, **details}
        kind = CUSTOM_EVENT
    return {"kind": kind, "step": int(step), "details": jsonable(details, other=str)}
