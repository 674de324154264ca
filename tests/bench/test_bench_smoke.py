"""CPU smoke runs of the GPU benchmarks and of scripts/gpu-check.sh, so CI exercises what only a lent GPU
measures: each benchmark's ``--smoke`` mode runs as a script and writes its JSON in the layout gpu-check.sh
reads (its numbers are not measurements), and gpu-check.sh refuses a machine without a CUDA GPU before
running anything."""

import ast
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
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
    kinds = ("bf16", "fp8", "fp8_mm")  # fp8: the bare FP8 GEMMs (the emulation here), fp8_mm: through fp8_mm
    for name in meta["linears"]:
        assert set(gemms[name]) == {f"{kind} {c}" for kind in kinds for c in calls}, gemms[name]
        assert all(v > 0 for v in gemms[name].values()), gemms[name]
    assert meta["fp8_gemm"].startswith("emulated")  # no FP8 GEMM on the CPU: torch._scaled_mm on a GPU
    assert set(quant) == {f"{n}.{w}" for n in meta["linears"] for w in ("input", "weight", "grad_output")} | {
        "end_step"
    }
    assert all(v > 0 for v in quant.values()), quant
    # every timed end_step call closed a step that had recorded statistics: the scale update ran each time
    # (an end_step with nothing pending returns at once and counts no step)
    for key in ("quantize_ms", "quantize_base_ms"):
        timed = meta["end_step_timed"][key]
        assert timed["calls"] > 0 and timed["updates"] == timed["calls"] == timed["step_counter"], timed
    # one step's totals: every converted Linear's three GEMMs and quantize calls, once per layer
    step = data["per_step_ms"]
    for kind in kinds:
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


def _assignment(script: str, name: str) -> str:
    """The line ``name=...`` of ``script``, with its newline."""
    return next(x for x in script.splitlines() if x.startswith(f"{name}=")) + "\n"


def test_gpu_check_parts_selects_by_name_and_prefix():
    # GPU_CHECK_PARTS picks parts for a short lease: names, trailing-* prefixes, all; unset, the default
    # parts; versions and import always
    script = GPU_CHECK.read_text()
    selected = _assignment(script, "DEFAULT_PARTS") + _function(script, "selected")
    probe = "for p in versions import gpu-tests train-delayed train-delayed-graph bench-gpt bench-linear "
    probe += 'bench-gpt-1.3b; do selected "$p" && printf "%s " "$p"; done; true'

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
        "bench-gpt-1.3b",
    ]
    assert chosen("all") == every
    assert chosen(None) == ["versions", "import", "gpu-tests", "bench-gpt-1.3b"]  # DEFAULT_PARTS
    assert chosen("bench-gpt,train-*") == [
        "versions",
        "import",
        "train-delayed",
        "train-delayed-graph",
        "bench-gpt",
    ]
    assert chosen("gpu-tests") == ["versions", "import", "gpu-tests"]
    assert chosen("train") == ["versions", "import"]  # a whole name, not a prefix, without the *


def gpu_check_parts(parts: str | None) -> list[tuple[str, int, bool]]:
    """gpu-check.sh's parts in the order its ``main`` runs them, as ``(name, cap in seconds, selected)`` with
    ``GPU_CHECK_PARTS=parts`` (None: unset): ``main`` run with ``run_part`` stubbed to record them (nothing
    else it runs needs a GPU; ``PYTHON`` is ``true``)."""
    script = GPU_CHECK.read_text()
    names = ("DEFAULT_PARTS", "COMPILED_GRAPH_TEST", "GPT_EAGER", "GPT_COMPILED")
    defs = "".join(_assignment(script, n) for n in names)
    defs += "".join(_function(script, f) for f in ("selected", "train_runs", "main"))
    stub = 'run_part() { RAN=0; selected "$1"; local sel=$?; echo "PART $1 $2 $((1 - sel))"; return $sel; }\n'
    stub += "set_detail() { :; }\nbench_detail() { :; }\n"
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_PARTS"}
    if parts is not None:
        env["GPU_CHECK_PARTS"] = parts
    with tempfile.TemporaryDirectory() as work:
        setup = f"ROOT={shlex.quote(str(ROOT))}; PY=true; WORK={shlex.quote(work)}; RESULTS=$WORK\n"
        proc = subprocess.run(
            ["bash", "-c", setup + defs + stub + "main"], cwd=ROOT, env=env, capture_output=True, text=True
        )
    assert proc.returncode == 0, proc.stderr
    rows = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("PART ")]
    return [(name, int(cap), sel == "1") for name, cap, sel in rows]


def test_gpu_check_default_parts_fit_the_default_budget_in_order_of_value():
    script = GPU_CHECK.read_text()
    budget = int(re.search(r"^BUDGET=\$\{GPU_CHECK_BUDGET:-(\d+)\}$", script, re.M).group(1))
    parts = gpu_check_parts(None)
    names = [name for name, _, _ in parts]
    # each part once, each cap at least run_part's least limit (20 s)
    assert len(set(names)) == len(names) and all(cap >= 20 for _, cap, _ in parts), parts
    # a run without GPU_CHECK_PARTS: the GPU tests, then the 1.3b preset's throughput and ceiling, whose caps
    # fit the default budget; they come first, so nothing before them can eat their time
    default = [(name, cap) for name, cap, selected in parts if selected]
    assert [name for name, _ in default] == [
        "versions",
        "import",
        "gpu-tests",
        "bench-gpt-1.3b",
        "bench-ceiling-1.3b",
    ]
    assert names[: len(default)] == [name for name, _ in default]
    assert sum(cap for _, cap in default) <= budget == 300, default
    # then the rest of 1.3b, the 124m preset's benchmarks, then everything else
    m124 = ["bench-gpt", "bench-ceiling", "bench-gpt-compile"]
    assert names[len(default)] == "bench-gpt-1.3b-compile"
    assert names[len(default) + 1 : len(default) + 4] == m124
    rest = names[len(default) + 4 :]
    assert {"gpu-tests-compile", "bench-kernels", "bench-linear", "train-delayed", "profile"} <= set(rest)
    # GPU_CHECK_PARTS=all: every part, in the same order; the budget the header gives for that covers them
    every = gpu_check_parts("all")
    assert [name for name, _, _ in every] == names and all(selected for *_, selected in every)
    all_budget = int(re.search(r"GPU_CHECK_PARTS=all GPU_CHECK_BUDGET=(\d+)", script).group(1))
    assert sum(cap for _, cap, _ in every) <= all_budget
    # the one GPU test gpu-tests leaves to gpu-tests-compile is there under the id both parts name
    test_id = _assignment(script, "COMPILED_GRAPH_TEST").split("=", 1)[1].strip().strip('"')
    path, test = test_id.split("::")
    func, param = test.rstrip("]").split("[")
    text = (ROOT / path).read_text()
    assert f"def {func}(" in text and f'"{param}"' in text, test_id


def test_gpu_check_parts_not_selected_are_not_failures(tmp_path):
    # a part outside the default parts shows as "not selected" and counts neither as run nor as failed
    script = GPU_CHECK.read_text()
    defs = _assignment(script, "DEFAULT_PARTS") + "".join(
        _function(script, f) for f in ("run_part", "selected", "summary")
    )
    setup = "BUDGET=300; START=$(date +%s); NAMES=() STATUS=() SECS=() DETAILS=(); RAN=0; PY=true; "
    setup += f"WORK={shlex.quote(str(tmp_path))}; RESULTS=$WORK\n"
    probe = "run_part gpu-tests 120 true; run_part bench-linear 120 false; summary"
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_PARTS"}
    proc = subprocess.run(["bash", "-c", setup + defs + probe], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith(("gpu-", "bench-"))}
    assert rows["gpu-tests"].split()[1] == "pass"
    assert "not selected" in rows["bench-linear"] and "GPU_CHECK_PARTS=all" in rows["bench-linear"]
    assert "result: all 1 parts passed" in proc.stdout


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
    assert "FP8LinearFn" in text  # the profiler table of the FP8 layer's host operations
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
    # 12 rows and, from the bias-gradient fold on, current scaling without quality columns (1-D and 2-D)
    # and the three dbias variants
    assert len(rows) == 17 and "quantize 1-D, quality" in proc.stdout
    assert sum("dbias" in name for name in rows) == 3, sorted(rows)
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
        assert set(us) == {"planned", "rebuilt", "prepared", "floor"} and all(v > 0 for v in us.values()), r
        assert r["launcher_us"]["planned"] == pytest.approx(us["planned"] - us["floor"])


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install '.[dev]')")
def test_host_path_smoke(tmp_path):
    """``bench/host_path.py``: every configuration timed against ``nn.Linear`` in one run, and the launches
    per layer those configurations make on the emulated GPU path (a step's end counted once per step)."""
    data = run_bench("host_path.py", tmp_path / "hp.json")
    rows = {r["config"]: r for r in data["rows"]}
    assert {"nn.Linear", "fp8scope delayed", "fp8scope current"} <= set(rows)
    assert rows["nn.Linear"]["ratio_to_nn_linear"] == pytest.approx(1.0)
    for r in rows.values():
        assert r["host_us_per_layer"] > 0 and r["ratio_to_nn_linear"] > 0, r
    # delayed: 3 quantize kernels (the bias gradient in grad_output's), 3 GEMMs per layer; per step the
    # scale update and the statistics buffer's ops, over the layers
    delayed = rows["fp8scope delayed"]["launches"]
    assert delayed["aten"]["_scaled_mm"] == 3 * data["meta"]["layers"]
    assert delayed["kernels"] == 3 * data["meta"]["layers"] + 1
    assert "sum" not in delayed["aten"]
    assert rows["fp8scope delayed"]["goal_ratio"] == 2.0 and rows["fp8scope current"]["goal_ratio"] == 2.5


@pytest.mark.slow
def test_replay_verdicts_smoke(tmp_path):
    """``bench/replay_verdicts.py``: real `fp8-train` runs against a real service, captured by default (a
    monitor is set), replayed, the report stored on the incident: the FP8 saturation comes back
    fp8-caused with its input named first, the learning-rate spike not-fp8."""
    data = run_bench("replay_verdicts.py", tmp_path / "rv.json")
    rows = {r["kind"]: r for r in data["rows"]}
    assert set(rows) == {"saturate", "lr-spike"} and data["meta"]["seeds"] == 1
    sat, lr = rows["saturate"], rows["lr-spike"]
    assert sat["bundles"] == ["incident-step40.pt"] and sat["trigger"] == "loss_spike" and sat["bitwise"]
    assert sat["verdict"] == "fp8-caused" and sat["culprits"][0] == "blocks.3.mlp.fc2.input"
    assert sat["loss_fp8"] > 2 * sat["loss_hp"] and sat["configs"] > 16  # bisected, layer by layer
    assert lr["verdict"] == "not-fp8" and lr["culprits"] == [] and lr["bitwise"]
    assert data["right"] == 2 and data["per_kind"]["saturate"]["culprit_first"] == 1
    check_goals(data["goals"])
    assert data["goals"]["verdict_right"]["met"]
