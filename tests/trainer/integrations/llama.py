"""A tiny Llama (transformers, on the CPU) and its data for the Hugging Face and Lightning callback tests;
importing this module needs transformers (``pytest.importorskip("transformers")`` first)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

from fp8_trainer import step_stats

BATCH, SEQ = 4, 16  # sequences per micro-batch, tokens per sequence (vocabulary: 64)


class Tokens(torch.utils.data.Dataset):
    """`n` sequences of SEQ seeded random tokens, each its own label (causal LM)."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama() -> LlamaForCausalLM:
    """Two decoder layers (7 Linears each), hidden size 32, seeded weights: the same model every call."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(cfg)


class Seen(TrainerCallback):
    """After fp8scope's callback at each step: the runtime's statistics; and the loss the Trainer logs."""

    def __init__(self, model):
        self.model, self.stats, self.losses, self.grad_norms = model, {}, {}, {}

    def on_step_end(self, args, state, control, **kwargs):
        s = step_stats(self.model) if hasattr(self.model, "_fp8_state") else None
        self.stats[state.global_step] = None if s is None else s.clone().numpy()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]
        if logs and "grad_norm" in logs:
            self.grad_norms[state.global_step] = float(logs["grad_norm"])
