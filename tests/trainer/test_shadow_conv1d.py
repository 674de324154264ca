"""Shadow mode on Hugging Face GPT-2, whose linear layers are transformers ``Conv1D`` (weight stored as
(in, out)): every one is watched, the numerics do not change, and the statistics are those of the layer's
own input, weight and output gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel

from fp8_trainer import DelayedScaling, shadow, step_stats, tensor_table


def gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg)


def test_gpt2_conv1d_layers_are_shadowed():
    plain, model = gpt2(), gpt2()
    shadow(model, DelayedScaling(amax_history_len=2))
    layers = [t.layer for t in tensor_table(model)[::3]]
    block = "transformer.h.0"
    names = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert layers == [f"{block}.{n}" for n in names] + ["lm_head"]
    fc = model.get_submodule(f"{block}.mlp.c_fc")
    seen = {}
    fc.register_forward_hook(
        lambda m, a, o: seen.update(x=a[0].detach().clone(), w=m.weight.detach().clone())
    )
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (model, plain):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.item())
    assert losses[0] == losses[1]
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    k = layers.index(f"{block}.mlp.c_fc")
    stats = step_stats(model)
    assert stats[3 * k, 0].item() == seen["x"].abs().max().item()  # the layer's input
    assert stats[3 * k + 1, 0].item() == seen["w"].abs().max().item()  # its (in, out) weight
    assert stats[3 * k + 1, 5].item() == fc.weight.numel() and stats[3 * k + 2, 5].item() == 2 * 16 * 128
    assert np.all(stats[:, 0].numpy() > 0)  # every tensor of every Conv1D and Linear was seen
