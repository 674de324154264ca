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

import math
from collections.abc import Callable

import torch
from torch import nn

from .autocast import fp8_autocast
from .data import Corpus
from .graphs import GraphedStep

__all__ = ["GraphedTraining", "graph_misfit", "make_capturable"]

WARMUP = 3  # eager steps before the capture (Triton compiles, the optimizer makes its state)


def graph_misfit(a, world: int) -> str | None:
    """Why ``--cuda-graph`` cannot run with these settings (``TrainConfig`` or the parsed flags) on
    ``world`` ranks, or None."""
    if a.device != "cuda":
        return "--cuda-graph needs --device cuda"
    if world > 1:
        return f"--cuda-graph: data-parallel runs ({world} ranks) are not captured (fp8_trainer.train_graph)"
    for flag, given in (
        ("--inject", bool(a.inject)),
        ("--halt-on-nonfinite", a.halt_on_nonfinite),
        ("--activation-checkpointing", a.activation_checkpointing != "none"),
    ):
        if given:
            return f"--cuda-graph: {flag} cannot be captured (see fp8_trainer.train_graph)"
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

    ``step_fn`` is what the graph captures; the ``runner`` that calls it is ``GraphedStep`` (on the CPU, a
    test hands in a runner that calls it eagerly, to check the same Python without a GPU).
    """

    def __init__(
        self,
        a,
        net: nn.Module,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        recipe,
        device: torch.device,
        autocast: Callable[[], object],
        runner=None,
    ):
        self.a, self.net, self.model, self.opt, self.recipe = a, net, model, opt, recipe
        self.autocast = autocast  # the bf16 autocast of fp8-train, built for the step
        shape = (a.grad_accum, a.batch_size, a.seq_len)
        self.x = torch.zeros(shape, dtype=torch.long, device=device)
        self.y = torch.zeros(shape, dtype=torch.long, device=device)
        self.max_norm = a.grad_clip if a.grad_clip > 0 else math.inf
        self.runner = (runner or GraphedStep)(self.step_fn, model, warmup=WARMUP, optimizer=opt)

    def step_fn(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured step: forward and backward of every micro-batch from the static inputs (the FP8 step
        closes after the last), clipping, the optimizer step. Gradients are written afresh by the first
        backward (``GraphedStep`` sets them to None before the capture), so nothing zeroes them here."""
        a = self.a
        step_loss = torch.zeros((), device=self.x.device)
        for micro in range(a.grad_accum):
            last = micro == a.grad_accum - 1
            fp8 = fp8_autocast(enabled=self.recipe is not None, fp8_recipe=self.recipe, step_boundary=last)
            with fp8, self.autocast():
                _, loss = self.net(self.x[micro], self.y[micro])
            (loss / a.grad_accum).backward()
            step_loss += loss.detach() / a.grad_accum
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.opt.step()
        return step_loss, grad_norm

    def __call__(self, corpus: Corpus, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
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
