"""Delayed scaling against sequences derived by hand (docs/fp8-semantics.md).

E4M3 (FP8_MAX = 448) throughout unless stated; amaxes are powers of two so every scale is exact.
History rows are newest first (fp8scope's layout). ``scale = (448 * 2**-margin) / amax``; a zero step amax
neither enters the history nor changes the scale (Transformer Engine's kernel_bulk); the max over the history
ignores NaN; an Inf window (or a zero / Inf / NaN amax with most_recent) keeps the previous scale; the
initial scale is 1.
"""

import math

import pytest
import torch

from fp8_trainer.formats import FLOAT32_MAX
from fp8_trainer.scaling import current_scale, delayed_scaling_update

NAN, INF = math.nan, math.inf

# history_len 1 (max == most_recent): step amax -> scale
#   2 -> 448/2 = 224;  4 -> 112;  0 -> no roll, keep 112;  1 -> 448;  inf -> keep 448;  8 -> 56;
#   nan -> rolls, but the NaN-ignoring max of [nan] is 0 (and most_recent sees NaN): keep 56;  0.5 -> 896
LEN1_AMAX = [2, 4, 0, 1, INF, 8, NAN, 0.5]
LEN1_SCALE = [224, 112, 112, 448, 448, 56, 56, 896]

# history_len 4; the window after each step (newest first) and its max:
#   s1 [2,0,0,0] 2   s2 [4,2,0,0] 4   s3 [1,4,2,0] 4   s4 [1,1,4,2] 4   s5 [1,1,1,4] 4   s6 [1,1,1,1] 1
#   s7 [.5,1,1,1] 1  s8 [inf,.5,1,1] inf  s9 [2,inf,.5,1] inf  s10 [2,2,inf,.5] inf  s11 [2,2,2,inf] inf
#   s12 [2,2,2,2] 2
LEN4_AMAX = [2, 4, 1, 1, 1, 1, 0.5, INF, 2, 2, 2, 2]
# "max", margin 0: 448/max, Inf windows keep the previous scale
LEN4_MAX_M0 = [224, 112, 112, 112, 112, 448, 448, 448, 448, 448, 448, 224]
# "max", margin 2: the same divided by 2**2 = 4
LEN4_MAX_M2 = [56, 28, 28, 28, 28, 112, 112, 112, 112, 112, 112, 56]
# "most_recent", margin 0: 448/newest; Inf (s8) keeps 896
LEN4_RECENT_M0 = [224, 112, 448, 448, 448, 448, 896, 896, 224, 224, 224, 224]
# "most_recent", margin 2
LEN4_RECENT_M2 = [56, 28, 112, 112, 112, 112, 224, 224, 56, 56, 56, 56]

# history_len 31: step 1 has amax 64, steps 2..33 have amax 1.
#   "max": steps 1..31 still see 64 in the window -> 448/64 = 7; at step 32 the window is steps 2..32 -> 448.
#   "most_recent": 7 at step 1, then 448.
LEN31_AMAX = [64] + [1] * 32
LEN31_MAX = [7] * 31 + [448, 448]
LEN31_RECENT = [7] + [448] * 32
# history_len 31 with a NaN at step 2 (then 4 for ever): step 1 -> 224; the NaN enters the window (TE:
# NaN != 0 rolls) but the max ignores it (fmaxf): step 2's window max is 2 -> 224; from step 3 on 4 -> 112.
LEN31_NAN_AMAX = [2, NAN] + [4] * 31
LEN31_NAN_MAX = [224, 224] + [112] * 31

# history_len 4, an idle tensor (an MoE expert that got no tokens, an all-zero gradient): amax 0 from step 5.
#   s1 [16,0,0,0] 28   s2 [1,16,0,0] 28   s3 [1,1,16,0] 28   s4 [1,1,1,16] 28
#   s5..s8 amax 0: no roll, the window stays [1,1,1,16], the scale stays 28 (rolling zeros in would push 16
#   out at s5 and jump the scale to 448)
#   s9 amax 2: rolls, [2,1,1,1] -> 224
IDLE_AMAX = [16, 1, 1, 1, 0, 0, 0, 0, 2]
IDLE_MAX = [28] * 8 + [224]
IDLE_HISTORY = [2, 1, 1, 1]
# "most_recent": 448/16 = 28, then 448 for three steps; the zero steps keep 448; then 448/2 = 224
IDLE_RECENT = [28, 448, 448, 448, 448, 448, 448, 448, 224]

# interval 3, history_len 1: the scale is recomputed after steps 3 and 6 only (history every step):
#   steps 1, 2 keep the initial 1; step 3 sees [8] -> 56; steps 4, 5 keep 56; step 6 sees [16] -> 28
INTERVAL3_AMAX = [2, 4, 8, 1, 1, 16]
INTERVAL3_SCALE = [1, 1, 56, 56, 56, 28]


def run(amaxes, *, length, algo="max", margin=0, interval=1, fp8_max=448.0):
    hist = torch.zeros(length, 1)
    scale = torch.ones(1)
    out = []
    for step, a in enumerate(amaxes, start=1):
        hist, scale = delayed_scaling_update(
            hist,
            torch.tensor([a], dtype=torch.float32),
            scale,
            fp8_max=fp8_max,
            margin=margin,
            amax_compute_algo=algo,
            interval=interval,
            step=step,
        )
        out.append(scale.item())
    return out, hist


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_history_len_1(algo):
    assert run(LEN1_AMAX, length=1, algo=algo)[0] == LEN1_SCALE


@pytest.mark.parametrize(
    "algo,margin,expected",
    [
        ("max", 0, LEN4_MAX_M0),
        ("max", 2, LEN4_MAX_M2),
        ("most_recent", 0, LEN4_RECENT_M0),
        ("most_recent", 2, LEN4_RECENT_M2),
    ],
)
def test_history_len_4(algo, margin, expected):
    scales, hist = run(LEN4_AMAX, length=4, algo=algo, margin=margin)
    assert scales == expected
    assert hist[:, 0].tolist() == [2, 2, 2, 2]


def test_history_len_31():
    assert run(LEN31_AMAX, length=31, algo="max")[0] == LEN31_MAX
    assert run(LEN31_AMAX, length=31, algo="most_recent")[0] == LEN31_RECENT
    scales, hist = run(LEN31_NAN_AMAX, length=31, algo="max")
    assert scales == LEN31_NAN_MAX
    assert hist[:, 0].tolist() == [4] * 31


def test_interval():
    assert run(INTERVAL3_AMAX, length=1, interval=3)[0] == INTERVAL3_SCALE


def test_zero_amax_neither_rolls_nor_changes_the_scale():
    scales, hist = run(IDLE_AMAX, length=4, algo="max")
    assert scales == IDLE_MAX
    assert hist[:, 0].tolist() == IDLE_HISTORY
    assert run(IDLE_AMAX, length=4, algo="most_recent")[0] == IDLE_RECENT
    # a zero-initialised weight at step 1: the history stays empty and the scale stays at the initial 1
    scales, hist = run([0, 0, 8], length=4)
    assert scales == [1, 1, 56] and hist[:, 0].tolist() == [8, 0, 0, 0]
    # an idle step that is due (interval 2) keeps the scale too
    assert run([4, 8, 0, 0, 2, 2], length=1, interval=2)[0] == [1, 56, 56, 56, 56, 224]


def test_random_idle_steps_keep_the_scale():
    # the regression seen in training: with history 4 an idle layer's scale jumped (25.97 -> 377 and the like)
    g = torch.Generator().manual_seed(0)
    amax = torch.rand(4, 64, generator=g) * 16 + 1
    hist, scale = torch.zeros(4, 64), torch.ones(64)
    for a in amax:
        hist, scale = delayed_scaling_update(hist, a, scale, fp8_max=448.0)
    hist_idle, scale_idle = delayed_scaling_update(hist, torch.zeros(64), scale, fp8_max=448.0)
    assert torch.equal(scale_idle, scale) and torch.equal(hist_idle, hist)


def test_nan_in_the_window_is_ignored_inf_keeps_the_scale():
    hist = torch.tensor([[4.0, 4.0, NAN], [NAN, INF, NAN], [2.0, 1.0, NAN]])
    new_hist, scale = delayed_scaling_update(
        hist, torch.tensor([NAN, 2.0, NAN]), torch.tensor([3.0, 5.0, 7.0]), fp8_max=448.0, history_len=3
    )
    # col 0: NaN rolls in, the window [nan, 4, nan] has fmax 4 -> 112; col 1: window [2, 4, inf]: Inf keeps 5;
    # col 2: an all-NaN window has amax 0 (TE: fmaxf from 0): keeps 7
    assert scale.tolist() == [112.0, 5.0, 7.0]
    assert new_hist[0].isnan().tolist() == [True, False, True] and new_hist[1:, 1].tolist() == [4.0, INF]
    _, recent = delayed_scaling_update(
        hist, torch.tensor([NAN, INF, 1.0]), torch.tensor([3.0, 5.0, 7.0]), fp8_max=448.0,
        amax_compute_algo="most_recent",
    )  # fmt: skip
    assert recent.tolist() == [3.0, 5.0, 448.0]


def test_scaled_max_is_computed_before_the_division():
    # TE: scale = (fp8_max * 2**-margin) / amax, one rounding of the division. Dividing first overflows
    # where 448 / amax is beyond float32 but 112 / amax is not (margin 2, amax 2**-120)
    assert run([2.0**-120], length=1, margin=2)[0] == [112 * 2.0**120]
    # a fractional margin: one correctly rounded division of the float32 scaled_max (float64 division of two
    # float32 values rounds to the same float32), where two roundings differ for some amaxes
    scaled_max = torch.tensor(448.0) * torch.exp2(torch.tensor(-0.5))
    amaxes = torch.rand(2000, generator=torch.Generator().manual_seed(1)) * 100 + 0.01
    expected = (scaled_max.double() / amaxes.double()).float()
    two_roundings = (torch.tensor(448.0) / amaxes) / torch.exp2(torch.tensor(0.5))
    assert not torch.equal(two_roundings, expected), "no amax here tells the two formulas apart"
    hist = torch.zeros(1, 2000)
    _, scale = delayed_scaling_update(hist, amaxes, torch.ones(2000), fp8_max=448.0, margin=0.5)
    assert torch.equal(scale, expected)


def test_tiny_amax_clamps_to_float32_max_and_e5m2():
    assert run([1e-45], length=1)[0] == [FLOAT32_MAX]
    e5m2 = run([7.0, 2.0**-20, 2.0**-130], length=2, fp8_max=57344.0, algo="most_recent")[0]
    assert e5m2 == [8192.0, 57344.0 * 2**20, FLOAT32_MAX]


def test_vectorised_per_tensor_settings_match_the_tables():
    """One update call for several tensors, each with its own history length, algorithm and margin."""
    cases = [  # (amaxes, history_len, most_recent, margin, expected)
        (LEN4_AMAX, 4, False, 0, LEN4_MAX_M0),
        (LEN4_AMAX, 4, True, 2, LEN4_RECENT_M2),
        (LEN1_AMAX + [1] * 4, 1, False, 0, LEN1_SCALE + [448] * 4),
        (LEN31_AMAX[:12], 31, False, 2, [7 / 4] * 12),
    ]
    n, length = len(cases), 31
    hist, scale = torch.zeros(length, n), torch.ones(n)
    hist_len = torch.tensor([c[1] for c in cases])
    recent = torch.tensor([c[2] for c in cases])
    margin = torch.tensor([float(c[3]) for c in cases])
    for step in range(12):
        amax = torch.tensor([float(c[0][step]) for c in cases])
        hist, scale = delayed_scaling_update(
            hist,
            amax,
            scale,
            fp8_max=torch.full((n,), 448.0),
            margin=margin,
            amax_compute_algo=recent,
            history_len=hist_len,
            step=step + 1,
        )
        assert scale.tolist() == [c[4][step] for c in cases], step
    assert (hist[4:, 0] == 0).all() and (
        hist[1:, 2] == 0
    ).all()  # entries beyond a tensor's length are dropped


def test_update_mask_freezes_history_and_scale():
    hist, scale = torch.zeros(2, 2), torch.tensor([3.0, 5.0])
    hist, scale = delayed_scaling_update(
        hist, torch.tensor([4.0, 4.0]), scale, fp8_max=448.0, update=torch.tensor([True, False])
    )
    assert scale.tolist() == [112.0, 5.0]
    assert hist.tolist() == [[4.0, 0.0], [0.0, 0.0]]


def test_current_scale():
    amax = torch.tensor([2.0, 0.0, INF, NAN, 1e-45])
    assert current_scale(amax, 448.0).tolist() == [224.0, 1.0, 1.0, 1.0, FLOAT32_MAX]


def test_current_scale_power_of_two():
    # rounded down (bits masked with 0xFF800000): 448/3 = 149.3 -> 128, 448/0.75 = 597.3 -> 512,
    # 448/448 = 1, 448/2 = 224 -> 128; zero / non-finite amax -> 1; the float32 maximum -> 2**127
    amax = torch.tensor([3.0, 0.75, 448.0, 2.0, 0.0, INF, NAN, 1e-45])
    expected = [128.0, 512.0, 1.0, 128.0, 1.0, 1.0, 1.0, 2.0**127]
    assert current_scale(amax, 448.0, power_2_scale=True).tolist() == expected
    assert current_scale(torch.tensor([7.0]), 57344.0, power_2_scale=True).tolist() == [8192.0]  # exact
    assert current_scale(amax, 448.0).tolist()[3] == 224.0  # off by default
