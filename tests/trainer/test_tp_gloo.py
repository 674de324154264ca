"""Tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``) on an FP8 model,
2 CPU processes (gloo): the GEMMs run on local shards in FP8, trains as the unsharded model does, and records
each logical tensor's statistics (not its shard's).

Both ranks take the whole batch (tensor parallelism splits the layers, not the data); the reference is the
same model unsharded, in the test process, on the same batches (the second step as two micro-batches). Each
block is ``Linear(32, 64)`` column-wise, GELU, ``Linear(64, 32)`` row-wise, LayerNorm; the head stays
unsharded (``PLAN``), or, with sequence parallelism (``SP_PLAN``: the norms on sequence shards), column-wise.

Tolerance of the losses: the FP8 tensors of the TP run are quantized with the scales the unsharded run uses
(delayed: the same history, the shards' amaxes merged at the step's end; current: the whole tensor's amax, one
all-reduce), so the weights' and the replicated tensors' FP8 values are the same bits. What differs is the
float32 summation order: a row-wise layer's output is the sum of two partial GEMMs (an all-reduce) instead of
one, which moves an output by float32 rounding (~1e-7 relative, as the step's amaxes here: 3.5e-7 at most);
where such a value sits on an FP8 rounding boundary, its quantization moves by one step (2^-4 relative in
E4M3, 2^-3 in E5M2), a change of one element among the thousands each output and the loss sum over. Measured
here the losses are equal to float32 (every run, four steps); the tolerance is 1e-4 relative. Current scaling
with each shard's own amax (the all-reduce left out) moves the loss by 2e-3 and an evaluation's outputs by
0.15; a shard's output taken for the whole, or a replicated tensor's statistics counted twice, fail the
statistics checks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import fp8_trainer
from fp8_trainer import CurrentScaling, DelayedScaling, MXFP8BlockScaling, fp8_autocast
from fp8_trainer.tensor_parallel import sharded_tensors
from tests.trainer import sharded_runs
from tests.trainer.gloo import gloo_group, spawn_ranks
from tests.trainer.sharded_runs import small_model

WORLD = 2
STEPS = 4
RECIPES = {
    "delayed": lambda: DelayedScaling(amax_history_len=4),
    "current": CurrentScaling,
    "delayed-no-reduce": lambda: DelayedScaling(amax_history_len=4, reduce_amax=False),
    "mxfp8": MXFP8BlockScaling,
}
LOSS_RTOL = 1e-4  # against the unsharded run (module docstring)
WEIGHT_ROWS = [1, 4, 7, 10, 13]  # tensor 3k+1 of layer k (tensor_table order)
AMAX, SCALE, OVERFLOW, UNDERFLOW, NONFINITE, NUMEL, SUM_SQ = range(7)
# the unsharded tensors' numel: input, weight, grad_output of each layer (64 tokens a step)
NUMEL_ROWS = [64 * 32, 64 * 32, 64 * 64] + [64 * 64, 32 * 64, 64 * 32]
NUMEL_ALL = NUMEL_ROWS * 2 + [64 * 32, 32 * 32, 64 * 32]
PLAN = {
    "0.0": ColwiseParallel(),
    "0.2": RowwiseParallel(),
    "1.0": ColwiseParallel(),
    "1.2": RowwiseParallel(),
}
# sequence parallelism: the norms on sequence shards (dimension 1), the head column-wise too
SP_PLAN = {
    "0.0": ColwiseParallel(),
    "0.2": RowwiseParallel(output_layouts=Shard(1)),
    "0.3": SequenceParallel(),
    "1.0": ColwiseParallel(input_layouts=Shard(1)),
    "1.2": RowwiseParallel(output_layouts=Shard(1)),
    "1.3": SequenceParallel(),
    "2": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
}
# the runs: recipe, plan, the reference run whose losses they must match
RUNS = {
    "delayed": ("delayed", PLAN),
    "current": ("current", PLAN),
    # no amax all-reduce asked for: the sharded tensors' rows are merged over the TP group all the same
    "delayed-no-reduce": ("delayed-no-reduce", PLAN),
    "delayed-sp": ("delayed", SP_PLAN),
    "current-sp": ("current", SP_PLAN),
}
# column-wise: weight, grad_output; row-wise: input, weight (layers 0..3; the head, layer 4, under SP_PLAN)
SHARDED = [1, 2, 3, 4, 7, 8, 9, 10]


make_model = small_model


def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return sharded_runs.batches(step, 4)


def train(model: nn.Module) -> dict:
    """STEPS optimizer steps on the whole batch, the second as two micro-batches. Each step's loss and
    statistics."""
    return sharded_runs.train(model, STEPS, 4)


def worker(rank: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, port, WORLD):
        mesh = init_device_mesh("cpu", (WORLD,))
        res = {}
        for name, (recipe, plan) in RUNS.items():
            model = fp8_trainer.convert_to_fp8(make_model(), recipe=RECIPES[recipe]())
            parallelize_module(model, mesh, plan)
            r = train(model)
            r["weight_types"] = [type(model[0][0].weight).__name__, type(model[0][2].weight).__name__]
            r["local_shapes"] = [tuple(model[0][i].weight.to_local().shape) for i in (0, 2)]
            r["sharded"] = sharded_tensors(model[0][0]._fp8_state)
            with torch.no_grad(), fp8_autocast():  # an evaluation: FP8, nothing recorded
                r["eval"] = model(batches(0)[0]).float()
            res[name] = r
        model = fp8_trainer.convert_to_fp8(make_model(), recipe=RECIPES["mxfp8"]())
        parallelize_module(model, mesh, PLAN)
        try:
            with fp8_autocast():
                model(batches(0)[0])
            res["mxfp8"] = None
        except NotImplementedError as e:
            res["mxfp8"] = str(e)
        out[rank] = res


def reference(name: str) -> dict:
    torch.set_num_threads(1)
    model = fp8_trainer.convert_to_fp8(make_model(), recipe=RECIPES[name]())
    r = train(model)
    with torch.no_grad(), fp8_autocast():
        r["eval"] = model(batches(0)[0]).float()
    return r


@pytest.fixture(scope="module")
def runs() -> dict:
    return spawn_ranks(worker, WORLD)


@pytest.fixture(scope="module")
def refs() -> dict:
    return {name: reference(name) for name in ("delayed", "current")}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_tp_trains_as_unsharded(runs, refs, name):
    ref = refs[name.split("-")[0]]
    for r in range(WORLD):
        res = runs[r][name]
        assert res["weight_types"] == ["DTensor", "DTensor"]
        assert res["local_shapes"] == [(32, 32), (32, 32)]  # (64, 32) and (32, 64), halved
        assert res["sharded"] == SHARDED + ([13, 14] if name.endswith("-sp") else [])
        losses = torch.tensor(res["losses"])
        assert torch.isfinite(losses).all() and losses[-1] < losses[0]  # it trains
        torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
        torch.testing.assert_close(res["eval"], ref["eval"], rtol=1e-3, atol=1e-3)
    # both ranks report the same (whole-tensor) statistics
    for step in range(STEPS):
        assert torch.equal(runs[0][name]["stats"][step], runs[1][name]["stats"][step]), step


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_tp_statistics_are_the_whole_tensors(runs, refs, name):
    ref = refs[name.split("-")[0]]
    for step in range(STEPS):
        stats = runs[0][name]["stats"][step]
        # one row per logical tensor: shards summed, replicated tensors counted once
        assert stats[:, NUMEL].tolist() == NUMEL_ALL, step
    # step 0 starts from the same weights: the weights' statistics are the unsharded run's
    first, ref_first = runs[0][name]["stats"][0], ref["stats"][0]
    w, w_ref = first[WEIGHT_ROWS], ref_first[WEIGHT_ROWS]
    assert torch.equal(w[:, : NUMEL + 1], w_ref[:, : NUMEL + 1])  # amax, scale and counts exactly
    torch.testing.assert_close(w[:, SUM_SQ:], w_ref[:, SUM_SQ:], rtol=1e-6, atol=0)
    # the first layer's input is the same tensor (replicated): exactly its statistics too
    assert torch.equal(first[0, : NUMEL + 1], ref_first[0, : NUMEL + 1])
    # the step's amaxes of every tensor as unsharded, to float rounding of the activations and gradients
    torch.testing.assert_close(first[:, AMAX], ref_first[:, AMAX], rtol=1e-4, atol=0)
    if name.startswith("delayed"):  # the history's scales follow the whole tensors' amaxes
        scales, ref_scales = runs[0][name]["stats"][2][:, SCALE], ref["stats"][2][:, SCALE]
        assert (ref_scales > 1).all()
        torch.testing.assert_close(scales, ref_scales, rtol=1e-4, atol=0)


@pytest.mark.slow
def test_tp_refuses_block_recipes(runs):
    for r in range(WORLD):
        assert "block-scaled recipes" in runs[r]["mxfp8"]
