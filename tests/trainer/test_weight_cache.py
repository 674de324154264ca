"""A weight copy kept within an FP8 step (``fp8_trainer.weight_cache``) is never used once the weight changed.

Each case changes a weight between two forwards of one open FP8 step, in a way a user's loop does, and
checks the second forward against the same layer with no copy kept (``weight_cache.enabled = False``): the
output must be bit for bit the one of a fresh quantization of the new weight. Before the cache saw optimizer
steps and computed weights, a fused AdamW step, a write through ``.data`` after an optimizer step, a
parametrization and a swapped ``.data`` served the old weight (relative error about 1 against the new one).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import fp8_trainer
from fp8_trainer import DelayedScaling, convert_to_fp8, fp8_autocast, get_fp8_state, weights_changed

ADAMW = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "for-loop": {"foreach": False},
}


def _layer(seed: int = 0, recipe=None) -> nn.Sequential:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(64, 64)), recipe=recipe or DelayedScaling())


def _fresh(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The model's output with no weight copy kept: a fresh quantization of the weight as it is now."""
    cache = get_fp8_state(model).weight_cache
    cache.enabled = False
    try:
        with fp8_autocast(step_boundary=False), torch.no_grad():
            return model(x)
    finally:
        cache.enabled = True


def _open_step(model, x) -> None:
    """A recorded micro-batch that leaves the step open (its weight copy held)."""
    with fp8_autocast(step_boundary=False):
        model(x).square().mean().backward()
    assert len(get_fp8_state(model).weight_cache) == 1


def _second_forward(model, x) -> torch.Tensor:
    with fp8_autocast(step_boundary=False):
        return model(x).detach()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("impl", list(ADAMW))
def test_an_optimizer_step_inside_an_open_step_quantizes_the_new_weight(impl):
    model = _layer()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, **ADAMW[impl])
    x = torch.randn(32, 64)
    _open_step(model, x)
    before = model[0].weight.detach().clone()
    opt.step()  # fused: the parameter changes, its version counter does not
    assert not torch.equal(model[0].weight, before)
    got = _second_forward(model, x)
    assert torch.equal(got, _fresh(model, x)), _relative(got, _fresh(model, x))


def test_a_data_write_after_an_optimizer_step_is_seen():
    # a WGAN critic: step, then clip its weights through .data, then run it again in the same open step
    model = _layer()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    x = torch.randn(32, 64)
    _open_step(model, x)
    opt.step()
    model[0].weight.data.clamp_(-0.01, 0.01)  # bumps nothing the parameter carries
    got = _second_forward(model, x)
    assert torch.equal(got, _fresh(model, x))


def test_a_data_write_alone_needs_weights_changed():
    # an in-place write through .data with no optimizer step between two forwards: the documented gap,
    # closed by weights_changed()
    model = _layer()
    x = torch.randn(32, 64)
    _open_step(model, x)
    model[0].weight.data.mul_(-3)
    weights_changed()
    got = _second_forward(model, x)
    assert torch.equal(got, _fresh(model, x))


@pytest.mark.parametrize("features", [64, 512])  # 512: a 1 MiB weight, which the allocator maps anew
def test_a_swapped_data_tensor_is_seen_even_at_a_recycled_address(features):
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(features, features)), recipe=DelayedScaling())
    x = torch.randn(32, features)
    _open_step(model, x)
    w = model[0].weight
    old_ptr = w.data_ptr()
    new = w.detach() * -3
    w.data = new  # the old storage is freed, unless something holds it
    # allocate the same size until the allocator hands the old block back (kept apart while it does not);
    # whether it does is the allocator's business: the output must be the new weight's either way
    held = []
    for _ in range(64):
        t = torch.empty_like(new)
        if t.data_ptr() == old_ptr:
            break
        held.append(t)
    w.data = t.copy_(new)
    del new, held
    got = _second_forward(model, x)
    assert torch.equal(got, _fresh(model, x)), (old_ptr == w.data_ptr(), _relative(got, _fresh(model, x)))


class _Gain(nn.Module):
    """A parametrization whose result depends on a buffer: ``weight * gain``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gain", torch.ones(()))

    def forward(self, w):
        return w * self.gain


def test_a_parametrized_weight_is_quantized_at_every_forward():
    model = _layer()
    gain = _Gain()
    parametrize.register_parametrization(model[0], "weight", gain)
    x = torch.randn(32, 64)
    with fp8_autocast(step_boundary=False):
        model(x).square().mean().backward()
    assert len(get_fp8_state(model).weight_cache) == 0  # a computed weight: no copy kept
    gain.gain.fill_(-2.0)  # the computed weight changes; a new tensor, maybe at the same address
    got = _second_forward(model, x)
    assert torch.equal(got, _fresh(model, x))
    # and the copy is still kept for a plain parameter
    plain = _layer()
    _open_step(plain, x)


def test_a_weight_no_copy_is_kept_of_counts_once_per_step():
    """Two micro-batches of one step with a weight the cache cannot keep (a computed weight; FSDP2 gathers
    into a fresh tensor per micro-batch likewise): quantized at each forward, its statistics recorded once,
    so the step's weight row is the weight's own (the input rows sum over the micro-batches)."""
    model = _layer()
    parametrize.register_parametrization(model[0], "weight", _Gain())
    state = get_fp8_state(model)
    x = torch.randn(32, 64)
    for boundary in (False, True):
        with fp8_autocast(step_boundary=boundary):
            model(x).square().mean().backward()
    stats = fp8_trainer.step_stats(model)
    numel = fp8_trainer.STAT_COLUMNS.index("numel")
    assert stats[1, numel] == 64 * 64  # the weight, once
    assert stats[0, numel] == 2 * 32 * 64  # the input of both micro-batches
    assert len(state.weight_cache) == 0


def test_a_kept_copy_is_still_used_while_nothing_changed():
    # the cache's purpose: a second micro-batch takes the held copy, not a new quantization
    model = _layer()
    state = get_fp8_state(model)
    x = torch.randn(32, 64)
    _open_step(model, x)
    held = state.weight_cache.values()[0][0]
    _second_forward(model, x)
    assert state.weight_cache.values()[0][0] is held
    with torch.no_grad():
        model[0].weight.mul_(2)  # in place on the parameter: its version counter moves
    _second_forward(model, x)
    assert state.weight_cache.values()[0][0] is not held


# --- the user's path: Lightning manual optimization (a GAN) with fused AdamW -----------------------------

L = pytest.importorskip("lightning")

from fp8_trainer.integrations.lightning import Fp8ScopeCallback  # noqa: E402
from tests.trainer.monitor_utils import FAST  # noqa: E402

STEPS, BATCH, Z = 6, 16, 32


class _Gan(L.LightningModule):
    """Generator and critic; each batch steps the critic, then the generator through the critic, all in
    one batch: one FP8 step under the callback, with two optimizer steps inside it."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(Z, 64), nn.GELU(), nn.Linear(64, 32))
        self.critic = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
        self.losses: list[float] = []

    def training_step(self, real, batch_idx):
        opt_g, opt_c = self.optimizers()
        z = torch.randn(real.shape[0], Z, generator=torch.Generator().manual_seed(batch_idx))
        c_loss = self.critic(self.gen(z).detach()).mean() - self.critic(real).mean()
        opt_c.zero_grad()
        self.manual_backward(c_loss)
        opt_c.step()
        g_loss = -self.critic(self.gen(z)).mean()  # the critic as the step above left it
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.losses += [c_loss.item(), g_loss.item()]

    def configure_optimizers(self):
        return (
            torch.optim.AdamW(self.gen.parameters(), lr=1e-2, fused=True),
            torch.optim.AdamW(self.critic.parameters(), lr=1e-2, fused=True),
        )


class _NoCache(L.Callback):
    """After fp8scope's callback converted the module: keep no weight copy (the reference run)."""

    def on_fit_start(self, trainer, pl_module):
        get_fp8_state(pl_module).weight_cache.enabled = False


def _fit_gan(server, tmp_path, name: str, reference: bool) -> _Gan:
    torch.manual_seed(0)
    module = _Gan()
    data = torch.randn(STEPS * BATCH, 32, generator=torch.Generator().manual_seed(1))
    cb = Fp8ScopeCallback(server.url, run_name=name, recipe=DelayedScaling(),
                          spool_path=tmp_path / f"{name}.jsonl", **FAST)  # fmt: skip
    callbacks = [cb, _NoCache()] if reference else [cb]
    trainer = L.Trainer(max_steps=STEPS * 2, max_epochs=1, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)  # fmt: skip
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    return module


def test_lightning_manual_optimization_with_fused_adamw_trains_as_without_a_kept_copy(server, tmp_path):
    module = _fit_gan(server, tmp_path, "gan", reference=False)
    assert sum(isinstance(m, fp8_trainer.Linear) for m in module.modules()) == 4
    reference = _fit_gan(server, tmp_path, "gan-reference", reference=True)
    assert len(module.losses) == 2 * STEPS
    assert module.losses == reference.losses
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
