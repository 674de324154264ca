"""``fp8-train --tp`` under torchrun, CPU processes (gloo): tensor parallelism, alone and with FSDP2 on a 2-D
mesh, trains as DDP does, and its sharded checkpoint resumes on another number of ranks and another layout.

Three runs of the tiny preset, delayed scaling, two micro-batches a step:

* ``mesh``: 4 ranks, ``--fsdp --tp 2`` (a ``(dp=2, tp=2)`` mesh), 4 steps, a sharded checkpoint after step 2;
* ``ddp``: 2 ranks, the same flags without ``--fsdp --tp`` (DDP), at the same time. DP rank ``d`` of
  ``mesh`` trains the data stream DDP's rank ``d`` trains: the two tp ranks of a group draw the same batches;
* ``tp``: 2 ranks, ``--tp 2`` alone (one TP group, no data parallelism), resumes ``mesh``'s step-2
  checkpoint (4 ranks on a 2-D mesh -> 2 ranks on a 1-D one) and runs to 4.

``mesh`` against ``ddp``: the weights start equal and delayed scaling takes every scale from the amax history,
which both fill with amaxes reduced over all ranks (the tp shards' rows merged first), so the FP8 casts use
the same scales. Both run with ``--grad-clip 0``, as in ``test_train_fsdp_gloo.py`` (where FSDP2 and DDP then
give the same bits). What differs is float32 summation order: the row-wise layers' partial sums are added by
an all-reduce. An ulp there moves an AdamW update of a near-zero gradient element, and an FP8 value of a
later step by one rounding step now and then, averaged out over thousands of products: tolerance 1e-4
relative on the losses, a hundred times less than what a head split across ranks, an unreduced amax or an
unsynchronised gradient moves them (percents). The gradient clipping over several meshes
(``clip_over_meshes``) runs all the same: it measures the norm.

The resumed run's first step is ``mesh``'s step 3 for dp group 0 (its data stream, its weights and FP8
scales restored onto another mesh), so rank 0's loss there equals ``mesh`` rank 0's to float32 rounding, and
its casts used exactly the scales ``mesh`` had after step 2.
"""

from __future__ import annotations

import pytest
import torch

from fp8_trainer.app.checkpoint import load_checkpoint
from fp8_trainer.app.cli import prepare
from tests.trainer.test_train_fsdp_gloo import LOSS_RTOL, WORKER, check_resumed, dumps, finish, launch, losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("tp")
    (tmp / "worker.py").write_text(WORKER)
    mesh = launch(tmp, "mesh", 4, "--steps", "4", "--fsdp", "--tp", "2", "--save", str(tmp / "ck-{step}"),
                  "--save-interval", "2")  # fmt: skip
    ddp = launch(tmp, "ddp", 2, "--steps", "4")
    out = {"mesh_out": finish(mesh), "ddp_out": finish(ddp)}
    tp = launch(tmp, "tp", 2, "--steps", "4", "--tp", "2", "--resume", str(tmp / "ck-2"))
    out["tp_out"] = finish(tp)
    for name, ranks in (("mesh", 4), ("ddp", 2), ("tp", 2)):
        out[name] = dumps(tmp, name, ranks)
    out["dir"] = tmp
    return out


@pytest.mark.slow
def test_fsdp_with_tensor_parallelism_trains_as_ddp(runs):
    mesh, ddp = runs["mesh"], runs["ddp"]
    assert "4 ranks, FSDP2, tensor parallel over 2" in runs["mesh_out"]
    for d in range(2):  # dp group d: ranks 2d and 2d + 1, the same batches, the same loss
        assert torch.equal(losses(mesh[2 * d]), losses(mesh[2 * d + 1]))
        torch.testing.assert_close(losses(mesh[2 * d]), losses(ddp[d]), rtol=LOSS_RTOL, atol=0)
    mean = (losses(mesh[0]) + losses(mesh[2])) / 2
    assert mean[-1] < mean[0] - 0.2  # it trains (from about ln 256 = 5.5)
    # one amax history on every rank: the sharded tensors' amaxes are the whole tensors'
    for r in range(1, 4):
        assert torch.equal(mesh[r]["steps"][4]["amax_history"], mesh[0]["steps"][4]["amax_history"])
    torch.testing.assert_close(mesh[0]["steps"][4]["scale"], ddp[0]["steps"][4]["scale"], rtol=0.05, atol=0)


@pytest.mark.slow
def test_tensor_parallel_checkpoint_resumes_on_another_mesh(runs):
    ck = load_checkpoint(runs["dir"] / "ck-2")
    assert ck["step"] == 2 and ck["sharded"] and len(ck["rng"]["data"]) == 2  # one stream per dp group
    assert "resuming after step 2" in runs["tp_out"] and "2 ranks, tensor parallel over 2" in runs["tp_out"]
    for r in range(2):  # both ranks of the one TP group continue dp group 0
        check_resumed(runs["mesh"][0], runs["tp"][r], 2)
    assert sorted(runs["tp"][0]["steps"]) == [3, 4]
    assert torch.equal(losses(runs["tp"][0]), losses(runs["tp"][1]))


def test_tp_refuses_what_cannot_run(capsys, monkeypatch):
    for flags, message in (
        (["--tp", "0"], "--tp must be >= 1"),
        (["--tp", "8"], "--tp 8: preset tiny's 4 attention heads do not split over 8 ranks"),
        (["--tp", "2", "--recipe", "mxfp8"], "--tp: not with --recipe mxfp8"),
        (["--tp", "2", "--compile"], "--tp: not with --compile"),
        (["--tp", "2", "--inject", "nan:blocks.0.mlp.fc@2"], "--tp: not with --inject"),
        (["--tp", "2"], "--tp 2: the 1 ranks do not split into groups of 2"),
    ):
        with pytest.raises(SystemExit) as exit_:
            prepare(["--steps", "4", *flags])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets it: 4 ranks, groups of 2, no --fsdp
    with pytest.raises(SystemExit) as exit_:
        prepare(["--steps", "4", "--tp", "2"])
    assert exit_.value.code == 2
    assert "--tp 2 on 4 ranks: data parallelism across the groups needs --fsdp" in capsys.readouterr().err
