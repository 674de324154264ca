"""CPU smoke runs of the GPU benchmarks and of scripts/gpu-check.sh, so CI exercises what only a lent GPU
measures: each benchmark's ``--smoke`` mode runs as a script and writes its JSON in the layout gpu-check.sh
reads (its numbers are not measurements), and gpu-check.sh refuses a machine without a CUDA GPU before
running anything."""

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fp8_kernels import triton_available

from tests.support import ROOT

GPU_CHECK = ROOT / "scripts" / "gpu-check.sh"


def run_bench(script: str, out: Path, *args: str, env: dict | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--smoke", "--out", str(out), *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert f"wrote {out}" in proc.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["smoke"] is True and isinstance(data["summary"], str) and data["summary"]
    return data


def check_goals(goals: dict) -> None:
    for g in goals.values():  # the layout gpu-check.sh's summary reads
        assert isinstance(g["met"], bool) and g["met"] == (g["value"] >= g["target"]), g


# bench/kernels.py's smoke run (about 150 s under the interpreter) is the kernel case "bench_kernels-smoke"
# (tests/kernels/kernel_cases.py), which test_triton_interpreter.py runs: not a second time here.


@pytest.mark.slow
def test_linear_smoke(tmp_path):
    data = run_bench("linear.py", tmp_path / "l.json")
    (row,) = data["rows"]
    assert row["shape"] == "64x32x48"
    assert {"nn.Linear", "fp8scope", "fp8scope current"} <= set(row["median_ms"])
    assert all(ms > 0 for ms in row["median_ms"].values())
    for name in ("fp8scope", "fp8scope current"):  # FP8 really ran: an FP8-sized error, not zero, not garbage
        assert 1e-3 < row["rel_err_vs_nn"][name] < 0.2, row["rel_err_vs_nn"]
    assert data["goals"] == {}  # assessed on CUDA only
    assert data["meta"]["shape_order"].startswith("MxKxN = tokens x in_features x out_features")


@pytest.mark.slow
def test_gpt_throughput_smoke(tmp_path):
    data = run_bench("gpt_throughput.py", tmp_path / "g.json")
    results, meta = data["results"], data["meta"]
    assert meta["preset"] == "tiny" and meta["steps"] == 2 and meta["device_type"] == "cpu"
    assert {"bf16", "delayed", "current", "bf16+compile", "delayed+compile"} <= set(results)
    assert "torchao" in results or "torchao" in meta["skipped"]
    for name, r in results.items():
        assert r["tokens_per_s"] > 0 and math.isfinite(r["final_loss"]), (name, r)
    for name in ("delayed", "current", "delayed+compile"):  # statistics on: read one step late while training
        assert results[name]["stats_polled"] >= 1, results[name]
    # each row against bf16 run the same way (eager, compiled)
    for name, same in (("delayed", "bf16"), ("delayed+compile", "bf16+compile")):
        want = results[name]["tokens_per_s"] / results[same]["tokens_per_s"]
        assert results[name]["x_bf16_same_mode"] == pytest.approx(want), name
    assert {"bf16+graph", "delayed+compile+graph"} <= set(meta["skipped"])  # CUDA only
    assert data["goals"] == {}


@pytest.mark.slow
def test_gpt_ceiling_smoke(tmp_path):
    data = run_bench("gpt_ceiling.py", tmp_path / "c.json", "--step-configs", "bf16,bf16+graph")
    meta, gemms, quant = data["meta"], data["gemm_ms"], data["quantize_ms"]
    # the Linears fp8_filter converts in the tiny preset (4 blocks, n_embd 128), read off the model
    assert meta["linears"] == {
        "attn.qkv": [128, 384, 4],
        "attn.proj": [128, 128, 4],
        "mlp.fc": [128, 512, 4],
        "mlp.fc2": [512, 128, 4],
    }
    calls = ("fprop", "dgrad", "wgrad")
    for name in meta["linears"]:
        assert all(gemms[name][f"{kind} {c}"] > 0 for kind in ("bf16", "fp8") for c in calls), gemms[name]
    assert set(quant) == {f"{n}.{w}" for n in meta["linears"] for w in ("input", "weight", "grad_output")} | {
        "end_step"
    }
    assert all(v > 0 for v in quant.values()), quant
    # one step's totals: every converted Linear's three GEMMs and quantize calls, once per layer
    step = data["per_step_ms"]
    for kind in ("bf16", "fp8"):
        want = sum(4 * gemms[n][f"{kind} {c}"] for n in meta["linears"] for c in calls)
        assert step[f"gemm_{kind}"] == pytest.approx(want), kind
    for key, times in (("quantize", quant), ("quantize_base", data["quantize_base_ms"])):
        assert set(times) == set(quant) and all(v > 0 for v in times.values()), times
        assert step[key] == pytest.approx(times["end_step"] + 4 * (sum(times.values()) - times["end_step"]))
    # a step configuration that fails (a CUDA graph, here on the CPU) is reported; the others are measured
    assert list(data["ceilings"]) == ["bf16"] and "CUDA" in meta["failed"]["bf16+graph"]
    bf16 = data["ceilings"]["bf16"]
    t, g16, g8, q = bf16["step_ms"], step["gemm_bf16"], step["gemm_fp8"], step["quantize"]
    # both measured (apart: on a loaded CPU the GEMMs timed alone can take longer than the step timed whole,
    # so their order is not asserted here; the ceiling's formulas are)
    assert g16 > 0 and t > 0
    assert bf16["gemm_share"] == pytest.approx(g16 / t)
    assert bf16["ceiling"] == pytest.approx(t / (t - g16 + g8))  # Amdahl: the GEMMs swapped, all else kept
    assert bf16["with_quantize"] == pytest.approx(t / (t - g16 + g8 + q))
    assert data["goals"] == {}  # assessed on CUDA only


def run_gpu_check(*args: str, python: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(GPU_CHECK), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHON": python},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_gpu_check_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(GPU_CHECK)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    proc = run_gpu_check("--no-such-flag", python=sys.executable)
    assert proc.returncode == 2 and "usage:" in proc.stderr


def _function(script: str, name: str) -> str:
    """The bash function ``name`` of ``script``, as text (from its ``name() {`` line to its closing brace)."""
    start = script.index(f"{name}() {{")
    return script[start : script.index("\n}\n", start) + 3]


def test_gpu_check_parts_selects_by_name_and_prefix():
    # GPU_CHECK_PARTS picks parts for a short lease: names, trailing-* prefixes; versions and import always
    script = GPU_CHECK.read_text()
    selected = _function(script, "selected")
    probe = "for p in versions import gpu-tests train-delayed train-delayed-graph bench-gpt bench-linear; do "
    probe += 'selected "$p" && printf "%s " "$p"; done; true'

    def chosen(parts: str | None) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_PARTS"}
        if parts is not None:
            env["GPU_CHECK_PARTS"] = parts
        proc = subprocess.run(["bash", "-c", selected + probe], capture_output=True, text=True, env=env)
        assert proc.returncode == 0 and not proc.stderr, proc.stderr
        return proc.stdout.split()

    every = [
        "versions",
        "import",
        "gpu-tests",
        "train-delayed",
        "train-delayed-graph",
        "bench-gpt",
        "bench-linear",
    ]
    assert chosen(None) == every
    assert chosen("bench-gpt,train-*") == [
        "versions",
        "import",
        "train-delayed",
        "train-delayed-graph",
        "bench-gpt",
    ]
    assert chosen("gpu-tests") == ["versions", "import", "gpu-tests"]
    assert chosen("train") == ["versions", "import"]  # a whole name, not a prefix, without the *


def test_gpu_check_train_runs_take_their_flags_from_the_name():
    # train_runs NAME[-compile][-graph]: the recipe, --compile, --cuda-graph (run_part stubbed: prints them)
    probe = 'run_part() { echo "$1 $2 ${*:3}"; }; WORK=$(mktemp -d); RAN=0; set_detail() { :; }; '
    probe += "train_runs delayed delayed-graph delayed-compile-graph mxfp8"
    proc = subprocess.run(
        ["bash", "-c", _function(GPU_CHECK.read_text(), "train_runs") + probe], capture_output=True, text=True
    )
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    runs = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()}
    assert list(runs) == [
        "train-delayed",
        "train-delayed-graph",
        "train-delayed-compile-graph",
        "train-mxfp8",
    ]
    for name, (cap, *cmd) in runs.items():
        assert cmd[cmd.index("--recipe") + 1] == name.split("-")[1], cmd
        assert ("--compile" in cmd) == ("-compile" in name) and ("--cuda-graph" in cmd) == name.endswith(
            "-graph"
        )
        assert int(cap) == (150 if "-compile" in name else 45)  # the first steps compile


def test_gpu_check_runs_every_gpt_configuration():
    # bench-gpt and bench-gpt-compile together measure every configuration bench/gpt_throughput.py knows
    tree = ast.parse((ROOT / "bench" / "gpt_throughput.py").read_text())
    (configs,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["CONFIGS"]
    ]
    script = GPU_CHECK.read_text()
    lists = {}
    for name in ("GPT_EAGER", "GPT_COMPILED"):
        line = next(x for x in script.splitlines() if x.startswith(f"{name}="))
        lists[name] = line.split("=", 1)[1].split(",")
    assert sorted(lists["GPT_EAGER"] + lists["GPT_COMPILED"]) == sorted(configs)
    # torchao runs compiled (the benchmark compiles it), so beside fp8scope compiled
    compiled = [c for c in lists["GPT_COMPILED"] if c != "torchao"]
    assert "torchao" in lists["GPT_COMPILED"] and all("compile" in c for c in compiled)
    assert not any("compile" in c for c in lists["GPT_EAGER"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: gpu-check.sh would run")
@pytest.mark.parametrize("python", ["this", "missing"])
def test_gpu_check_without_cuda_exits_2(python, tmp_path):
    # with this interpreter (torch without a GPU) and with one that does not exist
    exe = sys.executable if python == "this" else str(tmp_path / "no-python")
    proc = run_gpu_check(python=exe)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "no CUDA GPU" in proc.stdout and "nothing run" in proc.stdout
    assert proc.stdout.strip().count("\n") == 0, proc.stdout  # one line: no part started


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install '.[dev]')")
def test_kernel_configs_smoke(tmp_path):
    # every candidate configuration is run through the shipped kernels and checked (statistics here; bits too
    # on a GPU); the smoke mode runs one per kernel with every form of the main loop's loads (the register
    # prefetch, Triton's software pipeline), under the interpreter
    out = tmp_path / "kernel_configs.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernel_configs.py"), "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = json.loads(out.read_text())["results"]
    assert {r["kernel"] for r in results} == {"1-D", "transposed"} and len(results) == 6
    assert {r["loads"] for r in results} == {"prefetch", "pipeline x3", "pipeline x4"}  # side by side
    assert all(r["exact"] and r["error"] is None for r in results), results


def test_profile_gpu_smoke(tmp_path):
    out = tmp_path / "profile.txt"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "profile_gpu.py"),
            "--smoke",
            "--only",
            "host,gpt-compiled",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    text = out.read_text()
    for name in ("nn.Linear", "fp8scope delayed", "fp8scope current"):
        assert f"{name}" in text and "ms per call" in text
    assert "_FP8LinearFn" in text  # the profiler table of the FP8 layer's host operations
    # the compiled GPT step: the FP8 layers between compiled graphs
    assert "delayed, compiled:" in text and "CompiledFunction" in text


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install '.[dev]')")
def test_sass_profile_runs_without_a_gpu(tmp_path):
    # the sm_90 build needs no GPU: the script's numbers are the real ones here, not a smoke run's
    out = tmp_path / "sass.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sass.py"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode == 3:  # this Triton cannot build for sm_90 here, or lacks nvdisasm
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 12 and "quantize 1-D, quality" in proc.stdout
    for row in rows.values():  # each main loop found, loading its input; each program fits on an SM
        assert row["loop_instructions"] > 0 and row["loop_global_loads"] >= 1, row
        assert row["programs_per_sm"] >= 1 and row["kib_in_flight_per_sm"] > 0, row
    # the statistics of the quality columns cost instructions: more per iteration than the base columns'
    quality, base = rows["quantize 1-D, quality"], rows["quantize 1-D, base"]
    assert quality["loop_instructions"] > base["loop_instructions"], (quality, base)
    # the pipelined loads stage their blocks in shared memory, several ahead: more bytes in flight per SM
    for kernel in ("quantize 1-D, quality", "quantize 2-D (+ transpose), quality"):
        shipped, piped = rows[kernel], rows[f"{kernel}, pipelined"]
        assert piped["shared_bytes"] > shipped["shared_bytes"], (shipped, piped)
        assert piped["kib_in_flight_per_sm"] > shipped["kib_in_flight_per_sm"], (shipped, piped)
    # current scaling's quantize pass reduces the amax pass's partial maxima before its loop: no spill in
    # the loop, and no fewer programs per SM than the same kernel given its scale (delayed scaling)
    for current, delayed in (("1-D", "1-D"), ("2-D", "2-D (+ transpose)")):
        cur, dly = rows[f"current: quantize {current}, quality"], rows[f"quantize {delayed}, quality"]
        assert cur["loop_spills"] == 0 and cur["programs_per_sm"] >= dly["programs_per_sm"], (cur, dly)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install '.[dev]')")
def test_launch_host_smoke(tmp_path):
    data = run_bench("launch_host.py", tmp_path / "lh.json")
    rows = {r["launcher"]: r for r in data["rows"]}
    assert set(rows) == {
        "delayed, 1-D",
        "delayed, transposed",
        "current, 1-D (amax + quantize)",
        "current, transposed (amax + quantize)",
    }
    for r in rows.values():  # every form timed; the launcher's share is what it costs above the allocations
        us = r["us_per_call"]
        assert set(us) == {"planned", "rebuilt", "floor"} and all(v > 0 for v in us.values()), r
        assert r["launcher_us"]["planned"] == pytest.approx(us["planned"] - us["floor"])
