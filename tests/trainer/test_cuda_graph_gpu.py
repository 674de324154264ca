"""``GraphedStep`` on a GPU: a whole FP8 training step (forward, backward, scale update, optimizer step)
captured in a CUDA graph and replayed trains as the same steps run eagerly, the monitor's reader gets every
replayed step, and a recipe change between replays is captured again and takes effect. Skips without an
sm_89+ GPU."""

import pytest
import torch
from torch import nn

import fp8_trainer
from fp8_trainer.convert import get_fp8_state
from fp8_trainer.graphs import GraphedStep
from tests.support.gpu import FP8_GPU

pytestmark = FP8_GPU

STEPS = 7
BUFFERS = ("amax_history", "scale", "scale_inv", "last_stats", "step_t")


def _setup(recipe):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
    model = fp8_trainer.convert_to_fp8(mlp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    x = torch.empty(512, 256, device="cuda")

    def train_step():
        with (
            fp8_trainer.fp8_autocast(fp8_recipe=recipe),
            torch.autocast("cuda", torch.bfloat16, cache_enabled=False),
        ):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return model, opt, x, train_step


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randn(512, 256, device="cuda", generator=g) * (1 + i % 3) for i in range(STEPS)]


def _run(recipe, graphed: bool, change_at: int | None = None):
    """STEPS steps of the same inputs, eager (in-place updates, the arithmetic a replay runs) or through
    ``GraphedStep``; at ``change_at`` layer 0 gets margin 2. Returns the model, what the reader got per step,
    the losses, and the GraphedStep (or None)."""
    model, opt, x, step = _setup(recipe)
    state = get_fp8_state(model)
    reader = fp8_trainer.StatsReader(model)
    runner = GraphedStep(step, model, warmup=3, optimizer=opt) if graphed else None
    if not graphed:
        state.set_capturable(True)
    losses, stats = [], []
    for i, xi in enumerate(_inputs()):
        if i == change_at:
            fp8_trainer.set_layer_recipe(model, "0", margin=2)
        x.copy_(xi)
        if graphed:
            loss = runner()
        else:
            loss = step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.clone())
        got = reader.take()
        assert got is not None and got[1] == 1, f"step {i}: the reader got {got and got[1]} steps"
        stats.append(got[0].clone())
    return model, stats, losses, runner


def _assert_same(eager, graphed):
    (model_e, stats_e, losses_e, _), (model_g, stats_g, losses_g, _) = eager, graphed
    state_e, state_g = get_fp8_state(model_e), get_fp8_state(model_g)
    assert state_g.steps == state_e.steps == STEPS
    for i, (a, b) in enumerate(zip(losses_e, losses_g, strict=True)):
        assert torch.equal(a, b), f"loss of step {i}: {a.item()} vs {b.item()}"
    for i, (a, b) in enumerate(zip(stats_e, stats_g, strict=True)):
        assert torch.equal(a, b), f"statistics of step {i}"
    for name in BUFFERS:
        assert torch.equal(getattr(state_e, name), getattr(state_g, name)), name
    for p, q in zip(model_e.parameters(), model_g.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "recipe",
    [
        fp8_trainer.DelayedScaling(),
        fp8_trainer.CurrentScaling(),
        fp8_trainer.MXFP8BlockScaling(),
        fp8_trainer.Float8BlockScaling(),
    ],
    ids=["delayed", "current", "mxfp8", "block"],
)
def test_replayed_steps_train_as_eager_steps(recipe):
    graphed = _run(recipe, graphed=True)
    assert graphed[3].captures == 1
    _assert_same(_run(recipe, graphed=False), graphed)


def test_recipe_change_between_replays_is_captured_again():
    recipe = fp8_trainer.DelayedScaling()
    graphed = _run(recipe, graphed=True, change_at=5)
    assert graphed[3].captures == 2  # once after the warm-up, again after the change
    _assert_same(_run(recipe, graphed=False, change_at=5), graphed)
    # the change took effect: layer 0's input and weight were scaled with 2**-2 of the step before
    stats = graphed[1]
    for col in (0, 1):
        ratio = stats[4][col, 1].item() / stats[6][col, 1].item()
        assert 3.0 < ratio < 5.0, (col, ratio)


def test_a_model_without_fp8_layers_is_graphed_too():
    # the bf16 baseline of bench/gpt_throughput.py: no FP8 step closed, none counted, and replays train
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    x = torch.randn(32, 64, device="cuda")

    def train_step():
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    graphed = GraphedStep(train_step, model, warmup=2, optimizer=opt)
    losses = [graphed().item() for _ in range(6)]
    assert graphed.captures == 1 and get_fp8_state(model).steps == 0
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("compile_model", [False, True], ids=["eager", "compiled"])
def test_fp8_train_cuda_graph_trains_as_the_eager_loop(monkeypatch, compile_model):
    """``fp8-train --cuda-graph``: captured once after the warm-up, every later step a replay, and the run's
    losses those of the eager loop. The first step's loss is the same forward on the same weights, bit for
    bit; later ones follow updates by the capturable AdamW (a tensor learning rate), whose arithmetic is
    not the eager AdamW's to the last bit, so they are compared at bf16's resolution. With ``--compile``
    (both runs), the compiled parts between the FP8 Linears are captured with them."""
    from fp8_trainer.app import train_graph
    from fp8_trainer.app.train import train
    from fp8_trainer.app.train_config import TrainConfig

    runners = []

    class Recorded(GraphedStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            runners.append(self)

    monkeypatch.setattr(train_graph, "GraphedStep", Recorded)
    base = dict(preset="tiny", steps=12, batch_size=8, seq_len=64, eval_interval=0, progress=False,
                device="cuda", grad_accum=2, min_lr=1e-4, warmup_steps=2, compile=compile_model)  # fmt: skip
    eager = train(TrainConfig(**base), out=lambda s: None)
    graphed = train(TrainConfig(**base, cuda_graph=True), out=lambda s: None)
    (runner,) = runners
    assert runner.calls == 12 and runner.captures == 1
    assert get_fp8_state(graphed.model).steps == get_fp8_state(eager.model).steps == 12
    assert graphed.losses[0] == eager.losses[0]
    assert graphed.losses == pytest.approx(eager.losses, rel=2**-7)
    assert graphed.losses[-1] < graphed.losses[0]
