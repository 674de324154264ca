"""``fp8-train --cuda-graph``: the optimizer step (every micro-batch's forward and backward, the FP8 scale
update, gradient clipping, AdamW) captured in a CUDA graph after three eager steps and replayed.

What a replay needs, and the eager loop does not:
- inputs in tensors that stay put: each step's micro-batches are copied into ``x`` / ``y``
  (``(grad_accum, batch, seq_len)``) before the replay;
- the learning rate in a tensor the captured AdamW reads (``capturable=True``), filled before each replay;
- no host synchronisation inside the step (``GraphedStep`` checks the last warm-up step and names any);
- outputs copied after the replay: the loss and gradient norm tensors are the graph's own, overwritten by
  the next replay.

Not captured (refused by ``fp8-train``): fault injection (it changes the step's Python per step),
``--halt-on-nonfinite`` (it reads the loss between backward and update), activation checkpointing (it saves
and restores the GPU's RNG state, which capture forbids), several ranks (DDP's gradient buckets are not set
up for capture here). A recipe change from the dashboard between steps makes the next call capture again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..graphs import GraphedStep
from .data import Corpus

__all__ = ["GraphedTraining", "graph_misfit", "make_capturable"]

Pair = tuple[torch.Tensor, torch.Tensor]  # (x, y) of a micro-batch; (loss, grad_norm) of a step
WARMUP = 3  # eager steps before the capture (Triton compiles, the optimizer makes its state)


def graph_misfit(a, world: int) -> str | None:
    """Why ``--cuda-graph`` cannot run with these settings (``TrainConfig`` or the parsed flags) on
    ``world`` ranks, or None."""
    if a.device != "cuda":
        return "--cuda-graph needs --device cuda"
    if world > 1:
        return (
            f"--cuda-graph: data-parallel runs ({world} ranks) are not captured (fp8_trainer.app.train_graph)"
        )
    for flag, given in (
        ("--inject", bool(a.inject)),
        ("--halt-on-nonfinite", a.halt_on_nonfinite),
        ("--activation-checkpointing", a.activation_checkpointing != "none"),
    ):
        if given:
            return f"--cuda-graph: {flag} cannot be captured (see fp8_trainer.app.train_graph)"
    return None


def make_capturable(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Make an AdamW capturable in place: its learning rate a device tensor, its step counters on the
    device (as ``capturable=True`` wants them; a checkpoint saved by an eager run holds them on the host)."""
    for group in opt.param_groups:
        group["capturable"] = True
        lr = group["lr"]
        group["lr"] = torch.tensor(float(lr), device=device) if not torch.is_tensor(lr) else lr.to(device)
    for state in opt.state.values():
        if "step" in state:
            state["step"] = state["step"].to(device=device, dtype=torch.float32)


class GraphedTraining:
    """One optimizer step per call, replayed from a CUDA graph once captured.

    ``step(batches)`` is the step the graph captures: forward and backward of every micro-batch (the FP8
    step closing after the last), clipping and the optimizer step, returning ``(loss, grad_norm)``; it takes
    micro-batch ``m`` from ``batches(m)``, here the static input buffers. It must not zero the gradients:
    ``GraphedStep`` sets them to None before the capture, so the first backward writes them afresh. The
    ``runner`` that calls it is ``GraphedStep`` (on the CPU, a test hands in a runner that calls it eagerly,
    to check the same Python without a GPU).
    """

    def __init__(
        self,
        a,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        device: torch.device,
        step: Callable[[Callable[[int], Pair]], Pair],
        runner=None,
    ):
        self.a, self.opt = a, opt
        shape = (a.grad_accum, a.batch_size, a.seq_len)
        self.x = torch.zeros(shape, dtype=torch.long, device=device)
        self.y = torch.zeros(shape, dtype=torch.long, device=device)
        self.runner = (runner or GraphedStep)(lambda: step(self._static), model, warmup=WARMUP, optimizer=opt)

    def _static(self, micro: int) -> Pair:
        """Micro-batch ``micro`` of the step, in the buffers a replay reads."""
        return self.x[micro], self.y[micro]

    def __call__(self, corpus: Corpus, lr: float) -> Pair:
        """One optimizer step on the corpus's next micro-batches at learning rate ``lr``: ``(loss,
        grad_norm)``, device tensors of this step (copies: the next replay overwrites the graph's)."""
        a, pin = self.a, self.x.device.type == "cuda"
        for micro in range(a.grad_accum):
            x, y = corpus.batch("train", a.batch_size, a.seq_len)
            if pin:  # pinned host memory: the copy overlaps the previous replay
                x, y = x.pin_memory(), y.pin_memory()
            self.x[micro].copy_(x, non_blocking=pin)
            self.y[micro].copy_(y, non_blocking=pin)
        for group in self.opt.param_groups:
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(lr)
            else:  # an optimizer that is not capturable (the CPU check): a float, as in the eager loop
                group["lr"] = lr
        loss, grad_norm = self.runner()
        return loss.clone(), grad_norm.clone()
