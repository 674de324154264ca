"""Training data: token streams with a deterministic train/validation split and seeded batch sampling.

Three sources, all read the same way (the last ``val_fraction`` of the tokens is the validation split):

* the default corpus: the running Python's standard library source, as bytes (vocabulary 256), so every
  machine has a real corpus with no download;
* a text file (``--data FILE``): its bytes (vocabulary 256);
* a ``.bin`` file of uint16 token ids (the nanoGPT format, e.g. GPT-2 tokens): memory-mapped, vocabulary
  50304 (GPT-2's 50257 padded to a multiple of 64), or the largest id + 1 rounded up to a multiple of 64
  when the file holds larger ids.

Training batches come from a ``torch.Generator`` seeded by ``(seed, rank)``, so every data-parallel rank
draws its own stream and a run is repeatable; its state is saved in checkpoints. Validation batches are
the same fixed set at every evaluation (their own generator, reseeded each time), so validation losses of
one run, and of runs with the same seed, are comparable and evaluating never shifts the training stream.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import numpy as np
import torch

__all__ = ["BYTE_VOCAB", "GPT2_VOCAB", "ByteCorpus", "Corpus", "DataError", "load_corpus", "stdlib_corpus"]

BYTE_VOCAB = 256
GPT2_VOCAB = 50304  # 50257 GPT-2 tokens padded to a multiple of 64 (faster GEMMs)
VAL_FRACTION = 0.1


class DataError(ValueError):
    """A data file that cannot be trained on (missing, empty, too short, malformed)."""


@functools.cache  # read once per process: in-process runs (benchmarks, tests) reuse it
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


def _stream_seed(seed: int, rank: int) -> int:
    # distinct, reproducible streams per rank; rank 0 keeps the plain seed
    return seed + 1_000_003 * rank


class Corpus:
    """A 1-D token array split into train / validation, with seeded random batch sampling.

    Args:
        tokens: token ids (a numpy array or memmap of any integer dtype, or a 1-D tensor).
        vocab_size: the model's vocabulary (every id must be below it).
        val_fraction: share of the tokens (the last ones) held out for validation.
        seed, rank: seed the training stream of this data-parallel rank.
    """

    def __init__(self, tokens, vocab_size: int, val_fraction: float = VAL_FRACTION, seed: int = 0, rank=0):
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.numpy()
        n_val = int(len(tokens) * val_fraction)
        self.train, self.val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
        self.vocab_size = vocab_size
        self.seed = seed
        self.generator = torch.Generator().manual_seed(_stream_seed(seed, rank))

    def check_length(self, seq_len: int) -> None:
        """Raise ``DataError`` unless both splits hold more than ``seq_len + 1`` tokens."""
        need = seq_len + 2
        for split, data in (("training", self.train), ("validation", self.val)):
            if len(data) < need:
                raise DataError(
                    f"the {split} split has {len(data)} tokens; --seq-len {seq_len} needs at least {need} "
                    f"(the last {VAL_FRACTION:.0%} of the data is the validation split)"
                )

    def _rows(self, data, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts.numpy()[:, None] + np.arange(seq_len + 1)  # (B, T+1)
        rows = torch.from_numpy(np.asarray(data[idx], dtype=np.int64))
        return rows[:, :-1], rows[:, 1:]

    def batch(self, split: str, batch_size: int, seq_len: int, generator=None):
        """``(x, y)``, each ``(batch_size, seq_len)`` int64; ``y`` is ``x`` shifted by one token.

        Draws from this rank's training stream unless another ``generator`` is given.
        """
        data = self.train if split == "train" else self.val
        g = self.generator if generator is None else generator
        starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=g)
        return self._rows(data, starts, seq_len)

    def val_batches(self, n: int, batch_size: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed validation set: the same ``n`` batches at every call (for a given seed)."""
        g = torch.Generator().manual_seed(self.seed + 7)
        return [self.batch("val", batch_size, seq_len, generator=g) for _ in range(n)]


class ByteCorpus(Corpus):
    """Bytes as tokens (vocabulary 256); the standard library corpus when ``data`` is ``None``."""

    def __init__(self, data: bytes | None = None, val_fraction: float = VAL_FRACTION, seed: int = 0, rank=0):
        data = stdlib_corpus() if data is None else data
        super().__init__(np.frombuffer(data, dtype=np.uint8), BYTE_VOCAB, val_fraction, seed, rank)


def token_vocab(max_id: int) -> int:
    """Vocabulary for uint16 token files: GPT-2's padded 50304, or ``max_id + 1`` rounded up to 64."""
    return max(GPT2_VOCAB, -(-(max_id + 1) // 64) * 64)


def load_corpus(path: str | Path | None, seed: int = 0, rank: int = 0) -> Corpus:
    """The corpus ``--data`` names: ``None`` the stdlib corpus, ``*.bin`` uint16 token ids, else a text file.

    Raises:
        DataError: the file is missing, unreadable, empty, or (``.bin``) not a whole number of uint16 ids.
    """
    if path is None:
        return ByteCorpus(seed=seed, rank=rank)
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path}: the file is empty")
    if path.suffix == ".bin":
        if size % 2:
            raise DataError(f"{path}: {size} bytes is not a whole number of uint16 token ids")
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        return Corpus(tokens, token_vocab(int(tokens.max())), seed=seed, rank=rank)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    return ByteCorpus(data, seed=seed, rank=rank)
