"""Block-scaling statistics on the wire: what the monitor client posts for a run with a block-scaled layer.

The service on main does not take the block columns yet (its side is built against ``fp8_protocol.stats``
in parallel), so the posts are captured by a small local HTTP server standing in for it, and checked against
what the job computed: the five ``BLOCK_COLUMNS`` in every step once the run has had a block-scaled tensor
(zeros for per-tensor-scaled tensors), and ``"block_hist"`` (``[tensor index, lo, counts]``, the non-zero
span) for the block-scaled tensors of each step."""

from __future__ import annotations

import base64
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

import fp8_trainer
from fp8_protocol.spool import API
from fp8_protocol.stats import BLOCK_COLUMNS, BLOCK_HIST_BINS, STAT_COLUMNS
from fp8_trainer import Monitor
from fp8_trainer.monitor.control import apply_commands
from fp8_trainer.monitor.sender import StepRecord, block_hist_entries, step_body
from fp8_trainer.recipe import Float8BlockScaling
from tests.trainer.gloo import gloo_group, rank_step, spawn_ranks
from tests.trainer.monitor_utils import FAST, tiny_model

RUN_ID = 7


class _Capture(BaseHTTPRequestHandler):
    """Answers as the service does for registration, telemetry, status and alerts; keeps the telemetry."""

    def log_message(self, *args):  # quiet
        pass

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            raw = gzip.decompress(raw)
        return json.loads(raw)

    def do_POST(self):
        body = self._body()
        if self.path == f"{API}/runs":
            self.server.run = body
            self._answer(201, {"id": RUN_ID})
        elif self.path == f"{API}/runs/{RUN_ID}/telemetry":
            self.server.batches.append(body)
            self._answer(200, {"commands": []})
        else:
            self._answer(404, {"detail": "not found"})

    def do_PATCH(self):
        self.server.status = self._body().get("status")
        self._answer(200, {})

    def do_GET(self):
        self._answer(200, {"id": RUN_ID, "open_alerts": 0})


@pytest.fixture
def capture():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    server.batches, server.run, server.status = [], None, None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _unpack(packed: dict) -> np.ndarray:
    dtype = {"float32": "<f4", "float64": "<f8"}[packed["dtype"]]
    return np.frombuffer(base64.b64decode(packed["b64"]), dtype=dtype).astype(np.float64)


def test_client_posts_block_columns_and_histograms(capture):
    model, recipe = tiny_model(n_layer=1)
    layer = "blocks.0.mlp.fc"
    state = fp8_trainer.get_fp8_state(model)
    k = state.layer_index(layer)
    url = f"http://127.0.0.1:{capture.server_address[1]}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    seen = {}
    with Monitor(url, "block-payload", model, recipe, max_batch_steps=2, **FAST) as monitor:
        for step in range(1, 7):
            if step in (3, 5):  # delayed -> mxfp8 at step 3 and back at step 5, as a dashboard command does
                changes = {"scaling": "mxfp8" if step == 3 else "delayed"}
                acks = apply_commands(model, [{"id": step, "target": layer, "changes": changes}], step - 1)
                assert acks == [{"command_id": step, "state": "applied", "step": step}]
            x = torch.randint(0, 256, (4, 16), generator=gen)
            with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
                _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            block = state.last_block_stats
            seen[step] = (state.last_stats.clone().numpy(), None if block is None else block.clone().numpy())
            monitor.step(step, loss=loss.detach())
    assert capture.status == "finished"
    steps = {s["step"]: s for b in capture.batches for s in b.get("steps", [])}
    assert sorted(steps) == list(range(1, 7))
    n_block = len(BLOCK_COLUMNS)
    for step, body in steps.items():
        stats, block = seen[step]
        for j, name in enumerate(STAT_COLUMNS):  # the statistics as before
            np.testing.assert_array_equal(_unpack(body["stats"][name]), stats[:, j])
        if step < 3:  # before the run's first block-scaled tensor: no block part was computed
            assert block is None
            assert "block_hist" not in body
            continue
        # from the first block-scaled step on: the five columns in every step (sticky), as computed
        for j, name in enumerate(BLOCK_COLUMNS):
            np.testing.assert_array_equal(_unpack(body["stats"][name]), block[:, j])
        rows = slice(3 * k, 3 * k + 3)
        others = np.ones(len(stats), dtype=bool)
        others[rows] = False
        assert np.all(block[others, :] == 0)  # per-tensor-scaled tensors: zeros
        if step in (3, 4):
            assert np.all(block[rows, 0] > 0)
            hist = np.zeros((len(stats), BLOCK_HIST_BINS))
            for index, lo, counts in body["block_hist"]:
                assert counts[0] > 0 and counts[-1] > 0 and lo >= 0 and lo + len(counts) <= BLOCK_HIST_BINS
                hist[index, lo : lo + len(counts)] = counts
            assert [e[0] for e in body["block_hist"]] == [3 * k, 3 * k + 1, 3 * k + 2]
            np.testing.assert_array_equal(hist, block[:, n_block:])
            assert np.all(hist.sum(axis=1)[rows] == block[rows, 0])  # one count per block
        else:  # switched back: still the columns (zeros), no histogram
            assert np.all(block == 0) and "block_hist" not in body
    # the batch holding steps 1 and 2 went out before any block step: the columns are not in it
    assert "blocks" not in steps[1]["stats"]


def test_step_body_block_columns_are_sticky_and_zero_for_per_tensor_records():
    stats = np.arange(3 * len(STAT_COLUMNS), dtype=np.float64).reshape(3, -1)
    plain = StepRecord(1, stats, {})
    assert set(step_body(plain)["stats"]) == set(STAT_COLUMNS)
    body = step_body(plain, with_block=True)  # a run that has had a block-scaled tensor
    assert (
        all(np.all(_unpack(body["stats"][name]) == 0) for name in BLOCK_COLUMNS) and "block_hist" not in body
    )
    hist = np.zeros((3, BLOCK_HIST_BINS))
    hist[2, [120, 122]] = [5, 1]
    rec = StepRecord(
        2, stats, {}, block=np.array([[0, 0, 0, 0, 0], [0] * 5, [6, 1, 0, 1, 4.5]]), block_hist=hist
    )
    body = step_body(rec)
    assert body["block_hist"] == [[2, 120, [5, 0, 1]]] == block_hist_entries(hist)
    assert _unpack(body["stats"]["block_range"]).tolist() == [0, 0, 4.5]


def _rank_worker(rank: int, port: int, url: str, spool_dir: str, out) -> None:
    with gloo_group(rank, port, 2):
        model, recipe = tiny_model(recipe=Float8BlockScaling())  # any token count: the ranks' differ
        mon = Monitor(url, "ddp-block", model, recipe, spool_path=f"{spool_dir}/r{rank}.jsonl", **FAST)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(100 + rank)
        state = fp8_trainer.get_fp8_state(model)
        seen = {}
        for step in range(1, 5):
            rank_step(model, opt, gen, rank, recipe)
            seen[step] = (state.last_stats.clone().numpy(), state.last_block_stats.clone().numpy())
            mon.step(step)
        mon.close()
        out[rank] = seen


@pytest.mark.slow
def test_two_ranks_send_reduced_statistics_and_rank_0s_block_part(capture, tmp_path):
    url = f"http://127.0.0.1:{capture.server_address[1]}"
    res = spawn_ranks(_rank_worker, 2, url, str(tmp_path))
    steps = {s["step"]: s for b in capture.batches for s in b.get("steps", [])}
    assert sorted(steps) == [1, 2, 3, 4]
    for step, body in steps.items():
        (s0, b0), (s1, b1) = res[0][step], res[1][step]
        assert not np.array_equal(b0, b1)  # the ranks saw different data
        np.testing.assert_array_equal(_unpack(body["stats"]["numel"]), s0[:, 5] + s1[:, 5])  # reduced
        for j, name in enumerate(BLOCK_COLUMNS):  # rank 0's own (docs/fp8-semantics.md)
            np.testing.assert_array_equal(_unpack(body["stats"][name]), b0[:, j])
        hist = np.zeros_like(b0[:, len(BLOCK_COLUMNS) :])
        for index, lo, counts in body["block_hist"]:
            hist[index, lo : lo + len(counts)] = counts
        np.testing.assert_array_equal(hist, b0[:, len(BLOCK_COLUMNS) :])
