"""When a configuration of a replay (``fp8_trainer.app.replay``) "has the fault": the judges.

``LossJudge`` (a ``nonfinite`` or ``loss_spike`` bundle): a non-finite loss anywhere in the window, or the
failing step's loss at or above a bar (``verdict_bar``: halfway from the loss the spike rule expected to the
run's, at least 3 of its sigmas above the expected loss; for a non-finite original the rule's own spike
bar). The bisection tightens the bar to halfway between the high-precision and the FP8 loss.

``GradJudge`` (a ``grad_overflow`` bundle, ``fp8_trainer.app.incident_capture``, whose loss is not FP8's:
``judge_for``): the fault is in the trigger layer's parameter gradients of the failing step, not in its
loss. A configuration has it when

* a loss of the window is non-finite, or
* those gradients are far from the high-precision run's: their SQNR against it (the worst of the layer's
  parameters) below ``GRAD_FAULT_DB``; the high-precision run, its own reference, never is; or
* they blew up in the configuration's own run: their norm at the failing step above ``GRAD_BLOWUP`` times
  the median of their norms in the window's earlier steps. A gradient that blows up in high precision too
  (bad data, a loss-scaling bug) is then the high-precision run's fault as well, and the verdict is
  not-fp8, though the FP8 gradients (saturated) are far from the high-precision ones.

Both bars from measurements on the tiny preset (docs/replay.md, "Replay and verdict").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GRAD_BLOWUP", "GRAD_FAULT_DB", "GradJudge", "LossJudge", "judge_for", "sqnr_db", "verdict_bar"]

#: the trigger layer's gradient SQNR (dB) against high precision below which a configuration has the
#: fault: a saturated grad_output leaves about 0 dB (the gradients FACTOR times too small); clean FP8 over
#: a window stays far above (docs/replay.md)
GRAD_FAULT_DB = 6.0
#: the trigger layer's gradient norm at the failing step, over the median of its earlier steps in the
#: window, above which the gradient blew up in that configuration's own run
GRAD_BLOWUP = 10.0


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``out`` against the reference ``ref``, in dB (inf where they are equal)."""
    signal = ref.double().pow(2).sum().item()
    noise = (out.double() - ref.double()).pow(2).sum().item()
    if not (math.isfinite(signal) and math.isfinite(noise)):
        return math.nan
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _evidence(name: str, hp: list[str], result, reference) -> dict[str, Any]:
    """A configuration's entry without its verdict: the losses, and against ``reference`` (when given) each
    FP8 layer's output SQNR and the worst parameter gradient SQNR."""
    losses = result["losses"]
    entry = {"name": name, "high_precision": sorted(hp), "loss": losses[-1], "losses": losses}
    entry["layer_grad_sqnr_db"] = entry["layer_grad_ratio"] = None  # a gradient bundle's (GradJudge)
    if reference is not None:
        entry["sqnr_db"] = {
            n: sqnr_db(out, reference["outputs"][n])
            for n, out in result["outputs"].items()
            if n in reference["outputs"]
        }
        grad_db = {
            n: sqnr_db(g, reference["grads"][n])
            for n, g in result["grads"].items()
            if n in reference["grads"]
        }
        if grad_db:
            worst = min(grad_db, key=lambda n: grad_db[n] if not math.isnan(grad_db[n]) else -math.inf)
            entry["grad_sqnr_db_min"], entry["grad_sqnr_worst"] = grad_db[worst], worst
    return entry


def _nonfinite(losses: list[float]) -> bool:
    return not all(math.isfinite(v) for v in losses)


@dataclass
class LossJudge:
    """The fault: a non-finite loss in the window, or the failing step's loss at or above ``bar``."""

    bar: float | None

    def entry(self, name: str, hp: list[str], result, reference) -> dict[str, Any]:
        entry = _evidence(name, hp, result, reference)
        losses = result["losses"]
        entry["fault"] = _nonfinite(losses) or (self.bar is not None and losses[-1] >= self.bar)
        return entry

    def order(self, entry: dict[str, Any]) -> float:
        """A culprit's sort key, most likely first: the loss its return to high precision leaves."""
        return entry["loss"]

    def for_bisection(self, fp8: dict[str, Any], hp: dict[str, Any]) -> LossJudge:
        """The bisection's judge: the same batch in both, so halfway between the two losses."""
        a, b = fp8["loss"], hp["loss"]
        if math.isfinite(a) and math.isfinite(b) and a > b:
            return LossJudge(b + 0.5 * (a - b))
        return self

    def describe(self, entry: dict[str, Any]) -> str:
        return f"loss {entry['loss']:.4g}"


@dataclass
class GradJudge:
    """The fault: the gradients of ``layer``'s parameters at the failing step (module docstring)."""

    layer: str
    fault_db: float = GRAD_FAULT_DB
    blowup: float = GRAD_BLOWUP

    def entry(self, name: str, hp: list[str], result, reference) -> dict[str, Any]:
        entry = _evidence(name, hp, result, reference)
        ref = result["layer_ref"]  # high precision's, from the same weights
        mine = [n for n in result["grads"] if n in ref]
        db = math.inf
        if mine:
            got = torch.cat([result["grads"][n].reshape(-1) for n in mine])
            db = sqnr_db(got, torch.cat([ref[n].reshape(-1) for n in mine]))
        norms = result["layer_norms"]
        ratio = norms[-1] / statistics.median(norms[:-1]) if len(norms) > 1 and min(norms[:-1]) > 0 else 1.0
        entry["layer_grad_sqnr_db"], entry["layer_grad_ratio"] = db, ratio
        far = math.isnan(db) or db < self.fault_db
        blew_up = not math.isfinite(ratio) or ratio > self.blowup
        entry["fault"] = _nonfinite(result["losses"]) or far or blew_up
        return entry

    def order(self, entry: dict[str, Any]) -> float:
        """A culprit's sort key, most likely first: the gradient SQNR its return to high precision leaves,
        highest first."""
        db = entry["layer_grad_sqnr_db"]
        return -db if not math.isnan(db) else math.inf

    def for_bisection(self, fp8: dict[str, Any], hp: dict[str, Any]) -> GradJudge:
        return self

    def describe(self, entry: dict[str, Any]) -> str:
        return (
            f"{self.layer}'s gradients at SQNR {entry['layer_grad_sqnr_db']:.3g} dB against high precision, "
            f"{entry['layer_grad_ratio']:.3g}x their window median"
        )


def verdict_bar(trigger: dict[str, Any]) -> float | None:
    """The failing step's loss at or above which a configuration has the fault in the verdict: halfway from
    the loss the spike rule expected to the run's (at least 3 of its sigmas above the expected loss); for a
    non-finite original, the rule's own spike bar; None without a rule history."""
    expected = trigger.get("expected")
    if expected is None:
        return None
    loss, sigma = trigger["loss"], trigger["sigma"]
    if math.isfinite(loss):
        return expected + max(0.5 * (loss - expected), 3 * sigma)
    return expected + trigger["z_threshold"] * sigma


def judge_for(trigger: dict[str, Any], fp8=None, hp=None) -> LossJudge | GradJudge:
    """The judge of a bundle's trigger: its loss; for a ``grad_overflow``, its layer's gradients, unless the
    step's loss moved too and the replays ``fp8`` and ``hp`` (the window in the run's recipe and in high
    precision) say the loss is FP8's: its FP8 replay at or above the verdict bar, its high-precision one
    below. Then the loss judges, as for a spike (a saturated gradient that the loss rule scored just under
    its bar, the capture's gradient trigger writing the step's bundle), and the bisection names the casts
    whose return to high precision brings the loss back."""
    loss = LossJudge(verdict_bar(trigger))
    if trigger.get("kind") != "grad_overflow":
        return loss
    grad = GradJudge(trigger["tensor"].rsplit(".", 1)[0])
    if loss.bar is None or fp8 is None or hp is None:
        return grad
    if loss.entry("fp8", [], fp8, None)["fault"] and not loss.entry("high-precision", [], hp, None)["fault"]:
        return loss
    return grad


def layer_norm(model: torch.nn.Module, layer: str) -> float:
    """The norm of ``layer``'s parameter gradients (0 where it has none)."""
    grads = [p.grad.detach().double() for p in model.get_submodule(layer).parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
