"""``--remediation act``: an incident's step replayed before its update, and run again under the fix.

When the incident capture writes a bundle at step S (after the step's backward, before its optimizer
update) and the run acts on its incidents, the job pauses there:

1. step S is reported at once, with the bundle's event (``Monitor.flush``), so that the service opens the
   incident and lists the bundle on it;
2. the bundle is replayed in a child process, waited for (``AutoReplay.run_now``: the child that
   ``--remediation propose`` runs beside training), which stores its report on the incident; the service's
   remediation policy answers an *fp8-caused* report with a recipe command
   (``monitor_server/services/policies.py``);
3. one more telemetry exchange brings the command (``Monitor.flush``);
4. with a command of a policy waiting, the step runs again from where it began: its gradients dropped, the
   FP8 scaling state and the RNG put back (``fp8_trainer.rewind``: the weights and the optimizer have not
   moved yet), the waiting commands applied from step S (their acks say so), the step's own micro-batches
   and faults again; then the update, as usual, from the run again's gradients.

The service keeps step S as it first ran (the fault is what its incident reports); the run again is an event
``step_retried`` with both losses, and the training goes on from the run again (its loss is the step's in
``TrainResult.losses``). Without a policy's command the step goes on as it first ran. The pause is the
replay's time (about ten seconds for the tiny preset on a CPU), the price of not taking the update with the
fault in it; ``--remediation propose`` never pauses. A monitor that does not take step S in time (down:
spooling; not registered) leaves the bundle to be replayed beside training, as under ``propose``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fp8_protocol.replay import INCIDENT_BUNDLE_EVENT

from ..rewind import rewind
from .run import Run
from .train_step import forward_backward

__all__ = ["STEP_RETRIED_EVENT", "at_incident"]

#: the event a step run again sends, with its first and its new loss and the commands it ran under
STEP_RETRIED_EVENT = "step_retried"


def at_incident(run: Run, step: int, lr: float, step_loss: torch.Tensor, bundle: Path) -> torch.Tensor:
    """Steps 1-4 of the module docstring for the bundle written at ``step``; the step's loss to go on with
    (the run again's, else ``step_loss``). The step is reported here (``run.reported``)."""
    monitor = run.monitor
    monitor.step(step, loss=step_loss, lr=lr)
    run.reported = step
    monitor.event(INCIDENT_BUNDLE_EVENT, step, path=str(bundle))
    if not monitor.flush() or monitor.run_id is None or monitor.spooling:
        late = "the monitor did not take the step in time"
        run.say(f"fp8-train: step {step}: {late}; {bundle} is replayed beside training (as under propose)")
        run.replays.after_step(step, bundle, monitor)
        return step_loss
    run.say(f"fp8-train: step {step}: paused while {bundle} is replayed (--remediation act)")
    if run.replays.run_now(step, bundle, monitor) != 0 or not monitor.flush():
        return step_loss
    policy = [c for c in monitor.waiting_commands() if str(c.get("created_by") or "").startswith("policy:")]
    if not policy:
        return step_loss
    return _run_again(run, step, step_loss)


def _run_again(run: Run, step: int, first: torch.Tensor) -> torch.Tensor:
    """Step ``step`` again from where it began, under the waiting commands (module docstring, 4)."""
    capture = run.capture
    run.opt.zero_grad(set_to_none=True)
    rng, scaling = capture.step_start
    state = getattr(run.model, "_fp8_state", None)
    if state is not None and scaling is not None:
        rewind(state, scaling)  # before the commands: a new history length resizes what is put back
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng:
        torch.cuda.set_rng_state_all(rng["cuda"])
    acks = run.monitor.apply_commands_now(step)
    run.injector.begin(step)  # the step's faults again (announced when it first ran)
    try:
        loss = forward_backward(
            run.a, run.net, capture.recorded_batches(run.device), run.recipe, run.device, run.world
        )
    finally:
        run.injector.end(step)
    first_value, value = float(first), float(loss)
    capture.ran_again(value)
    applied = [a["command_id"] for a in acks if a.get("state") == "applied"]
    under = ", ".join(map(str, applied)) or "none applied"
    run.say(
        f"fp8-train: step {step} ran again under command(s) {under}: loss {first_value:.4f} -> {value:.4f}"
    )
    run.monitor.event(STEP_RETRIED_EVENT, step, first_loss=first_value, loss=value, commands=applied)
    return loss
