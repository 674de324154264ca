"""Training checkpoints: model (with each FP8 layer's scaling state), optimizer, step, RNG states.

A checkpoint holds everything a resumed run needs to continue exactly as the uninterrupted run would:
the model's ``state_dict`` (the FP8 amax histories, scales and recipe overrides travel in it as each FP8
Linear's ``_extra_state``), the optimizer state, the number of completed optimizer steps, the torch RNG
states and every data-parallel rank's data-stream generator state. It loads with ``weights_only=True``.
Files are written to a temporary name and renamed, so a crash while saving never destroys the previous one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["CHECKPOINT_VERSION", "CheckpointError", "check_compatible", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (missing, unreadable, or from an incompatible run)."""


def checkpoint_path(template: str, step: int) -> Path:
    """``--save`` may contain ``{step}`` to keep one file per save (``ckpt-{step}.pt``)."""
    return Path(template.replace("{step}", str(step)))


def save_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    config: dict[str, Any],
    data_rng: list[torch.Tensor],
) -> Path:
    """Write a checkpoint of the state after ``step`` optimizer steps (atomically); return its path.

    Args:
        config: the settings a resume must agree with (preset, vocabulary, recipe, ...), JSON-able.
        data_rng: the data-stream generator state of every rank, indexed by rank.
    """
    path = Path(path)
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "data": list(data_rng)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {
        "version": CHECKPOINT_VERSION,
        "step": step,
        "config": dict(config),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint`` (on the CPU). Raises ``CheckpointError``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a file that is not a checkpoint
        raise CheckpointError(f"{path}: not a readable fp8-train checkpoint ({type(e).__name__})") from None
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
