"""Reading the files ``fp8-train`` writes with ``torch.save`` (checkpoints, incident bundles) back safely."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["read_torch_file"]


def read_torch_file(path: Path, what: str, error: type[Exception]) -> Any:
    """The object saved in the file ``path``, loaded on the CPU with ``weights_only=True`` (plain tensors and
    containers, never code). A missing or unreadable file raises ``error`` naming the file and, as ``what``,
    what it should have been; checking the object's own version is the caller's."""
    if not path.is_file():
        raise error(f"{path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a file that is not what it should be
        raise error(f"{path}: not a readable {what} ({type(e).__name__})") from None
