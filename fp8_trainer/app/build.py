"""What a run of ``fp8-train`` is made of: the recipe, the data, the model (converted to FP8, sharded,
split over ranks), the optimizer, all restored from a checkpoint when resuming; the learning rate of each
step; the flags as the run's config."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..convert import convert_to_fp8, get_fp8_state
from ..recipe import CurrentScaling, DelayedScaling, Float8BlockScaling, Format, MXFP8BlockScaling
from .checkpoint import load_checkpoint, load_sharded
from .data import Corpus, load_corpus
from .model import GPT, fp8_filter, preset_config
from .schedule import lr_at
from .train_config import HISTORY_LEN, TrainConfig
from .train_graph import make_capturable

__all__ = [
    "Prepared",
    "build",
    "dist_env",
    "make_optimizer",
    "make_recipe",
    "run_config",
    "shard_model",
    "step_lr",
    "tp_model",
]


@dataclass
class Prepared:
    """What ``cli.prepare`` loaded while checking the flags, handed on so it is not loaded twice."""

    corpus: Corpus | None = None
    checkpoint: dict[str, Any] | None = None


def dist_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` as set by ``torchrun`` (``(0, 1, 0)`` otherwise)."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def make_recipe(a: TrainConfig):
    """The FP8 recipe the flags describe (``None`` for fp32 / bf16)."""
    block = a.recipe in ("mxfp8", "block")  # TE's block recipes default to E4M3 everywhere
    fmt = Format.parse(a.fp8_format or ("e4m3" if block else "hybrid"))
    if a.recipe == "delayed":
        return DelayedScaling(
            fp8_format=fmt,
            margin=a.margin if a.margin is not None else 0,
            amax_history_len=a.amax_history_len if a.amax_history_len is not None else HISTORY_LEN,
            amax_compute_algo=a.amax_compute_algo or "max",
            interval=a.interval if a.interval is not None else 1,
        )
    if a.recipe == "current":
        return CurrentScaling(fp8_format=fmt, power_2_scale=a.power_2_scale)
    if a.recipe == "mxfp8":
        return MXFP8BlockScaling(fp8_format=fmt)
    if a.recipe == "block":
        return Float8BlockScaling(fp8_format=fmt)
    return None


def run_config(a: TrainConfig, vocab_size: int) -> dict[str, Any]:
    """The flags as JSON-able data (for checkpoints and the monitor), without the secret token. A recipe flag
    left to its default holds the value the recipe used (``margin`` 0, not null), so the config says what
    was in force and a filter such as ``margin=0`` finds the runs that had it; a flag the recipe has no use
    for (``margin`` under current scaling) stays null."""
    values = vars(a) if isinstance(a, argparse.Namespace) else dataclasses.asdict(a)
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if k != "token"}
    recipe = make_recipe(a)
    used = recipe.to_dict() if recipe is not None else {}
    for key, value in used.items():
        if key in cfg and cfg[key] is None:
            cfg[key] = value.lower() if key == "fp8_format" else value  # as the flag spells it
    return {**cfg, "vocab_size": vocab_size}


def warmup_steps(a: TrainConfig) -> int:
    """``--warmup-steps``, by default a tenth of the run up to 100 steps."""
    return a.warmup_steps if a.warmup_steps is not None else min(100, a.steps // 10)


def step_lr(a: TrainConfig, step: int) -> float:
    """The scheduled learning rate of optimizer step ``step`` (before any injected spike)."""
    return lr_at(
        step,
        lr=a.lr,
        min_lr=a.min_lr,
        warmup_steps=warmup_steps(a),
        total_steps=a.steps,
        schedule=a.lr_schedule,
    )


def make_optimizer(a: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The run's optimizer (AdamW) over ``model``'s parameters."""
    return torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)


def build(a, prepared: Prepared, rank: int, device):
    """Data, model (converted to FP8 by the recipe), optimizer; restored from the checkpoint if resuming.

    Returns ``(corpus, recipe, model, optimizer, start_step, saved_streams)``.
    """
    torch.manual_seed(a.seed)  # the same initial weights on every rank
    data_rank = rank // a.tp  # the ranks of a tensor-parallel group train the same batches
    corpus = prepared.corpus or load_corpus(a.data, seed=a.seed, rank=data_rank)
    recipe = make_recipe(a)
    cfg = replace(preset_config(a.preset, corpus.vocab_size), checkpoint=a.activation_checkpointing)
    model = GPT(cfg).to(device)
    if recipe is not None:
        convert_to_fp8(model, recipe=recipe, module_filter_fn=fp8_filter)
        if not a.quality_stats:
            get_fp8_state(model).set_quality_stats(False)
        default_every = 10 if device.type == "cuda" else 1
        get_fp8_state(model).set_quality_schedule(a.quality_every or default_every)
    if a.tp > 1:
        mesh = tp_model(model, a.tp, device)
        if a.fsdp:
            shard_model(model, fp8=False, mesh=mesh["dp"])  # high-precision all-gather (docs/distributed.md)
    elif a.fsdp:
        shard_model(model, fp8=recipe is not None)
    opt = make_optimizer(a, model)  # after sharding: over the sharded parameters
    ckpt = prepared.checkpoint
    if ckpt is None and a.resume:
        ckpt = load_checkpoint(a.resume)
    if ckpt is not None and ckpt.get("sharded"):
        load_sharded(ckpt["sharded"], model=model, optimizer=opt)  # resharded to this run's ranks
        for group in opt.param_groups:
            group["capturable"] = False
    elif ckpt is not None:
        model.load_state_dict(ckpt["model"])  # FP8 scaling state included (each layer's _extra_state)
        opt.load_state_dict(ckpt["optimizer"])
        for group in opt.param_groups:  # as this run wants it, whatever the saving run was
            group["capturable"] = False
    if a.cuda_graph and device.type == "cuda":
        make_capturable(opt, device)
    if ckpt is None:
        return corpus, recipe, model, opt, 0, None
    torch.set_rng_state(ckpt["rng"]["torch"])
    if "cuda" in ckpt["rng"] and device.type == "cuda":
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    streams = ckpt["rng"]["data"]
    if data_rank < len(streams):
        corpus.generator.set_state(streams[data_rank])
    prepared.checkpoint = None  # model and optimizer hold copies now: free the memory
    return corpus, recipe, model, opt, ckpt["step"], len(streams)


def shard_model(model: GPT, fp8: bool, mesh=None) -> None:
    """FSDP2 on ``model`` in place, as ``docs/distributed.md`` writes it: the FP8 weights cast before the
    all-gather (``fp8``: the model is converted to FP8), ``fully_shard`` on each block and on the root (the
    embeddings, the final norm and the head tied to the embedding), over ``mesh`` (None: all ranks). Mixed
    precision stays autocast's (``bf16``), as without FSDP2, so the parameters, the all-gathers that are
    not FP8 and the gradient reduce-scatter are float32."""
    from torch.distributed.fsdp import fully_shard

    from ..fsdp import enable_fp8_all_gather

    if fp8:
        enable_fp8_all_gather(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def tp_model(model: GPT, tp: int, device):
    """Tensor parallelism on ``model`` in place (``--tp``): a ``(world / tp, tp)`` mesh (``("dp", "tp")``),
    each block's ``attn.qkv`` and ``mlp.fc`` column-wise and ``attn.proj`` and ``mlp.fc2`` row-wise over
    ``mesh["tp"]`` (the attention's head-major ``qkv`` gives each rank whole heads); the embeddings, the
    norms and the head stay whole on every rank. Returns the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.fc2"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    return mesh
