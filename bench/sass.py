"""The machine code of the fused quantize kernels for sm_90 (H100 / H200), built without a GPU: per kernel,
the registers per thread, the stack frame (spills), the shared memory, the main loop's instructions per
iteration, barriers, warp shuffles, global loads and stores, and what that means for memory: how many
programs an SM runs at once, and how many bytes of input they keep in flight.

Not a timing: what a kernel costs on a GPU also depends on memory latency and on how many programs an SM
holds. It is the measurement that can be made without a GPU, and how a change to a kernel's inner loop is
checked before a GPU says what it is worth. ``bytes / instr.`` divides the bytes one thread moves per
iteration (bf16 in; FP8 out, twice for the transposed kernel) by the loop's instructions. For scale, from
an H200's data sheet: 4.8 TB/s over 132 SMs x 4 schedulers x 32 threads x 1.98 GHz of issue (one warp
instruction per scheduler and clock) is about 0.14 bytes per thread instruction; a loop below that cannot
keep the memory busy however well its loads are in flight.

``instr. / 16 el.``: the loop's instructions per 16 elements of a thread (a thread takes 16 elements per
iteration of the 1-D kernels, 32 of the tiled ones: two rows of 16).

``programs / SM``: of the ``PROGRAMS_PER_SM`` a persistent grid launches per SM, how many run at once given
the registers and shared memory (the occupancy model; ``cross_build.SassProfile.programs_per_sm``).
``KiB in flight / SM``: those programs times the blocks (tiles) each has in flight when it waits for one
times its input bytes: 2 for the register prefetch (the current block and the next one, loaded before the
current is worked on), ``stages - 1`` for Triton's software pipeline (the ``pipelined`` rows: the same
kernels with ``prefetch`` off, ``triton.launch.pipeline_stages``), 1 for a plain loop. By Little's law a
kernel streams at most its bytes in flight over the memory latency; the figure is what the loads ask for,
not a measurement.

Each kernel is built the way its launcher builds it on a GPU (``fp8_kernels.triton.cross_build``: CUDA block
sizes, Triton's argument binder, ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, the FP8 cast saturating
as on sm_89+), for a bf16 input; ``nvdisasm`` and ``cuobjdump``, shipped with Triton, read the cubin.

    python bench/sass.py [--out bench/results/sass.json]

Exit status 3 where this Triton cannot build for sm_90 here or ships no ``nvdisasm`` / ``cuobjdump``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from pathlib import Path

import torch

E4M3 = torch.float8_e4m3fn
X_SHAPE = (512, 1024)  # sizes are no part of the compiled kernels


def _kernels():
    """``(name, module, kernel attribute, FP8 bytes written per input element, call, constexprs)``: ``call()``
    runs the launcher once on CPU tensors; ``constexprs`` override what it passed (the ``pipelined`` rows)."""
    from fp8_kernels.triton import current as triton_current
    from fp8_kernels.triton import histogram as triton_histogram
    from fp8_kernels.triton import quantize as triton_quantize

    x = torch.zeros(X_SHAPE, dtype=torch.bfloat16)
    one = torch.tensor(1.0)
    base = lambda: torch.zeros(6, dtype=torch.float64)  # noqa: E731  (a row of the base columns alone)
    q1, q2 = triton_quantize.quantize_with_stats_triton, triton_quantize.quantize_with_stats_transposed_triton
    amax, hist = triton_current.amax_pass, triton_histogram.exponent_histogram_triton
    c1, c2 = triton_current.quantize_current_triton, triton_current.quantize_current_transposed_triton
    quantize = [
        ("quantize 1-D, quality", "_quantize_kernel", 1, lambda: q1(x, one, E4M3)),
        ("quantize 1-D, base", "_quantize_kernel", 1, lambda: q1(x, one, E4M3, base())),
        ("quantize 2-D (+ transpose), quality", "_quantize_t_kernel", 2, lambda: q2(x, one, E4M3)),
        ("quantize 2-D (+ transpose), base", "_quantize_t_kernel", 2, lambda: q2(x, one, E4M3, base())),
    ]
    dbias = [  # the bias gradient in the same pass (grad_output's quantize)
        ("quantize 2-D + dbias, quality", "_quantize_t_kernel", 2, lambda: q2(x, one, E4M3, dbias=True)),
        ("quantize 2-D + dbias, base", "_quantize_t_kernel", 2, lambda: q2(x, one, E4M3, base(), dbias=True)),
        ("current: 2-D + dbias, base", "_quantize_t_kernel", 2, lambda: c2(x, E4M3, base(), dbias=True)),
    ]
    pipe = {"PREFETCH": False}  # the loads in Triton's software pipeline (its stages: pipeline_stages)
    return [
        *((name, triton_quantize, attr, out, call, {}) for name, attr, out, call in quantize),
        *(
            (f"{name}, pipelined", triton_quantize, attr, out, call, pipe)
            for name, attr, out, call in quantize
        ),
        ("current: amax pass", triton_current, "_amax_kernel", 0, lambda: amax(x), {}),
        # the quantize pass of current scaling: its scale from the amax pass's partial maxima
        ("current: quantize 1-D, quality", triton_quantize, "_quantize_kernel", 1, lambda: c1(x, E4M3), {}),
        (
            "current: quantize 1-D, base",
            triton_quantize,
            "_quantize_kernel",
            1,
            lambda: c1(x, E4M3, base()),
            {},
        ),
        ("current: quantize 2-D, quality", triton_quantize, "_quantize_t_kernel", 2, lambda: c2(x, E4M3), {}),
        (
            "current: quantize 2-D, base",
            triton_quantize,
            "_quantize_t_kernel",
            2,
            lambda: c2(x, E4M3, base()),
            {},
        ),
        *((name, triton_quantize, attr, out, call, {}) for name, attr, out, call in dbias),
        ("exponent histogram", triton_histogram, "_histogram_kernel", 0, lambda: hist(x), {}),
    ]


def _threads(kwargs: dict) -> int:
    return 32 * kwargs.get("num_warps", 4)


def _block_elems(kwargs: dict) -> int:
    return kwargs["BLOCK"] if "BLOCK" in kwargs else kwargs["BLOCK_M"] * kwargs["BLOCK_N"]


def _in_flight(kwargs: dict) -> int:
    """Blocks (tiles) a program has in flight when it waits for one (see the module's docstring)."""
    if "PREFETCH" not in kwargs:
        return 1
    return 2 if kwargs["PREFETCH"] else max(1, kwargs["STAGES"] - 1)


def profile_all(compile_sm90) -> list[dict]:
    """One row per kernel of ``_kernels``, built by ``compile_sm90`` (``cross_build.sm90_compiler()``)."""
    from fp8_kernels.triton import cross_build
    from fp8_kernels.triton import current as triton_current
    from fp8_kernels.triton.launch import PROGRAMS_PER_SM

    rows = []
    for name, module, attr, written, call, constexprs in _kernels():
        with contextlib.ExitStack() as stack:
            rec = stack.enter_context(cross_build.recorded(module, attr, saturating_cast=True))
            if attr != "_amax_kernel":  # current scaling's amax pass, recorded, not run
                stack.enter_context(cross_build.recorded(triton_current, "_amax_kernel"))
            call()
        args, kwargs = rec.launches[0]
        kwargs = {**kwargs, **constexprs}
        prof = cross_build.sass_profile(compile_sm90(rec.fn, args, kwargs))
        loop = prof.main_loop()
        moved = _block_elems(kwargs) * (2 + written) // _threads(kwargs)  # per thread and iteration
        programs = min(PROGRAMS_PER_SM, prof.programs_per_sm(_threads(kwargs)))
        block_bytes = _block_elems(kwargs) * 2  # bf16 in
        rows.append(
            {
                "kernel": name,
                "registers": prof.registers,
                "stack_bytes": prof.stack_bytes,
                "shared_bytes": prof.shared_bytes,
                "programs_per_sm": programs,
                "kib_in_flight_per_sm": programs * _in_flight(kwargs) * block_bytes / 1024,
                "loop_instructions": len(loop),
                # what one thread issues per 16 of its elements (the budgets of test_ptx.py)
                "instructions_per_16": round(len(loop) * 16 * _threads(kwargs) / _block_elems(kwargs), 1),
                "loop_barriers": prof.count(loop, "BAR"),
                "loop_shuffles": prof.count(loop, "SHFL"),
                "loop_global_loads": prof.count(loop, "LDG"),
                "loop_global_stores": prof.count(loop, "STG"),
                "loop_spills": prof.count(loop, "STL") + prof.count(loop, "LDL"),
                "bytes_per_thread": moved,
                "bytes_per_instruction": round(moved / len(loop), 3),
                "kernel_instructions": prof.instructions,
            }
        )
    return rows


COLUMNS = [
    ("kernel", "kernel", "{}"),
    ("registers", "regs", "{}"),
    ("stack_bytes", "stack B", "{}"),
    ("shared_bytes", "shared B", "{}"),
    ("programs_per_sm", "programs / SM", "{}"),
    ("kib_in_flight_per_sm", "KiB in flight / SM", "{:.0f}"),
    ("loop_instructions", "loop instr.", "{}"),
    ("instructions_per_16", "instr. / 16 el.", "{:.0f}"),
    ("loop_barriers", "BAR", "{}"),
    ("loop_shuffles", "SHFL", "{}"),
    ("loop_global_loads", "LDG", "{}"),
    ("loop_global_stores", "STG", "{}"),
    ("loop_spills", "STL+LDL", "{}"),
    ("bytes_per_instruction", "bytes / instr.", "{:.3f}"),
]


def table(rows: list[dict]) -> str:
    cells = [[h for _, h, _ in COLUMNS]] + [[f.format(r[k]) for k, _, f in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "sass.json"))
    a = p.parse_args(argv)
    import triton

    from fp8_kernels.triton import cross_build

    try:
        compile_sm90 = cross_build.sm90_compiler()
        rows = profile_all(compile_sm90)
    except RuntimeError as e:  # this Triton cannot build for sm_90 here, or ships no nvdisasm
        print(f"sass.py: cannot profile here: {e}", file=sys.stderr)
        return 3
    summary = table(rows)
    print(f"sm_90 machine code, Triton {triton.__version__}, bf16 input, main loop per iteration:\n{summary}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "target": "sm_90",
        "triton": triton.__version__,
        "torch": torch.__version__,
        "host": platform.node(),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
