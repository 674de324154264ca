"""Amax reduction across two CPU processes (gloo): identical scales, equal to the max over ranks."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8_trainer
from fp8_trainer import DelayedScaling, fp8_autocast
from tests.trainer.gloo import gloo_group, spawn_ranks

WORLD = 2


def worker(rank: int, port: int, out: dict) -> None:
    with gloo_group(rank, port, WORLD):
        calls = []
        real = dist.all_reduce

        def counting_all_reduce(tensor, *args, **kw):
            calls.append(tuple(tensor.shape))
            return real(tensor, *args, **kw)

        dist.all_reduce = counting_all_reduce
        try:
            torch.manual_seed(0)  # same weights on both ranks
            m = fp8_trainer.convert_to_fp8(
                nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16)),
                recipe=DelayedScaling(amax_history_len=1),
            )
            gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
            results = []
            for step, group in enumerate([None, dist.new_group([0, 1])]):
                x = torch.randn(5 + rank, 32, generator=gen) * (1 + 3 * rank) * (step + 1)
                with fp8_autocast(fp8_group=group):
                    y = m(x)
                (y * torch.randn(y.shape, generator=gen) * (1 + rank)).sum().backward()
                state = fp8_trainer.get_fp8_state(m)
                results.append((fp8_trainer.step_stats(m)[:, 0].clone(), state.scale.clone()))
            out[rank] = (results, calls)
        finally:
            dist.all_reduce = real


@pytest.mark.slow
def test_two_ranks_reduce_amax_in_one_collective():
    out = spawn_ranks(worker, WORLD)
    fmax = torch.tensor([448.0, 448.0, 57344.0] * 2)
    for step in range(2):
        local = [out[r][0][step][0] for r in range(WORLD)]  # each rank's own (local) amaxes
        assert not torch.equal(local[0], local[1])  # the ranks did see different data
        scales = [out[r][0][step][1] for r in range(WORLD)]
        assert torch.equal(scales[0], scales[1])
        expected = fmax / torch.maximum(local[0], local[1]).float()  # history_len 1: scale from this step
        assert torch.equal(scales[0], expected)
    for r in range(WORLD):
        assert out[r][1] == [(6,), (6,)]  # one all_reduce of all 6 amaxes per step


def nonfinite_worker(rank: int, port: int, out: dict) -> None:
    from fp8_trainer.distributed import all_reduce_amax
    from fp8_trainer.scaling import delayed_scaling_update

    with gloo_group(rank, port, WORLD):
        inf, nan = float("inf"), float("nan")
        mine = torch.tensor([inf, nan, 2.0, 1.0]) if rank == 0 else torch.tensor([1.0, 1.0, 1.0, -inf])
        reduced = all_reduce_amax(mine, None)
        # what the scale update makes of it: history 4 with a finite past, previous scale 7
        history = torch.full((4, 4), 2.0)
        _, scale = delayed_scaling_update(history, reduced, torch.full((4,), 7.0), fp8_max=448.0)
        out[rank] = (reduced, scale)


@pytest.mark.slow
def test_nonfinite_amaxes_survive_the_reduction_and_keep_the_scale():
    # +Inf must stay +Inf (nan_to_num's default posinf would make it 3.4e38, a finite amax that collapses
    # the scale to 448 / 3.4e38 and sits in the max window for amax_history_len steps)
    out = spawn_ranks(nonfinite_worker, WORLD)
    for r in range(WORLD):
        reduced, scale = out[r]
        assert reduced[0] == float("inf") and reduced[1] == float("inf"), reduced
        assert reduced[2] == 2.0 and reduced[3] == 1.0, reduced
        assert scale[0] == 7.0 and scale[1] == 7.0, scale  # a non-finite amax keeps the previous scale
        assert scale[2] == 448.0 / 2.0, scale
