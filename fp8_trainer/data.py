"""The default corpus: the running Python's standard library source, as bytes (vocabulary 256).

Deterministic: files are read in sorted order, the first 90% of the bytes are the training split and the
rest validation; batches are sampled with a seeded ``torch.Generator``.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

__all__ = ["ByteCorpus", "stdlib_corpus"]


def stdlib_corpus(max_bytes: int = 2 * 2**20) -> bytes:
    """Concatenated ``.py`` files under the stdlib path (sorted, test suites skipped), up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("test", "site-packages", "idlelib") or "tests" in rel:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class ByteCorpus:
    """Byte-level train/val split with seeded random batch sampling."""

    def __init__(self, data: bytes | None = None, val_fraction: float = 0.1, seed: int = 0):
        data = stdlib_corpus() if data is None else data
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        n_val = int(len(tokens) * val_fraction)
        self.train, self.val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, split: str, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, each ``(batch_size, seq_len)``; ``y`` is ``x`` shifted by one byte."""
        data = self.train if split == "train" else self.val
        starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=self.generator)
        offsets = torch.arange(seq_len + 1)
        rows = data[starts.unsqueeze(1) + offsets]  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]
