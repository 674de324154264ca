"""Which path the block-scaled GEMMs take here: the support line of ``fp8_trainer.block_gemm``, then for one
forward and backward of a block-scaled Linear per recipe, how fprop, dgrad and wgrad ran (native
``torch.nn.functional.scaled_mm`` or the emulation, and why). For the GPU check; runs on a CPU too.

    python scripts/block_gemm_paths.py
"""

from __future__ import annotations

import torch

import fp8_trainer
from fp8_trainer import block_gemm
from fp8_trainer.recipe import Float8BlockScaling, Format, MXFP8BlockScaling


def main() -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"block-scaled GEMM: {block_gemm.describe_native_support(dev)}")
    recipes = (Float8BlockScaling(), Float8BlockScaling(fp8_format=Format.HYBRID), MXFP8BlockScaling())
    for recipe in recipes:
        block_gemm.reset_gemm_paths()
        layer = torch.nn.Sequential(torch.nn.Linear(512, 256)).to(dev)
        model = fp8_trainer.convert_to_fp8(layer, recipe=recipe)
        x = torch.randn(256, 512, device=dev, requires_grad=True)
        with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
            model(x).sum().backward()
        paths = [
            f"{gemm} native" if rec.native else f"{gemm} emulated ({rec.reason})"
            for gemm, rec in block_gemm.gemm_paths().items()
        ]
        print(f"  {recipe.scaling} {recipe.fp8_format.value}: {'; '.join(paths)}")


if __name__ == "__main__":
    main()
