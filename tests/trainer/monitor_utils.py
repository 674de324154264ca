"""Shared pieces of the runtime tests that stream into a real `fp8-monitor serve` (tests/trainer, monitor/ and
integrations/): a small FP8 GPT and its training loop, and reading back what the service stored."""

from __future__ import annotations

import numpy as np
import torch

from fp8_trainer import DelayedScaling, convert_to_fp8, fp8_autocast, step_stats
from fp8_trainer.app.model import GPT, GPTConfig, fp8_filter
from tests.support.http import loopback
from tests.support.server import API, decode

HEATMAP_METRICS = ("amax", "scale", "overflow", "underflow", "nonfinite")
FAST = dict(flush_interval=0.1, retry_delays=(0.05, 0.1), probe_interval=0.2, http_timeout=2.0)


def tiny_model(recipe=None, n_layer: int = 1, seed: int = 0):
    """The tiny GPT preset cut to `n_layer` blocks, converted to FP8 (4 FP8 Linears per block)."""
    torch.manual_seed(seed)
    recipe = recipe or DelayedScaling(amax_history_len=4)
    cfg = GPTConfig(block_size=32, n_layer=n_layer, n_head=4, n_embd=64)
    model = convert_to_fp8(GPT(cfg), recipe=recipe, module_filter_fn=fp8_filter)
    return model, recipe


def train(model, recipe, monitor, steps: int, start: int = 1, seed: int = 0, hook=None, forward=None):
    """A plain loop; returns per step (the loss, a copy of step_stats) as the job computed them. ``forward``
    (default: the model) is what is called, e.g. ``torch.compile(model)``."""
    forward = model if forward is None else forward
    gen = torch.Generator().manual_seed(seed + start)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = {}
    for step in range(start, start + steps):
        x = torch.randint(0, 256, (4, 16), generator=gen)
        with fp8_autocast(fp8_recipe=recipe):
            _, loss = forward(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen[step] = (loss.item(), step_stats(model).clone().numpy())
        if monitor is not None:
            monitor.step(step, loss=loss.detach(), lr=1e-3)
        if hook is not None:
            hook(step)
    return seen


def get(url: str, path: str, **params):
    r = loopback.get(f"{url}{API}{path}", params=params, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def stored_stats(url: str, run_id: int) -> dict[str, np.ndarray]:
    """Per statistic, (T, steps) as stored, one column per step (the heatmap at full resolution)."""
    out = {}
    for metric in HEATMAP_METRICS:
        h = get(url, f"/runs/{run_id}/heatmap", metric=metric, max_cols=1000)
        assert h["bucket_width"] == 1
        out[metric] = np.array([decode(row) for row in h["values"]])
        out["steps"] = np.array(h["bucket_start"])
    return out


def assert_stored_equal(url: str, run_id: int, seen: dict) -> None:
    """Every step stored exactly once, with the statistics and loss the job computed."""
    run = get(url, f"/runs/{run_id}")
    steps = sorted(seen)
    assert run["steps_stored"] == len(steps), (run["steps_stored"], len(steps))
    assert (run["first_step"], run["last_step"]) == (steps[0], steps[-1])
    got = stored_stats(url, run_id)
    np.testing.assert_array_equal(got["steps"], steps)
    for j, metric in enumerate(HEATMAP_METRICS):
        want = np.stack([seen[s][1][:, j] for s in steps], axis=1)
        np.testing.assert_array_equal(got[metric], want, err_msg=metric)
    series = get(url, f"/runs/{run_id}/series", name="loss", max_points=5000)
    assert series["steps"] == steps
    np.testing.assert_array_equal(decode(series["values"]), [seen[s][0] for s in steps])


def stored_heatmap(url: str, run_id: int, metric: str, max_cols: int = 1000) -> tuple[list[int], np.ndarray]:
    """The heatmap of `metric` as stored: its bucket starts and values, (buckets, T), one row per bucket."""
    h = get(url, f"/runs/{run_id}/heatmap", metric=metric, max_cols=max_cols)
    return h["bucket_start"], np.array([decode(row) for row in h["values"]]).T
