"""fp8-train --save / --resume: a resumed run continues exactly as the uninterrupted one (in-process)."""

import pytest
import torch

from fp8_trainer import get_fp8_state
from fp8_trainer.app import cli
from fp8_trainer.app.checkpoint import CHECKPOINT_VERSION, load_checkpoint
from fp8_trainer.app.train import train

# gradient accumulation, a scale interval of 2 resumed after an odd step, warmup + cosine and an evaluation
# before the save: every piece of state that could be lost is exercised
BASE = ["--batch-size", "2", "--seq-len", "16", "--grad-accum", "2", "--no-progress", "--steps", "7"]
BASE += ["--warmup-steps", "2", "--eval-interval", "2", "--eval-iters", "2"]
FLAGS = [*BASE, "--recipe", "delayed", "--interval", "2", "--amax-history-len", "4"]


pytestmark = pytest.mark.usefixtures("one_thread")


def run(*extra: str):
    a, prepared = cli.prepare([*FLAGS, *extra])
    lines = []
    return train(a, prepared, out=lines.append), lines


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted run, saving after steps 3 and 6 and at its end (7)."""
    path = tmp_path_factory.mktemp("full")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    result, lines = run("--save", str(path / "ck-{step}.pt"), "--save-interval", "3")
    torch.set_num_threads(n)
    return result, lines, path


@pytest.mark.slow
def test_resume_continues_identically(full_run, tmp_path):
    full, lines, saved = full_run
    assert sorted(p.name for p in saved.iterdir()) == ["ck-3.pt", "ck-6.pt", "ck-7.pt"]  # and the end
    assert f"step     3  saved {saved / 'ck-3.pt'}" in lines
    ckpt = load_checkpoint(saved / "ck-3.pt")
    assert ckpt["step"] == 3 and ckpt["config"]["preset"] == "tiny" and "token" not in ckpt["config"]
    assert ckpt["model"]["blocks.0.mlp.fc._extra_state"]["step"] == 3  # the FP8 scaling state is in it

    resumed, lines = run("--resume", str(saved / "ck-3.pt"), "--save", str(tmp_path / "resumed.pt"))
    assert any("resuming after step 3" in line for line in lines)
    assert resumed.step == 7 and len(resumed.losses) == 4
    assert resumed.losses == full.losses[3:]  # exactly: same data, weights, optimizer, FP8 scales
    assert [v for s, v in resumed.val_losses if s in (4, 6, 7)] == [v for s, v in full.val_losses if s > 3]
    s1, s2 = get_fp8_state(full.model), get_fp8_state(resumed.model)
    for name in ("amax_history", "scale", "scale_inv", "last_stats"):
        assert torch.equal(getattr(s1, name), getattr(s2, name)), name
    assert s1.steps == s2.steps == 7
    a, b = load_checkpoint(saved / "ck-7.pt"), load_checkpoint(tmp_path / "resumed.pt")
    for key, value in a["model"].items():
        if not key.endswith("_extra_state"):
            assert torch.equal(value, b["model"][key]), key
    for key, st in a["optimizer"]["state"].items():
        assert all(torch.equal(st[k], b["optimizer"]["state"][key][k]) for k in st), key
    assert torch.equal(a["rng"]["data"][0], b["rng"]["data"][0])


def test_resume_without_restoring_the_data_stream_would_differ(full_run, tmp_path):
    """Guards the test above: the state it checks matters (a resume with a fresh data stream diverges)."""
    full, _, saved = full_run
    ckpt = load_checkpoint(saved / "ck-3.pt")
    ckpt["rng"]["data"] = []  # as if the data-stream state were not saved
    torch.save(ckpt, tmp_path / "no-rng.pt")
    resumed, lines = run("--resume", str(tmp_path / "no-rng.pt"))
    assert "note: the checkpoint has data streams for 0 ranks; ranks beyond start fresh" in lines
    assert resumed.losses != full.losses[3:]


@pytest.fixture(scope="module")
def checkpoint_at_3(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "ck.pt"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    run("--steps", "3", "--save", str(path))
    torch.set_num_threads(n)
    return path


@pytest.mark.parametrize(
    "args,message",
    [
        (["--preset", "124m"], "--resume: the checkpoint was saved with --preset tiny, not --preset 124m"),
        (["--recipe", "fp32"], "--resume: the checkpoint was saved with --recipe delayed"),
        (["--steps", "3"], "--resume: the checkpoint is at step 3; --steps 3 leaves nothing to train"),
        (["--inject", "lr-spike@2"], "before the resumed run's first step 4"),
    ],
)
def test_incompatible_resume_is_an_error(checkpoint_at_3, args, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.prepare([*BASE, "--resume", str(checkpoint_at_3), *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_resume_of_a_missing_or_foreign_file_is_an_error(tmp_path, capsys):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    for name, message in [
        ("nope.pt", "nope.pt: no such file"),
        ("junk.pt", "junk.pt: not a readable fp8-train checkpoint"),
        (
            "other.pt",
            f"other.pt: expected an fp8-train checkpoint of version {CHECKPOINT_VERSION}, got version None",
        ),
    ]:
        with pytest.raises(SystemExit):
            cli.prepare([*FLAGS, "--resume", str(tmp_path / name)])
        assert f"--resume {tmp_path / message}" in capsys.readouterr().err
