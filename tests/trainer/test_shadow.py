"""Shadow mode: FP8 what-if statistics on a model that trains in its own precision.

The model's numerics must not change (losses and weights bit for bit those of the same run without shadow),
and what a real `fp8-monitor serve` stores must be what delayed scaling would have computed, worked out here
from first principles on copies of the tensors (numpy float32, TE's DelayedScaling rules)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fp8_trainer import DelayedScaling, Monitor, set_layer_recipe, step_stats, tensor_table
from fp8_trainer.app.model import GPT, GPTConfig
from fp8_trainer.shadow import shadow
from tests.trainer.monitor_utils import FAST, get, stored_stats

CFG = GPTConfig(block_size=32, n_layer=1, n_head=4, n_embd=64)
# E4M3 forward, E5M2 grad_output (HYBRID): max, overflow rule, and the largest magnitude that rounds to zero
FMT = {
    "input": (448.0, lambda a: a > 464.0, 2.0**-10),
    "weight": (448.0, lambda a: a > 464.0, 2.0**-10),
    "grad_output": (57344.0, lambda a: a >= 61440.0, 2.0**-17),
}


def _train(model, steps: int, monitor=None, on_step=None) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(1, steps + 1):
        x = torch.randint(0, 256, (4, 16), generator=gen)
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step)
        if monitor is not None:
            monitor.step(step, loss=loss.detach())
    return losses


def _capture(model) -> dict:
    """Copies of every linear layer's input, weight and grad_output, per step (hooks that return nothing)."""
    seen: dict[str, dict[str, np.ndarray]] = {}

    def fwd(name, m, args, out):
        seen[f"{name}.input"] = args[0].detach().reshape(-1, args[0].shape[-1]).numpy().copy()
        seen[f"{name}.weight"] = m.weight.detach().numpy().copy()

        def grad(g):
            seen[f"{name}.grad_output"] = g.detach().reshape(-1, g.shape[-1]).numpy().copy()

        out.register_hook(grad)

    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda m, a, o, name=name: fwd(name, m, a, o))
    return seen


def _reference(per_step: list[dict], names: list[str], roles: list[str], history_len: int) -> np.ndarray:
    """(steps, T, 5): amax, scale, overflow, underflow, nonfinite under delayed scaling, first principles."""
    out = np.zeros((len(per_step), len(names), 5))
    for j, (name, role) in enumerate(zip(names, roles, strict=True)):
        fmax, saturates, zero_below = FMT[role]
        history: list[np.float32] = []
        scale = np.float32(1.0)  # the initial scale
        for s, tensors in enumerate(per_step):
            x = tensors[name].astype(np.float32)
            amax = np.float32(np.abs(x).max())
            a = np.abs(x) * scale  # float32, as the cast computes it
            underflow = np.count_nonzero((x != 0) & (a <= zero_below))
            out[s, j] = [
                amax,
                scale,
                np.count_nonzero(saturates(a)),
                underflow,
                np.count_nonzero(~np.isfinite(x)),
            ]
            if amax != 0:  # a zero amax keeps history and scale
                history = ([amax] + history)[:history_len]
                scale = np.float32(fmax) / max(history)
    return out


def test_shadow_keeps_numerics_and_stores_what_delayed_scaling_would_compute(server, tmp_path):
    torch.manual_seed(0)
    plain = GPT(CFG)
    torch.manual_seed(0)
    model = GPT(CFG)
    seen = _capture(model)
    per_step = []
    recipe = DelayedScaling(amax_history_len=4)
    with Monitor(server.url, "what-if", model, shadow=recipe, spool_path=tmp_path / "s.jsonl", **FAST) as mon:
        losses = _train(model, 8, mon, on_step=lambda s: per_step.append(dict(seen)))
    assert losses == _train(plain, 8)  # bit for bit: shadow changed nothing the model computes
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)

    table = tensor_table(model)
    assert [t.layer for t in table[::3]] == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc",
                                             "blocks.0.mlp.fc2", "lm_head"]  # fmt: skip
    want = _reference(per_step, [t.name for t in table], [t.role for t in table], history_len=4)
    got = stored_stats(server.url, mon.run_id)
    np.testing.assert_array_equal(got["steps"], np.arange(1, 9))
    for c, metric in enumerate(("amax", "scale", "overflow", "underflow", "nonfinite")):
        np.testing.assert_array_equal(got[metric], want[:, :, c].T, err_msg=metric)
    assert want[1:, :, 1].min() > 1  # the scales really moved off their initial value
    assert want[:, :, 3].sum() > 0  # and some gradients would underflow in E5M2: the what-if has content
    run = get(server.url, f"/runs/{mon.run_id}")
    assert run["config"].pop("fp8_recipe")["amax_history_len"] == 4  # the what-if recipe, spelled out
    run["config"].pop("fp8_run")  # how the job was started (test_run_info.py)
    assert run["config"] == {"fp8_source": "shadow"}
    assert run["num_tensors"] == 15 and run["effective_recipe"]["model"]["amax_history_len"] == 4


def test_what_if_recipe_changes_per_layer():
    """A margin set on one layer halves that layer's next scales (the what-if recipe, not the model)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    shadow(model, DelayedScaling(amax_history_len=1))
    _train(model, 2)
    set_layer_recipe(model, "blocks.0.mlp.fc", margin=1)
    _train(model, 1)
    stats = step_stats(model)
    k = [t.layer for t in tensor_table(model)[::3]].index("blocks.0.mlp.fc")
    state = model._fp8_state
    hist, scale = state.amax_history[0], state.scale  # newest amax (history of one) and the next scales
    for i in range(3 * k, 3 * k + 3):
        fmax = 57344.0 if i % 3 == 2 else 448.0
        assert scale[i].item() == np.float32(fmax / 2) / np.float32(hist[i].item())
    assert stats[3 * k, 1].item() > 0


def test_shadow_refuses_fp8_models_and_evaluation_records_nothing():
    from fp8_trainer import convert_to_fp8

    fp8 = convert_to_fp8(GPT(CFG))
    with pytest.raises(ValueError, match="already an FP8 layer|already has an FP8"):
        shadow(fp8)
    model = GPT(CFG)
    shadow(model)
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 8)))
    assert step_stats(model) is None


def _edge_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 53, generator=g)
    out = [x, x * 1e-6, x * 1e4, torch.zeros(5, 7), torch.empty(0, 16)]
    y = x.clone()
    y[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    y[1, :4] = 0.0
    y[2, :2] = torch.tensor([1e-45, -3e38])  # a subnormal and a product that overflows float32
    out += [y, torch.full((3, 3), float("nan")), x.to(torch.bfloat16), (x * 1e-5).to(torch.bfloat16)]
    return out


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_cpu_rows_equal_the_reference_kernel(fp8_dtype):
    """Shadow mode's CPU row (no FP8 tensor made, counting passes skipped where max/min rule them out) is
    bit for bit what the runtime's quantize-with-statistics reference records, delayed and current."""
    from fp8_kernels import quantize_current_reference, quantize_with_stats_reference
    from fp8_trainer.shadow import cpu_stats_row

    for j, x in enumerate(_edge_tensors()):
        for scale in (1.0, 3.5e-3, 448.0 / 0.7, 2.0**100, 1.3e-36, 3.4028235e38):
            s = torch.tensor(scale, dtype=torch.float32)
            _, want = quantize_with_stats_reference(x, s, fp8_dtype)
            got = cpu_stats_row(x, np.float32(scale), fp8_dtype)
            np.testing.assert_array_equal(got, want.numpy(), err_msg=f"tensor {j}, scale {scale}")
        for pow2 in (False, True):
            _, _, want = quantize_current_reference(x, fp8_dtype, power_2_scale=pow2)
            got = cpu_stats_row(x, None, fp8_dtype, power_2_scale=pow2)
            np.testing.assert_array_equal(got, want.numpy(), err_msg=f"tensor {j}, current, pow2={pow2}")


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_activation_checkpointing_counts_each_tensor_once(mode):
    """A checkpointed block recomputes its forward inside backward: the shadow statistics and the step
    count are those of the same model without checkpointing, and the losses those of the plain model."""
    from dataclasses import replace

    from fp8_trainer import get_fp8_state

    runs = {}
    for ckpt in ("none", mode):
        torch.manual_seed(0)
        model = GPT(replace(CFG, checkpoint=ckpt))
        shadow(model, DelayedScaling(amax_history_len=4))
        stats = []
        losses = _train(model, 3, on_step=lambda s, m=model, out=stats: out.append(step_stats(m).clone()))
        runs[ckpt] = (losses, stats, get_fp8_state(model).steps)
    assert runs[mode][0] == runs["none"][0] and runs[mode][2] == runs["none"][2] == 3
    for a, b in zip(runs[mode][1], runs["none"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
