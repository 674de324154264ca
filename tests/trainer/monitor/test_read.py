"""Data out: a real FP8 training streamed through `Monitor` into `fp8-monitor serve` (SQLite and PostgreSQL),
read back with `fp8_trainer.monitor.read.Reader` (Parquet and CSV, long and wide frames) bit for bit as the
job computed it, NaN and infinities included; the README example; the read client's refusals."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch

from fp8_protocol.stats import stored_amax
from fp8_trainer import Monitor, tensor_table
from fp8_trainer.monitor.read import Reader, ReadError
from tests.support import ROOT
from tests.support.http import loopback
from tests.support.server import pg_database_or_skip, running_server
from tests.trainer.monitor_utils import FAST, tiny_model, train

# what the job computes and the export carries: the base columns and the quality columns (no block-scaled
# layer, so no block columns)
STATS = (
    "amax",
    "scale",
    "overflow",
    "underflow",
    "nonfinite",
    "numel",
    "sum_sq",
    "err_sq",
    "subnormal",
    "min_abs",
)
README = ROOT / "README.md"


def stored(seen: dict, steps: list[int], j: int) -> np.ndarray:
    """(S, T) of statistic STATS[j] as the service stores what the job computed: the same values, but the
    amax of a tensor gone all NaN (0 in the job, whose amax ignores NaN) NaN."""
    want = np.stack([seen[s][1][:, j] for s in steps])
    if STATS[j] != "amax":
        return want
    numel, nonfinite = (
        np.stack([seen[s][1][:, STATS.index(c)] for s in steps]) for c in ("numel", "nonfinite")
    )
    return stored_amax(want, numel, nonfinite)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request, tmp_path_factory):
    if request.param == "sqlite":
        with running_server(f"sqlite:///{tmp_path_factory.mktemp('monitor') / 'monitor.db'}") as srv:
            yield srv
        return
    with pg_database_or_skip("fp8scope_read") as url, running_server(url) as srv:
        yield srv


@pytest.fixture(scope="module")
def job(server):
    """A tiny FP8 GPT trained 8 steps with +inf written into one weight and a NaN into another before
    step 5, then one step whose forward ran outside fp8_autocast (scalars only). Returns the run id,
    what the job computed per FP8 step (loss, step_stats) and the scalars-only step's loss."""
    torch.set_num_threads(1)
    model, recipe = tiny_model()
    modules = dict(model.named_modules())

    def poison(step):
        if step == 4:
            with torch.no_grad():
                modules["blocks.0.mlp.fc"].weight[0, 0] = float("inf")
                modules["blocks.0.mlp.fc2"].weight[1, 1] = float("nan")

    with Monitor(server.url, "read-back", model, recipe, **FAST) as mon:
        seen = train(model, recipe, mon, 8, hook=poison)
        x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(99))
        with torch.no_grad():
            _, loss = model(x, x)  # no fp8_autocast: no FP8 layer runs in step 9
        mon.step(9, loss=loss.detach(), tokens_per_s=123.0)
    computed = np.stack([seen[s][1] for s in sorted(seen)])  # (S, T, 6)
    # the test exercises all three: an infinite amax (the weight), a NaN loss, and tensors gone all NaN
    # (the amax ignores NaN elements, which are counted as non-finite instead: 0, stored as NaN)
    assert np.isposinf(computed[:, :, 0]).any() and any(np.isnan(seen[s][0]) for s in seen)
    assert ((computed[:, :, 4] == computed[:, :, 5]) & (computed[:, :, 0] == 0)).any()
    return mon.run_id, seen, loss.item(), [t.name for t in tensor_table(model)]


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_stats_and_series_bit_for_bit(server, job, fmt):
    run_id, seen, last_loss, names = job
    steps = sorted(seen)
    with Reader(server.url, format=fmt) as reader:
        assert [t["name"] for t in reader.tensors(run_id)] == names
        stats = reader.stats(run_id)
        # step 9 has scalars only: not among the statistics
        np.testing.assert_array_equal(stats["steps"], steps)
        for j, name in enumerate(STATS):
            want = stored(seen, steps, j)  # (S, T)
            assert stats[name].dtype == np.float64 and stats[name].shape == want.shape
            # bit for bit: NaN where the job had NaN, inf where it had inf
            np.testing.assert_array_equal(stats[name].view(np.int64), want.view(np.int64), err_msg=name)
        part = reader.stats(run_id, start=3, end=6)
        np.testing.assert_array_equal(part["steps"], [3, 4, 5, 6])
        np.testing.assert_array_equal(part["amax"], stats["amax"][2:6])

        s, loss = reader.series(run_id, "loss")
        np.testing.assert_array_equal(s, [*steps, 9])
        np.testing.assert_array_equal(loss, [seen[k][0] for k in steps] + [last_loss])
        assert np.isnan(loss[-2])  # the loss after the poisoned step is NaN, kept as such
        assert reader.series(run_id, "tokens_per_s") == ([9], [123.0])
        table = reader.scalars(run_id)  # every scalar side by side; NaN where a step did not carry one
        np.testing.assert_array_equal(table["steps"], [*steps, 9])
        np.testing.assert_array_equal(table["tokens_per_s"], [np.nan] * 8 + [123.0])
        np.testing.assert_array_equal(table["loss"], loss)
        empty = reader.series(run_id, "no_such_scalar")
        assert empty[0].size == 0 and empty[1].size == 0


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_frames_long_and_wide(server, job, fmt):
    run_id, seen, _, names = job
    steps = sorted(seen)
    T = len(names)
    with Reader(server.url, format=fmt) as reader:
        long = reader.frame(run_id, "stats")
        assert list(long.columns) == ["step", "tensor", "layer", "role", *STATS]
        assert long["step"].tolist() == [s for s in steps for _ in range(T)]
        assert long["tensor"].astype(str).tolist() == names * len(steps)
        wide = reader.frame(run_id, "stats", layout="wide")
        assert list(wide.columns) == ["step"] + [f"{n}.{stat}" for n in names for stat in STATS]
        for j, stat in enumerate(STATS):
            want = stored(seen, steps, j)
            got_long = long[stat].to_numpy(dtype=np.float64).reshape(len(steps), T)
            got_wide = wide[[f"{n}.{stat}" for n in names]].to_numpy(dtype=np.float64)
            np.testing.assert_array_equal(got_long.view(np.int64), want.view(np.int64), err_msg=stat)
            np.testing.assert_array_equal(got_wide.view(np.int64), want.view(np.int64), err_msg=stat)
        scalars = reader.frame(run_id, "scalars")
        assert scalars["step"].tolist() == [*steps, 9] and "tokens_per_s" in scalars.columns
        events = reader.frame(run_id, "events")
        assert "nonfinite" in set(events["kind"])
        alerts = reader.frame(run_id, "alerts")
        assert sorted(alerts["id"]) == sorted(a["id"] for a in reader.alerts(run_id))


def test_heatmap_events_alerts_and_runs(server, job):
    run_id, seen, _, names = job
    steps = sorted(seen)
    with Reader(server.url) as reader:
        assert reader.run(run_id)["name"] == "read-back"
        assert run_id in [r["id"] for r in reader.runs()]
        hm = reader.heatmap(run_id, "amax", max_cols=1000)
        assert hm["bucket_width"] == 1 and hm["values"].shape == (len(names), 9)  # steps 1..9
        stats = reader.stats(run_id)
        np.testing.assert_array_equal(hm["values"][:, :8], stats["amax"].T)
        assert np.isnan(hm["values"][:, 8]).all() and hm["bucket_steps"][8] == 0  # step 9: no statistics
        assert hm["bucket_start"].tolist() == [*steps, 9]
        events = reader.events(run_id)
        bad = [e for e in events if e["kind"] == "nonfinite" and e["details"]["what"] == "statistics"]
        assert bad and bad[0]["step"] == 5
        alerts = reader.alerts(run_id)
        assert any(a["kind"] == "nonfinite" for a in alerts)


def test_readme_example_runs(server, job, capsys):
    text = README.read_text()
    section = text[text.index("## Getting data out") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    # the newest run on this server is the job's: the example names it, its loss and its largest amax
    exec(compile(code.replace("http://127.0.0.1:8000", server.url), "README", "exec"), {})
    run_id, seen, last_loss, names = job
    worst = names[int(seen[8][1][:, 0].argmax())]
    want = f"run {run_id}: 9 steps, last loss {last_loss:.4f}, largest amax in {worst}\n"
    assert capsys.readouterr().out == want


def test_defaults_from_the_environment(server, job, monkeypatch, tmp_path):
    monkeypatch.setenv("FP8SCOPE_URL", server.url)
    with Reader() as reader:
        assert reader.run(job[0])["id"] == job[0]
    monkeypatch.delenv("FP8SCOPE_URL")
    with pytest.raises(ValueError, match="url: expected the service root"):
        Reader()


def test_refusals_are_said_in_words(tmp_path, monkeypatch):
    tokens = ("--token", "trainer:ingest:ingest-secret-1", "--token", "dash:read:read-secret-1")
    with running_server(f"sqlite:///{tmp_path / 'auth.db'}", *tokens) as srv:
        monkeypatch.delenv("FP8SCOPE_TOKEN", raising=False)
        monkeypatch.delenv("FP8SCOPE_TOKEN_FILE", raising=False)
        with Reader(srv.url) as r, pytest.raises(ReadError, match=r"token rejected \(HTTP 401"):
            r.runs()
        with (
            Reader(srv.url, token="ingest-secret-1") as r,
            pytest.raises(ReadError, match=r"the token lacks the 'read' scope \(HTTP 403"),
        ):
            r.runs()
        token_file = tmp_path / "token"
        token_file.write_text("read-secret-1\n")
        monkeypatch.setenv("FP8SCOPE_TOKEN_FILE", str(token_file))
        with Reader(srv.url) as reader:
            assert reader.runs() == []
            with pytest.raises(ReadError, match=r"run 999 not found \(HTTP 404\)"):
                reader.stats(999)
        with Reader(srv.url + "/static") as r, pytest.raises(ReadError, match="no fp8scope API at"):
            r.runs()
    with Reader(srv.url) as r, pytest.raises(ReadError, match="cannot reach the fp8scope service"):
        r.runs()


def test_frame_without_pandas_says_what_to_install(server, job, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if pandas were not installed
    with Reader(server.url) as reader, pytest.raises(ImportError, match="Reader.frame needs pandas"):
        reader.frame(job[0], "stats")


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_run_without_statistics(tmp_path, fmt):
    """A baseline run (no FP8 tensors) and a run with nothing stored read as empty arrays, not errors."""
    with running_server(f"sqlite:///{tmp_path / 'empty.db'}") as srv, Reader(srv.url, format=fmt) as reader:
        body = {"name": "bf16", "config": {}, "recipe": {}, "tensors": []}
        run_id = loopback.post(f"{srv.url}/api/v1/runs", json=body, timeout=10).json()["id"]
        stats = reader.stats(run_id)
        assert stats["steps"].shape == (0,) and stats["amax"].shape == (0, 0)
        assert [a.size for a in reader.series(run_id, "loss")] == [0, 0]
        assert reader.events(run_id) == [] and reader.alerts(run_id) == []
