"""The generic path for any runtime: tensors declared with the Monitor, each step's statistics block passed to
``monitor.step(step, stats=...)``, stored by a real `fp8-monitor serve` exactly as passed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8_trainer import STAT_COLUMNS, Monitor
from fp8_trainer.monitor.external import CallerStats
from tests.trainer.monitor_utils import FAST, assert_stored_equal, get

TENSORS = ["blocks.0.fc.input", "blocks.0.fc.weight", "blocks.0.fc.grad_output", "head.input"]


def _block(rng: np.random.Generator, step: int) -> np.ndarray:
    """A statistics block as another runtime might report it, with the values JSON cannot carry."""
    b = np.zeros((len(TENSORS), len(STAT_COLUMNS)))
    b[:, 0] = rng.uniform(1e-3, 100, len(TENSORS))  # amax
    b[:, 1] = 448 / b[:, 0]  # scale
    b[:, 2:5] = rng.integers(0, 5, (len(TENSORS), 3))  # overflow, underflow, nonfinite
    b[:, 5] = 4096
    if step == 3:
        b[1, 0], b[2, 1] = np.inf, np.nan
    return b


def test_caller_blocks_are_stored_as_passed(server, tmp_path):
    rng = np.random.default_rng(0)
    model = torch.nn.Linear(16, 16)  # the Monitor only needs a module; the statistics are the caller's
    seen = {}
    with Monitor(server.url, "other-runtime", model, tensors=TENSORS, spool_path=tmp_path / "s.jsonl",
                 **FAST) as mon:  # fmt: skip
        for step in range(1, 9):
            block = _block(rng, step)
            # a torch tensor on the training device or a numpy array: both are accepted
            mon.step(
                step,
                loss=torch.tensor(5.0 - 0.1 * step),
                stats=torch.from_numpy(block) if step % 2 else block,
            )
            seen[step] = (float(np.float32(5.0 - 0.1 * step)), block)
    assert_stored_equal(server.url, mon.run_id, seen)
    run = get(server.url, f"/runs/{mon.run_id}")
    run["config"].pop("fp8_run")  # how the job was started (test_run_info.py)
    assert run["config"] == {"fp8_source": "caller"}
    tensors = get(server.url, f"/runs/{mon.run_id}/tensors")
    assert [(t["index"], t["name"], t["layer"], t["role"], t["format"]) for t in tensors] == [
        (0, "blocks.0.fc.input", "blocks.0.fc", "input", "e4m3"),
        (1, "blocks.0.fc.weight", "blocks.0.fc", "weight", "e4m3"),
        (2, "blocks.0.fc.grad_output", "blocks.0.fc", "grad_output", "e5m2"),
        (3, "head.input", "head", "input", "e4m3"),
    ]


def test_two_blocks_before_one_poll_are_merged():
    """Two micro-batches' blocks before one optimizer step is read: amax max with its scale, counts summed."""
    feed = CallerStats(["l.input", "l.weight"])
    a = np.array([[2.0, 224.0, 1, 0, 0, 10], [1.0, 448.0, 0, 2, 0, 10]])
    b = np.array([[4.0, 112.0, 0, 1, 1, 10], [0.5, 896.0, 0, 1, 0, 10]])
    feed.put(a)
    feed.put(b)
    assert feed.poll() is None  # the copy started now is read at the next poll
    feed.put(a)
    _, got = feed.poll()
    np.testing.assert_array_equal(got.numpy(), [[4.0, 112.0, 1, 1, 1, 20], [1.0, 448.0, 0, 3, 0, 20]])
    assert feed.merged == 2


def test_declaration_and_shape_errors(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="role must be one of"):
        Monitor("http://127.0.0.1:9", "x", model, tensors=["fc.activation"], spool_path=tmp_path / "a.jsonl")
    with pytest.raises(ValueError, match="format must be one of"):
        Monitor("http://127.0.0.1:9", "x", model, tensors=[{"name": "a", "layer": "a", "role": "input",
                "format": "e3m4"}], spool_path=tmp_path / "a.jsonl")  # fmt: skip
    mon = Monitor("http://127.0.0.1:9", "x", model, tensors=["fc.input"], spool_path=tmp_path / "a.jsonl",
                  **FAST)  # fmt: skip
    with pytest.raises(ValueError, match=r"expected shape \(1, 6\)"):
        mon.step(1, stats=np.zeros((2, 6)))
    mon.close()
