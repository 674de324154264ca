"""Training with block-scaled recipes: ``fp8-train --recipe mxfp8 / block`` on the tiny preset, one layer
switched delayed -> mxfp8 -> delayed at run time, and checkpoints of block-scaled layers."""

from __future__ import annotations

import io
import math

import pytest
import torch

import fp8_trainer
from fp8_kernels.reference.block_quantize import block_scaled_mm, mxfp8_quantize
from fp8_protocol.stats import BLOCK_COLUMNS, SCALE
from fp8_trainer.app import cli
from fp8_trainer.app.train import train
from fp8_trainer.recipe import Float8BlockScaling, MXFP8BlockScaling
from tests.trainer.monitor_utils import tiny_model

BLOCKS = BLOCK_COLUMNS.index("blocks")


@pytest.mark.parametrize("recipe", ["mxfp8", "block"])
def test_fp8_train_tiny_preset_block_recipe(recipe):
    flags = ["--recipe", recipe, "--preset", "tiny", "--steps", "16", "--batch-size", "4", "--seq-len", "64"]
    flags += ["--lr", "3e-3", "--warmup-steps", "2", "--eval-interval", "0", "--no-progress"]
    args, prepared = cli.prepare(flags)
    result = train(args, prepared, out=lambda line: None)
    losses = result.losses
    assert len(losses) == 16 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses  # learning: bytes from ~5.5 nats down
    state = fp8_trainer.get_fp8_state(result.model)
    assert len(state.layer_names) == 16 and all(spec is not None for spec in state.block_specs)
    want = "e8m0" if recipe == "mxfp8" else "fp32"
    assert all(specs[0].scale_format == want for specs in state.block_specs)
    assert bool((state.last_block_stats[:, BLOCKS] > 0).all())  # every tensor block-scaled in the last step
    # E4M3 everywhere, as Transformer Engine's block recipes: the gradients too (their block GEMMs on a GPU
    # take E4M3 operands only)
    assert set(state.dtypes) == {torch.float8_e4m3fn}
    assert {t.format for t in fp8_trainer.tensor_table(result.model)} == {"e4m3"}


@pytest.mark.parametrize(("recipe", "flag", "want"), [("mxfp8", "hybrid", torch.float8_e5m2),
                                                     ("delayed", None, torch.float8_e5m2),
                                                     ("current", "e4m3", torch.float8_e4m3fn)])  # fmt: skip
def test_fp8_train_format_defaults_follow_the_recipe_and_the_flag_wins(recipe, flag, want):
    from fp8_trainer.app.build import make_recipe

    args, _ = cli.prepare(["--recipe", recipe] + (["--fp8-format", flag] if flag else []))
    assert make_recipe(args).fp8_format.for_role("grad_output").dtype == want


def test_fp8_train_refuses_mxfp8_token_counts_not_divisible_by_32(capsys):
    with pytest.raises(SystemExit):
        cli.prepare(["--recipe", "mxfp8", "--batch-size", "1", "--seq-len", "40"])
    assert "--recipe mxfp8: --batch-size x --seq-len = 40 tokens per micro-batch" in capsys.readouterr().err


def _step(model, recipe, gen):
    x = torch.randint(0, 256, (4, 16), generator=gen)
    with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
        _, loss = model(x, x)
    loss.backward()
    return loss.item()


def test_layer_switched_delayed_mxfp8_delayed_at_run_time():
    model, recipe = tiny_model()
    layer = "blocks.0.mlp.fc"
    k = fp8_trainer.get_fp8_state(model).layer_index(layer)
    fc = dict(model.named_modules())[layer]
    seen = []
    fc.register_forward_hook(lambda m, args, out: seen.append((args[0].detach(), out.detach())))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    state = fp8_trainer.get_fp8_state(model)
    phases = {1: None, 3: "mxfp8", 5: "delayed"}
    for step in range(1, 7):
        if phases.get(step):  # at a step boundary, as a dashboard command is applied
            previous = fp8_trainer.set_layer_recipe(model, layer, scaling=phases[step])
            assert previous == {"scaling": "delayed" if step == 3 else "mxfp8"}
        loss = _step(model, recipe, gen)
        assert math.isfinite(loss)
        x, out = seen[-1]
        x2 = x.reshape(-1, x.shape[-1])
        ref = block_scaled_mm(mxfp8_quantize(x2, torch.float8_e4m3fn).rowwise,
                              mxfp8_quantize(fc.weight.detach(), torch.float8_e4m3fn).rowwise)  # fmt: skip
        mx_out = (ref + fc.bias.detach()).reshape(out.shape)
        block = state.last_block_stats
        rows = slice(3 * k, 3 * k + 3)
        if step in (3, 4):  # MXFP8: E8M0 copies, block statistics for this layer only
            assert torch.equal(out, mx_out)
            assert bool((block[rows, BLOCKS] > 0).all())
            assert int(block[3 * k, BLOCKS]) == x2.numel() // 32
            scale = float(state.last_stats[3 * k, SCALE])
            assert scale == 2.0 ** round(math.log2(scale))  # a power of two: an E8M0 scale
        else:
            assert not torch.equal(out, mx_out)  # per-tensor delayed scaling
            if block is not None:
                assert float(block[rows].abs().sum()) == 0  # zeros: per-tensor scaled
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert state.block_stats is not None  # sticky: the block part stays once a layer was block-scaled
    # back on delayed scaling, the layer's scale follows the amaxes its tensors had under MXFP8
    assert torch.isfinite(state.scale[3 * k : 3 * k + 3]).all() and bool(
        (state.scale[3 * k : 3 * k + 3] > 0).all()
    )


@pytest.mark.parametrize(
    "base", [MXFP8BlockScaling(), None], ids=["mxfp8-recipe", "delayed-with-block-layer"]
)
def test_checkpoint_round_trip_of_block_scaled_layers(base):
    model, recipe = tiny_model(recipe=base)
    if base is None:
        fp8_trainer.set_layer_recipe(model, "blocks.0.attn.proj", scaling="block")
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        _step(model, recipe, gen)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    restored, _ = tiny_model(recipe=base, seed=5)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert fp8_trainer.get_layer_recipes(restored) == fp8_trainer.get_layer_recipes(model)
    scalings = {s["scaling"] for s in fp8_trainer.get_layer_recipes(restored).values()}
    assert scalings == ({"mxfp8"} if base is not None else {"delayed", "block"})
    x = torch.randint(0, 256, (4, 16), generator=gen)
    with fp8_trainer.fp8_autocast(fp8_recipe=recipe), torch.no_grad():
        assert torch.equal(model(x, x)[1], restored(x, x)[1])


def test_block_recipe_as_the_autocast_recipe_overrides_the_conversion_recipe():
    model, _ = tiny_model()  # converted with DelayedScaling
    recipe = Float8BlockScaling(w_block_scaling_dim=1)
    gen = torch.Generator().manual_seed(2)
    _step(model, recipe, gen)
    state = fp8_trainer.get_fp8_state(model)
    assert all(specs is not None and not specs[1].two_d for specs in state.block_specs)
    assert bool((state.last_block_stats[:, BLOCKS] > 0).all())
