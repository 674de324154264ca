"""Shadow mode's what-if numbers are the numbers the FP8 runtime records for the same tensors.

A shadowed model and the same model converted to FP8 see the same first-layer inputs and the same weights
in their first step (everything downstream of an FP8 cast differs: that is the point of FP8). For those
tensors the what-if statistics must equal the real ones: under block recipes (per block, not a per-tensor
delayed scale relabelled), once per optimizer step for weights under gradient accumulation, and once per
micro-batch under reentrant activation checkpointing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fp8_protocol.stats import BLOCK_COLUMNS, NUMEL, OVERFLOW
from fp8_trainer import (
    DelayedScaling,
    Float8BlockScaling,
    MXFP8BlockScaling,
    convert_to_fp8,
    end_step,
    fp8_autocast,
    get_fp8_state,
    set_layer_recipe,
    step_stats,
)
from fp8_trainer.block_linear import split_block_stats
from fp8_trainer.shadow import shadow
from tests.kernels.exact_checks import same_row

BLOCKS = BLOCK_COLUMNS.index("blocks")


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


def _step(model, x, fp8: bool, recipe=None) -> None:
    if fp8:
        with fp8_autocast(fp8_recipe=recipe):
            model(x).square().mean().backward()
    else:
        model(x).square().mean().backward()


def _spiky_inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    calm = torch.randn(64, 64, generator=g)
    spike = torch.randn(64, 64, generator=g)
    spike[5] *= 11.0  # one token's activations jump x11: a stale per-tensor scale would saturate them
    return [calm, spike]


@pytest.mark.parametrize(
    "recipe", [MXFP8BlockScaling(), Float8BlockScaling()], ids=["mxfp8", "block-2d-weights"]
)
def test_shadow_under_a_block_recipe_records_what_a_block_scaled_run_records(recipe):
    watched, fp8 = _net(), convert_to_fp8(_net(), recipe=recipe)
    shadow(watched, recipe)
    for x in _spiky_inputs():
        _step(watched, x.clone().requires_grad_(), fp8=False)
        _step(fp8, x.clone().requires_grad_(), fp8=True, recipe=recipe)
        # with the block part: the statistics columns then the block columns and histogram
        got, want = get_fp8_state(watched).newest_stats(), get_fp8_state(fp8).newest_stats()
        # the first layer's input and both weights: the same values reach both models
        for i in (0, 1, 4):
            torch.testing.assert_close(got[i], want[i], rtol=0, atol=0)
        stats, block = split_block_stats(got)
        assert block is not None and block[0, BLOCKS] > 0  # block statistics, not zeros
        # per-block scales cover the spike: nothing saturates, where a stale delayed scale would
        assert stats[0, OVERFLOW] == 0


def test_shadow_refuses_mxfp8_for_layers_whose_features_are_not_multiples_of_32():
    model = nn.Sequential(nn.Linear(48, 64))
    with pytest.raises(ValueError, match="MXFP8 needs in_features and out_features divisible by 32"):
        shadow(model, MXFP8BlockScaling())
    state = shadow(model, DelayedScaling())
    with pytest.raises(ValueError, match="divisible by 32"):
        set_layer_recipe(model, None, scaling="mxfp8")  # a recipe command on a shadowed model
    assert state.block_specs == [None]


def test_a_recipe_command_switching_a_shadowed_layer_to_mxfp8_records_block_statistics():
    watched, fp8 = _net(), convert_to_fp8(_net(), recipe=DelayedScaling())
    shadow(watched, DelayedScaling())
    for model in (watched, fp8):
        set_layer_recipe(model, "0", scaling="mxfp8")
    x = _spiky_inputs()[1]
    _step(watched, x.clone().requires_grad_(), fp8=False)
    _step(fp8, x.clone().requires_grad_(), fp8=True)
    got, want = get_fp8_state(watched).newest_stats(), get_fp8_state(fp8).newest_stats()
    assert split_block_stats(got)[1][0, BLOCKS] > 0
    torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=0)


def test_a_conv1d_weight_is_block_scaled_as_the_linear_it_stands_for():
    transformers = pytest.importorskip("transformers")
    conv = transformers.pytorch_utils.Conv1D(128, 64)  # (in=64, out=128), weight stored (64, 128)
    linear = nn.Linear(64, 128)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    recipe = Float8BlockScaling()  # 128 x 128 weight blocks: the orientation matters
    shadow(conv, recipe)
    shadow(linear, recipe)
    x = torch.randn(32, 64) * torch.logspace(-3, 3, 64)  # columns of very different magnitudes
    for m in (conv, linear):
        m(x.clone().requires_grad_()).sum().backward()
    got, want = get_fp8_state(conv).newest_stats(), get_fp8_state(linear).newest_stats()
    assert split_block_stats(got)[1][1, BLOCKS] == 1  # one 128 x 128 block of weight
    torch.testing.assert_close(got, want, rtol=0, atol=0)


ACCUM = 4


def test_weights_count_once_per_optimizer_step_as_in_an_fp8_run():
    watched, fp8 = _net(), convert_to_fp8(_net())
    state = shadow(watched)
    state.step_boundary = False  # micro-batches of one step, as the trainer integrations run it
    g = torch.Generator().manual_seed(0)
    for i in range(ACCUM):
        x = torch.randn(16, 64, generator=g)
        _step(watched, x.clone().requires_grad_(), fp8=False)
        with fp8_autocast(step_boundary=i == ACCUM - 1):
            fp8(x.clone().requires_grad_()).square().mean().backward()
    end_step(watched)
    got, want = step_stats(watched), step_stats(fp8)
    for i, w in ((1, watched[0].weight), (4, watched[2].weight)):
        assert got[i, NUMEL] == w.numel() == want[i, NUMEL]
        # the sums of squares: the CPU what-if rows and the fused kernel add the same terms in another order
        same_row(got[i], want[i], f"weight {i}")
    assert got[0, NUMEL] == ACCUM * 16 * 64  # the inputs: every micro-batch


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.net = _net()
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(self.net, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointing_with_accumulation_records_every_micro_batch_once(reentrant):
    plain, ckpt = _net(), _Checkpointed(reentrant)
    for model in (plain, ckpt):
        shadow(model).step_boundary = False
    g = torch.Generator().manual_seed(0)
    for _ in range(ACCUM):
        x = torch.randn(16, 64, generator=g)
        for model in (plain, ckpt):
            model(x.clone().requires_grad_()).square().mean().backward()
    for model in (plain, ckpt):
        end_step(model)
        assert get_fp8_state(model).steps == 1
    got = step_stats(ckpt)
    assert got[0, NUMEL] == ACCUM * 16 * 64 and got[2, NUMEL] == ACCUM * 16 * 128  # input, grad_output
    torch.testing.assert_close(got, step_stats(plain), rtol=0, atol=0)


def test_a_shadowed_mxfp8_run_on_the_dashboard_shows_block_metrics_and_no_false_saturation(server, tmp_path):
    from fp8_trainer import Monitor
    from tests.trainer.monitor_utils import FAST, decode, get

    model = _net()
    xs = _spiky_inputs()
    with Monitor(server.url, "shadow-mxfp8-spike", model, shadow=MXFP8BlockScaling(),
                 spool_path=tmp_path / "s.jsonl", **FAST) as monitor:  # fmt: skip
        for step, x in enumerate(xs, 1):
            loss = model(x.clone().requires_grad_()).square().mean()
            loss.backward()
            monitor.step(step, loss=loss.detach())
    run = get(server.url, f"/runs/{monitor.run_id}")  # the whole config: a list has only the keys asked for
    assert run["config"]["fp8_source"] == "shadow"

    def heatmap(metric):
        h = get(server.url, f"/runs/{run['id']}/heatmap", metric=metric, max_cols=1000)
        return {t["name"]: decode(row) for t, row in zip(h["tensors"], h["values"], strict=True)}

    overflow, drange = heatmap("overflow"), heatmap("block_range")
    assert list(overflow["0.input"]) == [0, 0]  # the spike at step 2 is covered by its blocks' own scales
    assert all(v > 0 for v in drange["0.input"])  # block statistics reached the dashboard
