"""Bandwidth of the fused quantize + statistics kernel vs PyTorch eager, torch.compile and torchao (CUDA).

For bfloat16 tensors of 2^20 ... 2^28 elements, each implementation quantizes to FP8 with a given scale
(delayed scaling): ``triton`` is the fused kernel (one pass: FP8 tensor + the full statistics row, quality
columns included), ``triton-base`` the same kernel recording the base columns alone (a 6-column row: what
the quality statistics cost), ``eager`` and
``compile`` the PyTorch reference run eagerly and through torch.compile, ``torchao`` (where torchao imports)
torchao's own amax + saturated cast compiled (``tensor_to_amax``, ``to_fp8_saturated``: no statistics, the
work torchao does per tensor), ``copy`` a plain ``x.clone()`` of the same input. ``triton+T`` is the
same kernel also writing the transposed FP8 tensor (the input viewed as rows of 1024; 32 in the smoke run,
whose interpreter walks tiles slowly), the layout backward
GEMMs take; ``eager+T`` is the reference followed by ``q.t().contiguous()``. ``triton-pipe`` and
``triton+T-pipe`` are the same two kernels with their main loop's loads in Triton's software pipeline
(``fp8_kernels.triton.launch.pipeline_stages``: asynchronous copies into shared memory, several blocks ahead)
instead of the shipped register prefetch: the alternative, timed beside it.

Bandwidth is useful bytes / time: the input read once and every output written once (bf16 in, FP8 out, and
one more FP8 write for the transposes), as a fraction of the device's copy bandwidth measured in the same
run on a 1 GiB buffer (bytes read + written). Goals, at the largest size: ``triton`` and ``triton+T`` at
>= 80% of that copy bandwidth and >= 2x their eager references; the column ``x base`` is triton-base's
time over triton's (1.00: the quality statistics cost nothing).

How it times (CUDA): each sample is N back-to-back calls between one pair of CUDA events, divided by N, so
launches overlap execution as in training and no sample includes a host synchronisation; N is chosen so a
sample lasts about 2 ms. Calls rotate over several input tensors (together at least 4x the L2 cache) and
keep the last outputs alive, so consecutive calls neither read nor write cache-resident buffers. Samples are
interleaved across implementations (A, B, C, A, B, C, ...); the table shows medians. The JSON goes to
bench/results/kernels.json.

Where a kernel's work is shorter than its launch (the smaller sizes), back-to-back calls run at the host's
pace: the GPU waits for each launch, and the GB/s measure the launcher, not bandwidth. Each sample also
times the host's loop that issues the calls; a row is marked ``launch_bound`` (JSON, and "launch-bound"
after its line) where the fused kernel's or its transposed variant's host time per call is at least 90% of
its time per call: the GPU waited on the host.

    python bench/kernels.py [--min-exp 20] [--max-exp 28] [--step-exp 1] [--reps 20] [--format e4m3|e5m2]
    TRITON_INTERPRET=1 python bench/kernels.py --smoke   # tiny sizes on the CPU: exercises the script only
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections import deque
from pathlib import Path
from typing import NamedTuple

import torch
from gpu_common import device_name, failure, meta_head, print_goals, write_json
from gpu_timing import calls_per_sample, goal, ms_per_call, ms_per_call_and_host

from fp8_kernels import fp8_gpu, new_stats

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
COPY_BYTES = 2**30  # copy bandwidth reference: far beyond any L2 cache
SAMPLE_MS = 2.0  # target length of one timed sample (N back-to-back calls)
LAUNCH_BOUND = 0.9  # host time per call / time per call from which a row measures the launcher
STATS_IMPLS = (
    "triton",
    "eager",
    "compile",
    "triton+T",
    "eager+T",
    "triton-pipe",
    "triton+T-pipe",
)  # those that produce a full statistics row


def sample_calls(fn, device: torch.device, min_calls: int, smoke: bool) -> int:
    """N for a sample of about ``SAMPLE_MS`` (at least ``min_calls``: every rotating buffer once)."""
    if smoke:
        return 2
    return calls_per_sample(fn, device, SAMPLE_MS, min_calls=min_calls, max_calls=2000, floor_ms=1e-4)


def copy_bandwidth(nbytes: int, device: torch.device, reps: int, smoke: bool) -> float:
    """GB/s of ``dst.copy_(src)`` (bytes read + bytes written) for ``nbytes``-byte buffers."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def fn(i):
        dst.copy_(src)

    fn(0)
    n = sample_calls(fn, device, 3, smoke)
    ms = statistics.median(ms_per_call(fn, n, device) for _ in range(reps))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def make_torchao(fp8: torch.dtype, backend: str):
    """torchao's per-tensor work (amax for the next scale + saturated cast), compiled; ``(fn, None)`` or
    ``(None, reason)`` where torchao does not import."""
    try:
        from torchao.float8.float8_utils import tensor_to_amax, to_fp8_saturated
    except Exception as e:  # ImportError, or a torchao built for another torch
        return None, f"{type(e).__name__}: {e}"

    def torchao_cast(x, scale):
        return to_fp8_saturated(x.to(torch.float32) * scale, fp8), tensor_to_amax(x)

    return torch.compile(torchao_cast, backend=backend), None


def pipelined(fn):
    """``fn`` run with the quantize kernels' loads in Triton's software pipeline (``prefetch`` off for the
    call, so ``pipeline_stages`` applies) instead of the shipped register prefetch."""
    from fp8_kernels.triton import quantize as triton_quantize

    def run(*args):
        shipped = triton_quantize.prefetch
        triton_quantize.prefetch = lambda device: False
        try:
            return fn(*args)
        finally:
            triton_quantize.prefetch = shipped

    return run


def build_impls(fp8: torch.dtype, backend: str, with_torchao: bool, width: int = 1024):
    """name -> ``fn(x, scale, stats) -> outputs``, and why torchao is missing (or ``None``); the transposed
    variants view ``x`` as rows of ``width``."""
    from fp8_kernels import quantize_with_stats_reference
    from fp8_kernels.triton.quantize import quantize_with_stats_transposed_triton, quantize_with_stats_triton

    compiled = torch.compile(quantize_with_stats_reference, backend=backend)

    def eager_t(x, scale, stats):
        q, row = quantize_with_stats_reference(x.view(-1, width), scale, fp8, stats)
        return q, q.t().contiguous(), row

    def triton_t(x, scale, stats):
        return quantize_with_stats_transposed_triton(x.view(-1, width), scale, fp8, stats)

    impls = {
        "copy": lambda x, scale, stats: x.clone(),  # a fresh output each call, as the others write
        "triton": lambda x, scale, stats: quantize_with_stats_triton(x, scale, fp8, stats),
        "triton-base": lambda x, scale, stats: quantize_with_stats_triton(x, scale, fp8, stats),  # 6-col row
        "eager": lambda x, scale, stats: quantize_with_stats_reference(x, scale, fp8, stats),
        "compile": lambda x, scale, stats: compiled(x, scale, fp8, stats),
        "triton+T": triton_t,
        "eager+T": eager_t,
        "triton-pipe": pipelined(lambda x, scale, stats: quantize_with_stats_triton(x, scale, fp8, stats)),
        "triton+T-pipe": pipelined(triton_t),
    }
    why_not = "not requested"
    if with_torchao:
        ao, why_not = make_torchao(fp8, backend)
        if ao is not None:
            impls["torchao"] = lambda x, scale, stats: ao(x, scale)
    return impls, why_not


def rows_match(row: torch.Tensor, ref: torch.Tensor) -> bool:
    """Statistics rows equal: every column exactly but the two sums of squares, which a kernel sums in
    float32 per block (within 14 * 2**-24 relative; ``triton.quantize``)."""
    from fp8_protocol.stats import ERR_SQ, SUM_SQ

    exact = [c for c in range(row.shape[0]) if c not in (SUM_SQ, ERR_SQ)]
    sums_ok = torch.allclose(row[SUM_SQ : ERR_SQ + 1], ref[SUM_SQ : ERR_SQ + 1], rtol=14 * 2.0**-24, atol=0.0)
    return torch.equal(row[exact].nan_to_num(-1), ref[exact].nan_to_num(-1)) and sums_ok


def useful_bytes(name: str, n: int) -> int:
    """Bytes an ideal implementation moves: bf16 read, FP8 written (twice for the transposed variants)."""
    if name == "copy":
        return 4 * n
    return 3 * n + (n if "+T" in name else 0)


def bench_size(n: int, impls: dict, fp8, device, reps: int, l2_bytes: int, smoke: bool) -> dict:
    g = torch.Generator(device=device).manual_seed(n)
    n_bufs = 2 if smoke else max(2, min(256, math.ceil(4 * l2_bytes / (2 * n))))
    xs = [torch.randn(n, generator=g, device=device).to(torch.bfloat16) for _ in range(n_bufs)]
    scale = torch.tensor(3.7, device=device)

    # correctness first: one call each on the same input, statistics (and bits, on a GPU) against eager
    rows = {}
    for name in STATS_IMPLS:
        out = impls[name](xs[0], scale, new_stats(device=device))
        rows[name] = out
    ref_row = rows["eager"][1]
    stats_match = {name: rows_match(out[-1], ref_row) for name, out in rows.items()}
    bits_match = None
    # the interpreter's float8 casts are not trusted (docs/fp8-semantics.md, "Known traps")
    if device.type == "cuda":
        ref_q = rows["eager"][0].view(torch.uint8)
        ref_qt = rows["eager+T"][1].view(torch.uint8)
        bits_match = {
            name: torch.equal(rows[name][0].view(torch.uint8), ref_q) for name in ("triton", "triton-pipe")
        }
        for name in ("triton+T", "triton+T-pipe"):
            bits_match[name] = torch.equal(rows[name][1].view(torch.uint8), ref_qt)
    for name, ok in {**stats_match, **(bits_match or {})}.items():
        if not ok:
            print(f"WARNING: {name} at {n} elements differs from the eager reference")
    del rows

    keep: deque = deque(maxlen=n_bufs)  # the last outputs stay allocated: each call writes fresh memory
    scratch = {name: new_stats(device=device, quality=name != "triton-base") for name in impls}
    runs, counts = {}, {}
    for name, impl in impls.items():

        def run(i, impl=impl, name=name):
            keep.append(impl(xs[i % n_bufs], scale, scratch[name]))

        run(0)  # compilation, autotuning
        runs[name] = run
        counts[name] = sample_calls(run, device, n_bufs, smoke)
    times: dict[str, list[float]] = {name: [] for name in impls}
    host: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(reps):
        for name, run in runs.items():
            ms, host_ms = ms_per_call_and_host(run, counts[name], device)
            times[name].append(ms)
            host[name].append(host_ms)
    keep.clear()
    row = {
        "numel": n,
        "input_buffers": n_bufs,
        "stats_match_eager": stats_match,
        "bits_match_eager": bits_match,
    }
    for name, t in times.items():
        ms = statistics.median(t)
        row[name] = {
            "ms": ms,
            "host_ms": statistics.median(host[name]),
            "spread_ms": [min(t), max(t)],
            "calls_per_sample": counts[name],
            "gbps": useful_bytes(name, n) / (ms * 1e-3) / 1e9,
        }
    # the fused kernels issued no faster than they ran: the GPU waited on the host
    fused = (row["triton"], row["triton+T"])
    row["launch_bound"] = any(t["host_ms"] >= LAUNCH_BOUND * t["ms"] for t in fused)
    return row


class Plan(NamedTuple):
    """Where and what a run measures: the device, the tensor sizes, samples per size, torch.compile's
    backend, the copy reference's buffer size and the L2 size the rotating inputs must outgrow."""

    device: torch.device
    sizes: list[int]
    reps: int
    backend: str
    copy_bytes: int
    l2_bytes: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (``--help`` shows the module's docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-exp", type=int, default=20)
    p.add_argument("--max-exp", type=int, default=28)
    p.add_argument("--step-exp", type=int, default=1)
    p.add_argument("--reps", type=int, default=20, help="timed samples per implementation and size")
    p.add_argument("--format", choices=sorted(FORMATS), default="e4m3")
    p.add_argument("--no-torchao", action="store_true", help="leave the torchao baseline out")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernels.json"))
    return p.parse_args(argv)


def smoke_plan() -> Plan | None:
    """The smoke run's plan: tiny sizes on the CPU under Triton's interpreter, which must be switched on
    before triton's first import; ``None`` (said on stderr) where triton came in without it already."""
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
    elif os.environ.get("TRITON_INTERPRET") != "1":
        print("--smoke: triton is already imported without TRITON_INTERPRET=1", file=sys.stderr)
        return None
    return Plan(torch.device("cpu"), [2**10, 2**12], 2, "eager", 2**20, 0)


def gpu_plan(a: argparse.Namespace) -> Plan:
    """The measurement's plan on the CUDA GPU: the requested sizes, compiled by inductor."""
    device = torch.device("cuda")
    sizes = [2**e for e in range(a.min_exp, a.max_exp + 1, a.step_exp)]
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20)
    return Plan(device, sizes, a.reps, "inductor", COPY_BYTES, l2_bytes)


def allow_recompiles() -> None:
    """Room for one torch.compile compilation per size: each size may compile afresh, more often than
    dynamo's default limit allows."""
    dynamo = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo, knob):
            setattr(dynamo, knob, max(64, getattr(dynamo, knob)))


def probe_torchao(impls: dict, device: torch.device, why_not: str) -> str:
    """Drop torchao from ``impls`` where it imports but does not run with this torch (the others are still
    measured); returns why it is missing, updated."""
    if "torchao" in impls:
        try:
            probe = torch.randn(2**12, device=device).to(torch.bfloat16)
            impls["torchao"](probe, torch.tensor(2.0, device=device), None)
        except Exception as e:
            del impls["torchao"]
            return failure(e)
    return why_not


def table_columns(impls: dict) -> list[str]:
    """The implementations in the table's order: the fused kernels first, then their references."""
    order = (
        *("triton", "triton-base", "triton+T", "triton-pipe", "triton+T-pipe"),
        *("eager", "eager+T", "compile", "torchao", "copy"),
    )
    return [c for c in order if c in impls]


def print_header(cols: list[str], with_torchao: bool) -> None:
    """The table's head: GB/s and fraction of copy per implementation, then the fused kernel's ratios."""
    header = f"{'numel':>10} " + " ".join(f"{c + ' GB/s':>13} {'%copy':>5}" for c in cols)
    header += f" {'x base':>6} {'x eager':>7} {'xT eager':>8} {'x compile':>9}"
    print(header + (" x torchao" if with_torchao else ""))


def add_ratios(row: dict, impls: dict, copy_gbps: float) -> None:
    """Each implementation's fraction of the copy bandwidth, and the fused kernel's speed-ups over the
    references (``base_over_full``: what the quality statistics cost)."""
    for impl in impls:
        row[impl]["fraction_of_copy"] = row[impl]["gbps"] / copy_gbps
    row["speedup_vs_eager"] = row["eager"]["ms"] / row["triton"]["ms"]
    row["base_over_full"] = row["triton-base"]["ms"] / row["triton"]["ms"]
    row["speedup_T_vs_eager_T"] = row["eager+T"]["ms"] / row["triton+T"]["ms"]
    row["speedup_vs_compile"] = row["compile"]["ms"] / row["triton"]["ms"]
    if "torchao" in impls:
        row["speedup_vs_torchao"] = row["torchao"]["ms"] / row["triton"]["ms"]


def print_row(row: dict, cols: list[str]) -> None:
    """One size's line, printed as soon as it is measured."""
    line = f"{row['numel']:>10} " + " ".join(
        f"{row[c]['gbps']:13.1f} {row[c]['fraction_of_copy']:5.0%}" for c in cols
    )
    line += f" {row['base_over_full']:6.2f} {row['speedup_vs_eager']:7.2f} {row['speedup_T_vs_eager_T']:8.2f}"
    line += f" {row['speedup_vs_compile']:9.2f}"
    if "speedup_vs_torchao" in row:
        line += f" {row['speedup_vs_torchao']:9.2f}"
    print(line + ("  launch-bound" if row["launch_bound"] else ""), flush=True)


def kernel_goals(big: dict) -> dict:
    """The goals at the largest size: the fused kernels near the copy bandwidth and well ahead of eager."""
    return {
        "triton_80pct_of_copy": goal(big["triton"]["fraction_of_copy"], 0.8, "fused kernel / copy bandwidth"),
        "triton_T_80pct_of_copy": goal(
            big["triton+T"]["fraction_of_copy"], 0.8, "fused kernel + transpose, fraction of copy"
        ),
        "triton_2x_eager": goal(big["speedup_vs_eager"], 2.0, "fused kernel vs eager reference"),
        "triton_T_2x_eager": goal(big["speedup_T_vs_eager_T"], 2.0, "fused + transpose vs eager + transpose"),
    }


def summarise(big: dict, copy_gbps: float, correct: bool) -> str:
    """The one-line summary scripts/gpu-check.sh shows, at the largest size."""
    return (
        f"2^{int(math.log2(big['numel']))}: triton {big['triton']['gbps']:.0f} GB/s "
        f"({big['triton']['fraction_of_copy']:.0%} of copy {copy_gbps:.0f}), "
        f"+T {big['triton+T']['fraction_of_copy']:.0%}, "
        f"base-only {big['triton-base']['fraction_of_copy']:.0%}, "
        f"pipelined {big['triton-pipe']['fraction_of_copy']:.0%}, "
        f"+T {big['triton+T-pipe']['fraction_of_copy']:.0%}; "
        f"x eager {big['speedup_vs_eager']:.2f}, "
        f"+T x eager {big['speedup_T_vs_eager_T']:.2f}"
        + (f", x torchao {big['speedup_vs_torchao']:.2f}" if "speedup_vs_torchao" in big else ", torchao n/a")
        + ("; launch-bound" if big["launch_bound"] else "")
        + ("" if correct else "; STATISTICS/BITS DIFFER FROM EAGER")
    )


def run_meta(a: argparse.Namespace, plan: Plan, copy_gbps: float, torchao: str | None) -> dict:
    """What was run, where, and how it was timed: the JSON's ``meta``."""
    import triton

    return {
        **meta_head(plan.device, a.smoke),
        "triton": triton.__version__,
        "input_dtype": "bfloat16",
        "fp8_format": a.format,
        "copy_gbps": copy_gbps,
        "copy_bytes": plan.copy_bytes,
        "l2_bytes": plan.l2_bytes,
        "reps": plan.reps,
        "compile_backend": plan.backend,
        "torchao": torchao,
        "timing": "median over samples of N back-to-back calls between one CUDA event pair, divided by N; "
        "inputs rotated over buffers totalling >= 4x L2, outputs kept alive",
        "launch_bound": f"a row where triton's or triton+T's host time per call (host_ms: the loop issuing a "
        f"sample's calls) is >= {LAUNCH_BOUND:g}x its time per call: the GPU waited on the host, and the "
        "row's GB/s measure the launcher, not bandwidth",
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.smoke:
        plan = smoke_plan()
        if plan is None:
            return 2
    elif not fp8_gpu():
        print("bench/kernels.py: needs a CUDA GPU with FP8 support (sm_89+); none here, nothing measured")
        return 0
    else:
        plan = gpu_plan(a)
    device, reps = plan.device, plan.reps

    allow_recompiles()
    fp8 = FORMATS[a.format]
    impls, torchao_missing = build_impls(fp8, plan.backend, not a.no_torchao, width=32 if a.smoke else 1024)
    torchao_missing = probe_torchao(impls, device, torchao_missing)
    copy_gbps = copy_bandwidth(plan.copy_bytes, device, max(reps, 5), a.smoke)
    print(
        f"fused quantize+stats, bf16 -> {a.format}, {device_name(device)}, "
        f"copy bandwidth {copy_gbps:.0f} GB/s "
        f"({plan.copy_bytes / 2**30:g} GiB buffers); median of {reps} samples of back-to-back calls"
        + (" (smoke: interpreter, not a measurement)" if a.smoke else "")
    )
    if "torchao" not in impls:
        print(f"torchao baseline: not measured ({torchao_missing})")
    cols = table_columns(impls)
    print_header(cols, "torchao" in impls)
    rows = []
    for n in plan.sizes:
        row = bench_size(n, impls, fp8, device, reps, plan.l2_bytes, a.smoke)
        add_ratios(row, impls, copy_gbps)
        rows.append(row)
        print_row(row, cols)
    if any(r["launch_bound"] for r in rows):
        print(
            f"launch-bound: the host took at least {LAUNCH_BOUND:.0%} of the fused kernel's time per call to "
            "issue it (triton or triton+T), so the GPU waited for launches: those rows' GB/s measure the "
            "launcher, not bandwidth"
        )
    big = rows[-1]
    goals = kernel_goals(big)
    correct = all(big["stats_match_eager"].values()) and all((big["bits_match_eager"] or {}).values())
    print(f"goals at {big['numel']} elements{' (smoke: not a measurement)' if a.smoke else ''}:")
    print_goals(goals, 24, "8.2f")
    meta = run_meta(a, plan, copy_gbps, None if "torchao" in impls else torchao_missing)
    summary = summarise(big, copy_gbps, correct)
    write_json(a.out, {"meta": meta, "goals": goals, "correct": correct, "summary": summary, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
