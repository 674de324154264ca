"""``Monitor``: stream a training run's FP8 health into the fp8scope monitor service.

A plain loop (``recipe`` is what the model was converted with; ``None`` for a bf16/fp32 baseline)::

    import torch
    from fp8_trainer import DelayedScaling, Monitor, convert_to_fp8, fp8_autocast
    from fp8_trainer.data import ByteCorpus
    from fp8_trainer.model import GPT, PRESETS, fp8_filter

    corpus, recipe = ByteCorpus(), DelayedScaling(amax_history_len=16)
    model = convert_to_fp8(GPT(PRESETS["tiny"]), recipe=recipe, module_filter_fn=fp8_filter)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Monitor("http://127.0.0.1:8000", "tiny-fp8", model, recipe, config={"lr": 1e-3}) as monitor:
        for step in range(1, 201):
            x, y = corpus.batch("train", 16, 64)
            with fp8_autocast(fp8_recipe=recipe):
                _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            monitor.step(step, loss=loss.detach(), lr=1e-3)  # right after opt.step(); applies commands

Statistics of every quantized tensor at every step are read one step late (no host sync in the step that
produced them), batched and sent from a background thread. A dead service costs nothing: telemetry goes
to a spool file (``fp8-monitor upload PATH`` sends it later) and training goes on. Client-side loss-spike
and non-finite detection sends events at once with a flight recorder (see ``detect.py``); recipe commands
from the dashboard are applied at the next ``step()`` and acknowledged (see ``control.py``). In a
torch.distributed job every rank constructs the Monitor alike and rank 0 reports (see ``ranks.py``).

Flight-recorder histograms: a weight's exponent histogram is taken at once (the weight after the step in
which the event was seen); for an ``input`` or ``grad_output`` tensor a one-shot hook on its layer
captures the tensor at the next forward (input) or backward (gradient of the layer's output, i.e. the
grad_output before quantization) and sends its histogram as a follow-up ``custom`` event
``{"histogram_for": kind, "event_step", "tensor", "captured": "next forward"|"next backward",
"histogram"}``: keeping a copy of every activation just in case would cost memory on every step.
"""

from __future__ import annotations

import logging
import re
import socket
import time
import uuid
from collections import deque
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from fp8_kernels import exponent_histogram, histogram_to_dict
from torch import nn

from fp8_protocol.runs import check_tags

from ..convert import get_fp8_state
from ..hostcopy import HostCopy
from ..stats import StatsReader
from .control import CommandInbox, apply_commands
from .detect import DetectConfig, Detector, FlightRecorder, amax_movers
from .env import env_token, service_url
from .external import attach_source
from .ranks import RankSync, reduce_rank_stats
from .sender import Sender, SenderConfig, StepRecord, wire_float
from .spool import SpoolWriter
from .system import SystemSampler

__all__ = ["Monitor", "MonitorRefused"]

log = logging.getLogger("fp8scope.monitor")
_SENDER_KEYS = {f.name for f in fields(SenderConfig)} - {"extra_headers"}
_DETECT_KEYS = {f.name for f in fields(DetectConfig)}


def _parse_tuning(tuning: dict[str, Any]) -> tuple[SenderConfig, DetectConfig, int]:
    """Split and validate the ``**tuning`` keywords (ValueError naming a bad one)."""
    known = _SENDER_KEYS | _DETECT_KEYS | {"rank_sample_interval"}
    unknown = sorted(set(tuning) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown Monitor tuning option; expected one of {sorted(known)}")
    ints = {
        "max_batch_steps",
        "max_buffered_steps",
        "loss_window",
        "loss_min_history",
        "loss_ema_span",
        "flight_steps",
        "max_involved",
        "rank_sample_interval",
    }
    for key, value in tuning.items():
        if key == "gzip":
            if not isinstance(value, bool):
                raise ValueError(f"gzip: must be a bool, got {value!r}")
        elif key == "retry_delays":
            if not isinstance(value, (tuple, list)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in value
            ):
                raise ValueError(f"retry_delays: must be a sequence of numbers >= 0, got {value!r}")
            tuning[key] = tuple(float(v) for v in value)
        elif key in ints:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}: must be an integer >= 1, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{key}: must be a number > 0, got {value!r}")
    sender = SenderConfig(**{k: v for k, v in tuning.items() if k in _SENDER_KEYS})
    detect = DetectConfig(**{k: v for k, v in tuning.items() if k in _DETECT_KEYS})
    return sender, detect, int(tuning.get("rank_sample_interval", 50))


def _recipe_dict(recipe) -> dict[str, Any]:
    if recipe is None:
        return {}
    # the service's effective recipe needs the scaling mode spelled out (its default is "delayed")
    return {**recipe.to_dict(), "scaling": recipe.scaling}


class MonitorRefused(RuntimeError):
    """The service refused the run (``Monitor(..., fail_fast=True)``); the message says why."""


class Monitor:
    """Telemetry client of one training run; see the module docstring for a complete loop.

    Args:
        url: the service root, e.g. ``"http://127.0.0.1:8000"``; ``None``: the ``FP8SCOPE_URL`` environment
            variable.
        run_name: the run's name in the dashboard.
        model: the model (converted with ``convert_to_fp8`` unless ``recipe`` is None).
        recipe: the ``DelayedScaling`` / ``CurrentScaling`` the model was converted with, or None for a
            run without FP8 (then only scalars are sent).
        token: bearer token with the ``ingest`` scope (when the service has tokens); ``None``: the
            ``FP8SCOPE_TOKEN`` environment variable, else the first line of the file ``FP8SCOPE_TOKEN_FILE``
            names (so a token never needs to be on a command line).
        config: JSON-able dict stored with the run.
        tokens_per_step: tokens one optimizer step trains on (all micro-batches and ranks); with it each step
            reports ``tokens_per_s`` (unless ``step()`` is given one). Every step reports ``step_time_s``, the
            host time since the previous ``step()``.
        tags: the run's tags (letters, digits and ``_-.:/=+@``, at most 64 characters, at most 32 tags), to
            find and filter runs by in the dashboard.
        spool_path: where to spool when the service is unreachable (default
            ``./fp8scope-spool/<run_name>-<time>.jsonl``; only created when needed).
        fail_fast: register the run before returning and raise ``MonitorRefused`` if the service refuses it
            (a rejected token, a wrong URL) instead of spooling; an unreachable service still spools.
        tensors: for statistics computed by the training script (another runtime): the tensors, as
            ``"<layer>.<role>"`` names or dicts (``external.declare_tensors``); each step's block then goes
            to ``step(step, stats=block)``.
        shadow: a recipe: attach shadow mode to a model not in FP8 (``fp8_trainer.shadow``) and report its
            FP8 what-if statistics. Without either, a torchao or Transformer Engine model is recognised and
            watched from its own state.
        **tuning: ``flush_interval`` (1 s), ``max_batch_steps`` (64), ``max_buffered_steps`` (4096),
            ``retry_delays`` ((0.2, 0.5, 1.0) s), ``probe_interval`` (1 s), ``http_timeout`` (5 s),
            ``alerts_refresh`` (3 s), ``gzip`` (True), ``close_timeout`` (15 s), ``loss_window`` (50),
            ``loss_min_history`` (20), ``loss_z_threshold`` (6), ``loss_rel_floor`` (0.001),
            ``loss_ema_span`` (10), ``flight_steps`` (64), ``max_involved`` (8),
            ``rank_sample_interval`` (50).

    Raises:
        ValueError: a model without FP8 layers while ``recipe`` is not None, a URL that is not
            ``http(s)://host[:port]`` (or none given nor in ``FP8SCOPE_URL``), or a bad tuning value.
        MonitorRefused: with ``fail_fast``, the service refused the run (the message says why).
    """

    def __init__(
        self,
        url: str | None,
        run_name: str,
        model: nn.Module,
        recipe=None,
        *,
        token: str | None = None,
        config: dict[str, Any] | None = None,
        tags: list[str] | tuple[str, ...] = (),
        tokens_per_step: int | None = None,
        spool_path: str | Path | None = None,
        fail_fast: bool = False,
        tensors=None,
        shadow=None,
        **tuning: Any,
    ):
        sender_cfg, detect_cfg, self.rank_sample_interval = _parse_tuning(dict(tuning))
        tags = check_tags(tags)
        if tokens_per_step is not None and (isinstance(tokens_per_step, bool) or not tokens_per_step > 0):
            raise ValueError(f"tokens_per_step: must be a number > 0, got {tokens_per_step!r}")
        self.tokens_per_step = tokens_per_step
        self._last_step_at: float | None = None
        url = service_url(url)
        token = token if token is not None else env_token()
        # statistics not from fp8scope's own layers: the caller's, shadow mode's, torchao's (external.py)
        recipe, self._caller = attach_source(model, recipe, tensors=tensors, shadow=shadow)
        self.model = model
        self.recipe = recipe
        self._logged: set[str] = set()
        self._closed = False
        if self._caller is not None:
            self.tensors = self._caller.tensors
        elif recipe is not None:
            state = get_fp8_state(model)
            if state.n_layers == 0:
                raise ValueError(
                    "model: no FP8 layers; convert it with fp8_trainer.convert_to_fp8 first "
                    "(or pass recipe=None for a run without FP8)"
                )
            self.tensors = [t.to_dict() for t in state.tensor_table()]
        else:
            self.tensors = []
        self.n_tensors = len(self.tensors)
        self._names = [t["name"] for t in self.tensors]
        self._modules = dict(model.named_modules())
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.world_size = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        self._ranks = RankSync(self.n_tensors) if distributed else None
        if self._caller is not None:
            self._reader = self._caller
        else:
            self._reader = StatsReader(model) if recipe is not None else None
        self._prev: tuple[int, Any] | None = None  # (step, scalars) of a run without FP8 layers, one late
        # (step, scalars, FP8 ran) in step order, waiting for the host copy of their statistics: a step
        # whose copy is in flight holds back the later ones, so the service gets every step, in order
        self._waiting: deque[tuple[int, Any, bool]] = deque()
        self._scalars_by_step: dict[int, Any] = {}
        self._announced: list[list[dict[str, Any]]] = []
        self.inbox = CommandInbox()
        forward = [t["index"] for t in self.tensors if t["role"] != "grad_output"]
        backward = [t["index"] for t in reversed(self.tensors) if t["role"] == "grad_output"]
        self.detector = Detector(detect_cfg, forward + backward)
        self.recorder = FlightRecorder(detect_cfg.flight_steps)
        self.detect_cfg = detect_cfg
        self.sender: Sender | None = None
        if self.rank == 0:
            client_key = uuid.uuid4().hex
            run_body = {
                "name": run_name,
                "config": {**dict(config or {}), **_source_config(model, self._caller)},
                "recipe": _recipe_dict(recipe),
                "world_size": self.world_size,
                "host": socket.gethostname()[:200],
                "tensors": self.tensors,
            }
            if tags:  # only when used: a service from before tags registers the run as it always did
                run_body["tags"] = tags
            if spool_path is None:
                safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", run_name)[:80] or "run"
                spool_path = (
                    Path("fp8scope-spool") / f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{client_key[:6]}.jsonl"
                )
            spool = SpoolWriter(spool_path, run_body, client_key)
            self.sender = Sender(url, token, run_body, client_key, spool, sender_cfg, self.inbox.add)
            device = next((p.device for p in model.parameters()), None)
            gpu = None
            if device is not None and device.type == "cuda":
                gpu = device.index if device.index is not None else torch.cuda.current_device()
            self.sender.sampler = SystemSampler(gpu)
            if fail_fast and not self.sender.register_now() and self.sender.refused:
                self.sender.http.close()
                raise MonitorRefused(f"fp8scope monitor: {self.sender.refused}")
            self.sender.start()

    # ----- public state -----
    @property
    def run_id(self) -> int | None:
        """The run's id on the service; None until registered (or while spooling from the start)."""
        return self.sender.run_id if self.sender else None

    @property
    def dashboard_url(self) -> str | None:
        """The run's page on the dashboard, once registered."""
        if self.run_id is None:
            return None
        return f"{self.sender.root}/#/runs/{self.run_id}"

    @property
    def open_alerts(self) -> int:
        """Open alerts of the run as last seen (refreshed every few seconds; 0 if unknown)."""
        return self.sender.open_alerts if self.sender else 0

    @property
    def spooling(self) -> bool:
        """True while telemetry goes to the spool file instead of the service."""
        return bool(self.sender and self.sender.spooling)

    @property
    def spool_path(self) -> Path | None:
        return self.sender.spool.path if self.sender else None

    # ----- the training-loop API -----
    def step(self, step: int, loss=None, lr=None, stats=None, **scalars: Any) -> None:
        """Report optimizer step ``step`` (1-based, just completed) and apply pending recipe commands.

        ``loss`` and other scalars may be 0-dim tensors: they are read one step late, like the FP8
        statistics. ``stats``: this step's statistics block when the tensors were declared with
        ``Monitor(..., tensors=...)`` (see ``external.py`` for its shape and columns). Never raises because
        of the monitor, except ValueError for a ``stats`` block of the wrong shape.
        """
        if stats is not None:
            if not hasattr(self._caller, "put"):
                raise ValueError("stats: only for a Monitor made with tensors=[...] (the caller's own)")
            self._caller.put(stats)
        if self._closed:
            self._log_once("closed", "fp8scope monitor: step() after close() is ignored")
            return
        try:
            now = time.perf_counter()
            if self._last_step_at is not None:
                step_time = now - self._last_step_at
                scalars.setdefault("step_time_s", step_time)
                if self.tokens_per_step is not None:
                    scalars.setdefault("tokens_per_s", self.tokens_per_step / max(step_time, 1e-9))
            self._last_step_at = now
            values = {"loss": loss, "lr": lr, **scalars}
            holder = _capture({k: v for k, v in values.items() if v is not None})
            if self._ranks is None:
                self._step_single(int(step), holder)
            else:
                self._step_multi(int(step), holder)
        except Exception:  # the monitor must never take training down
            self._log_once(
                "step-error", "fp8scope monitor: step() failed; telemetry may be incomplete", exc=True
            )

    def event(self, kind: str, step: int, **details: Any) -> None:
        """Send an event at once: ``"loss_spike"`` or ``"nonfinite"`` as such, anything else as a ``custom``
        event with ``details["name"] = kind`` (e.g. ``monitor.event("checkpoint", step, path=...)``)."""
        if self.sender is None or self._closed:
            return
        try:
            kind = str(kind)
            if kind not in ("loss_spike", "nonfinite"):
                details = {"name": kind, **details}
                kind = "custom"
            # made JSON-safe here, on the caller's thread: a Path or numpy value must not reach the sender
            self.sender.put_event({"kind": kind, "step": int(step), "details": _json_safe(details)})
        except Exception:  # the monitor must never take training down
            self._log_once("event-error", "fp8scope monitor: event() failed; the event is left out", exc=True)

    def close(self, status: str = "finished") -> None:
        """Report the last step, flush (within ``close_timeout``), set the run's status (``finished``,
        ``crashed``, ``interrupted`` or ``halted``: see ``fp8_protocol.runs``), stop the thread."""
        if self._closed:
            return
        try:
            if self._ranks is None:
                if self._prev is not None:
                    self._emit(self._prev[0], None, self._prev[1])
                    self._prev = None
                if self._reader is not None:
                    got = self._reader.flush()
                    if got is None and any(fp8 for _, _, fp8 in self._waiting):
                        got = self._reader.read_now()
                    self._release(got, closing=True)
            else:
                for s, block in self._ranks.flush():
                    self._handle_block(s, block, closing=True)
        except Exception:
            self._log_once("close-error", "fp8scope monitor: reading the last step failed", exc=True)
        self._closed = True
        if self._reader is not None:
            self._reader.close()
        if self.sender is not None:
            leftover = [c for batch in self._announced for c in batch] + self.inbox.take()
            for c in leftover:
                self.sender.put_ack(
                    {
                        "command_id": c.get("id"),
                        "state": "rejected",
                        "reason": f"the run ended ({status}) before the next step boundary",
                    }
                )
            self.sender.finish(status)
            self.sender.join(self.sender.cfg.close_timeout + 10)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            status = "finished"
        elif issubclass(exc_type, KeyboardInterrupt):  # Ctrl-C: the user stopped it, nothing broke
            status = "interrupted"
        else:
            status = "crashed"
        self.close(status)
        return False

    # ----- internals -----
    def _log_once(self, kind: str, msg: str, *args: Any, exc: bool = False) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg, *args, exc_info=exc)

    def _step_single(self, step: int, holder) -> None:
        commands = self.inbox.take()
        if commands:
            for ack in self._apply(commands, step):
                self.sender.put_ack(ack)
        if self._reader is None:
            prev, self._prev = self._prev, (step, holder)
            if prev is not None:
                self._emit(prev[0], None, prev[1])
            return
        fp8_ran, got = self._reader.advance()
        if got is not None:
            self._say_merged(self._reader.merged)
        if not fp8_ran:
            self._say_no_fp8(step)
        self._waiting.append((step, holder, fp8_ran))
        self._release(got)

    def _release(self, got: tuple[int, torch.Tensor] | None, closing: bool = False) -> None:
        """Emit the waiting steps, in order, up to the first whose statistics are still being copied; ``got``
        is the copy that just completed (the statistics of the first waiting step in which FP8 ran)."""
        while self._waiting:
            step, holder, fp8_ran = self._waiting[0]
            stats = None
            if fp8_ran:
                if got is None and not closing:
                    return
                stats, got = (got[1] if got is not None else None), None
            self._waiting.popleft()
            self._emit(step, stats, holder)

    def _say_no_fp8(self, step: int) -> None:
        if hasattr(self._caller, "put"):  # the caller's own statistics
            how = "no statistics block was given with step(%s, stats=...)"
        elif self._caller is not None:  # another runtime's state (Transformer Engine)
            how = "no FP8 cast ran in step %s"
        else:
            how = "no FP8 layer ran in step %s: wrap the forward in fp8_autocast"
        self._log_once(
            "no-fp8-step",
            f"fp8scope monitor: {how}. Steps without FP8 statistics are reported with their scalars only.",
            step,
        )

    def _say_merged(self, n: int) -> None:
        if n > 1:
            self._log_once(
                "merged-steps",
                "fp8scope monitor: %d FP8 steps closed between two monitor.step() calls (one per "
                "micro-batch, as in Transformer Engine's loop); each monitor step reports them merged: amax "
                "the max with the scale that scaled it, counts summed. For one amax-history entry per "
                "optimizer step, use fp8_autocast(step_boundary=False) for all micro-batches but the last.",
                n,
            )

    def _step_multi(self, step: int, holder) -> None:
        n_commands = 0
        if self.rank == 0:
            self._scalars_by_step[step] = holder
            new = self.inbox.take()
            if new:
                self._announced.append(new)
                n_commands = len(new)
        taken = self._reader.take() if self._reader is not None else None
        stats = None
        if taken is not None:
            stats, merged = taken
            self._say_merged(merged)
        if stats is not None:
            device = stats.device
        else:  # a bf16/fp32 baseline: the gather still needs the backend's device (NCCL: the GPU)
            device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        for s, block in self._ranks.step(step, stats, n_commands, device):
            self._handle_block(s, block, closing=False, now=step)

    def _handle_block(self, s: int, block: np.ndarray, closing: bool, now: int | None = None) -> None:
        header = block[0, self.n_tensors]
        if self.rank == 0:
            try:
                self._report_block(s, block, header)
            except Exception:  # never skip the broadcast below: the other ranks would wait in it forever
                self._log_once("report-error", "fp8scope monitor: reporting a step failed", exc=True)
        if header[1] and not closing:
            # every rank sees this header at the same call: all enter the broadcast together
            commands = self._ranks.broadcast_commands(self._announced.pop(0) if self.rank == 0 else None)
            acks = self._apply(commands, now)
            if self.sender is not None:
                for ack in acks:
                    self.sender.put_ack(ack)

    def _report_block(self, s: int, block: np.ndarray, header: np.ndarray) -> None:
        """Rank 0: step ``s``'s reduced statistics to the sender, and every rank's amaxes now and then."""
        T = self.n_tensors
        holder = self._scalars_by_step.pop(s, None)
        if not (header[0] or self.recipe is None):  # no FP8 layer ran in this step on any rank
            self._say_no_fp8(s)
            self._emit(s, None, holder)
            return
        self._emit(s, reduce_rank_stats(block[:, :T]) if T else None, holder)
        if T and s % self.rank_sample_interval == 0:
            amax = [[wire_float(float(v)) for v in block[r, :T, 0]] for r in range(block.shape[0])]
            self.sender.put_event(
                {"kind": "rank_amax", "step": s, "details": {"world_size": self.world_size, "amax": amax}}
            )

    def _apply(self, commands: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        if self._caller is not None:  # the caller's statistics, Transformer Engine's state
            return self._caller.apply_commands(commands, step)
        if self.recipe is None:
            reason = "this run has no FP8 layers (Monitor recipe=None): recipe changes do not apply"
            return [{"command_id": c.get("id"), "state": "rejected", "reason": reason} for c in commands]
        return apply_commands(self.model, commands, step)

    def _emit(self, step: int, stats, holder) -> None:
        """One step's host data -> detection, flight recorder, the sender queue (rank 0 only)."""
        if stats is None:  # no FP8 layer ran in this step (or the run has none): its scalars only
            arr = np.zeros((0, 6)) if self.n_tensors == 0 else None
        elif isinstance(stats, np.ndarray):
            arr = stats
        else:
            arr = stats.numpy()
        rec = StepRecord(step, arr, _read(holder, self._log_once))
        events = self.detector.check(rec)
        movers = None
        if any(kind == "loss_spike" for kind, _, _ in events):  # against the history before this step
            movers = amax_movers(self.recorder, rec, min(3, self.detect_cfg.max_involved))
        self.recorder.push(rec)
        events_out = []
        for kind, details, involved in events:
            if kind == "loss_spike":
                involved = movers
            if "tensor_index" in details:
                details["tensor"] = self._names[details["tensor_index"]]
            details = {
                **details,
                "tensors": [self._names[i] for i in involved],
                "last_steps": self.recorder.last_steps(),
                "flight_recorder": self.recorder.dump(self._names, involved),
                "histograms": self._histograms(kind, step, involved),
            }
            events_out.append({"kind": kind, "step": step, "details": details})
        # the step first: the service then sees its statistics no later than the events about it
        self.sender.put_step(rec)
        for event in events_out:
            self.sender.put_event(event)

    def _histograms(self, kind: str, step: int, involved: list[int]) -> dict[str, Any]:
        """Exponent histograms of the involved weights now; one-shot hooks for inputs and gradients."""
        out = {}
        for i in involved:
            info = self.tensors[i]
            module = self._modules.get(info["layer"])
            if module is None:
                continue
            try:
                if info["role"] == "weight":
                    out[info["name"]] = histogram_to_dict(exponent_histogram(module.weight))
                else:
                    self._capture_once(module, kind, step, info)
            except Exception:
                self._log_once("histogram", "fp8scope monitor: exponent histogram failed", exc=True)
        return out

    def _capture_once(self, module: nn.Module, kind: str, step: int, info: dict[str, Any]) -> None:
        sender = self.sender

        def send(x: torch.Tensor, captured: str) -> None:
            try:  # runs inside the user's forward / backward: never raise there
                details = {
                    "histogram_for": kind,
                    "event_step": step,
                    "tensor": info["name"],
                    "captured": captured,
                    "histogram": histogram_to_dict(exponent_histogram(x)),
                }
                sender.put_event({"kind": "custom", "step": step, "details": details})
            except Exception:
                self._log_once("histogram", "fp8scope monitor: exponent histogram failed", exc=True)

        if info["role"] == "input":

            def pre_hook(m, args):
                if not torch.is_grad_enabled():  # an evaluation forward: wait for the next training one
                    return
                handle.remove()
                if args and isinstance(args[0], torch.Tensor):
                    send(args[0], "next forward")

            handle = module.register_forward_pre_hook(pre_hook)
        else:

            def fwd_hook(m, args, output):
                if not torch.is_grad_enabled():  # an evaluation forward has no backward
                    return
                handle.remove()
                if isinstance(output, torch.Tensor) and output.requires_grad:

                    def grad_hook(g):
                        send(g, "next backward")

                    output.register_hook(grad_hook)

            handle = module.register_forward_hook(fwd_hook)


def _source_config(model: nn.Module, caller) -> dict[str, Any]:
    """Where the run's statistics come from, when not from fp8scope's FP8 layers (the dashboard shows it)."""
    if caller is not None:
        return {"fp8_source": caller.source}
    source = getattr(getattr(model, "_fp8_state", None), "source", None)
    return {"fp8_source": source} if source else {}


def _capture(values: dict[str, Any]):
    """Scalars of this step without a host sync: device tensors start a pinned copy read next step."""
    if not values:
        return None
    dev = [k for k, v in values.items() if isinstance(v, torch.Tensor) and v.device.type != "cpu"]
    if not dev:
        return ({k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}, None)
    rest = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in values.items() if k not in dev}
    stacked = torch.stack([values[k].detach().reshape(()).to(torch.float64) for k in dev])
    return (rest, (dev, HostCopy(stacked)))


def _read(holder, log_once) -> dict[str, float]:
    """The floats of a ``_capture`` holder (a step later: the device copy is complete by then)."""
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


def _json_safe(value: Any) -> Any:
    """Event details as JSON can carry them: non-finite floats as the wire strings, numpy scalars as
    Python numbers, anything else unknown (a Path, an object) as its ``str``."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return wire_float(float(value))
    return str(value)
