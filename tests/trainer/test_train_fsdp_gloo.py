"""``fp8-train --fsdp`` under torchrun, CPU processes (gloo): FSDP2 trains as DDP does, and its sharded
checkpoints resume on another number of ranks with the FP8 scaling state they saved.

Four runs of the tiny preset, delayed scaling, two micro-batches a step:

* ``fsdp``: 2 ranks, ``--fsdp``, 6 steps, a sharded checkpoint after steps 3 and 6, an evaluation at 3 and 6;
* ``ddp``: the same flags without ``--fsdp`` (DDP), at the same time;
* ``one``: 1 rank, ``--fsdp``, resumes ``fsdp``'s step-3 checkpoint (2 -> 1 ranks), runs to 6, saves after 5
  and 6;
* ``two``: 2 ranks, ``--fsdp``, resumes ``one``'s step-5 checkpoint (1 -> 2 ranks), runs to 7.

FSDP2 against DDP: each rank draws the same data either way, and the weights start equal. The FP8 weights
are the same bits (delayed scaling: both quantize with the history's scale, FSDP2 before the all-gather);
the gradients are averaged over the ranks either way (all-reduce / reduce-scatter), element by element. The
runs go with ``--grad-clip 0`` (the gradient norm measured, not applied): then the losses are the same bits
(measured: 0 difference over six steps). With clipping on, the norm is a float32 sum taken in another order
(per shard, then over the ranks, against per parameter); an ulp of the clipping coefficient moves every
update a little, AdamW turns an ulp's difference in a near-zero gradient element into a different update of
that element, and an FP8 value of a later step moves by one rounding step here and there (measured: 1.4e-4
relative on a loss, 9e-6 with the attention's former qkv layout: which elements flip is luck). The
tolerance stays 1e-4, a hundred times less than what a weight all-gathered with a wrong scale, a shard taken
for the whole weight or an unsynchronised gradient moves them (percents); an amax is one element, and the
scales are compared to 5%. Saving a checkpoint changes nothing (a run without ``--save`` is bit for bit the
same, checked by hand).

A resumed run's first step is the saving run's next step on rank 0 (its data stream, weights and FP8 scales
restored, on any number of ranks), so its loss there is equal to the uninterrupted run's to float32
rounding (the GEMMs of an unsharded and a sharded forward are the same), and the scales its FP8 casts used
(the statistics' scale column) are exactly those the saving run had after the saved step.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fp8_trainer.app.build import run_config
from fp8_trainer.app.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from fp8_trainer.app.cli import prepare
from fp8_trainer.app.train_config import TrainConfig

# Each rank runs the real fp8-train flags and loop and dumps, per step, its loss and FP8 state.
WORKER = """
import sys, torch
from fp8_trainer import get_fp8_state, step_stats
from fp8_trainer.app import cli
from fp8_trainer.app.build import dist_env
from fp8_trainer.app.train import train

torch.set_num_threads(1)
steps = {}

def on_step(step, model, info):
    state = get_fp8_state(model)
    steps[step] = {
        "loss": info["loss"].item(), "stats": step_stats(model).clone(), "scale": state.scale.clone(),
        "amax_history": state.amax_history.clone(), "fp8_steps": state.steps,
    }

a, prepared = cli.prepare(sys.argv[2:])
result = train(a, prepared, on_step=on_step, out=lambda line: print(line, flush=True))
torch.save({"steps": steps, "val": result.val_losses}, f"{sys.argv[1]}-rank{dist_env()[0]}.pt")
"""
FLAGS = ["--batch-size", "4", "--seq-len", "32", "--grad-accum", "2", "--lr", "3e-3", "--no-progress"]
FLAGS += ["--eval-interval", "3", "--eval-iters", "1", "--log-interval", "3", "--grad-clip", "0"]
LOSS_RTOL = 1e-4  # FSDP2 against DDP (module docstring)
SCALE_RTOL = 0.05
SCALE = 1  # the statistics' scale column


def launch(tmp_path, name: str, ranks: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd += [str(tmp_path / "worker.py"), str(tmp_path / name), *FLAGS, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(p: subprocess.Popen) -> str:
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    return out


def dumps(tmp_path, name: str, ranks: int) -> list[dict]:
    return [torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=True) for r in range(ranks)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("fsdp")
    (tmp / "worker.py").write_text(WORKER)
    ck = str(tmp / "ck-{step}")
    fsdp = launch(tmp, "fsdp", 2, "--steps", "6", "--fsdp", "--save", ck, "--save-interval", "3")
    ddp = launch(tmp, "ddp", 2, "--steps", "6")
    out = {"fsdp_out": finish(fsdp), "ddp_out": finish(ddp)}
    resume = ["--fsdp", "--save", str(tmp / "one-ck-{step}"), "--save-interval", "5"]
    one = launch(tmp, "one", 1, "--steps", "6", "--resume", str(tmp / "ck-3"), *resume)
    out["one_out"] = finish(one)
    two = launch(tmp, "two", 2, "--steps", "7", "--fsdp", "--resume", str(tmp / "one-ck-5"))
    out["two_out"] = finish(two)
    for name, ranks in (("fsdp", 2), ("ddp", 2), ("one", 1), ("two", 2)):
        out[name] = dumps(tmp, name, ranks)
    out["dir"] = tmp
    return out


def losses(dump: dict) -> torch.Tensor:
    return torch.tensor([dump["steps"][s]["loss"] for s in sorted(dump["steps"])])


@pytest.mark.slow
def test_fsdp_trains_as_ddp(runs):
    fsdp, ddp = runs["fsdp"], runs["ddp"]
    assert "2 ranks, FSDP2" in runs["fsdp_out"] and "FSDP2" not in runs["ddp_out"]
    mean = (losses(fsdp[0]) + losses(fsdp[1])) / 2
    assert torch.isfinite(mean).all() and len(mean) == 6
    assert mean[-2:].mean() < mean[0] - 0.3  # it trains (from about ln 256 = 5.5)
    for r in range(2):
        diff = ((losses(fsdp[r]) - losses(ddp[r])) / losses(ddp[r])).abs().max().item()
        print(f"rank {r}: max relative loss difference FSDP2 - DDP {diff:.2e}")
        torch.testing.assert_close(losses(fsdp[r]), losses(ddp[r]), rtol=LOSS_RTOL, atol=0)
        # the scales follow single extreme elements: as under DDP to the rounding above (module docstring)
        fsdp_scale, ddp_scale = fsdp[r]["steps"][6]["scale"], ddp[r]["steps"][6]["scale"]
        torch.testing.assert_close(fsdp_scale, ddp_scale, rtol=SCALE_RTOL, atol=0)
    assert torch.equal(fsdp[0]["steps"][6]["amax_history"], fsdp[1]["steps"][6]["amax_history"])
    # every rank evaluates under FSDP2 (a forward is a collective), rank 0 reports
    assert [s for s, _ in fsdp[0]["val"]] == [3, 6] and fsdp[1]["val"] == []
    torch.testing.assert_close(
        torch.tensor([v for _, v in fsdp[0]["val"]]), torch.tensor([v for _, v in ddp[0]["val"]]),
        rtol=LOSS_RTOL, atol=0,
    )  # fmt: skip


def check_resumed(saved: dict, resumed: dict, step: int, same_data: bool = True) -> None:
    """``resumed``'s first step ``step + 1`` continues ``saved``'s state after ``step``: its FP8 casts used
    the saved scales, its history is the saved one with the new step in front, its weights and rank 0's data
    are the saved ones (``same_data``: the same loss as ``saved``'s own step ``step + 1``, where ``saved``
    went on)."""
    before, first = saved["steps"][step], resumed["steps"][step + 1]
    assert first["fp8_steps"] == step + 1 and before["fp8_steps"] == step
    n = first["stats"].shape[0]
    assert torch.equal(first["stats"][:, SCALE], before["scale"][:n].double())
    assert torch.equal(first["amax_history"][1:], before["amax_history"][:-1])
    if same_data:
        torch.testing.assert_close(first["loss"], saved["steps"][step + 1]["loss"], rtol=1e-6, atol=0)


@pytest.mark.slow
def test_sharded_checkpoint_resumes_on_another_number_of_ranks(runs):
    ck = load_checkpoint(runs["dir"] / "ck-3")  # fp8-train.pt beside the shards
    assert ck["step"] == 3 and ck["sharded"] and len(ck["rng"]["data"]) == 2 and "model" not in ck
    assert sorted(p.name for p in (runs["dir"] / "ck-3").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "fp8-train.pt"
    ]  # fmt: skip
    # 2 -> 1 ranks, then 1 -> 2 ranks
    assert "resuming after step 3" in runs["one_out"] and "1 ranks" not in runs["one_out"]
    check_resumed(runs["fsdp"][0], runs["one"][0], 3)
    assert sorted(runs["one"][0]["steps"]) == [4, 5, 6]
    assert "resuming after step 5" in runs["two_out"] and "2 ranks, FSDP2" in runs["two_out"]
    for r in range(2):  # rank 1 starts a fresh data stream, on the same weights and scales
        check_resumed(runs["one"][0], runs["two"][r], 5, same_data=r == 0)
    assert runs["two"][0]["steps"][6]["loss"] != runs["two"][1]["steps"][6]["loss"]
    for dump in (*runs["one"], *runs["two"]):
        assert all(torch.isfinite(torch.tensor(s["loss"])) for s in dump["steps"].values())  # it trains on
    assert sorted(runs["two"][0]["steps"]) == [6, 7]


def test_fsdp_refuses_what_cannot_run(tmp_path, capsys):
    for flags, message in (
        (["--compile"], "--fsdp: not with --compile"),
        (["--inject", "nan:blocks.0.mlp.fc@2"], "--fsdp: not with --inject"),
        (["--capture-dir", str(tmp_path)], "--fsdp: not with --capture-dir"),
    ):
        with pytest.raises(SystemExit) as exit_:
            prepare(["--fsdp", "--steps", "4", *flags])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_checkpoint_layout_must_suit_the_run(runs, tmp_path, capsys):
    with pytest.raises(SystemExit):  # a sharded directory without --fsdp
        prepare(["--steps", "8", "--resume", str(runs["dir"] / "ck-3")])
    assert "resume it with --fsdp or --tp" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        prepare(["--fsdp", "--steps", "8", "--resume", str(tmp_path / "empty")])
    assert "not a sharded fp8-train checkpoint" in capsys.readouterr().err
    model = torch.nn.Linear(2, 2)  # a checkpoint file with --fsdp
    config = run_config(TrainConfig(), 256)
    opt = torch.optim.SGD(model.parameters())
    save_checkpoint(tmp_path / "ck.pt", TrainingState(model, opt, step=1, config=config, data_rng=[]))
    with pytest.raises(SystemExit):
        prepare(["--fsdp", "--steps", "8", "--resume", str(tmp_path / "ck.pt")])
    assert "--fsdp and --tp resume from a sharded checkpoint directory" in capsys.readouterr().err
