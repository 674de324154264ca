"""Block-scaling statistics on the wire: what the monitor client posts for a run with a block-scaled layer.

The service on main does not take the block columns yet (its side is built against ``fp8_protocol.stats``
in parallel), so the posts are captured by a small local HTTP server standing in for it, and checked against
what the job computed: the six ``BLOCK_COLUMNS`` in every step once the run has had a block-scaled tensor
(zeros for per-tensor-scaled tensors), and ``"block_hist"`` (``[tensor index, lo, counts]``, the non-zero
span) for the block-scaled tensors of each step. In a data-parallel job (2 gloo ranks) the block part rank 0
posts is the merge of every rank's, as micro-steps merge (counts and histograms summed, ``block_range`` the
max)."""

from __future__ import annotations

import base64
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import fp8_trainer
from fp8_protocol.api import API_PREFIX
from fp8_protocol.stats import BLOCK_COLUMNS, BLOCK_HIST_BINS, STAT_COLUMNS
from fp8_trainer import Monitor
from fp8_trainer.block_linear import BLOCK_WIDTH, split_block_stats
from fp8_trainer.merge import merge_step_stats
from fp8_trainer.monitor.control import apply_commands
from fp8_trainer.monitor.ranks import reduce_rank_block
from fp8_trainer.monitor.sender import StepRecord, block_hist_entries, step_body
from fp8_trainer.recipe import DelayedScaling, Float8BlockScaling
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
        if self.path == f"{API_PREFIX}/runs":
            self.server.run = body
            self._answer(201, {"id": RUN_ID})
        elif self.path == f"{API_PREFIX}/runs/{RUN_ID}/telemetry":
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
    rec = StepRecord(2, stats, {}, block=np.array([[0] * 6, [0] * 6, [6, 1, 0, 1, 4.5, 2]]), block_hist=hist)
    body = step_body(rec)
    assert body["block_hist"] == [[2, 120, [5, 0, 1]]] == block_hist_entries(hist)
    assert _unpack(body["stats"]["block_range"]).tolist() == [0, 0, 4.5]
    assert _unpack(body["stats"]["blocks_zero"]).tolist() == [0, 0, 2]


def _sent_block(body: dict, n_tensors: int) -> np.ndarray:
    """The block part a step's payload carries, (T, BLOCK_WIDTH): the six columns, then the histogram."""
    hist = np.zeros((n_tensors, BLOCK_HIST_BINS))
    for index, lo, counts in body.get("block_hist", []):
        hist[index, lo : lo + len(counts)] = counts
    columns = np.stack([_unpack(body["stats"][name]) for name in BLOCK_COLUMNS], axis=1)
    return np.concatenate([columns, hist], axis=1)


def _merged_over_ranks(parts: list[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """The ranks' block parts merged as micro-steps merge (merge_step_stats): everything summed but
    block_range, the max; a weight's rows (copies of one tensor on every rank) the max."""
    merged = np.sum(parts, axis=0)
    merged[weights] = np.max(parts, axis=0)[weights]
    j = BLOCK_COLUMNS.index("block_range")
    merged[:, j] = np.fmax.reduce([p[:, j] for p in parts], axis=0)
    return merged


def _weights(model) -> np.ndarray:
    return np.array([t.role == "weight" for t in fp8_trainer.get_fp8_state(model).tensor_table()])


def test_rank_reduction_of_block_parts_is_the_micro_step_merge():
    """reduce_rank_block folds the ranks' block parts as merge_step_stats folds micro-steps: a NaN
    block_range loses to a number (fmax), a rank without a block part (zeros) adds nothing."""
    rng = np.random.default_rng(5)
    W, T = 3, 4
    stats = rng.uniform(1, 10, size=(W, T, len(STAT_COLUMNS)))
    block = rng.integers(0, 50, size=(W, T, BLOCK_WIDTH)).astype(np.float64)
    j = BLOCK_COLUMNS.index("block_range")
    block[:, :, j] = rng.uniform(0, 20, size=(W, T))
    block[0, 1, j] = np.nan  # a rank whose worst block had a NaN range
    block[2] = 0.0  # a rank with no block part in this step
    want = torch.from_numpy(np.concatenate([stats[0], block[0]], axis=1))
    for r in range(1, W):
        want = merge_step_stats(want, torch.from_numpy(np.concatenate([stats[r], block[r]], axis=1)))
    got = reduce_rank_block(block)
    np.testing.assert_array_equal(got, split_block_stats(want.numpy())[1])
    assert got[1, j] == block[1, 1, j]  # NaN ignored


def _rank_worker(rank: int, port: int, url: str, spool_dir: str, out) -> None:
    with gloo_group(rank, port, 2):
        model, recipe = tiny_model(recipe=Float8BlockScaling())  # any token count: the ranks' differ
        mon = Monitor(url, "ddp-block", model, recipe, spool_path=f"{spool_dir}/r{rank}.jsonl", **FAST)
        ddp = DistributedDataParallel(model)  # one model: the same weights on both ranks
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(100 + rank)
        state = fp8_trainer.get_fp8_state(model)
        seen = {}
        for step in range(1, 5):
            rank_step(ddp, opt, gen, rank, recipe)
            seen[step] = (state.last_stats.clone().numpy(), state.last_block_stats.clone().numpy())
            mon.step(step)
        mon.close()
        out[rank] = {"seen": seen, "weights": _weights(model)}


@pytest.mark.slow
def test_two_ranks_send_statistics_and_block_part_reduced_over_ranks(capture, tmp_path):
    url = f"http://127.0.0.1:{capture.server_address[1]}"
    res = spawn_ranks(_rank_worker, 2, url, str(tmp_path))
    steps = {s["step"]: s for b in capture.batches for s in b.get("steps", [])}
    assert sorted(steps) == [1, 2, 3, 4]
    weights = res[0]["weights"]
    for step, body in steps.items():
        (s0, b0), (s1, b1) = res[0]["seen"][step], res[1]["seen"][step]
        assert not np.array_equal(b0, b1)  # the ranks saw different data
        np.testing.assert_array_equal(b0[weights], b1[weights])  # but hold one weight
        numel = np.where(weights, s0[:, 5], s0[:, 5] + s1[:, 5])  # a weight once, the rest summed
        np.testing.assert_array_equal(_unpack(body["stats"]["numel"]), numel)
        sent = _sent_block(body, len(s0))
        np.testing.assert_array_equal(sent, _merged_over_ranks([b0, b1], weights))


LAYER = "blocks.0.mlp.fc"
SWITCH = 3  # the step from which LAYER is MXFP8 on every rank
NO_FP8_ON_RANK_1 = 5  # a step rank 1 runs without FP8 (rank 0 with)
OUTLIER = 2.0**20  # one input value on rank 1: its block's scale jumps and the rest of the block flushes to 0


def _add_outlier(module, args):
    (x,) = args
    spike = torch.zeros_like(x)
    spike[0, 0, 0] = OUTLIER
    return (x + spike,)


def _switching_worker(rank: int, port: int, url: str, spool_dir: str, out) -> None:
    with gloo_group(rank, port, 2):
        # per-tensor (delayed) scaling everywhere at first; no amax all-reduce, so that rank 1 may run a step
        # without FP8 while rank 0 runs it in FP8 (the all-reduce would wait for it)
        model, recipe = tiny_model(recipe=DelayedScaling(amax_history_len=4, reduce_amax=False))
        mon = Monitor(url, "ddp-switch", model, recipe, spool_path=f"{spool_dir}/s{rank}.jsonl", **FAST)
        ddp = DistributedDataParallel(model)  # one model: the same weights on both ranks
        if rank == 1:
            model.get_submodule(LAYER).register_forward_pre_hook(_add_outlier)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(100 + rank)
        state = fp8_trainer.get_fp8_state(model)
        seen = {}
        for step in range(1, 8):
            if step == SWITCH:  # every rank, between the same two optimizer steps
                fp8_trainer.set_layer_recipe(model, LAYER, scaling="mxfp8")
            fp8 = not (rank == 1 and step == NO_FP8_ON_RANK_1)
            x = torch.randint(0, 256, (2, 16), generator=gen)  # 32 tokens: MXFP8's multiple of 32
            with fp8_trainer.fp8_autocast(fp8_recipe=recipe, enabled=fp8):
                _, loss = ddp(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            block = state.last_block_stats
            seen[step] = None
            if fp8:
                seen[step] = (
                    state.last_stats.clone().numpy(),
                    None if block is None else block.clone().numpy(),
                )
            mon.step(step)
        mon.close()
        out[rank] = {"seen": seen, "k": state.layer_index(LAYER), "weights": _weights(model)}


@pytest.mark.slow
def test_block_part_is_reduced_over_ranks_from_a_mid_run_switch_to_mxfp8(capture, tmp_path):
    """Rank 1 alone has an outlier in LAYER's input: what reaches the service shows its block, merged with
    rank 0's, from the step the layer became block-scaled on, also in a step where rank 1 ran no FP8."""
    url = f"http://127.0.0.1:{capture.server_address[1]}"
    res = spawn_ranks(_switching_worker, 2, url, str(tmp_path))
    assert capture.status == "finished"
    steps = {s["step"]: s for b in capture.batches for s in b.get("steps", [])}
    assert sorted(steps) == list(range(1, 8))
    rows = slice(3 * res[0]["k"], 3 * res[0]["k"] + 3)
    weights = res[0]["weights"]
    for step, body in steps.items():
        ran = [res[r]["seen"][step] for r in (0, 1) if res[r]["seen"][step] is not None]
        numel = np.where(weights, np.max([st[:, 5] for st, _ in ran], axis=0), sum(st[:, 5] for st, _ in ran))
        np.testing.assert_array_equal(_unpack(body["stats"]["numel"]), numel)  # per-tensor part as before
        if step < SWITCH:  # no block-scaled layer yet: no block part (zero columns at most, batch-sticky)
            assert all(block is None for _, block in ran) and "block_hist" not in body
            assert all(
                np.all(_unpack(body["stats"][name]) == 0) for name in BLOCK_COLUMNS if name in body["stats"]
            )
            continue
        sent = _sent_block(body, len(numel))
        np.testing.assert_array_equal(sent, _merged_over_ranks([block for _, block in ran], weights))
        assert np.all(sent[rows, 0] > 0)
        assert [e[0] for e in body["block_hist"]] == list(range(rows.start, rows.stop))  # LAYER's 3 tensors
        if step == NO_FP8_ON_RANK_1:
            continue
        (_, b0), (_, b1) = ran
        # what only rank 1 saw reaches the service: the outlier's block flushed to zero, its wider range,
        # and the scale exponent bin its block landed in
        inp = rows.start  # LAYER's input
        j_under, j_range = BLOCK_COLUMNS.index("blocks_underflow"), BLOCK_COLUMNS.index("block_range")
        assert b1[inp, j_under] > 0 and sent[inp, j_under] == b0[inp, j_under] + b1[inp, j_under]
        assert b1[inp, j_range] > b0[inp, j_range] and sent[inp, j_range] == b1[inp, j_range]
        outlier_bins = (b1[inp, len(BLOCK_COLUMNS) :] > 0) & (b0[inp, len(BLOCK_COLUMNS) :] == 0)
        assert outlier_bins.any() and np.all(sent[inp, len(BLOCK_COLUMNS) :][outlier_bins] > 0)
