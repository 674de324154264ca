"""The block-scaled recipes: Transformer Engine's names and defaults, validation, JSON round trip."""

from __future__ import annotations

import json

import pytest

from fp8_trainer.recipe import (
    Float8BlockScaling,
    Format,
    MXFP8BlockScaling,
    QParams,
    block_recipe_from_dict,
    recipe_from_dict,
)


def test_defaults_are_transformer_engines():
    mx = MXFP8BlockScaling()
    assert mx.fp8_format is Format.E4M3 and mx.enable_2d_quantization is False and mx.block_size == 32
    b = Float8BlockScaling()
    assert b.fp8_format is Format.E4M3 and b.block_size == 128
    assert (b.x_block_scaling_dim, b.w_block_scaling_dim, b.grad_block_scaling_dim) == (1, 2, 1)
    for role in ("input", "weight", "grad_output"):
        assert b.qparams(role) == QParams(power_2_scale=True, amax_epsilon=0.0)
    assert [b.block_scaling_dim(r) for r in ("input", "weight", "grad_output")] == [1, 2, 1]


@pytest.mark.parametrize(
    "recipe",
    [
        MXFP8BlockScaling(),
        MXFP8BlockScaling(fp8_format="hybrid", enable_2d_quantization=True),
        Float8BlockScaling(),
        Float8BlockScaling(
            fp8_format=Format.HYBRID,
            fp8_quant_bwd_grad=QParams(power_2_scale=False, amax_epsilon=1e-12),
            x_block_scaling_dim=2,
            w_block_scaling_dim=1,
        ),
    ],
)
def test_json_round_trip(recipe):
    d = json.loads(json.dumps(recipe.to_dict()))
    assert block_recipe_from_dict(d) == recipe
    assert type(recipe).from_dict(d) == recipe


def test_validation_names_the_field():
    with pytest.raises(ValueError, match="fp8_format: pure E5M2"):
        MXFP8BlockScaling(fp8_format="E5M2")
    with pytest.raises(ValueError, match="fp8_format: pure E5M2"):
        Float8BlockScaling(fp8_format=Format.E5M2)
    with pytest.raises(ValueError, match="enable_2d_quantization"):
        MXFP8BlockScaling(enable_2d_quantization=1)
    with pytest.raises(ValueError, match="w_block_scaling_dim: must be 1"):
        Float8BlockScaling(w_block_scaling_dim=3)
    with pytest.raises(ValueError, match="grad_block_scaling_dim: 2-D blocks for both w_block_scaling_dim"):
        Float8BlockScaling(grad_block_scaling_dim=2)
    with pytest.raises(ValueError, match="w_block_scaling_dim: 2-D blocks for both x_block_scaling_dim"):
        Float8BlockScaling(x_block_scaling_dim=2)
    with pytest.raises(ValueError, match="fp8_quant_fwd_inp.amax_epsilon"):
        Float8BlockScaling(fp8_quant_fwd_inp={"amax_epsilon": -1.0})
    with pytest.raises(ValueError, match="fp8_quant_fwd_weight.pow2: unknown field"):
        Float8BlockScaling(fp8_quant_fwd_weight={"pow2": True})
    with pytest.raises(ValueError, match="margin: unknown field for MXFP8BlockScaling"):
        block_recipe_from_dict({"type": "mxfp8", "margin": 0})
    with pytest.raises(ValueError, match="type: unknown block recipe type"):
        block_recipe_from_dict({"type": "delayed"})


def test_block_recipes_are_recipes():
    """Now that the FP8 Linear runs them, ``recipe_from_dict`` (what a stored or pushed recipe goes through)
    rebuilds the block recipes too, and an unknown type still names the known ones."""
    for recipe in (MXFP8BlockScaling(enable_2d_quantization=True), Float8BlockScaling(x_block_scaling_dim=2,
                   w_block_scaling_dim=1)):  # fmt: skip
        assert recipe_from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe
    with pytest.raises(ValueError, match="unknown recipe type 'sometimes'.*'mxfp8', 'block'"):
        recipe_from_dict({"type": "sometimes"})
