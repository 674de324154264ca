"""FP8 scaling state in checkpoints: every FP8 Linear saves its slice as module extra state."""

import pytest
import torch

import fp8_trainer
from fp8_trainer import DelayedScaling, fp8_autocast, set_layer_recipe
from fp8_trainer.app.model import GPT, GPTConfig, fp8_filter

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
RECIPE = DelayedScaling(amax_history_len=4, interval=2)
N, M = 3, 4  # resume after an odd step: the interval counter must be restored to update on the right steps


pytestmark = pytest.mark.usefixtures("one_thread")


def build(recipe=RECIPE):
    torch.manual_seed(0)
    model = fp8_trainer.convert_to_fp8(GPT(CFG), recipe=recipe, module_filter_fn=fp8_filter)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(i: int):
    g = torch.Generator().manual_seed(1000 + i)  # the same data for step i in every run
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def train(model, opt, steps: range) -> list[float]:
    losses = []
    for i in steps:
        x, y = batch(i)
        with fp8_autocast():
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def snapshot(model) -> dict[str, torch.Tensor]:
    s = fp8_trainer.get_fp8_state(model)
    return {name: getattr(s, name).clone() for name in ("amax_history", "scale", "scale_inv")}


def assert_same(a: dict, b: dict) -> None:
    for key in a:
        assert torch.equal(a[key], b[key]), key


def trained_checkpoint(tmp_path):
    model, opt = build()
    train(model, opt, range(N))
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    return model, opt, path


def test_resume_is_exact(tmp_path):
    model, opt, path = trained_checkpoint(tmp_path)
    losses, snaps = [], []
    for i in range(N, N + M):
        losses += train(model, opt, range(i, i + 1))
        snaps.append({**snapshot(model), "stats": fp8_trainer.step_stats(model).clone()})

    ckpt = torch.load(path, weights_only=True)
    extra = ckpt["model"]["blocks.0.mlp.fc._extra_state"]
    assert extra["amax_history"].shape == (4, 3) and extra["step"] == N
    model2, opt2 = build()
    model2.load_state_dict(ckpt["model"])  # strict=True
    opt2.load_state_dict(ckpt["opt"])
    assert fp8_trainer.get_fp8_state(model2).steps == N
    for i in range(N, N + M):
        assert train(model2, opt2, range(i, i + 1)) == [losses[i - N]]
        assert_same({**snapshot(model2), "stats": fp8_trainer.step_stats(model2)}, snaps[i - N])
    assert len({s["scale"][0].item() for s in snaps}) > 1  # the scales moved while resuming


def test_without_extra_state_the_resume_differs(tmp_path):
    model, opt, path = trained_checkpoint(tmp_path)
    train(model, opt, range(N, N + M))
    ckpt = torch.load(path, weights_only=True)
    plain = {k: v for k, v in ckpt["model"].items() if not k.endswith("._extra_state")}

    model2, opt2 = build()
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*_extra_state"):
        model2.load_state_dict(plain)  # strict=True: PyTorch's rule for missing extra state
    result = model2.load_state_dict(plain, strict=False)  # e.g. a checkpoint of a plain model
    assert result.missing_keys and all(k.endswith("._extra_state") for k in result.missing_keys)
    assert torch.equal(fp8_trainer.get_fp8_state(model2).scale, torch.ones(3 * 8))  # defaults kept
    opt2.load_state_dict(ckpt["opt"])
    train(model2, opt2, range(N, N + M))
    assert not torch.equal(snapshot(model2)["scale"], snapshot(model)["scale"])


def test_overrides_survive_round_trip(tmp_path):
    model, opt = build()
    set_layer_recipe(model, "blocks.0.mlp.fc", margin=2)
    set_layer_recipe(model, None, amax_compute_algo="most_recent")
    train(model, opt, range(2))
    set_layer_recipe(model, "blocks.1.attn.qkv", fp8_enabled=False)  # after its scale moved away from 1
    train(model, opt, range(2, 3))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "m.pt")

    model2, opt2 = build()
    assert fp8_trainer.get_layer_recipes(model2) != fp8_trainer.get_layer_recipes(model)
    ckpt = torch.load(tmp_path / "m.pt", weights_only=True)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert fp8_trainer.get_layer_recipes(model2) == fp8_trainer.get_layer_recipes(model)
    s1, s2 = fp8_trainer.get_fp8_state(model), fp8_trainer.get_fp8_state(model2)
    assert s2.layer_overrides == s1.layer_overrides and s2.model_overrides == s1.model_overrides
    assert s2.enabled == s1.enabled and torch.equal(s2.margin, s1.margin)
    assert_same(snapshot(model2), snapshot(model))
    assert train(model2, opt2, range(3, 4)) == train(model, opt, range(3, 4))
    # the FP8-off layer's rows report its kept scale, the restored one
    assert torch.equal(fp8_trainer.step_stats(model2), fp8_trainer.step_stats(model))


@pytest.mark.parametrize("new_len", [2, 8])
def test_history_length_mismatch_keeps_newest_pads_zeros(tmp_path, new_len):
    model, opt = build()
    train(model, opt, range(6))
    saved = snapshot(model)
    assert (saved["amax_history"] > 0).all()  # 6 steps fill all 4 rows

    model2, opt2 = build(DelayedScaling(amax_history_len=new_len, interval=2))
    train(model2, opt2, range(new_len))  # rows the checkpoint has no entries for must be zeroed, not kept
    assert (snapshot(model2)["amax_history"] > 0).all()
    model2.load_state_dict(model.state_dict())
    got = snapshot(model2)
    n = min(4, new_len)
    assert got["amax_history"].shape[0] == new_len
    assert torch.equal(got["amax_history"][:n], saved["amax_history"][:n])
    assert (got["amax_history"][n:] == 0).all()
    assert torch.equal(got["scale"], saved["scale"])


def test_load_while_step_pending_raises():
    model, opt = build()
    train(model, opt, range(1))
    state_dict = model.state_dict()
    x, y = batch(1)
    with fp8_autocast():
        _, loss = model(x, y)  # forward recorded, backward not yet run
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="a step is pending"):
        model.load_state_dict(state_dict)
    assert_same(snapshot(model), before)
    loss.backward()  # nothing was overwritten in place, and once the step completes loading works again
    model.load_state_dict(state_dict)


def test_malformed_extra_state_names_layer():
    model, _ = build()
    sd = model.state_dict()
    sd["blocks.1.mlp.fc2._extra_state"] = {**sd["blocks.1.mlp.fc2._extra_state"], "scale": torch.ones(4)}
    with pytest.raises(ValueError, match=r"blocks\.1\.mlp\.fc2\._extra_state"):
        model.load_state_dict(sd)


def test_scale_inv_is_derived_from_scale_on_load():
    # a checkpoint whose scale_inv disagrees with its scale (edited, or written by another tool) must not
    # scale every output by the disagreement: scale_inv = 1 / scale after loading, whatever was stored
    model, opt = build()
    train(model, opt, range(N))
    sd = model.state_dict()
    key = next(k for k in sd if k.endswith("_extra_state"))
    sd[key] = {**sd[key], "scale_inv": sd[key]["scale_inv"] * 4}
    loaded, _ = build()
    loaded.load_state_dict(sd)
    state, want = fp8_trainer.get_fp8_state(loaded), fp8_trainer.get_fp8_state(model)
    assert torch.equal(state.scale, want.scale)
    assert torch.equal(state.scale_inv, torch.reciprocal(want.scale))
    x, y = batch(N)
    with torch.no_grad(), fp8_autocast():
        assert torch.equal(loaded(x, y)[1], model(x, y)[1])
