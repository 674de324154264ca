"""``triton.launch.launch_key``: what a cached Triton launch handle is looked up by. Two launches may share a
compiled kernel only where Triton would have compiled the same one, so the key must change with everything
Triton specialises on (a wrong key would run a kernel compiled for aligned pointers on a misaligned one)."""

import pytest
import torch

from fp8_kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install .[dev])")


def _key(*args, **kwargs):
    from fp8_kernels.triton.launch import launch_key

    return launch_key(torch.device("cpu"), args, kwargs)


def test_same_metadata_same_key_whatever_the_values_and_sizes():
    a, b = torch.zeros(64), torch.ones(128)
    assert _key(a, 1008, BLOCK=16) == _key(b, 2000, BLOCK=16)


def test_key_changes_with_what_triton_specialises_on():
    x = torch.zeros(64)
    base = _key(x, 32, BLOCK=16)
    assert _key(x[1:], 32, BLOCK=16) != base  # pointer 4 bytes off a 16-byte boundary
    assert _key(x.to(torch.bfloat16), 32, BLOCK=16) != base  # dtype
    assert _key(x, 33, BLOCK=16) != base  # not a multiple of 16
    assert _key(x, 1, BLOCK=16) != _key(x, 3, BLOCK=16)  # an integer equal to 1 is a constant to Triton
    assert _key(x, 2**31 + 32, BLOCK=16) != base  # int64 instead of int32
    assert _key(x, 32, BLOCK=32) != base  # a constexpr
    assert _key(x, 32, BLOCK=16, num_warps=8) != _key(x, 32, BLOCK=16, num_warps=4)  # a launch option


def test_a_kept_plan_launches_what_a_fresh_one_would():
    """``triton.quantize._plan`` keeps each call shape's constexprs and launch options: every variant of a
    quantize call, launched again from its kept plan, passes exactly what building it afresh passed, and the
    variants get plans of their own (a key that missed one would hand a variant another's constexprs)."""
    from fp8_kernels.reference.quantize import BASE_COLUMNS, new_stats
    from fp8_kernels.triton import cross_build
    from fp8_kernels.triton import quantize as triton_quantize
    from fp8_kernels.triton.launch import divisor

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.tensor(1.0)
    parts = torch.zeros(4, dtype=torch.int32)
    variants = []
    xs = (torch.zeros(48, 64, dtype=torch.bfloat16), torch.zeros(32, 24), torch.zeros(33, 17))
    for x in xs:
        for transpose in (False, True):
            base = dict(fp8_dtype=e4m3, transpose=transpose)
            variants += [
                dict(base, x=x, scale=one),
                dict(base, x=x, scale=one, fp8_dtype=e5m2),
                dict(base, x=x, scale=one, stats=torch.zeros(len(BASE_COLUMNS), dtype=torch.float64)),
                dict(base, x=x, scale=one, amax=torch.tensor(2.0)),
                dict(base, x=x, scale=None, amax_parts=parts, scale_from_amax=True),
                dict(base, x=x, scale=None, amax_parts=parts, scale_from_amax=True, power_2_scale=True),
                dict(base, x=x, scale=one, precast=torch.zeros(x.shape)),
            ]

    def launches(fresh: bool) -> list[dict]:
        seen = []
        for kernel in ("_quantize_kernel", "_quantize_t_kernel"):
            with cross_build.recorded(triton_quantize, kernel) as rec:
                for v in variants:
                    if v["transpose"] != (kernel == "_quantize_t_kernel"):
                        continue
                    if fresh:
                        triton_quantize._PLANS.clear()
                    v = dict(v)
                    stats = v.pop("stats", None)
                    row = stats if stats is not None else new_stats()
                    triton_quantize.launch_quantize(v.pop("x"), v.pop("scale"), v.pop("fp8_dtype"), row, **v)
                seen += [kwargs for _, kwargs in rec.launches]
        return seen

    fresh = launches(fresh=True)
    kept = launches(fresh=False)
    kept_again = launches(fresh=False)
    assert kept == fresh and kept_again == fresh
    # the variants that differ in what the kernel is given: per input, bf16 or not (and the 2-D kernel's
    # row divisors), times the seven forms of a call
    one_d = {x.dtype == torch.bfloat16 for x in xs}
    two_d = {(x.dtype == torch.bfloat16, divisor(x.shape[0]), divisor(x.shape[1])) for x in xs}
    assert len({tuple(sorted(k.items())) for k in fresh}) == 7 * (len(one_d) + len(two_d)) == 35
