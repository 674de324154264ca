"""convert_to_fp8 never silently replaces another runtime's layer and never silently skips one: it names
what it converted, what it left and why (torchao's Float8Linear, shapes); transformers' Conv1D (GPT-2) is
converted to an FP8 Conv1D sharing its parameters."""

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


def test_transformers_conv1d_becomes_an_fp8_conv1d_sharing_its_parameters(caplog):
    transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    weights = {name: p for name, p in model.named_parameters()}
    with caplog.at_level(logging.INFO, logger="fp8_trainer.convert"):
        fp8_trainer.convert_to_fp8(model)
    conv1d = ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
              "transformer.h.0.mlp.c_proj"]  # fmt: skip
    assert all(isinstance(model.get_submodule(n), fp8_trainer.Conv1D) for n in conv1d)
    assert fp8_trainer.ineligible_layers(model) == {}
    # the same parameters, stored (in, out) as GPT-2 stores them: checkpoints and optimizers see no change
    assert all(p is weights[name] for name, p in model.named_parameters())
    assert model.get_submodule(conv1d[0]).weight.shape == (32, 96)
    assert any("5 FP8 layer(s)" in r.getMessage() for r in caplog.records)
    assert isinstance(model.lm_head, fp8_trainer.Linear)


def test_a_conv1d_whose_features_are_not_multiples_of_16_is_left_out_with_its_reason():
    transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency")
    model = nn.Sequential(transformers.pytorch_utils.Conv1D(40, 32), nn.Linear(40, 16), nn.Linear(16, 16))
    fp8_trainer.convert_to_fp8(model)
    assert fp8_trainer.ineligible_layers(model) == {  # Conv1D(nf=40, nx=32): weight (32, 40)
        "0": "in_features=32, out_features=40: not multiples of 16",
        "1": "in_features=40, out_features=16: not multiples of 16",
    }
    assert isinstance(model[2], fp8_trainer.Linear)
