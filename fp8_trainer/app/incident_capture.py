"""Incident bundles: what a replay of a failing step needs, kept in memory and written when the step fails.

``IncidentCapture`` keeps a rolling snapshot of the state *before* a step, refreshed every ``every`` steps:
the model's ``state_dict`` (weights and each FP8 layer's scaling state, its ``_extra_state``), the
optimizer's, and the torch RNG states (CPU, and CUDA where initialised), all copied to host memory. Since
the snapshot it keeps each step's micro-batches, learning rate, injected faults (``fp8-train --inject``) and
loss. The two newest snapshots are kept, so a window always covers at least ``every`` steps before the
failing one: a fault whose damage shows a step late (a bad update) still lies inside the replayed window.

Trigger, checked after each step's backward, before the optimizer step (one host read a step: the loss,
and the step's grad_output overflow fractions with it, in one copy):

* ``nonfinite``: the step's loss is NaN or infinite (the first such step only: after it every loss is);
* ``loss_spike``: the loss-spike rule the monitor uses (``fp8_protocol.loss_spike``: robust z-score of the
  loss against a short moving average, ``z >= 6`` with 20 losses of history); the bundle records the loss
  the rule expected and its robust sigma, which the replay's verdict measures against;
* ``grad_overflow`` (when neither loss trigger fired): in some FP8 layer's ``grad_output`` cast, at least
  ``grad_overflow_frac`` of the elements saturated in the step (the step's own statistics, ``overflow /
  numel``), a tensor that was below the bar the step before. A saturated E5M2 gradient need not move the
  loss (the layer's gradients come out too small for a step), so the loss triggers would not see it. The
  bundle records the tensor (``LAYER.grad_output``), the fraction and the bar, and the loss's score as for a
  spike; the replay then judges the layer's gradients, or the loss where it is FP8's
  (``fp8_trainer.app.replay_judge.judge_for``).

A bundle (``incident-step<S>.pt``, ``torch.save``, loads with ``weights_only=True``) holds the older of the
two snapshots, the steps since it up to and including the failing one, and the run's configuration. Bundles
that would take the directory past ``max_bytes`` are not written (the capture says so); at most
``max_bundles`` per run.

Cost (``bench/`` numbers in ``docs/replay.md``): a snapshot is a host copy of the weights and the optimizer
state (about 3x the parameter bytes with AdamW) every ``every`` steps, plus the batches (token ids) of up to
``2 * every`` steps; memory is two snapshots. Off in the library (nothing creates an ``IncidentCapture`` by
itself); in ``fp8-train`` on with ``--capture-dir``, and with ``--monitor-url`` into ``default_directory``
(``--no-capture`` turns that off): a monitored run is the one whose incidents someone will ask about.
"""

from __future__ import annotations

import copy
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp8_protocol.loss_spike import MAD_TO_SIGMA, LossSpikeParams, LossSpikeRule
from fp8_protocol.stats import NUMEL, OVERFLOW

from ..rewind import scaling_state
from .torch_file import read_torch_file

__all__ = [
    "BUNDLE_VERSION",
    "CaptureConfig",
    "IncidentCapture",
    "default_directory",
    "load_bundle",
    "step_batches",
]

BUNDLE_VERSION = 1


@dataclass(frozen=True)
class CaptureConfig:
    """Where and how much to capture."""

    directory: str
    every: int = 8  # steps between snapshots (the replayed window is every .. 2 * every steps)
    max_bytes: int = 512 * 2**20  # the bundles in the directory together (a bundle beyond it is skipped)
    max_bundles: int = 4  # bundles per run
    spike: LossSpikeParams = field(default_factory=LossSpikeParams)
    # the grad_output overflow fraction of one step that is an incident (healthy tiny-preset runs on the
    # CPU peak at 0.18 with delayed scaling, in the history's first steps; never above 0 with current
    # scaling; a gradspike saturates 0.9999: docs/replay.md)
    grad_overflow_frac: float = 0.5

    def __post_init__(self):
        if self.every < 1:
            raise ValueError(f"every: expected an integer >= 1, got {self.every}")
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes: expected > 0, got {self.max_bytes}")
        if not 0 < self.grad_overflow_frac <= 1:
            raise ValueError(
                f"grad_overflow_frac: expected a fraction in (0, 1], got {self.grad_overflow_frac}"
            )


def _host_copy(value: Any) -> Any:
    """``value`` (a state_dict, nested) with every tensor copied to the CPU, detached."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_host_copy(v) for v in value)
    return copy.deepcopy(value)


def _rng_state() -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


@dataclass
class _Snapshot:
    step: int  # the state after this many optimizer steps (before step ``step + 1``)
    model: dict[str, Any]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)  # each step since: batches, lr, faults, loss


class IncidentCapture:
    """The job's side of incident replay (module docstring). The loop calls ``begin`` before a step's first
    forward, wraps its batch source with ``batches``, and calls ``end`` after the step's backward."""

    def __init__(
        self,
        config: CaptureConfig,
        model: nn.Module,
        optimizer,
        run_config: dict[str, Any],
        rerun: bool = False,
    ):
        self.config = config
        # rerun: keep what each step began from (the RNG, the FP8 scaling state), so that a step can run
        # again before its update (fp8_trainer.app.retry); a copy of the amax history a step, no host sync
        self.rerun = rerun
        self.step_start: tuple[dict[str, Any], Any] | None = None  # (RNG state, ScalingState or None)
        self.model, self.optimizer = model, optimizer
        self.run_config = dict(run_config)
        self.rule = LossSpikeRule(config.spike)
        self.snapshots: list[_Snapshot] = []  # the two newest, oldest first
        self.written: list[Path] = []
        self.skipped: list[str] = []  # why bundles were not written
        self.seen_nonfinite = False
        self._current: dict[str, Any] | None = None
        self._fp8_steps = 0  # the FP8 state's completed steps when the step began
        self._overflowing: set[int] = set()  # grad_output rows at or above the bar in the last FP8 step

    def begin(self, step: int, lr: float, injections=()) -> None:
        """Optimizer step ``step`` starts: take a snapshot if one is due, open the step's record."""
        newest = self.snapshots[-1] if self.snapshots else None
        if newest is None or step - 1 - newest.step >= self.config.every:
            snap = _Snapshot(
                step - 1,
                _host_copy(self.model.state_dict()),
                _host_copy(self.optimizer.state_dict()),
                _rng_state(),
            )
            self.snapshots = [*self.snapshots[-1:], snap]
        self._current = {
            "step": step,
            "lr": float(lr),
            "batches": [],
            "injections": [_injection_dict(i) for i in injections if i.active(step)],
        }
        self.snapshots[-1].steps.append(self._current)
        state = self._fp8_state()
        self._fp8_steps = state.steps if state is not None else 0
        if self.rerun:
            self.step_start = (_rng_state(), scaling_state(state) if state is not None else None)

    def _fp8_state(self):
        return getattr(self.model, "_fp8_state", None)  # None: the model does not train in FP8

    def _read(self, loss: torch.Tensor) -> tuple[float, list[float]]:
        """The step's loss and, where an FP8 step completed since ``begin``, each layer's grad_output
        overflow fraction in it: one host read (on a GPU, one synchronisation) for both."""
        value = loss.detach().reshape(1).double()
        state = self._fp8_state()
        stats = state.last_stats if state is not None and state.steps != self._fp8_steps else None
        if stats is None:
            return float(value.item()), []
        grad = stats[2::3]  # layer k owns rows 3k, 3k+1, 3k+2: grad_output is the third
        frac = grad[:, OVERFLOW] / grad[:, NUMEL].clamp_min(1)
        host = torch.cat([value.to(frac.device), frac]).tolist()
        return host[0], host[1:]

    def _grad_trigger(self, fractions: list[float]) -> dict[str, Any] | None:
        """``grad_overflow`` when a layer's grad_output saturated at or above the bar in this step and not
        in the one before (the worst such tensor), else None."""
        bar = self.config.grad_overflow_frac
        over = {k for k, f in enumerate(fractions) if f >= bar}
        new = over - self._overflowing
        if fractions:
            self._overflowing = over
        if not new:
            return None
        k = max(new, key=lambda i: fractions[i])
        name = self._fp8_state().layer_names[k]
        return {
            "kind": "grad_overflow",
            "tensor": f"{name}.grad_output",
            "fraction": fractions[k],
            "bar": bar,
        }

    def batches(self, source):
        """``source`` (``micro -> (x, y)``) that also keeps each micro-batch of the step (on the host)."""

        def draw(micro: int):
            x, y = source(micro)
            self._current["batches"].append(
                (x.detach().to("cpu", copy=True), y.detach().to("cpu", copy=True))
            )
            return x, y

        return draw

    def recorded_batches(self, device: torch.device):
        """The step's own micro-batches again, on ``device``: ``micro -> (x, y)``, for a run again."""
        return step_batches(self._current, device)

    def ran_again(self, loss: float) -> None:
        """The step ran again (``fp8_trainer.app.retry``): its record keeps the loss it went on with. A
        later bundle whose window holds it replays it under the recipe its snapshot had."""
        self._current.update(loss=loss, first_loss=self._current.get("loss"), ran_again=True)

    def end(self, step: int, loss: torch.Tensor) -> Path | None:
        """The step's backward is done (``loss`` its mean loss): write a bundle if it is an incident; its
        path, or None."""
        value, fractions = self._read(loss)  # a host read: the triggers need the values
        self._current["loss"] = value
        trigger = None
        if not math.isfinite(value):
            if not self.seen_nonfinite:
                trigger = {"kind": "nonfinite", "loss": value}
            self.seen_nonfinite = True
            score = None
        else:
            score = self.rule.update(value)
            if score is not None and score.spike:
                trigger = {"kind": "loss_spike", "loss": value}
        grad = self._grad_trigger(fractions)
        if trigger is None and grad is not None:
            trigger = {**grad, "loss": value}  # with the loss's score: the replay judges the loss if FP8's
        if trigger is None:
            return None
        # what the loss was expected to be (the spike rule's baseline), for the replay's verdict
        rule = self.rule
        if score is not None:
            trigger.update(expected=score.expected, sigma=score.sigma, z=score.z)
        elif rule.baseline is not None and len(rule.resid) >= rule.params.min_history:  # as the rule scores
            med = statistics.median(rule.resid)
            mad = statistics.median([abs(r - med) for r in rule.resid])
            sigma = max(MAD_TO_SIGMA * mad, rule.params.rel_floor * abs(rule.baseline), 1e-12)
            trigger.update(expected=rule.baseline + med, sigma=sigma)
        trigger["z_threshold"] = rule.params.z_threshold
        return self._write(step, trigger)

    def _write(self, step: int, trigger: dict[str, Any]) -> Path | None:
        if len(self.written) >= self.config.max_bundles:
            self.skipped.append(f"step {step}: {self.config.max_bundles} bundles already written")
            return None
        first = self.snapshots[0]
        steps = [s for snap in self.snapshots for s in snap.steps if s["step"] <= step]
        bundle = {
            "version": BUNDLE_VERSION,
            "step": step,
            "trigger": trigger,
            "config": self.run_config,
            "snapshot": {
                "step": first.step,
                "model": first.model,
                "optimizer": first.optimizer,
                "rng": first.rng,
            },
            "steps": steps,
        }
        directory = Path(self.config.directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"incident-step{step}.pt"
        tmp = path.with_name(path.name + ".tmp")
        torch.save(bundle, tmp)
        used = sum(p.stat().st_size for p in directory.glob("incident-step*.pt"))
        if used + tmp.stat().st_size > self.config.max_bytes:
            tmp.unlink()
            self.skipped.append(f"step {step}: the directory would exceed {self.config.max_bytes} bytes")
            return None
        os.replace(tmp, path)
        self.written.append(path)
        return path


def step_batches(record: dict[str, Any], device: torch.device):
    """A step record's micro-batches (a bundle's ``steps`` entry, or the step in progress), ``micro -> (x,
    y)`` on ``device``: the step's batch source when it runs again or is replayed."""
    return lambda micro: tuple(t.to(device) for t in record["batches"][micro])


def default_directory(save: str | None, run_name: str) -> str:
    """Where a monitored ``fp8-train`` run captures without ``--capture-dir``: ``incidents/<run name>/``
    beside the ``--save`` file, else under the working directory. One folder per run, so that the size cap
    and the bundle names (by step) of one run never meet another's."""
    base = Path(save).parent if save else Path()
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", run_name).strip(".")[:80] or "run"
    return str(base / "incidents" / safe)


def _injection_dict(inj) -> dict[str, Any]:
    return {"kind": inj.kind, "step": inj.step, "layer": inj.layer, "factor": inj.factor}


def load_bundle(path: str | Path) -> dict[str, Any]:
    """Read a bundle written by ``IncidentCapture`` (on the CPU). Raises ``ValueError`` naming the file."""
    path = Path(path)
    bundle = read_torch_file(path, "incident bundle", ValueError)
    if not isinstance(bundle, dict) or bundle.get("version") != BUNDLE_VERSION:
        raise ValueError(f"{path}: expected an incident bundle of version {BUNDLE_VERSION}")
    return bundle
