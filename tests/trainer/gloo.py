"""The processes of one data-parallel job on the CPU (gloo, spawned), for the multi-rank tests of the
runtime."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp8_trainer import fp8_autocast
from tests.support.server import free_port


@contextlib.contextmanager
def gloo_group(rank: int, port: int, world: int) -> Iterator[None]:
    """This process as rank `rank` of a gloo process group of `world` ranks meeting at loopback `port`;
    the group is destroyed on the way out."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker: Callable[..., None], world: int, *args: Any) -> dict[int, Any]:
    """Run ``worker(rank, port, *args, out)`` in `world` spawned processes that meet at a free loopback port
    (their process group's), wait for them, and return what each rank put in ``out[rank]``."""
    out = mp.Manager().dict()
    mp.start_processes(worker, args=(free_port(), *args, out), nprocs=world, join=True, start_method="spawn")
    return {rank: out[rank] for rank in range(world)}


def per_rank_stats(res: dict[int, Any], steps: list[int]) -> np.ndarray:
    """Each rank's ``res[rank]["stats"][step]`` (T, 6) stacked: (ranks, steps, T, 6)."""
    return np.stack([np.stack([res[r]["stats"][s] for s in steps]) for r in range(len(res))])


def rank_step(
    model: Any, opt: torch.optim.Optimizer, gen: torch.Generator, rank: int, recipe: Any = None
) -> torch.Tensor:
    """One optimizer step of a GPT on this rank's own data: 2 + rank sequences of 16 tokens, the loss weighted
    by 1 + 3 * rank (so the ranks' statistics differ), the forward under ``fp8_autocast(recipe)`` when a
    recipe is given. Returns the (unweighted) loss."""
    x = torch.randint(0, 256, (2 + rank, 16), generator=gen)
    with fp8_autocast(fp8_recipe=recipe) if recipe is not None else contextlib.nullcontext():
        _, loss = model(x, x)
    (loss * (1 + 3 * rank)).backward()
    opt.step()
    opt.zero_grad()
    return loss
