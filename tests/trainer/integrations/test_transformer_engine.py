"""Transformer Engine: statistics read from TE's own delayed-scaling state.

On any machine: the host-side reading of two step-boundary copies of a TE amax history is checked against a
replay of TE's update kernel (``common/recipe/delayed_scaling.cu``, ``kernel_bulk``) written here from its
source, including several casts per optimizer step (gradient accumulation) and zero-amax steps.
With TE and a GPU: a real ``te.Linear`` model streams into a real server and the stored amax and scale equal
TE's own state at the same step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8_trainer.integrations.transformer_engine import TEStats, te_step_row

F32_MAX = np.float32(np.finfo(np.float32).max)


def te_kernel(hist: np.ndarray, scale: np.float32, amax: np.float32, scaled_max: np.float32, algo: str):
    """One column of kernel_bulk: roll unless the amax is zero, then the scale from the window."""
    if amax == 0:
        return hist, scale
    n = len(hist)
    vals = np.array([hist[i + 1] if i < n - 1 else amax for i in range(n)], dtype=np.float32)
    ref = amax if algo == "most_recent" else np.float32(np.fmax.reduce(vals))
    new = vals.copy()
    new[0] = 0
    if np.isfinite(ref) and ref > 0:
        with np.errstate(over="ignore"):
            scale = np.float32(scaled_max / ref)
        scale = F32_MAX if np.isinf(scale) else scale
    return new, scale


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_reading_two_copies_replays_te(algo, fmt):
    margin = 1.0
    scaled_max = np.float32({"e4m3": 448.0, "e5m2": 57344.0}[fmt]) * np.float32(2.0**-margin)
    # the casts of each optimizer step (one per fp8_autocast: several under gradient accumulation)
    steps = [[2.0], [3.0, 1.5], [0.0], [5.0], [0.5, 0.25, 8.0], [1e-40], [1.0, 0.0], [7.0]]
    hist, scale = np.zeros(4, dtype=np.float32), np.float32(1.0)
    for casts in steps:
        prev, prev_scale = hist.copy(), scale
        want_amax, want_scale = np.float32(0), scale
        for a in map(np.float32, casts):
            if a > want_amax:
                want_amax, want_scale = a, scale  # the scale this cast used
            hist, scale = te_kernel(hist, scale, a, scaled_max, algo)
        got = te_step_row(prev, hist, prev_scale, fmt, margin, algo, expected=len(casts))
        assert got == [float(want_amax), float(want_scale), 0.0, 0.0, 0.0, 0.0], casts


def test_with_transformer_engine(tmp_path):
    te = pytest.importorskip("transformer_engine.pytorch", reason="transformer_engine is not installed")
    if not torch.cuda.is_available():
        pytest.skip("Transformer Engine needs a CUDA GPU")
    from transformer_engine.common.recipe import DelayedScaling

    from fp8_trainer import Monitor
    from tests.support.server import running_server
    from tests.trainer.monitor_utils import FAST, get, stored_stats

    torch.manual_seed(0)
    model = torch.nn.Sequential(te.Linear(64, 128), torch.nn.GELU(), te.Linear(128, 64)).cuda()
    recipe = DelayedScaling(amax_history_len=8, margin=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = {}
    with running_server(f"sqlite:///{tmp_path / 'm.db'}") as srv:
        with Monitor(srv.url, "te", model, spool_path=tmp_path / "s.jsonl", **FAST) as mon:
            for step in range(1, 7):
                used = [m.fp8_meta["scaling_fwd"].scale[:2].clone() for m in (model[0], model[2])
                        if "scaling_fwd" in m.fp8_meta]  # fmt: skip
                x = torch.randn(32, 64, device="cuda")
                with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
                    loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                amax = [m.fp8_meta["scaling_fwd"].amax_history[-1, :2].clone() for m in (model[0], model[2])]
                seen[step] = (torch.cat(amax).cpu().numpy(), torch.cat(used).cpu().numpy() if used else None)
                mon.step(step, loss=loss.detach())
        got = stored_stats(srv.url, mon.run_id)
        assert get(srv.url, f"/runs/{mon.run_id}")["config"]["fp8_source"] == "transformer_engine"
    fwd = [0, 1, 3, 4]  # input and weight of each layer in the tensor table
    steps = list(got["steps"])
    for s in steps:
        np.testing.assert_array_equal(got["amax"][fwd, steps.index(s)], seen[s][0])
        if seen[s][1] is not None:
            np.testing.assert_array_equal(got["scale"][fwd, steps.index(s)], seen[s][1])


class StandIn(torch.nn.Module):
    """Where TE cannot run: a module with TE 2.x's ``fp8_meta`` layout (``module/base.py``,
    ``quantization.py`` ``DelayedScalingRecipeState``) whose casts update it as ``kernel_bulk`` does. It
    checks the plumbing (tensor table, one-step-late copies, the Monitor's steps); the GPU test above is
    what proves the reading against TE itself."""

    def __init__(self, amaxes: list[list[float]]):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.fp8, self.amaxes, self.calls = True, amaxes, 0
        self.recipe = type("DelayedScaling", (), {"margin": 0, "amax_compute_algo": "max",
                                                  "fp8_format": "Format.HYBRID"})()  # fmt: skip
        state = type("DelayedScalingRecipeState", (), {})
        self.fp8_meta = {"recipe": self.recipe, "num_gemms": 1}
        for key, n in (("scaling_fwd", 3), ("scaling_bwd", 2)):
            self.fp8_meta[key] = state()
            self.fp8_meta[key].scale = torch.ones(n)
            self.fp8_meta[key].amax_history = torch.zeros(4, n)

    def forward(self, x):
        a = np.float32(self.amaxes[self.calls])
        self.calls += 1
        for key, idx in (("scaling_fwd", [0, 1]), ("scaling_bwd", [0])):
            st = self.fp8_meta[key]
            for i in idx:
                h, s = te_kernel(st.amax_history[:, i].numpy().copy(), np.float32(st.scale[i]), a,
                                 np.float32(448.0 if key == "scaling_fwd" else 57344.0), "max")  # fmt: skip
                st.amax_history[:, i], st.scale[i] = torch.from_numpy(h), float(s)
        return self.lin(x)


StandIn.__module__ = "transformer_engine.pytorch.module.linear"
StandIn.__name__ = StandIn.__qualname__ = "Linear"


def test_monitor_plumbing_with_a_stand_in(tmp_path):
    from fp8_trainer import Monitor
    from tests.support.server import running_server
    from tests.trainer.monitor_utils import FAST, get, stored_stats

    casts = [[2.0], [3.0, 1.5], [0.0], [5.0], [9.0]]  # per optimizer step; two forwards in step 2
    model = torch.nn.Sequential(StandIn([a for step in casts for a in step]))
    with running_server(f"sqlite:///{tmp_path / 'm.db'}") as srv:
        with Monitor(srv.url, "te-stand-in", model, spool_path=tmp_path / "s.jsonl", **FAST) as mon:
            for step, n in enumerate(map(len, casts), start=1):
                for _ in range(n):
                    model(torch.randn(2, 4)).sum().backward()
                mon.step(step, loss=1.0)
        got = stored_stats(srv.url, mon.run_id)
        tensors = get(srv.url, f"/runs/{mon.run_id}/tensors")
    assert [t["name"] for t in tensors] == ["0.input", "0.weight", "0.grad_output"]
    np.testing.assert_array_equal(got["steps"], [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(got["amax"][0], [2.0, 3.0, 0.0, 5.0, 9.0])
    s1 = np.float32(448.0) / np.float32(2.0)  # after step 1; step 2's first cast (3.0) used it
    s3 = np.float32(448.0) / np.float32(3.0)  # the window max after step 2: scaled step 4's 5.0
    np.testing.assert_array_equal(got["scale"][0], [1.0, s1, s3, s3, np.float32(448.0) / np.float32(5.0)])

    reader = TEStats(model)
    reader.take()  # a step boundary: the reader now holds TE's recipe object
    commands = [{"id": 1, "target": "model", "changes": {"margin": 2}},
                {"id": 2, "target": "0", "changes": {"margin": 1}},
                {"id": 3, "target": "model", "changes": {"amax_history_len": 8}}]  # fmt: skip
    acks = reader.apply_commands(commands, 5)
    assert [a["state"] for a in acks] == ["applied", "rejected", "rejected"]
    assert model[0].recipe.margin == 2 and "model-wide" in acks[1]["reason"]
    assert acks[2]["reason"].startswith("amax_history_len: not changeable")
