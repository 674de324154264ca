"""Activation checkpointing (torch.utils.checkpoint, both modes) keeps the FP8 Linears in FP8: the recompute
runs in FP8 with the scales of the original forward, statistics count once per tensor per step, and the step
closes once, at the end of the whole backward. A checkpointed GPT trains bit for bit like the same GPT
without checkpointing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import fp8_trainer
from fp8_trainer import CurrentScaling, DelayedScaling, fp8_autocast
from fp8_trainer.app.model import GPT, GPTConfig, fp8_filter
from fp8_trainer.recipe import Float8BlockScaling, MXFP8BlockScaling

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def train(checkpoint: str, recipe, steps: int = 4, micro: int = 1):
    torch.manual_seed(0)
    model = fp8_trainer.convert_to_fp8(GPT(replace(CFG, checkpoint=checkpoint)), recipe=recipe,
                                       module_filter_fn=fp8_filter)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = fp8_trainer.get_fp8_state(model)
    losses, stats = [], []
    for step in range(steps):
        for i in range(micro):
            g = torch.Generator().manual_seed(100 * step + i)
            idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size + 1), generator=g)
            with fp8_autocast(fp8_recipe=recipe, step_boundary=i == micro - 1):
                _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            losses.append(loss.item())
        assert not state.pending and state.steps == step + 1  # closed once, at the end of the backward
        stats.append(state.newest_stats().clone())  # with the block part, for block-scaled layers
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, stats, state.scale.clone(), state.amax_history.clone()


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize(
    "recipe",
    [DelayedScaling(amax_history_len=4), CurrentScaling(), MXFP8BlockScaling(), Float8BlockScaling()],
    ids=["delayed", "current", "mxfp8", "block"],
)
def test_checkpointed_gpt_trains_exactly_like_the_plain_one(mode, recipe):
    plain = train("none", recipe)
    ckpt = train(mode, recipe)
    assert ckpt[0] == plain[0]  # identical losses, step after step
    for s_ckpt, s_plain in zip(ckpt[1], plain[1], strict=True):
        assert torch.equal(s_ckpt, s_plain)  # every statistic, counted once (numel equal too)
    assert torch.equal(ckpt[2], plain[2]) and torch.equal(ckpt[3], plain[3])


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_checkpointing_under_gradient_accumulation(mode):
    recipe = DelayedScaling(amax_history_len=4)
    plain = train("none", recipe, steps=2, micro=3)
    ckpt = train(mode, recipe, steps=2, micro=3)
    assert ckpt[0] == plain[0]
    for s_ckpt, s_plain in zip(ckpt[1], plain[1], strict=True):
        assert torch.equal(s_ckpt, s_plain)


def test_checkpointed_forward_is_fp8_not_high_precision():
    # before: the reentrant recompute ran outside the region in high precision, bit-identical to no FP8
    recipe = DelayedScaling(amax_history_len=4)
    fp8 = train("reentrant", recipe, steps=2)
    torch.manual_seed(0)
    model = GPT(CFG)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size + 1), generator=g)
    _, loss = model(idx[:, :-1], idx[:, 1:])
    assert fp8[0][0] != loss.item()
    assert all(s[:, 5].sum() > 0 for s in fp8[1])  # statistics were recorded in every step
