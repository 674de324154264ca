"""Run for ``test_quality_interpreted.py`` with TRITON_INTERPRET=1, as
``python -m tests.kernels.quality_cases_triton OUT`` from the repository root: the Triton quantize kernels'
quality columns against the first-principles float64 computation and the reference, for the same
hand-built tensors. Writes the names of the cases checked (JSON) to OUT; any mismatch raises."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from fp8_kernels import new_stats, quantize_with_stats_reference
from fp8_kernels.triton.current import quantize_current_triton
from fp8_kernels.triton.quantize import launch_quantize
from fp8_protocol.stats import ERR_SQ, MIN_ABS, SUBNORMAL, SUM_SQ
from tests.kernels.exact_checks import same_row
from tests.kernels.quality_reference import quality_first_principles
from tests.kernels.test_quality_stats import _cases


def _against_first_principles(row: torch.Tensor, x: torch.Tensor, scale: float, fp8, what: str) -> None:
    exp = quality_first_principles(x, scale, fp8)
    # float32 block sums in any order (the interpreter adds one term after the other) and the float32
    # squares: exact_checks.same_row's bound
    rtol = (1024 + 2) * 2.0**-24
    for col, name in ((SUM_SQ, "sum_sq"), (ERR_SQ, "err_sq")):
        assert math.isclose(row[col].item(), exp[name], rel_tol=rtol), (what, name, row.tolist(), exp)
    assert row[SUBNORMAL].item() == exp["subnormal"], (what, row.tolist(), exp)
    assert row[MIN_ABS].item() == exp["min_abs"], (what, row.tolist(), exp)


def main(out: Path) -> None:
    done = []
    for name, (x, scale) in _cases().items():
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            s = torch.tensor(scale)
            _, row_ref = quantize_with_stats_reference(x, s, fp8)
            _, _, row, _ = launch_quantize(x, s, fp8, None)
            _against_first_principles(row, x, scale, fp8, f"{name} 1-D")
            same_row(row, row_ref, f"{name} 1-D vs reference")
            x2 = x.reshape(-1, x.shape[-1]) if x.dim() == 2 else x.reshape(1, -1)
            _, _, row_t, _ = launch_quantize(x2, s, fp8, None, transpose=True)
            _against_first_principles(row_t, x2, scale, fp8, f"{name} 2-D")
            _, cur_scale, row_c = quantize_current_triton(x, fp8)
            _against_first_principles(row_c, x, cur_scale.item(), fp8, f"{name} current")
            # accumulation: two calls into one row merge as the reference's (sums add, min_abs the min)
            acc, acc_ref = new_stats(), new_stats()
            for part in (x, x.flatten()[: max(1, x.numel() // 3)] * 0.5):
                launch_quantize(part, s, fp8, acc)
                quantize_with_stats_reference(part, s, fp8, acc_ref)
            same_row(acc, acc_ref, f"{name} accumulated")
            done += [f"{name}-{fp8}-1d", f"{name}-{fp8}-2d", f"{name}-{fp8}-current"]
    out.write_text(json.dumps(done))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
