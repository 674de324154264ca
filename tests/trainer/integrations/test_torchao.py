"""A torchao FP8 model (``convert_to_float8_training``, tensorwise dynamic scaling, emulated on the CPU) is
monitored with the statistics of the scales torchao really used: every cast torchao makes is recorded here
through its own cast function, and what a real `fp8-monitor serve` stores must equal it, per tensor and step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("torchao.float8")

import torchao.float8.float8_linear as ao_linear
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from fp8_trainer import Monitor, step_stats, tensor_table
from fp8_trainer.app.model import GPT, GPTConfig
from fp8_trainer.integrations.torchao import torchao_scale, watch_torchao
from fp8_trainer.monitor.control import apply_commands
from tests.trainer.monitor_utils import FAST, get, stored_stats

ROLE = {"INPUT": "input", "WEIGHT": "weight", "GRAD_OUTPUT": "grad_output"}


def _torchao_gpt(round_pow2: bool = False):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=1, n_head=4, n_embd=64))
    config = Float8LinearConfig(emulate=True, round_scales_to_power_of_2=round_pow2)
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "lm_head")


class Casts:
    """Every cast torchao's Float8Linear layers make: (layer, role) -> (amax, the scale it used, numel)."""

    def __init__(self):
        self.seen: dict[tuple[str, str], tuple[float, float, int]] = {}
        self.layer_of: dict[int, str] = {}  # id of a layer's linear_mm_config (passed to every cast) -> name

    def watch(self, model) -> None:
        for name, m in model.named_modules():
            if type(m).__name__ == "Float8Linear":
                self.layer_of[id(m.linear_mm_config)] = name

    def take(self) -> dict:
        seen, self.seen = self.seen, {}
        return seen


@pytest.fixture
def casts(monkeypatch):
    c = Casts()
    real = ao_linear.hp_tensor_to_float8_dynamic

    def spy(hp, dtype, linear_mm_config, *args, gemm_input_role=None, **kwargs):
        out = real(hp, dtype, linear_mm_config, *args, gemm_input_role=gemm_input_role, **kwargs)
        key = (c.layer_of[id(linear_mm_config)], ROLE[gemm_input_role.name])
        got = (torch.max(torch.abs(hp)).item(), out._scale.item(), hp.numel())
        assert c.seen.setdefault(key, got) == got  # a tensor cast twice (both backward GEMMs): same scale
        return out

    monkeypatch.setattr(ao_linear, "hp_tensor_to_float8_dynamic", spy)
    return c


def _train_step(model, opt, gen) -> float:
    x = torch.randint(0, 256, (4, 16), generator=gen)
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def test_stored_statistics_are_torchaos_scales(server, tmp_path, casts):
    model = _torchao_gpt()
    casts.watch(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    per_step = []
    with Monitor(server.url, "torchao", model, spool_path=tmp_path / "s.jsonl", **FAST) as mon:
        for step in range(1, 7):
            loss = _train_step(model, opt, gen)
            per_step.append(casts.take())
            mon.step(step, loss=loss)
    table = tensor_table(model)
    assert [t.layer for t in table[::3]] == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc",
                                             "blocks.0.mlp.fc2"]  # fmt: skip
    assert [t.format for t in table[:3]] == ["e4m3", "e4m3", "e5m2"]
    got = stored_stats(server.url, mon.run_id)
    for s, seen in enumerate(per_step):
        assert len(seen) == len(table)  # torchao cast every tensor this step
        for t in table:
            amax, scale, numel = seen[(t.layer, t.role)]
            assert got["amax"][t.index, s] == np.float32(amax), (t.name, s)
            assert got["scale"][t.index, s] == scale, (t.name, s)  # the very scale torchao used
            assert got["overflow"][t.index, s] == 0 and got["nonfinite"][t.index, s] == 0
    config = get(server.url, f"/runs/{mon.run_id}")["config"]
    config.pop("fp8_run")  # how the job was started (tests/trainer/monitor/test_run_info.py)
    assert config == {
        "fp8_source": "torchao",  # and the recipe the statistics follow: torchao's tensorwise current scaling
        "fp8_recipe": {
            "type": "current",
            "scaling": "current",
            "fp8_format": "HYBRID",
            "power_2_scale": False,
        },
    }
    assert get(server.url, f"/runs/{mon.run_id}/tensors")[2]["format"] == "e5m2"


def test_scale_rules_follow_torchao():
    """Zero, tiny, NaN amaxes and power-of-two rounding give torchao's own answers."""
    from torchao.float8.float8_utils import amax_to_scale

    for amax in (0.0, 1e-30, 3.7, 1e20, float("nan"), float("inf")):
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            for pow2 in (False, True):
                a = torch.tensor(amax)
                want = amax_to_scale(a, dtype, round_scales_to_power_of_2=pow2)
                torch.testing.assert_close(
                    torchao_scale(a, dtype, pow2), want, rtol=0, atol=0, equal_nan=True
                )


def test_recipe_commands_on_torchao(casts):
    model = _torchao_gpt(round_pow2=True)
    watch_torchao(model)
    casts.watch(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    _train_step(model, opt, gen)
    commands = [
        {"id": 1, "target": "blocks.0.mlp.fc", "changes": {"margin": 1}},
        {"id": 2, "target": "model", "changes": {"amax_history_len": 8}},
        {"id": 3, "target": "blocks.0.mlp.fc", "changes": {"fp8_enabled": False}},
    ]
    acks = apply_commands(model, commands, step=1)
    assert [a["state"] for a in acks] == ["rejected", "rejected", "applied"]
    assert "torchao" in acks[0]["reason"] and "margin" in acks[0]["reason"]
    assert acks[1]["reason"].startswith("amax_history_len:")
    casts.take()
    _train_step(model, opt, gen)
    assert {layer for layer, _ in casts.take()} == {
        "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc2"}  # fmt: skip
    k = [t.layer for t in tensor_table(model)[::3]].index("blocks.0.mlp.fc")
    stats = step_stats(model)
    assert stats[3 * k : 3 * k + 3, 0].tolist() == [0, 0, 0]  # FP8 off: nothing quantized there
    scales = stats[:, 1][stats[:, 0] > 0]
    assert torch.equal(torch.exp2(torch.log2(scales).floor()), scales)  # round_scales_to_power_of_2
    fc = model.get_submodule("blocks.0.mlp.fc")
    x = torch.randn(3, 64)
    assert torch.equal(fc(x), torch.nn.functional.linear(x, fc.weight, fc.bias))
    assert apply_commands(model, [{"id": 4, "target": "blocks.0.mlp.fc", "changes": {"fp8_enabled": True}}],
                          step=2)[0]["state"] == "applied"  # fmt: skip
    assert not torch.equal(fc(x), torch.nn.functional.linear(x, fc.weight, fc.bias))  # FP8 again


def test_a_nan_input_shows_torchaos_nan_scale_and_the_whole_tensor_lost(server, tmp_path):
    """One NaN element makes torchao's amax and scale NaN, and so every element of its FP8 tensor: the row
    says so (scale NaN, nonfinite = numel, SQNR -inf), where fp8scope's own rule would show amax 0 and one
    non-finite element as if the rest had survived."""
    from fp8_protocol.stats import sqnr_db

    model = _torchao_gpt()
    qkv = model.blocks[0].attn.qkv
    seen = {}

    def poison(module, args):
        x = args[0].clone()
        x[0, 0, 0] = float("nan")
        seen["numel"] = x.numel()
        return (x,)

    def output(module, args, out):
        seen["all_nan"] = bool(torch.isnan(out).all())

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    with Monitor(server.url, "torchao-nan", model, spool_path=tmp_path / "s.jsonl", **FAST) as mon:
        mon.step(1, loss=_train_step(model, opt, gen))
        hooks = [qkv.register_forward_pre_hook(poison), qkv.register_forward_hook(output)]
        mon.step(2, loss=_train_step(model, opt, gen))
        for h in hooks:
            h.remove()
    assert seen["all_nan"]  # torchao's NaN scale: every output element NaN, not just one
    stats = step_stats(model)[0].tolist()  # blocks.0.attn.qkv.input at step 2
    assert stats[0] == 0 and np.isnan(stats[1]) and stats[4] == seen["numel"] and stats[2] == stats[3] == 0
    assert sqnr_db(stats[6], stats[7]) == -np.inf
    got = stored_stats(server.url, mon.run_id)
    assert np.isnan(got["scale"][0, 1]) and got["nonfinite"][0, 1] == seen["numel"]
    alerts = get(server.url, f"/runs/{mon.run_id}/alerts")
    assert any("blocks.0.attn.qkv.input" in str(a) for a in alerts), alerts
