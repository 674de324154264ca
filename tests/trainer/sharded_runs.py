"""What the sharded-training tests (FSDP2, tensor parallelism, both on a 2-D mesh) share: a small model of
two blocks and a head, its data, and a training loop that records each step's loss and FP8 statistics, so
every rank and the unsharded reference run exactly the same steps."""

from __future__ import annotations

import torch
from torch import nn

import fp8_trainer
from fp8_trainer import fp8_autocast


def small_model() -> nn.Module:
    """Two blocks (Linear 32->64, GELU, Linear 64->32, LayerNorm) and a Linear head, seeded."""
    torch.manual_seed(0)

    def block() -> nn.Sequential:
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32))

    return nn.Sequential(block(), block(), nn.Linear(32, 32))


def batches(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch ``(x, y)``: ``rows`` sequences of 16 tokens of 32 features (a
    micro-batch of 2 sequences is 32 tokens, as MXFP8 needs)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 16, 32, generator=gen) * 2, torch.randn(rows, 16, 32, generator=gen)


def train(
    model: nn.Module, steps: int, rows: int, take: slice = slice(None), accumulate: bool = True
) -> dict:
    """``steps`` optimizer steps on the ``take`` rows of each global batch of ``rows``, the second step as
    two micro-batches when ``accumulate``: ``{"losses": [...], "stats": [step_stats, ...]}``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, stats = [], []
    for step in range(steps):
        x, y = (t[take] for t in batches(step, rows))
        half = x.shape[0] // 2
        parts = [slice(0, half), slice(half, None)] if accumulate and step == 1 else [slice(None)]
        total = 0.0
        for j, part in enumerate(parts):
            with fp8_autocast(step_boundary=j == len(parts) - 1):
                out = model(x[part])
            loss = (out.float() - y[part]).pow(2).mean() / len(parts)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
        stats.append(fp8_trainer.step_stats(model).clone())
    return {"losses": losses, "stats": stats}
