"""What the sharded-training tests (FSDP2, tensor parallelism, both on a 2-D mesh) share: a small model of
two blocks and a head, its data, and a training loop that records each step's loss and FP8 statistics, so
every rank and the unsharded reference run exactly the same steps."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fp8_trainer
from fp8_trainer import fp8_autocast


def small_model() -> nn.Module:
    """Two blocks (Linear 32->64, GELU, Linear 64->32, LayerNorm) and a Linear head, seeded."""
    torch.manual_seed(0)

    def block() -> nn.Sequential:
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32))

    return nn.Sequential(block(), block(), nn.Linear(32, 32))


#: the small model's blocks over a tensor-parallel mesh: the first Linear column-wise, the second row-wise
TP_PLAN = {
    "0.0": ColwiseParallel(),
    "0.2": RowwiseParallel(),
    "1.0": ColwiseParallel(),
    "1.2": RowwiseParallel(),
}


def mesh_2d(dp: int, tp: int, rows: int):
    """This rank's ``(dp, tp)`` CPU mesh and the slice of a global batch of ``rows`` sequences its dp group
    trains (the tp ranks of a group train the same rows)."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    d = mesh.get_local_rank("dp")
    return mesh, slice(d * rows // dp, (d + 1) * rows // dp)


def shard_2d(model: nn.Module, mesh) -> nn.Module:
    """The small model on a ``(dp, tp)`` mesh: ``TP_PLAN`` over ``mesh["tp"]``, then ``fully_shard`` per block
    and on the root over ``mesh["dp"]`` (FSDP2's high-precision all-gather)."""
    parallelize_module(model, mesh["tp"], TP_PLAN)
    for blk in list(model)[:2]:
        fully_shard(blk, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def batches(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch ``(x, y)``: ``rows`` sequences of 16 tokens of 32 features (a
    micro-batch of 2 sequences is 32 tokens, as MXFP8 needs)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 16, 32, generator=gen) * 2, torch.randn(rows, 16, 32, generator=gen)


def train(
    model: nn.Module,
    steps: int,
    rows: int,
    take: slice = slice(None),
    accumulate: bool = True,
    after_step: Callable[[int, float], None] | None = None,
) -> dict:
    """``steps`` optimizer steps on the ``take`` rows of each global batch of ``rows``, the second step as
    two micro-batches when ``accumulate``: ``{"losses": [...], "stats": [step_stats, ...]}``.
    ``after_step(step, loss)`` is called after each optimizer step (e.g. a monitor's ``step``)."""
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
        if after_step is not None:
            after_step(step, total)
    return {"losses": losses, "stats": stats}
