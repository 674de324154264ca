"""convert_to_fp8 never silently replaces another runtime's layer and never silently skips one: it names
what it converted, what it left and why (torchao's Float8Linear, transformers' Conv1D, shapes)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import fp8_trainer


def test_torchao_float8_linear_is_left_to_torchao(caplog):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 16))
    convert_to_float8_training(
        model, config=Float8LinearConfig(emulate=True), module_filter_fn=lambda m, fqn: fqn != "3"
    )
    assert isinstance(model[0], Float8Linear) and type(model[3]) is nn.Linear
    with caplog.at_level(logging.INFO, logger="fp8_trainer.convert"):
        fp8_trainer.convert_to_fp8(model)
    assert isinstance(model[0], Float8Linear) and isinstance(model[2], Float8Linear)  # not replaced
    assert isinstance(model[3], fp8_trainer.Linear)  # the plain one is converted
    left = fp8_trainer.ineligible_layers(model)
    assert set(left) == {"0", "2"}
    assert "torchao" in left["0"] and "another runtime" in left["0"]
    said = [r.getMessage() for r in caplog.records]
    assert any("2 layer(s) left out of FP8" in m and "torchao" in m for m in said), said
    assert any("1 FP8 layer(s): 3" in m for m in said), said
    # torchao's layers still train as torchao's
    x = torch.randn(8, 32, requires_grad=True)
    with fp8_trainer.fp8_autocast():
        model(x).sum().backward()
    assert model[0].weight.grad is not None
    assert [t.name for t in fp8_trainer.tensor_table(model)] == ["3.input", "3.weight", "3.grad_output"]


def test_transformers_conv1d_is_named_not_skipped_silently(caplog):
    transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    with caplog.at_level(logging.WARNING, logger="fp8_trainer.convert"):
        fp8_trainer.convert_to_fp8(model)
    left = fp8_trainer.ineligible_layers(model)
    conv1d = {"transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
              "transformer.h.0.mlp.c_proj"}  # fmt: skip
    assert set(left) == conv1d
    assert all("Conv1D" in reason and "(in, out)" in reason for reason in left.values())
    assert any("4 layer(s) left out of FP8" in r.getMessage() for r in caplog.records)
    assert isinstance(model.lm_head, fp8_trainer.Linear)  # the one nn.Linear is converted, and said so
