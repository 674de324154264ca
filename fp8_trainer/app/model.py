"""A small nanoGPT-style GPT decoder (pre-LayerNorm, causal self-attention, GELU MLP).

Every ``nn.Linear`` in the blocks has dimensions that are multiples of 16, so ``convert_to_fp8`` swaps
them all; the ``lm_head`` is usually kept in high precision (see ``fp8_filter``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

__all__ = ["CHECKPOINT_MODES", "GPT", "GPTConfig", "PRESETS", "fp8_filter", "preset_config"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level
    block_size: int = 128  # max sequence length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    # activation checkpointing of each block in training: "none", "reentrant" or "non-reentrant"
    # (torch.utils.checkpoint's use_reentrant=True / False); the FP8 Linears recompute in FP8
    checkpoint: str = "none"

    def __post_init__(self) -> None:
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint: expected one of {CHECKPOINT_MODES}, got {self.checkpoint!r}")


CHECKPOINT_MODES = ("none", "reentrant", "non-reentrant")


#: Model shapes by name (GPT-2 / GPT-3 sizes; the parameter counts are those of a GPT-2 vocabulary). The
#: vocabulary of a preset is only a default: a run takes the one of its data (``preset_config``).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),  # CPU-trainable in minutes
    "124m": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "350m": GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "1.3b": GPTConfig(block_size=2048, n_layer=24, n_head=32, n_embd=2048),
}


def preset_config(name: str, vocab_size: int) -> GPTConfig:
    """The preset ``name`` with the vocabulary of the data it trains on."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return replace(PRESETS[name], vocab_size=vocab_size)


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """``module_filter_fn`` for ``convert_to_fp8``: everything but the output head."""
    return fqn != "lm_head"


class CausalSelfAttention(nn.Module):
    """Causal self-attention. The ``qkv`` projection's output features are *head-major*: head ``h``'s query,
    key and value (``head_size`` each) side by side, then head ``h + 1``'s. So a column-wise tensor-parallel
    split of ``qkv`` (contiguous rows of its weight) hands each rank whole heads, and the forward takes as
    many heads as its ``qkv`` output holds: all of them unsharded, ``n_head / tp`` under ``--tp``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_size = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    @torch.no_grad()
    def to_head_major(self) -> None:
        """Reorder ``qkv``'s output features from query | key | value blocks (each head-ordered) to
        head-major; ``GPT`` calls it once on its freshly drawn weights."""
        C, hs = self.qkv.in_features, self.head_size
        order = torch.arange(3 * C).view(3, C // hs, hs).transpose(0, 1).reshape(-1)  # new row -> old row
        self.qkv.weight.copy_(self.qkv.weight[order])
        if self.qkv.bias is not None:
            self.qkv.bias.copy_(self.qkv.bias[order])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, -1, 3, self.head_size)  # (B, T, heads, q|k|v, hs)
        q, k, v = qkv.permute(3, 0, 2, 1, 4)  # each (B, heads, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.fc2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm, ``lm_head`` (tied to ``wte``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scaled init of the residual projections
            if name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))
        # the draws of the attention's initial weights are those of the query | key | value layout, put in
        # head-major order: a seed gives the same function as with that layout
        for block in self.blocks:
            block.attn.to_head_major()

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """``idx`` (B, T) token ids -> logits (B, T, vocab); with ``targets``, ``(logits, loss)``."""
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            if self.cfg.checkpoint == "none" or not (self.training and torch.is_grad_enabled()):
                x = block(x)
            else:
                x = torch.utils.checkpoint.checkpoint(
                    block, x, use_reentrant=self.cfg.checkpoint == "reentrant"
                )
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
