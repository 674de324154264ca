"""fp8-train --inject: each fault shows in step_stats at its step and tensor (real training, in-process)."""

import pytest
import torch

from fp8_trainer import step_stats, tensor_table
from fp8_trainer.app import cli
from fp8_trainer.app.inject import Injection, parse_injection
from fp8_trainer.app.train import train

FLAGS = ["--batch-size", "4", "--seq-len", "32", "--eval-interval", "0", "--no-progress"]
FLAGS += ["--lr-schedule", "constant", "--warmup-steps", "0"]
OVERFLOW, NAN = "blocks.1.mlp.fc", "blocks.2.attn.qkv"


pytestmark = pytest.mark.usefixtures("one_thread")


def run(steps: int, *extra: str):
    """Train; return the result, per-step (lr, stats) and the printed lines."""
    a, prepared = cli.prepare(["--steps", str(steps), *FLAGS, *extra])
    per_step, lines = {}, []
    result = train(
        a,
        prepared,
        on_step=lambda step, model, info: per_step.__setitem__(step, (info["lr"], step_stats(model).clone())),
        out=lines.append,
    )
    return result, per_step, lines


def row(model, name: str) -> int:
    return next(t.index for t in tensor_table(model) if t.name == name)


def test_overflow_and_nan_hit_their_tensor_at_their_step():
    clean, clean_steps, _ = run(6)
    r, steps, lines = run(6, "--inject", f"overflow:{OVERFLOW}@3", "--inject", f"nan:{NAN}@5")
    overflow, nonfinite = 2, 4  # STAT_COLUMNS: amax, scale, overflow, underflow, nonfinite, numel
    w = row(r.model, f"{OVERFLOW}.weight")

    assert torch.equal(steps[2][1], clean_steps[2][1])  # nothing changes before the first injection
    assert steps[2][1][w, overflow] == 0
    at3 = steps[3][1]
    assert at3[w, overflow] > 0.5 * at3[w, 5]  # x1e4: most of the weight saturates at step 3
    weights = [t.index for t in tensor_table(r.model) if t.role == "weight" and t.index != w]
    assert torch.equal(at3[weights], clean_steps[3][1][weights])  # the other weights are untouched
    assert clean_steps[3][1][w, overflow] == 0
    assert at3[w, 0] > 100 and steps[4][1][w, 0] < 1  # weight amax: restored after its step (init std 0.02)

    x = row(r.model, f"{NAN}.input")
    assert steps[4][1][:, nonfinite].sum() == 0
    at5 = steps[5][1]
    assert at5[x, nonfinite] > 0
    upstream = [
        t.index
        for t in tensor_table(r.model)
        if t.role == "input" and t.layer.startswith(("blocks.0.", "blocks.1."))
    ]
    assert len(upstream) == 8 and at5[upstream, nonfinite].sum() == 0  # blocks 0-1: the NaN enters at NAN
    assert "inject: step 3: overflow: blocks.1.mlp.fc.weight x10000 for this step" in lines
    assert f"inject: step 5: nan: one NaN in {NAN}.input" in lines
    assert "warning: non-finite training loss" in lines


def test_lr_spike_multiplies_the_lr_and_the_loss_spikes_after():
    clean, clean_steps, _ = run(8)
    r, steps, lines = run(8, "--inject", "lr-spike@7")
    assert steps[7][0] == pytest.approx(100 * clean_steps[7][0])
    assert steps[6][0] == clean_steps[6][0] and steps[8][0] == clean_steps[8][0]
    assert r.losses[:7] == clean.losses[:7]  # step 7's own forward comes before its update
    assert r.losses[7] > 1.2 * clean.losses[7] and r.losses[7] > max(r.losses[:7])
    assert "inject: step 7: lr-spike: learning rate x100" in lines


def test_overflow_factor():
    a, prepared = cli.prepare(["--steps", "2", *FLAGS, "--inject", f"overflow:{OVERFLOW}@2x1e3"])
    seen = []

    def on_step(step, model, info):
        w = model.get_submodule(OVERFLOW).weight
        seen.append((w.detach().abs().max().item(), step_stats(model)[row(model, f"{OVERFLOW}.weight"), 0]))

    train(a, prepared, on_step=on_step, out=lambda line: None)
    (w_after_1, _), (w_after_2, amax_2) = seen
    assert amax_2.item() == torch.tensor(w_after_1 * 1e3, dtype=torch.float32).item()  # step 2 saw w x 1e3
    assert w_after_2 < 1  # and the weight is back to its own scale after it


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("overflow:blocks.0.attn.qkv@5", Injection("overflow", 5, "blocks.0.attn.qkv", 1e4)),
        ("overflow:blocks.0.attn.qkv@5x300", Injection("overflow", 5, "blocks.0.attn.qkv", 300.0)),
        ("nan:blocks.3.mlp.fc2@12", Injection("nan", 12, "blocks.3.mlp.fc2")),
        ("lr-spike@7", Injection("lr-spike", 7, None, 100.0)),
        ("lr-spike@7x2.5", Injection("lr-spike", 7, None, 2.5)),
        ("jump:blocks.1.mlp.fc@9", Injection("jump", 9, "blocks.1.mlp.fc", 16.0)),
        ("gradspike:blocks.1.mlp.fc@9x64", Injection("gradspike", 9, "blocks.1.mlp.fc", 64.0)),
        ("lowprec:blocks.1.mlp.fc@9", Injection("lowprec", 9, "blocks.1.mlp.fc", 2.0**20)),
    ],
)
def test_parse(spec, expected):
    assert parse_injection(spec) == expected


@pytest.mark.parametrize(
    "spec,message",
    [
        ("overflow@5", "expected overflow:LAYER@STEP"),
        ("nan:blocks.0.mlp.fc@5x3", "expected overflow:LAYER@STEP"),
        ("lr-spike@0", "STEP must be >= 1"),
        ("lr-spike@3x0", "FACTOR must be a finite number > 0"),
        ("lr-spike@3x1e999", "FACTOR must be a finite number > 0"),
        ("underflow:blocks.0.mlp.fc@2", "expected overflow:LAYER@STEP"),
        ("jump:blocks.0.mlp.fc@2x0.5", "a jump's FACTOR must be > 1"),
        ("lowprec:blocks.0.mlp.fc", "expected overflow:LAYER@STEP"),
    ],
)
def test_parse_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_injection(spec)


def test_a_persistent_fault_acts_from_its_step_on_and_is_announced_once():
    jump, spike = parse_injection("jump:blocks.1.mlp.fc@4"), parse_injection("gradspike:blocks.1.mlp.fc@4")
    assert [jump.active(s) for s in (3, 4, 9)] == [False, True, True]
    assert [spike.active(s) for s in (3, 4, 9)] == [False, True, False]
    r, steps, lines = run(6, "--inject", "jump:blocks.1.mlp.fc@4")
    x, overflow = row(r.model, "blocks.1.mlp.fc.input"), 2
    assert steps[3][1][x, overflow] == 0
    assert steps[4][1][x, overflow] > 0  # the input x16 saturates against the history of the smaller one
    assert steps[5][1][x, overflow] == 0  # still x16, but the history has seen it
    assert [line for line in lines if line.startswith("inject:")] == [
        "inject: step 4: jump: blocks.1.mlp.fc.input x16 from this step on, undone on its output"
    ]


def test_gradspike_saturates_grad_output_only_and_is_exact_in_float32():
    """The gradient x2**20 at the layer's output overflows its E5M2 cast at its step, nothing else; a float32
    run with it trains bit for bit as one without (the factor is a power of two), and so, measured, does the
    loss of the FP8 run's next steps (AdamW takes one saturated gradient in its stride)."""
    layer = "blocks.1.mlp.fc"
    clean, clean_steps, _ = run(6)
    r, steps, _ = run(6, "--inject", f"gradspike:{layer}@4")
    go = row(r.model, f"{layer}.grad_output")
    overflow, numel = 2, 5
    assert steps[4][1][go, overflow] > 0.99 * steps[4][1][go, numel]  # all but its zeros saturate, at step 4
    assert steps[3][1][go, overflow] == 0 and steps[5][1][go, overflow] == 0
    others = [t.index for t in tensor_table(r.model) if t.index != go]
    assert steps[4][1][others, overflow].sum() == clean_steps[4][1][others, overflow].sum()
    assert r.losses[:4] == clean.losses[:4]

    def fp32(*extra):
        a, prepared = cli.prepare(["--steps", "6", *FLAGS, "--recipe", "fp32", *extra])
        return train(a, prepared, out=lambda line: None).losses

    assert fp32("--inject", f"gradspike:{layer}@4") == fp32()
    # the FP8 run's next losses: within 1% of the clean run's (the loss falls by ~8% a step here)
    assert all(abs(x - c) < 0.01 * c for x, c in zip(r.losses[4:], clean.losses[4:], strict=True))
