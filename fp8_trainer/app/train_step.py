"""One optimizer step of ``fp8-train``, in parts the loop, the CUDA-graph capture (``app.train_graph``) and
the replay (``app.replay``) share: a micro-batch, forward and backward over the micro-batches, clip and step;
and the validation loss."""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ..autocast import fp8_autocast
from .data import Corpus
from .train_config import FP8_RECIPES, TrainConfig

__all__ = [
    "bf16",
    "clip_and_step",
    "clip_over_meshes",
    "evaluate",
    "forward_backward",
    "next_batch",
    "nonfinite",
    "optimizer_step",
    "sharded",
]


def next_batch(a: TrainConfig, corpus: Corpus, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's next training micro-batch on ``device``, ``(B, T)`` each."""
    x, y = corpus.batch("train", a.batch_size, a.seq_len)
    if device.type == "cuda":  # pinned host memory: the copy overlaps the previous kernels
        x = x.pin_memory().to(device, non_blocking=True)
        y = y.pin_memory().to(device, non_blocking=True)
    return x, y


def forward_backward(
    a, net: nn.Module, batches, recipe, device, world: int, captured: bool = False
) -> torch.Tensor:
    """One optimizer step's forward and backward over its micro-batches, micro-batch ``m`` from
    ``batches(m)`` (the FP8 step closes after the last); returns the step's mean loss, on the device.
    ``captured``: the step runs inside a CUDA graph (``bf16``'s cache off)."""
    step_loss = torch.zeros((), device=device)
    for micro in range(a.grad_accum):
        x, y = batches(micro)
        last = micro == a.grad_accum - 1
        ddp = world > 1 and not sharded(a)
        no_sync = net.no_sync() if ddp and not last else nullcontext()  # DDP: reduce once
        if a.fsdp:
            net.set_requires_gradient_sync(last)  # FSDP2's no_sync: reduce-scatter after the last only
        with no_sync:
            fp8 = fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe, step_boundary=last)
            with fp8, bf16(a, device, cache=not captured):
                _, loss = net(x, y)
            (loss / a.grad_accum).backward()
        step_loss += loss.detach() / a.grad_accum
    return step_loss


def optimizer_step(a: TrainConfig, model: nn.Module, opt) -> torch.Tensor:
    """Clip (or only measure) the gradient norm, step, drop the gradients; the norm, on the device."""
    grad_norm = clip_and_step(a, model, opt)
    opt.zero_grad(set_to_none=True)
    return grad_norm


def clip_and_step(a: TrainConfig, model: nn.Module, opt) -> torch.Tensor:
    """Clip (or only measure) the gradient norm and step; the norm, on the device."""
    max_norm = a.grad_clip if a.grad_clip > 0 else math.inf  # inf: only measure the norm
    if a.tp > 1:
        grad_norm = clip_over_meshes(list(model.parameters()), max_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(grad_norm, DTensor):  # FSDP2's sharded gradients: the norm is replicated on every rank
        grad_norm = grad_norm.full_tensor()
    opt.step()
    return grad_norm


def clip_over_meshes(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` for gradients that live on different device meshes (under ``--tp`` with
    ``--fsdp`` the split layers' on the 2-D mesh, the rest on its dp dimension), which one norm over all of
    them cannot mix: the norm of each mesh's gradients, made whole (``full_tensor``), then their norm; each
    gradient scaled by the same clipping coefficient, replicated on its own mesh. Returns the total norm."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as clip_grad_norm_
    for mesh, grads in groups.items():
        c = coef if mesh is None else DTensor.from_local(coef, mesh, [Replicate()] * mesh.ndim)
        for g in grads:
            g.mul_(c)
    return total


def bf16(a: TrainConfig, device: torch.device, cache: bool = True):
    """bf16 autocast for the bf16 baseline, and on a GPU also around FP8 recipes: what is not an FP8 GEMM
    (attention, LayerNorm, the output head) then runs in bf16 as in FP8 training with Transformer Engine, and
    tokens/s compare with the bf16 baseline. On the CPU, FP8 runs keep float32 elsewhere (bf16 is slow).
    ``cache=False`` in a captured step (autocast's weight-cast cache would outlive the capture)."""
    fp8_on_gpu = device.type == "cuda" and a.recipe in FP8_RECIPES
    enabled = a.recipe == "bf16" or fp8_on_gpu
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled, cache_enabled=cache)


def sharded(a: TrainConfig) -> bool:
    """Whether the model's parameters are split over ranks (``--fsdp``, ``--tp``): no DDP, a collective
    evaluation, a sharded checkpoint."""
    return a.fsdp or a.tp > 1


def nonfinite(loss: torch.Tensor, world: int) -> bool:
    """Whether this step's loss is non-finite on any rank (every rank gets the same answer)."""
    bad = (~torch.isfinite(loss)).float()
    if world > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item())


@torch.no_grad()
def evaluate(model: nn.Module, batches, a: TrainConfig, recipe, device) -> float:
    """Mean loss over the fixed validation batches (FP8 forwards under no_grad record no statistics)."""
    model.eval()
    losses = []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe), bf16(a, device):
            losses.append(model(x, y)[1].float())
    model.train()
    return torch.stack(losses).mean().item()
