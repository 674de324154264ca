"""A small GPT trained in FP8 on the CPU tracks its float32 loss curve."""

import pytest
import torch

import fp8_trainer
from fp8_trainer import CurrentScaling, DelayedScaling, fp8_autocast
from fp8_trainer.app.data import ByteCorpus, stdlib_corpus
from fp8_trainer.app.model import GPT, GPTConfig, fp8_filter

STEPS = 250
CFG = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)  # every Linear dim a multiple of 16


@pytest.fixture(scope="module")
def corpus_bytes():
    return stdlib_corpus(max_bytes=2**20)


def train(recipe, data: bytes) -> list[float]:
    torch.manual_seed(0)
    model = GPT(CFG)
    if recipe is not None:
        fp8_trainer.convert_to_fp8(model, recipe=recipe, module_filter_fn=fp8_filter)
    corpus = ByteCorpus(data, seed=0)  # identical batches for every run
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(STEPS):
        x, y = corpus.batch("train", 8, CFG.block_size)
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if recipe is not None:
        assert fp8_trainer.get_fp8_state(model).steps == STEPS
        assert fp8_trainer.step_stats(model)[:, 4].sum().item() == 0  # no non-finite values
    return losses


@pytest.mark.slow
def test_fp8_tracks_float32_loss(corpus_bytes, one_thread):
    def final(losses):  # mean of the last 30 steps: the per-batch noise is larger than the FP8 effect
        return sum(losses[-30:]) / 30

    ref = train(None, corpus_bytes)
    assert final(ref) < 0.6 * ref[0]  # it did learn (from ln 256 = 5.5 to well under 3.3)
    for recipe in (DelayedScaling(amax_history_len=16), CurrentScaling()):
        got = train(recipe, corpus_bytes)
        assert abs(final(got) - final(ref)) <= 0.03 * final(ref), (
            type(recipe).__name__,
            final(got),
            final(ref),
        )
        assert got != ref  # FP8 did change the numerics
