"""``Monitor``: stream a training run's FP8 health into the fp8scope monitor service.

A plain loop (``recipe`` is what the model was converted with; ``None`` for a bf16/fp32 baseline)::

    import torch
    from fp8_trainer import DelayedScaling, Monitor, convert_to_fp8, fp8_autocast
    from fp8_trainer.app.data import ByteCorpus
    from fp8_trainer.app.model import GPT, PRESETS, fp8_filter

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
Events carry exponent histograms of the tensors they name (see ``histograms.py``).

This module is the Monitor's surface: its arguments, its public state, ``step`` / ``event`` / ``close``.
The work is done by one module each: registering the run (``register.py``), a step's scalars
(``scalars.py``), the step path of one rank (``single_rank.py``) or of several (``multi_rank.py``),
detection and events (``events.py``, ``detect.py``), the wire (``sender.py``), and the log (``notices.py``).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
from torch import nn

from fp8_protocol.env import env_token, service_url
from fp8_protocol.runs import check_tags

from ..convert import get_fp8_state
from ..stats import StatsReader
from .config import jsonable_config
from .control import CommandInbox, commands_applier
from .detect import DetectConfig
from .events import StepReporter, custom_event
from .external import attach_source
from .histograms import Histograms
from .multi_rank import MultiRankSteps
from .notices import Notices
from .ranks import RankSync
from .register import MonitorRefused, run_body, start_sender
from .run_info import run_info as started_info
from .run_info import wanted as started_wanted
from .scalars import capture as capture_scalars
from .sender import Sender, SenderConfig
from .single_rank import SingleRankSteps
from .step_path import StepParts

__all__ = ["Monitor", "MonitorRefused"]

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


def _checked_tokens_per_step(tokens_per_step: int | None) -> int | None:
    """``tokens_per_step`` as given, once known to be None or a number > 0 (ValueError otherwise)."""
    if tokens_per_step is not None and (isinstance(tokens_per_step, bool) or not tokens_per_step > 0):
        raise ValueError(f"tokens_per_step: must be a number > 0, got {tokens_per_step!r}")
    return tokens_per_step


def _tensor_table(model: nn.Module, recipe, caller) -> list[dict[str, Any]]:
    """The tensors the run reports: the caller's or another runtime's (``caller``), fp8scope's own FP8
    layers (refusing a model without any while a recipe says it is in FP8), or none for a baseline."""
    if caller is not None:
        return caller.tensors
    if recipe is None:
        return []
    state = get_fp8_state(model)
    if state.n_layers == 0:
        raise ValueError(
            "model: no FP8 layers; convert it with fp8_trainer.convert_to_fp8 first "
            "(or pass recipe=None for a run without FP8)"
        )
    return [t.to_dict() for t in state.tensor_table()]


def _stats_reader(model: nn.Module, recipe, caller):
    """Where each step's statistics come from: ``caller`` when there is one, else the model's FP8 layers
    (``StatsReader``); None for a run without FP8."""
    if caller is not None:
        return caller
    return StatsReader(model) if recipe is not None else None


def _world() -> tuple[bool, int, int]:
    """``(distributed, world_size, rank)``: a torch.distributed job of more than one rank, or one process."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return distributed, dist.get_world_size() if distributed else 1, dist.get_rank() if distributed else 0


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
        config: the run's configuration, stored with it: a dict, a dataclass or an object with ``to_dict()``
            (a transformers ``PretrainedConfig``), holding what JSON holds, numpy and torch scalars, enums
            and paths; keys that are not strings become their text (``fp8_trainer.monitor.config``).
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
        announce: print one line with the run's dashboard address on the job's terminal (stderr) once the
            run is registered, as other experiment trackers do (``fp8-train`` prints its own).
        run_info: record in the run's config, as ``fp8_run``, the command line and, inside a git
            repository, the commit and whether the tree has changes (``run_info.py``); ``None``: unless the
            ``FP8SCOPE_RUN_INFO`` environment variable is ``0``.
        **tuning: ``flush_interval`` (1 s), ``max_batch_steps`` (64), ``max_buffered_steps`` (4096),
            ``retry_delays`` ((0.2, 0.5, 1.0) s), ``probe_interval`` (1 s), ``http_timeout`` (5 s),
            ``alerts_refresh`` (3 s), ``gzip`` (True), ``close_timeout`` (15 s), ``loss_window`` (50),
            ``loss_min_history`` (20), ``loss_z_threshold`` (6), ``loss_rel_floor`` (0.001),
            ``loss_ema_span`` (10), ``flight_steps`` (64), ``max_involved`` (8),
            ``rank_sample_interval`` (50).

    Raises:
        ValueError: a ``config`` value with no JSON form (the message says where), a model without FP8
            layers while ``recipe`` is not None, a URL that is not
            ``http(s)://host[:port]`` (or none given nor in ``FP8SCOPE_URL``), a bad tuning value or a
            ``run_info`` that is not a bool.
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
        announce: bool = True,
        run_info: bool | None = None,
        **tuning: Any,
    ):
        sender_cfg, detect_cfg, self.rank_sample_interval = _parse_tuning(dict(tuning))
        record_start = started_wanted(run_info)
        tags = check_tags(tags)
        config = jsonable_config(config)  # refused here, with where, rather than stopping the sender later
        self.tokens_per_step = _checked_tokens_per_step(tokens_per_step)
        self.run_name = run_name
        self._announce = bool(announce)
        self._last_step_at: float | None = None
        url = service_url(url)
        token = token if token is not None else env_token()
        # statistics not from fp8scope's own layers: the caller's, shadow mode's, torchao's (external.py)
        recipe, self._caller = attach_source(model, recipe, tensors=tensors, shadow=shadow)
        self.model = model
        self.recipe = recipe
        self._notices = Notices(self._caller)
        self._closed = False
        self.tensors = _tensor_table(model, recipe, self._caller)
        self.n_tensors = len(self.tensors)
        distributed, self.world_size, self.rank = _world()
        self._reader = _stats_reader(model, recipe, self._caller)
        self.inbox = CommandInbox()
        self.detect_cfg = detect_cfg
        self.sender: Sender | None = None
        if self.rank == 0:
            body = self._run_body(config, tags, started_info() if record_start else None)
            self.sender = start_sender(
                url,
                token,
                body,
                model,
                cfg=sender_cfg,
                on_commands=self.inbox.add,
                spool_path=spool_path,
                fail_fast=fail_fast,
            )
        self._reporter = self._make_reporter()
        self.detector, self.recorder = self._reporter.detector, self._reporter.recorder
        self._steps = self._make_steps(distributed)

    def _run_body(self, config, tags: list[str], started: dict[str, Any] | None) -> dict[str, Any]:
        """What registering the run tells the service: its name, settings, tensors and ranks."""
        return run_body(
            self.run_name,
            self.model,
            self.recipe,
            self._caller,
            config=config,
            tags=tags,
            world_size=self.world_size,
            tensors=self.tensors,
            started=started,
        )

    def _make_reporter(self) -> StepReporter:
        """Detection and events of every step: the exponent histograms they carry and the reporter."""
        once = self._notices.once
        histograms = Histograms(self.tensors, self.model, self.sender, once)
        return StepReporter(self.tensors, self.detect_cfg, histograms, self.sender, once)

    def _make_steps(self, distributed: bool) -> SingleRankSteps | MultiRankSteps:
        """The step path: this rank's alone, or one rank's of a distributed job (rank 0 reports)."""
        parts = StepParts(
            reader=self._reader,
            inbox=self.inbox,
            apply=commands_applier(self.model, self.recipe, self._caller),
            report=self._reporter.report,
            sender=self.sender,
            notices=self._notices,
        )
        if not distributed:
            return SingleRankSteps(parts)
        return MultiRankSteps(
            RankSync(self.n_tensors),
            parts,
            model=self.model,
            recipe=self.recipe,
            n_tensors=self.n_tensors,
            rank_sample_interval=self.rank_sample_interval,
            copies=np.array([t.get("role") == "weight" for t in self.tensors], dtype=bool),
        )

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
    def first_nonfinite(self) -> tuple[int, str] | None:
        """(step, tensor name) of the run's first non-finite statistics as this process detected them (the
        tensor first in the order a NaN spreads: where it began); None while there has been none."""
        first = self.detector.first_nonfinite
        if first is None:
            return None
        step, index = first
        return step, self.tensors[index]["name"]

    @property
    def open_incidents(self) -> int:
        """Open incidents of the run as last seen: its open alerts grouped by cause, so that one NaN that
        spreads to every tensor is one incident (refreshed with ``open_alerts``; 0 if unknown)."""
        return self.sender.open_incidents if self.sender else 0

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
            self._notices.once("closed", "fp8scope monitor: step() after close() is ignored")
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
            self._steps.step(int(step), capture_scalars({k: v for k, v in values.items() if v is not None}))
            if self._announce and self.run_id is not None:  # registered (in the background): say where, once
                self._announce = False
                print(f"fp8scope: run {self.run_name!r} -> {self.dashboard_url}", file=sys.stderr, flush=True)
        except Exception:  # the monitor must never take training down
            self._notices.once(
                "step-error", "fp8scope monitor: step() failed; telemetry may be incomplete", exc=True
            )

    def event(self, kind: str, step: int, **details: Any) -> None:
        """Send an event at once: ``"loss_spike"`` or ``"nonfinite"`` as such, anything else as a ``custom``
        event with ``details["name"] = kind`` (e.g. ``monitor.event("checkpoint", step, path=...)``)."""
        if self.sender is None or self._closed:
            return
        try:
            # made JSON-safe here, on the caller's thread: a Path or numpy value must not reach the sender
            self.sender.put_event(custom_event(kind, step, details))
        except Exception:  # the monitor must never take training down
            self._notices.once(
                "event-error", "fp8scope monitor: event() failed; the event is left out", exc=True
            )

    # ----- a job that pauses between two steps (fp8-train --remediation act) -----
    def flush(self, timeout: float = 30.0) -> bool:
        """Report every step so far now (their statistics read at once: a host synchronisation) and send
        them, and the events queued, without waiting for ``flush_interval``; wait until they have gone out
        (answered, with the commands of the answer in the inbox, or spooled), at most ``timeout`` seconds.
        For a job about to pause, not for every step. True when they went out in time; False on a job of
        several ranks (whose steps are reported together), after ``close`` or when the monitor is down.
        Never raises because of the monitor."""
        if self.sender is None or self._closed or not isinstance(self._steps, SingleRankSteps):
            return False
        try:
            self._steps.flush()
            done = threading.Event()
            self.sender.put_flush(done)
            deadline = time.monotonic() + timeout
            while not done.wait(0.1):  # a sender thread that died would never set it
                if self.sender.failed or not self.sender.is_alive() or time.monotonic() > deadline:
                    return False
            return True
        except Exception:  # the monitor must never take training down
            self._notices.once("flush-error", "fp8scope monitor: flush() failed", exc=True)
            return False

    def waiting_commands(self) -> list[dict[str, Any]]:
        """The recipe commands from the service waiting for the next step boundary."""
        return self.inbox.peek()

    def apply_commands_now(self, first_step: int) -> list[dict[str, Any]]:
        """Apply the waiting commands now, between two steps, so that optimizer step ``first_step`` is the
        first to run under them (a step run again: ``fp8_trainer.app.retry``); their acks, sent with the
        next telemetry. One process only: ``[]`` on a job of several ranks, whose ranks apply commands
        together in ``step``."""
        if self._closed or not isinstance(self._steps, SingleRankSteps):
            return []
        return self._steps.apply_waiting(first_step)

    def close(self, status: str = "finished") -> None:
        """Report the last step, flush (within ``close_timeout``), set the run's status (``finished``,
        ``crashed``, ``interrupted`` or ``halted``: see ``fp8_protocol.runs``), stop the thread."""
        if self._closed:
            return
        try:
            self._steps.close()
        except Exception:
            self._notices.once("close-error", "fp8scope monitor: reading the last step failed", exc=True)
        self._closed = True
        if self._reader is not None:
            self._reader.close()
        if self.sender is not None:
            leftover = self._steps.unapplied() + self.inbox.take()
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
