"""Training checkpoints: model (with each FP8 layer's scaling state), optimizer, step, RNG states.

A checkpoint holds everything a resumed run needs to continue exactly as the uninterrupted run would:
the model's ``state_dict`` (the FP8 amax histories, scales and recipe overrides travel in it as each FP8
Linear's ``_extra_state``), the optimizer state, the number of completed optimizer steps, the torch RNG
states and every data-parallel rank's data-stream generator state. It loads with ``weights_only=True``.
Files are written to a temporary name and renamed, so a crash while saving never destroys the previous one.

A model sharded with FSDP2 (``fp8-train --fsdp``) saves a *sharded checkpoint*: a directory written by
``torch.distributed.checkpoint`` (DCP), every rank writing its own shards of the weights and optimizer
state, beside a small ``fp8-train.pt`` with the rest (version, step, config, RNG states, data streams),
``load_checkpoint`` reads that file alone. The FP8 scaling state travels in the model state as for a file
(each FP8 Linear's ``_extra_state``; the same on every rank, stored once). DCP reshards on load, so a
sharded checkpoint resumes on another number of ranks (``load_sharded``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .torch_file import read_torch_file

__all__ = [
    "CHECKPOINT_VERSION",
    "CheckpointError",
    "TrainingState",
    "check_compatible",
    "check_layout",
    "load_checkpoint",
    "load_sharded",
    "save_checkpoint",
    "save_sharded",
]

#: 2: the attention's ``qkv`` output features are head-major (``model.CausalSelfAttention``); a version-1
#: checkpoint's are query, key, value blocks, which this model would read as other heads
CHECKPOINT_VERSION = 2
SHARDED_META = "fp8-train.pt"  # in a sharded checkpoint's directory: everything but the model and optimizer


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (missing, unreadable, or from an incompatible run)."""


def checkpoint_path(template: str, step: int) -> Path:
    """``--save`` may contain ``{step}`` to keep one file per save (``ckpt-{step}.pt``)."""
    return Path(template.replace("{step}", str(step)))


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint saves: the state after ``step`` optimizer steps.

    Attributes:
        config: the settings a resume must agree with (preset, vocabulary, recipe, ...), JSON-able.
        data_rng: the data-stream generator state of every rank, indexed by rank.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: int
    config: dict[str, Any]
    data_rng: list[torch.Tensor]


def save_checkpoint(path: str | Path, saved: TrainingState) -> Path:
    """Write a checkpoint of ``saved`` into the file ``path`` (atomically); return its path."""
    path = Path(path)
    state = {
        **_meta(saved),
        "model": saved.model.state_dict(),
        "optimizer": saved.optimizer.state_dict(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def _meta(saved: TrainingState) -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "data": list(saved.data_rng)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {"version": CHECKPOINT_VERSION, "step": saved.step, "config": dict(saved.config), "rng": rng}


def _plain_shards(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each FP8 all-gather weight (a DTensor over an ``FP8ShardedWeight``) as a DTensor over
    its plain high-precision shard, sharing its memory: DCP then writes and reads plain tensors."""
    from torch.distributed.tensor import DTensor

    from ..fsdp import FP8ShardedWeight

    out = {}
    for key, value in state.items():
        if isinstance(value, DTensor) and isinstance(value._local_tensor, FP8ShardedWeight):
            value = DTensor.from_local(
                value._local_tensor._tensor,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        out[key] = value
    return out


def save_sharded(path: str | Path, saved: TrainingState) -> Path:
    """Write a sharded checkpoint of ``saved``, an FSDP2 model's (a collective: every rank calls it), into
    the directory ``path``, replacing an older one only once the new one is complete; return ``path``.

    Every rank writes its shards with ``torch.distributed.checkpoint``; rank 0 writes the ``fp8-train.pt``
    beside them. The ranks must share the file system at ``path``.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    lead = dist.get_rank() == 0
    if lead:
        shutil.rmtree(tmp, ignore_errors=True)  # the remains of a save that crashed
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(saved.model, saved.optimizer)
    dcp.save({"model": _plain_shards(model_state), "optimizer": optim_state}, checkpoint_id=tmp)
    if lead:
        torch.save(_meta(saved), tmp / SHARDED_META)
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # no rank goes on (or reads it) before it is in place
    return path


def load_sharded(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the model (FP8 scaling state included) and optimizer of the sharded checkpoint ``path`` into an
    FSDP2 ``model`` (a collective), resharded to this run's ranks whatever the saving run's number was."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": _plain_shards(model_state), "optimizer": optim_state}
    dcp.load(state, checkpoint_id=Path(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint`` (on the CPU), or the ``fp8-train.pt`` of a sharded
    checkpoint's directory (then without ``model`` and ``optimizer``, and with ``sharded``: the directory,
    for ``load_sharded``). Raises ``CheckpointError``."""
    path = Path(path)
    if path.is_dir():
        if not (path / SHARDED_META).is_file():
            raise CheckpointError(
                f"{path}: a directory without {SHARDED_META}: not a sharded fp8-train checkpoint"
            )
        return {**load_checkpoint(path / SHARDED_META), "sharded": str(path)}
    ckpt = read_torch_file(path, "fp8-train checkpoint", CheckpointError)
    if not isinstance(ckpt, dict) or ckpt.get("version") != CHECKPOINT_VERSION:
        version = ckpt.get("version") if isinstance(ckpt, dict) else None
        raise CheckpointError(
            f"{path}: expected an fp8-train checkpoint of version {CHECKPOINT_VERSION}, "
            f"got version {version!r}"
        )
    return ckpt


def check_compatible(ckpt: dict[str, Any], config: dict[str, Any], steps: int) -> None:
    """Raise ``CheckpointError`` naming the flag if this run cannot continue the checkpoint's run.

    The model shape (preset, vocabulary) and FP8 or not must match; the recipe may change between
    the FP8 recipes (the scaling state carries over), and ``--steps`` must go past the
    checkpoint's step.
    """
    saved = ckpt["config"]
    if saved["preset"] != config["preset"]:
        raise CheckpointError(
            f"--resume: the checkpoint was saved with --preset {saved['preset']}, "
            f"not --preset {config['preset']}"
        )
    if saved["vocab_size"] != config["vocab_size"]:
        raise CheckpointError(
            f"--resume: the checkpoint's vocabulary is {saved['vocab_size']} but this --data gives "
            f"{config['vocab_size']} (saved with --data {saved.get('data') or '(default corpus)'})"
        )
    fp8 = ("delayed", "current", "mxfp8", "block")
    if (saved["recipe"] in fp8) != (config["recipe"] in fp8):
        raise CheckpointError(
            f"--resume: the checkpoint was saved with --recipe {saved['recipe']}; an FP8 checkpoint resumes "
            f"with an FP8 recipe (delayed, current, mxfp8, block), a bf16/fp32 one with bf16 or fp32, not "
            f"--recipe {config['recipe']}"
        )
    if ckpt["step"] >= steps:
        raise CheckpointError(
            f"--resume: the checkpoint is at step {ckpt['step']}; --steps {steps} leaves nothing to train"
        )


def check_layout(ckpt: dict[str, Any], sharded: bool) -> None:
    """Raise ``CheckpointError`` if the checkpoint's layout (a file, or a sharded directory) does not suit a
    run whose parameters are split over ranks (``sharded``: ``--fsdp`` or ``--tp``) or one whose are not."""
    if ckpt.get("sharded") and not sharded:
        raise CheckpointError(
            "--resume: the checkpoint is a sharded directory (saved with --fsdp or --tp); resume it with "
            "--fsdp or --tp"
        )
    if sharded and not ckpt.get("sharded"):
        raise CheckpointError(
            "--resume: --fsdp and --tp resume from a sharded checkpoint directory (saved with --fsdp or "
            "--tp), not a checkpoint file"
        )
