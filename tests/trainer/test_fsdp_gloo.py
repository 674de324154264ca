"""FSDP2 (``fully_shard``) on an FP8 model, 2 CPU processes (gloo): the FP8 all-gather trains as the unsharded
model does, moves FP8 bytes, and records the whole weight's statistics.

Each recipe runs three ways on the same global batch (8 rows; under FSDP2 rank r takes rows 4r..4r+3):

* ``fp8``: ``enable_fp8_all_gather`` then ``fully_shard`` per block and on the root (weights cast before the
  all-gather);
* ``hp``: ``fully_shard`` alone (high-precision all-gather, each rank quantizes the gathered weight);
* ``ref``: one process, no sharding, the whole batch (run here, in the test process).

``fp8`` and ``hp`` quantize the same weight with the same scale (delayed: the same history; current: the
whole weight's amax either way), so their FP8 weights are the same bits and their losses equal to float32
rounding of the reductions. Against ``ref`` the losses differ by more: the activations and gradients are
quantized per rank (each rank's own current-scaling amax; the FSDP2 gradient is the average of two
half-batch gradients, each from its own FP8 GEMM), which moves each FP8 value by up to one rounding step
(2^-4 relative in E4M3, 2^-3 in E5M2) on either side; these roundings are independent and average out
over the thousands of products in each output, so over four steps of this model the loss moves by 0.15%
at most (measured); the tolerance is 1%. A broken all-gather (a wrong scale, a shard taken for the whole
weight, FP8 bytes read as another dtype) moves it by far more (tens of percent, or NaN).

Statistics: the sums of squares are float64 sums of per-shard float32 partial sums, equal to float32
rounding; amax and the counts exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp8_trainer
from fp8_trainer import CurrentScaling, DelayedScaling, MXFP8BlockScaling, fp8_autocast
from fp8_trainer.fsdp import FP8GatheredWeight, enable_fp8_all_gather
from tests.trainer import sharded_runs
from tests.trainer.gloo import gloo_group, spawn_ranks
from tests.trainer.sharded_runs import small_model

WORLD = 2
STEPS = 4
ROWS = 8  # the global batch
RECIPES = {
    "delayed": lambda: DelayedScaling(amax_history_len=4),
    "current": CurrentScaling,
    "mxfp8": MXFP8BlockScaling,
}
LOSS_RTOL = 0.01  # against the unsharded run (module docstring)
# layer index of each Linear in tensor_table order: tensors 3k (input), 3k+1 (weight), 3k+2 (grad_output)
WEIGHT_ROWS = [1, 4, 7, 10, 13]
AMAX, SCALE, OVERFLOW, UNDERFLOW, NONFINITE, NUMEL, SUM_SQ = range(7)


make_model = small_model


def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return sharded_runs.batches(step, ROWS)


def train(model: nn.Module, rows: slice, grad_accum: bool) -> dict:
    """STEPS optimizer steps on ``rows`` of each global batch; the second step as two micro-batches when
    ``grad_accum``. Returns each step's loss on these rows and each step's statistics."""
    return sharded_runs.train(model, STEPS, ROWS, rows, accumulate=grad_accum)


def evaluate(model: nn.Module, rows: slice) -> dict:
    x = batches(0)[0][rows]
    with torch.no_grad():  # an evaluation outside fp8_autocast: the high-precision all-gather again
        hp_eval = model(x).float()
    with torch.no_grad(), fp8_autocast():  # and FP8 after it
        fp8_eval = model(x).float()
    return {"hp_eval": hp_eval, "fp8_eval": fp8_eval}


def shard(model: nn.Module, fp8_all_gather: bool, param_dtype) -> nn.Module:
    if fp8_all_gather:
        assert enable_fp8_all_gather(model) == ["0.0", "0.2", "1.0", "1.2", "2"]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    for blk in list(model)[:2]:
        fully_shard(blk, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def worker(rank: int, port: int, runs: list, out: dict) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, port, WORLD):
        real = dist.all_gather_single
        gathered: list[tuple[torch.dtype, int]] = []

        def counting_all_gather_single(output, input, *args, **kwargs):  # FSDP2's all-gather
            gathered.append((input.dtype, input.numel() * input.element_size()))
            return real(output, input, *args, **kwargs)

        dist.all_gather_single = counting_all_gather_single
        try:
            res = {}
            for name, fp8_ag, param_dtype in runs:
                gathered.clear()
                model = fp8_trainer.convert_to_fp8(make_model(), recipe=RECIPES[name]())
                shard(model, fp8_ag, param_dtype)
                rows = slice(rank * ROWS // WORLD, (rank + 1) * ROWS // WORLD)
                r = train(model, rows, grad_accum=True)
                r["gathered"] = list(gathered)  # the training steps' all-gathers
                r.update(evaluate(model, rows))
                with fp8_autocast():
                    model[0].unshard()  # the layer's weight as FSDP2 hands it to an FP8 forward
                r["unsharded_type"] = type(model[0][0].weight).__name__
                r["unsharded_dtype"] = model[0][0].weight.dtype
                model[0].reshard()
                res[(name, fp8_ag, str(param_dtype))] = r
            out[rank] = res
        finally:
            dist.all_gather_single = real


def reference(name: str) -> dict:
    torch.set_num_threads(1)
    model = fp8_trainer.convert_to_fp8(make_model(), recipe=RECIPES[name]())
    return train(model, slice(None), grad_accum=True)


def global_losses(res: dict, key) -> torch.Tensor:
    return torch.tensor([sum(res[r][key]["losses"][s] for r in range(WORLD)) / WORLD for s in range(STEPS)])


@pytest.fixture(scope="module")
def runs() -> dict:
    runs = [
        ("delayed", True, None),
        ("delayed", False, None),
        ("current", True, None),
        ("current", False, None),
        ("delayed", True, torch.bfloat16),
        ("delayed", False, torch.bfloat16),
        ("mxfp8", True, None),
    ]
    return spawn_ranks(worker, WORLD, runs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["delayed", "current"])
def test_fp8_all_gather_matches_unsharded_and_high_precision_all_gather(runs, name):
    fp8, hp = (name, True, "None"), (name, False, "None")
    ref = reference(name)
    for r in range(WORLD):
        assert runs[r][fp8]["unsharded_type"] == "FP8GatheredWeight"
        assert runs[r][hp]["unsharded_type"] in ("Parameter", "Tensor")
    losses = global_losses(runs, fp8)
    assert torch.isfinite(losses).all() and losses[-1] < losses[0]  # it trains
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
    # the same FP8 weights as the high-precision all-gather: the same losses to float32 rounding
    torch.testing.assert_close(losses, global_losses(runs, hp), rtol=1e-5, atol=0)

    for step in range(STEPS):
        for r in range(WORLD):
            ours, theirs = runs[r][fp8]["stats"][step], runs[r][hp]["stats"][step]
            w, w_hp = ours[WEIGHT_ROWS], theirs[WEIGHT_ROWS]
            # the whole weight's statistics (not the shard's): those of the hp all-gather, on every rank
            assert torch.equal(w[:, :OVERFLOW], w_hp[:, :OVERFLOW]), (step, r)
            # step 1 too (two micro-batches, each gathering the weight into a fresh tensor): both count
            # the whole weight once per step (FP8State.quantized_weight)
            assert torch.equal(w[:, : NUMEL + 1], w_hp[:, : NUMEL + 1]), (step, r)
            torch.testing.assert_close(w[:, SUM_SQ:], w_hp[:, SUM_SQ:], rtol=1e-6, atol=0)
        for key in (fp8, hp):
            assert runs[0][key]["stats"][step][WEIGHT_ROWS, NUMEL].tolist() == [2048, 2048, 2048, 2048, 1024]
    # step 0 starts from the same weights as the unsharded run: the same weight statistics
    first, ref_first = runs[0][fp8]["stats"][0][WEIGHT_ROWS], ref["stats"][0][WEIGHT_ROWS]
    assert torch.equal(first[:, : NUMEL + 1], ref_first[:, : NUMEL + 1])
    torch.testing.assert_close(first[:, SUM_SQ:], ref_first[:, SUM_SQ:], rtol=1e-6, atol=0)
    if name == "delayed":  # scale of step 0 is 1; later the history's, as the unsharded run
        assert (first[:, SCALE] == 1).all()
        assert (runs[0][fp8]["stats"][2][WEIGHT_ROWS, SCALE] > 1).all()

    # an evaluation outside fp8_autocast gathers in high precision; FP8 again after it
    for r in range(WORLD):
        assert torch.equal(runs[r][fp8]["hp_eval"], runs[r][hp]["hp_eval"])
        assert torch.equal(runs[r][fp8]["fp8_eval"], runs[r][hp]["fp8_eval"])


@pytest.mark.slow
def test_all_gather_moves_fp8_bytes(runs):
    for name, dtype in (("delayed", "None"), ("current", "None"), ("delayed", "torch.bfloat16")):
        fp8 = [g for g in runs[0][(name, True, dtype)]["gathered"]]
        hp = [g for g in runs[0][(name, False, dtype)]["gathered"]]
        assert len(fp8) == len(hp) > 0
        assert {d for d, _ in fp8} == {torch.uint8}
        ratio = sum(b for _, b in fp8) / sum(b for _, b in hp)
        element = 4 if dtype == "None" else 2
        assert ratio < 0.55 and ratio > 1 / element * 0.9, ratio


@pytest.mark.slow
def test_mixed_precision_policy_bf16(runs):
    fp8, hp = ("delayed", True, "torch.bfloat16"), ("delayed", False, "torch.bfloat16")
    for r in range(WORLD):
        assert runs[r][fp8]["unsharded_dtype"] == torch.bfloat16  # what the layer sees: a bf16 weight
        assert runs[r][fp8]["unsharded_type"] == "FP8GatheredWeight"
    torch.testing.assert_close(global_losses(runs, fp8), global_losses(runs, hp), rtol=1e-5, atol=0)
    for step in range(STEPS):
        w, w_hp = runs[0][fp8]["stats"][step][WEIGHT_ROWS], runs[0][hp]["stats"][step][WEIGHT_ROWS]
        assert torch.equal(w[:, : NUMEL + 1], w_hp[:, : NUMEL + 1])


@pytest.mark.slow
def test_block_recipe_gathers_in_high_precision(runs):
    key = ("mxfp8", True, "None")
    ref = reference("mxfp8")
    for r in range(WORLD):
        assert runs[r][key]["unsharded_type"] in ("Parameter", "Tensor")
        assert {d for d, _ in runs[r][key]["gathered"]} == {torch.float32}
    torch.testing.assert_close(global_losses(runs, key), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)


def test_gathered_weight_dequantizes_for_other_ops():
    q = torch.tensor([[1.0, -2.0], [0.5, 448.0]]).to(torch.float8_e4m3fn)
    w = FP8GatheredWeight(q, torch.tensor(0.25), torch.bfloat16)
    assert w.dtype == torch.bfloat16 and w.shape == (2, 2)
    expected = torch.tensor([[0.25, -0.5], [0.125, 112.0]], dtype=torch.bfloat16)
    assert torch.equal(w + 0, expected)
    v = w.view(4)
    assert isinstance(v, FP8GatheredWeight) and v._data.data_ptr() == q.data_ptr()  # views alias the FP8 data


def uneven_worker(rank: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, port, 3):
        res = {}
        for name in ("delayed", "current"):
            for fp8_ag in (True, False):
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(32, 80), nn.GELU(), nn.Linear(80, 48))
                fp8_trainer.convert_to_fp8(model, recipe=RECIPES[name]())
                if fp8_ag:
                    enable_fp8_all_gather(model)
                fully_shard(model[0])
                fully_shard(model)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                losses, stats = [], []
                for step in range(2):
                    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + rank))
                    with fp8_autocast():
                        loss = model(x).pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
                    stats.append(fp8_trainer.step_stats(model)[[1, 4]].clone())
                res[(name, fp8_ag)] = (losses, stats)
        out[rank] = res


@pytest.mark.slow
def test_uneven_shards_three_ranks():
    """80 and 48 rows over 3 ranks: FSDP2 pads the last shard; the FP8 all-gather pads its FP8 shard alike,
    and the statistics count the weight's own elements only."""
    out = spawn_ranks(uneven_worker, 3)
    for name in ("delayed", "current"):
        for r in range(3):
            (losses, stats), (hp_losses, hp_stats) = out[r][(name, True)], out[r][(name, False)]
            assert losses == hp_losses
            for w, w_hp in zip(stats, hp_stats, strict=True):
                assert torch.equal(w[:, : NUMEL + 1], w_hp[:, : NUMEL + 1])
                assert w[:, NUMEL].tolist() == [80 * 32, 48 * 80]


def test_enable_skips_tied_weights():
    from fp8_trainer.app.model import GPT, PRESETS

    model = GPT(PRESETS["tiny"])
    fp8_trainer.convert_to_fp8(model)  # lm_head too: its weight is the embedding's
    changed = enable_fp8_all_gather(model)
    assert "lm_head" not in changed and "blocks.0.mlp.fc" in changed
    assert model.lm_head.weight is model.wte.weight  # still tied
    assert type(model.blocks[0].mlp.fc.weight.data).__name__ == "FP8ShardedWeight"
    assert enable_fp8_all_gather(model) == []  # once is enough
