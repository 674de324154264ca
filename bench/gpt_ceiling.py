"""How much FP8 can speed up a GPT training step at most: the bf16 step, and the GEMMs FP8 replaces in it,
measured side by side in one run.

FP8 here replaces only the block Linears' GEMMs (qkv, proj, fc, fc2 in each block: ``fp8_filter``); the
embeddings, LayerNorm, attention, the tied ``lm_head``, the loss and the optimizer stay as they are. So by
Amdahl's law a step can get at most as fast as

    ceiling        = T_step / (T_step - G_bf16 + G_fp8)          FP8 GEMMs, quantization and host work free
    with quantize  = T_step / (T_step - G_bf16 + G_fp8 + Q)      fp8scope's quantize kernels added

where, for the preset and batch of ``bench/gpt_throughput.py`` and measured in this run:

* ``T_step``: the bf16 training step (autocast, AdamW), as ``gpt_throughput.py`` runs it: eager, and in a
  CUDA graph (no host launch cost: the step's device time);
* ``G_bf16``: the block Linears' three GEMMs per layer (fprop ``F.linear`` with bias, dgrad and wgrad), at
  the step's shapes (tokens x in x out), bfloat16, for each of them: what ``nn.Linear`` runs under autocast;
* ``G_fp8``: the same GEMMs as the bare FP8 ``torch._scaled_mm`` calls that fp8scope's ``Linear`` issues
  through ``fp8_trainer.gemm.fp8_mm`` (the same operands in the same layouts, fast accumulation for fprop),
  without ``fp8_mm``'s host-side checks; the same GEMMs through ``fp8_mm`` are timed too and reported
  apart (``fp8_mm ...`` in ``gemm_ms``, ``gemm_fp8_mm`` per step). Off the GPU there is no FP8 GEMM and
  both are ``fp8_mm``'s emulation;
* ``Q``: fp8scope's quantize calls of one step at these shapes (each layer's input and float32 weight E4M3,
  grad_output E5M2, each with its transposed copy where the GEMMs need one, statistics recorded: what
  ``Linear`` runs), plus the step's one scale update (``FP8State.end_step`` after a step that recorded
  statistics: amaxes into the history, new scales, a fresh statistics buffer), delayed scaling; also
  without the quality statistics (``FP8State.set_quality_stats(False)``), which the ceiling's second
  column does not use.

Each GEMM / quantize time is N back-to-back calls between one pair of CUDA events (``gpu_timing``); a step
time is ``--steps`` steps with one synchronisation before and after (median of two rounds). The ceiling says
whether a goal such as "1.3x bf16 tokens/s" is reachable for this model and batch at all, whatever the
runtime does: where the GEMMs FP8 speeds up are a small part of the step, it is not. ``--preset 350m`` /
``1.3b`` measure the same for wider models.

    python bench/gpt_ceiling.py [--preset 124m] [--batch-size 16] [--seq-len 1024] [--steps 10]
    python bench/gpt_ceiling.py --smoke   # tiny preset on the CPU: exercises the script only

The JSON goes to bench/results/gpt_ceiling_<preset>.json.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from gpt_throughput import (
    Job,
    add_device_arguments,
    apply_smoke,
    gpt_parser,
    random_batches,
    run_steps,
    vocab_size,
)
from gpu_common import device_name, failure, meta_head, write_json
from gpu_timing import calls_per_sample, goal, ms_per_call

from fp8_trainer.app.model import GPT, GPTConfig, fp8_filter, preset_config
from fp8_trainer.gemm import _pad_k, check_scaled_mm_args, fp8_mm, gemm_operand, uses_scaled_mm
from fp8_trainer.linear_ops import _quantize, fused_transposes
from fp8_trainer.state import FP8State

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SAMPLE_MS = 20.0
GEMM_CALLS = ("fprop", "dgrad", "wgrad")  # a Linear's GEMMs in a training step
QUANTIZED = ("input", "weight", "grad_output")  # what a Linear quantizes in a step


def fp8_linears(cfg: GPTConfig) -> dict[str, tuple[int, int, int]]:
    """The Linears ``fp8_filter`` converts, one entry per kind: ``name: (in_features, out_features, count)``
    (``blocks.3.mlp.fc`` counts as ``mlp.fc``), read off the model itself (built on the meta device)."""
    with torch.device("meta"):
        model = GPT(cfg)
    out: dict[str, tuple[int, int, int]] = {}
    for fqn, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and fp8_filter(mod, fqn):
            kind = ".".join(p for p in fqn.split(".") if not p.isdigit() and p != "blocks")
            k, n, count = mod.in_features, mod.out_features, out.get(kind, (0, 0, 0))[2]
            if count and out[kind][:2] != (k, n):
                raise ValueError(f"{fqn}: {k}x{n}, but other {kind} layers are {out[kind][:2]}")
            out[kind] = (k, n, count + 1)
    return out


def timed(fn, device: torch.device) -> float:
    """Milliseconds per call of ``fn``: back-to-back calls, as many as make a sample about SAMPLE_MS long,
    median of three samples."""
    for _ in range(3):
        fn(0)
    n = calls_per_sample(fn, device, SAMPLE_MS, min_calls=3, max_calls=200, floor_ms=1e-3)
    return statistics.median(ms_per_call(fn, n, device) for _ in range(3))


def fp8_operand(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A GEMM operand of FP8 values in ``dtype`` (in the emulation's float32 form off the GPU)."""
    return gemm_operand(torch.randn(shape, device=device).clamp(-200, 200).to(dtype))


def bare_gemm(a, scale_a, b, scale_b, out_dtype, bias=None, *, fast_accum=False):
    """``fp8_mm(a, scale_a, b, scale_b, out_dtype, bias, fast_accum=...)`` as the GEMM it runs, a function of
    no argument: the ``torch._scaled_mm`` call ``fp8_mm`` makes, with the operands it passes on (K zero-padded
    to a multiple of 16 here, beforehand, where ``fp8_mm`` pads) and without its host-side work; ``fp8_mm``
    itself where it emulates (no FP8 GEMM on this device)."""
    if not uses_scaled_mm(a.device):
        return lambda: fp8_mm(a, scale_a, b, scale_b, out_dtype, bias, fast_accum=fast_accum)
    k = a.shape[1]
    if k % 16:
        a, b = _pad_k(a.contiguous(), k + (-k) % 16), _pad_k(b.t().contiguous(), k + (-k) % 16).t()
    check_scaled_mm_args(a, b, scale_a, scale_b, out_dtype, bias)  # the call fp8_mm would make, as it is
    return lambda: torch._scaled_mm(
        a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=fast_accum
    )


def gemm_times(m: int, k: int, n: int, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """ms per call of fprop, dgrad and wgrad of one ``(m tokens, k in, n out)`` Linear, in ``dtype`` (what
    ``nn.Linear`` runs), as the bare FP8 GEMMs fp8scope's ``Linear`` runs (``fp8 ...``) and as its calls of
    ``fp8_mm`` (``fp8_mm ...``: the same GEMMs with the wrapper's host-side work)."""
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    b = torch.randn(n, device=device, dtype=dtype)
    g = torch.randn(m, n, device=device, dtype=dtype)
    one = torch.ones((), device=device)
    qx, qw, qg = (
        fp8_operand((m, k), E4M3, device),
        fp8_operand((n, k), E4M3, device),
        fp8_operand((m, n), E5M2, device),
    )
    # the layouts fp8scope's Linear hands fp8_mm: transposes stored contiguously where the GEMM wants them
    qxt, qwt, qgt = qx.t().contiguous(), qw.t().contiguous(), qg.t().contiguous()
    fp8 = {  # fp8_mm's arguments per GEMM, as fp8scope's Linear passes them
        "fprop": ((qx, one, qw.t(), one, dtype, b), True),
        "dgrad": ((qg, one, qwt.t(), one, dtype), False),
        "wgrad": ((qgt, one, qxt.t(), one, dtype), False),
    }
    out = {
        "bf16 fprop": timed(lambda i: F.linear(x, w, b), device),
        "bf16 dgrad": timed(lambda i: g @ w, device),
        "bf16 wgrad": timed(lambda i: g.t() @ x, device),
    }
    for call, (args, fast) in fp8.items():
        gemm = bare_gemm(*args, fast_accum=fast)
        out[f"fp8 {call}"] = timed(lambda i, gemm=gemm: gemm(), device)
    for call, (args, fast) in fp8.items():
        out[f"fp8_mm {call}"] = timed(lambda i, args=args, fast=fast: fp8_mm(*args, fast_accum=fast), device)
    return out


def quantize_times(
    linears: dict[str, tuple[int, int, int]], m: int, device: torch.device, dtype: torch.dtype, quality: bool
) -> tuple[dict[str, float], dict[str, int]]:
    """ms per call of each quantize one block's Linears run in a step (delayed scaling, statistics recorded,
    the transposed copy written in the same pass where the GEMMs need it), and of the step's scale update;
    and how many timed ``end_step`` calls there were and how many of them updated the scales (all of them)."""
    state = FP8State(list(linears), device=device, layer_shapes=[(n, k) for k, n, _ in linears.values()])
    state.set_quality_stats(quality)
    out = {}
    for li, (name, (k, n, _)) in enumerate(linears.items()):
        fused_t = fused_transposes(state, li, device)
        for j, (what, shape) in enumerate((("input", (m, k)), ("weight", (n, k)), ("grad_output", (m, n)))):
            # the weight is the float32 master weight (autocast leaves it so; the FP8 Linear quantizes it)
            t = torch.randn(shape, device=device, dtype=torch.float32 if what == "weight" else dtype)
            out[f"{name}.{what}"] = timed(
                lambda _, i_t=3 * li + j, t=t, tr=fused_t: _quantize(state, i_t, t, True, tr), device
            )
    # end_step does nothing unless a recorded forward left the step pending (FP8State.end_step): each call
    # is armed as a training step's forward leaves it, so each folds the statistics buffer's amaxes into the
    # history and computes new scales (the buffer's amaxes are zeros after the first call, which changes
    # what the update writes, not the work it does)
    calls, steps = 0, state.steps

    def scale_update(_):
        nonlocal calls
        calls += 1
        state.pending = True
        state.end_step()

    out["end_step"] = timed(scale_update, device)
    updates = {"calls": calls, "updates": state.steps - steps, "step_counter": int(state.step_t)}
    return out, updates


def step_times(
    args: argparse.Namespace, device: torch.device, vocab: int
) -> tuple[dict[str, float], dict[str, str]]:
    """ms per bf16 training step of each of ``args.step_configs`` (``gpt_throughput.Job``): ``args.steps``
    steps with one synchronisation before and after, median of two such rounds; and the configurations that
    failed (other than eager bf16), with why."""
    batches = random_batches(args, vocab, device)
    out, failed = {}, {}
    for config in args.step_configs:
        try:
            job = Job(config, args, device, vocab)
            run_steps(job, batches, args.warmup, 0)
            out[config] = statistics.median(
                run_steps(job, batches, args.steps, r * args.steps) * 1e3 / args.steps for r in range(2)
            )
        except Exception as e:  # a capture or compile that fails: say so, keep the others
            if config == "bf16":
                raise
            failed[config] = failure(e)
        job = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out, failed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, ``--smoke`` applied and ``--step-configs`` checked and split into a list."""
    p = gpt_parser(__doc__, 10, "untimed steps per step configuration", "timed steps per step configuration")
    p.add_argument(
        "--step-configs",
        default=None,
        help="bf16 step configurations of gpt_throughput.py "
        "(default: bf16,bf16+graph on CUDA, bf16 elsewhere)",
    )
    add_device_arguments(p)
    p.add_argument("--out", default=None, help="default: bench/results/gpt_ceiling_<preset>.json")
    a = p.parse_args(argv)
    apply_smoke(a)
    default_steps = "bf16,bf16+graph" if torch.device(a.device).type == "cuda" else "bf16"
    a.step_configs = [c.strip() for c in (a.step_configs or default_steps).split(",") if c.strip()]
    bad = [c for c in a.step_configs if c.split("+")[0] != "bf16"]
    if bad:
        p.error(f"--step-configs: bf16 configurations only (bf16[+compile][+graph]), got {bad}")
    a.no_compile = False
    return a


def gemms_per_step(linears: dict[str, tuple[int, int, int]], gemms: dict[str, dict], kind: str) -> float:
    """ms of the GEMMs of every converted Linear in one step, as ``kind`` (bf16, fp8, fp8_mm) runs them."""
    return sum(linears[name][2] * sum(t[f"{kind} {c}"] for c in GEMM_CALLS) for name, t in gemms.items())


def quantize_per_step(linears: dict[str, tuple[int, int, int]], times: dict[str, float]) -> float:
    """ms of every quantize call of one step, and of the step's scale update."""
    return times["end_step"] + sum(
        linears[name][2] * sum(times[f"{name}.{what}"] for what in QUANTIZED) for name in linears
    )


def ceilings_of(steps: dict[str, float], g_bf16: float, g_fp8: float, q: float) -> dict[str, dict]:
    """Amdahl's bound per step configuration: the step with its bf16 GEMMs swapped for FP8 ones (and the
    quantize work added, for ``with_quantize``); ``None`` where the measured parts leave no time at all."""
    ceilings = {}
    for config, t in steps.items():
        rest = t - g_bf16
        ceilings[config] = {
            "step_ms": t,
            "gemm_share": g_bf16 / t,
            "ceiling": t / (rest + g_fp8) if rest + g_fp8 > 0 else None,
            "with_quantize": t / (rest + g_fp8 + q) if rest + g_fp8 + q > 0 else None,
        }
    return ceilings


def print_gemms(linears: dict[str, tuple[int, int, int]], gemms: dict[str, dict], m: int) -> None:
    """Per Linear kind: its three GEMMs in bf16 and FP8, and the speed-up."""
    print(f"\n{'Linear (tokens x in x out)':<36} {'bf16 ms':>9} {'fp8 ms':>9} {'x':>6}   (fprop+dgrad+wgrad)")
    for lname, (k, n, _) in linears.items():
        t = gemms[lname]
        b16 = sum(t[f"bf16 {g}"] for g in GEMM_CALLS)
        f8 = sum(t[f"fp8 {g}"] for g in GEMM_CALLS)
        print(f"{lname + f' ({m}x{k}x{n})':<36} {b16:9.3f} {f8:9.3f} {b16 / f8:6.2f}")


def print_ceilings(ceilings: dict[str, dict], failed: dict[str, str]) -> None:
    print(f"\n{'bf16 step':<22} {'step ms':>9} {'GEMM share':>11} {'ceiling':>8} {'w/ quantize':>12}")
    for config, c in ceilings.items():
        ceil = f"{c['ceiling']:8.2f}" if c["ceiling"] else f"{'n/a':>8}"
        wq = f"{c['with_quantize']:12.2f}" if c["with_quantize"] else f"{'n/a':>12}"
        print(f"{config:<22} {c['step_ms']:9.2f} {c['gemm_share']:11.1%} {ceil} {wq}")
    for config, why in failed.items():
        print(f"{config:<22} {'n/a':>9}  {why}")
    print(
        "ceiling: the step's speed-up with the block Linears' GEMMs in FP8 and all else as in bf16, "
        "quantization and host work free; w/ quantize: plus fp8scope's quantize kernels"
    )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    vocab = vocab_size(a)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    m = a.batch_size * a.seq_len
    linears = fp8_linears(preset_config(a.preset, vocab))

    steps, failed = step_times(a, device, vocab)
    gemms = {name: gemm_times(m, k, n, device, dtype) for name, (k, n, _) in linears.items()}
    quant, updates = quantize_times(linears, m, device, dtype, quality=True)
    quant_base, updates_base = quantize_times(linears, m, device, dtype, quality=False)
    per_step = {f"gemm_{kind}": gemms_per_step(linears, gemms, kind) for kind in ("bf16", "fp8", "fp8_mm")}
    per_step["quantize"] = q = quantize_per_step(linears, quant)
    per_step["quantize_base"] = quantize_per_step(linears, quant_base)
    g_bf16, g_fp8 = per_step["gemm_bf16"], per_step["gemm_fp8"]
    ceilings = ceilings_of(steps, g_bf16, g_fp8, q)

    print(
        f"GPT {a.preset}, batch {a.batch_size} x {a.seq_len} = {m} tokens, {device_name(device)}, {dtype}: "
        f"what FP8 on the block Linears can buy at most" + (" (smoke: not a measurement)" if a.smoke else "")
    )
    print_gemms(linears, gemms, m)
    n_linears = sum(c for *_, c in linears.values())
    print(
        f"per step ({n_linears} Linears): GEMMs bf16 {g_bf16:.2f} ms, FP8 {g_fp8:.2f} ms "
        f"(saves {g_bf16 - g_fp8:.2f}; {per_step['gemm_fp8_mm']:.2f} through fp8_mm); "
        f"fp8scope quantize + scale update {q:.2f} ms "
        f"({per_step['quantize_base']:.2f} without the quality statistics)"
    )
    print_ceilings(ceilings, failed)

    meta = {
        **meta_head(device, a.smoke),
        "preset": a.preset,
        "batch_size": a.batch_size,
        "seq_len": a.seq_len,
        "tokens": m,
        "failed": failed,
        "linears": linears,
        "dtype": str(dtype),
        "steps": a.steps,
        "warmup": a.warmup,
        "fp8_gemm": "torch._scaled_mm" if uses_scaled_mm(device) else "emulated (fp8_mm: no FP8 GEMM here)",
        "end_step_timed": {"quantize_ms": updates, "quantize_base_ms": updates_base},
    }
    best = max((c["ceiling"] for c in ceilings.values() if c["ceiling"]), default=None)
    goals = {}
    if device.type == "cuda" and best is not None:
        goals["ceiling_reaches_1.3x"] = goal(
            best, 1.3, "the best ceiling: can FP8 GEMMs make this step 1.3x?"
        )
    head = f"{a.preset} b{a.batch_size}x{a.seq_len}: GEMMs bf16 {g_bf16:.1f} ms, FP8 {g_fp8:.1f} ms"
    summary = f"{head}, quantize {q:.1f} ms; " + ", ".join(
        f"{config} {c['step_ms']:.1f} ms/step, GEMM share {c['gemm_share']:.0%}, "
        f"ceiling x{c['ceiling'] or 0:.2f} (x{c['with_quantize'] or 0:.2f} w/ quantize)"
        for config, c in ceilings.items()
    )
    data = {
        "meta": meta,
        "goals": goals,
        "summary": summary,
        "gemm_ms": gemms,
        "quantize_ms": quant,
        "quantize_base_ms": quant_base,
        "per_step_ms": per_step,
        "ceilings": ceilings,
    }
    write_json(a.out or Path(__file__).parent / "results" / f"gpt_ceiling_{a.preset}.json", data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
