"""fp8-train under torchrun, 2 CPU processes (gloo): DDP and the FP8 amax reduction keep the ranks equal."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from fp8_trainer.app.checkpoint import load_checkpoint

# Each rank runs the real fp8-train flags and loop, then dumps its own final state (only rank 0 saves
# checkpoints, so the comparison needs this).
WORKER = """
import sys, torch
from fp8_trainer import get_fp8_state, step_stats
from fp8_trainer.app import cli
from fp8_trainer.app.build import dist_env
from fp8_trainer.app.train import train

torch.set_num_threads(1)
a, prepared = cli.prepare(sys.argv[2:])
result = train(a, prepared, out=lambda line: print(line, flush=True))
state = get_fp8_state(result.model)
torch.save(
    {
        "weights": {k: v for k, v in result.model.state_dict().items() if not k.endswith("_extra_state")},
        "scale": state.scale, "amax_history": state.amax_history, "stats": step_stats(result.model),
        "losses": result.losses,
    },
    f"{sys.argv[1]}/rank{dist_env()[0]}.pt",
)
"""
STEPS = 4


@pytest.mark.slow
def test_two_ranks_end_identical(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    flags = ["--steps", str(STEPS), "--batch-size", "2", "--seq-len", "16", "--grad-accum", "2"]
    flags += ["--eval-interval", "2", "--eval-iters", "1", "--log-interval", "2", "--no-progress"]
    flags += ["--save", str(tmp_path / "ck.pt"), "--inject", "overflow:blocks.0.mlp.fc@3"]
    # PYTHONFAULTHANDLER: a process of the job sent SIGABRT prints its Python stacks as it ends
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.Popen(
        [*cmd, str(script), str(tmp_path), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: the agent and both ranks
    )
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # a hang seen twice in full runs, never alone: show where each waits
        os.killpg(proc.pid, signal.SIGABRT)
        out, err = proc.communicate(timeout=60)
        pytest.fail(
            f"the 2-rank run did not end in 120 s; its output and stacks:\n{out[-3000:]}\n{err[-20000:]}"
        )
    assert proc.returncode == 0, out[-3000:] + err[-3000:]

    ranks = [torch.load(tmp_path / f"rank{k}.pt", weights_only=True) for k in range(2)]
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own data...
    assert not torch.equal(ranks[0]["stats"][:, 0], ranks[1]["stats"][:, 0])  # ...and saw its own amaxes
    for key, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][key]), key  # DDP: identical weights
    assert torch.equal(ranks[0]["scale"], ranks[1]["scale"])  # amax reduction: identical FP8 scales
    assert torch.equal(ranks[0]["amax_history"], ranks[1]["amax_history"])
    reduced = torch.maximum(ranks[0]["stats"][:, 0], ranks[1]["stats"][:, 0]).float()
    assert torch.equal(ranks[0]["amax_history"][0], reduced)  # the newest entry is the max over ranks

    ckpt = load_checkpoint(tmp_path / "ck.pt")  # written by rank 0 alone, with both ranks' data streams
    assert ckpt["step"] == STEPS and len(ckpt["rng"]["data"]) == 2
    assert not torch.equal(ckpt["rng"]["data"][0], ckpt["rng"]["data"][1])
    assert out.count("fp8-train: preset tiny") == 1 and "2 ranks" in out  # only rank 0 prints
    assert out.count("inject: step 3: overflow: blocks.0.mlp.fc.weight") == 1
    assert out.count(f"step {STEPS:5d}  val loss") == 1 and out.count("FP8 health after step 4") == 1
