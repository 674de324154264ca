"""The Triton kernels built for an NVIDIA GPU on a machine without one: what a launch would compile, and a
static profile of its machine code (SASS).

A launcher (``launch_quantize``, ``tensor_amax_triton``, ...) runs on CPU tensors with the CUDA block sizes
(``cuda_sizes``) and its kernel replaced by a recorder (``recorded``); the recorded arguments then go
through what a real launch does before it compiles (Triton's argument binder: types, 16-byte pointer
alignment, integer specialisation, for a ``GPUTarget("cuda", 90, 32)`` backend) and ``triton.compile``,
which runs the whole pipeline (ttir, ttgir, llir, ptx, and ptxas for the cubin; Triton ships ptxas).
``sass_profile`` reads the cubin with the ``nvdisasm`` and ``cuobjdump`` Triton ships beside ptxas.

The binder and ``JITFunction._pack_args`` are Triton internals (of the 3.x line): ``sm90_compiler`` raises
``RuntimeError`` with the reason where this Triton lacks them or its CUDA backend cannot build here.
``tests/kernels/test_ptx.py`` and ``bench/sass.py`` are the users.
"""

from __future__ import annotations

import collections
import contextlib
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Recorder", "SassProfile", "cuda_sizes", "recorded", "sass_profile", "sm90_compiler"]

CUDA = torch.device("cuda")  # only its type is read: the launchers' block sizes for a GPU


def sm90_compiler() -> Callable[[Any, tuple, dict], Any]:
    """``compile(kernel, args, kwargs) -> CompiledKernel`` for sm_90, as a launch would compile it; raises
    ``RuntimeError`` (with the cause) where this Triton cannot build for CUDA here."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature

        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
    except Exception as e:  # an old or CPU-only Triton
        raise RuntimeError(f"this Triton cannot build for CUDA here: {e!r}") from e

    from .launch import FP_FUSION

    def compile_sm90(fn, args: tuple, kwargs: dict):
        kwargs = {"enable_fp_fusion": FP_FUSION, **kwargs}  # as triton.launch.launch passes it
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        return triton.compile(
            ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
        )

    from .current import _amax_kernel

    try:
        compile_sm90(
            _amax_kernel,
            (torch.zeros(16), torch.zeros(()), 16),
            dict(IS_BF16=False, BLOCK=1024, PER_PROGRAM=False, num_warps=4),
        )
    except Exception as e:
        raise RuntimeError(f"cannot compile a Triton kernel for sm_90 here: {e!r}") from e
    return compile_sm90


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch instead of running it."""

    def __init__(self, fn):
        self.fn = fn
        self.launches: list[tuple[tuple, dict]] = []
        self.grids: list[tuple] = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


#: ATen ops that only make views or allocate: no device work on a GPU (``LaunchCounter`` leaves them out)
NO_LAUNCH = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "_reshape_alias",
        "t",
        "transpose",
        "permute",
        "select",
        "slice",
        "expand",
        "as_strided",
        "alias",
        "detach",
        "unsqueeze",
        "squeeze",
        "unbind",
        "empty",
        "empty_strided",
    }
)


class LaunchCounter(TorchDispatchMode):
    """Counts, by name, the ATen ops that would launch device work on a GPU (every op but ``ignore``:
    ``NO_LAUNCH`` by default) while it is active; kernel stubs add their own ``kernel:<name>`` counts to
    ``ops``, and set ``muted`` while the reference they stand in for runs, whose ops are not launches."""

    def __init__(self, ignore: frozenset[str] = NO_LAUNCH):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.ignore = ignore
        self.muted = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.muted and name not in self.ignore:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def cuda_sizes(patch: Callable[[Any, str, Any], None]) -> None:
    """Make the launchers choose the CUDA block sizes for CPU tensors; ``patch(module, name, value)`` sets an
    attribute (``monkeypatch.setattr``, or a setter that remembers what to restore)."""
    from . import current as triton_current
    from . import histogram as triton_histogram
    from . import launch as triton_launch
    from . import quantize as triton_quantize
    from . import scale_update

    for module in (triton_quantize, triton_current, triton_histogram):
        patch(module, "block_1d", lambda device: triton_launch.block_1d(CUDA))
    patch(triton_quantize, "tile_2d", lambda device: triton_launch.tile_2d(CUDA))
    cuda_blocks = triton_launch.block_scale_update(CUDA)
    patch(scale_update, "block_scale_update", lambda device: cuda_blocks)


@contextlib.contextmanager
def recorded(module, name: str, *, saturating_cast: bool | None = None) -> Iterator[Recorder]:
    """``with recorded(triton_quantize, "_quantize_kernel") as rec:`` runs launchers on CPU tensors with the
    CUDA block sizes, ``module.name`` replaced by a ``Recorder``; ``saturating_cast`` forces the launchers'
    view of the device's FP8 cast (``triton.launch.saturating_cast``: ``True`` as on sm_89+)."""
    from . import quantize as triton_quantize

    undo: list[tuple[Any, str, Any]] = []

    def patch(mod, attr, value):
        undo.append((mod, attr, getattr(mod, attr)))
        setattr(mod, attr, value)

    try:
        cuda_sizes(patch)
        if saturating_cast is not None:
            patch(triton_quantize, "saturating_cast", lambda device: saturating_cast)
        rec = Recorder(getattr(module, name))
        patch(module, name, rec)
        yield rec
    finally:
        for mod, attr, value in reversed(undo):
            setattr(mod, attr, value)


def _tool(name: str) -> Path:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise RuntimeError(f"{name}: not shipped with this Triton ({path} is missing)")
    return path


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.M)
_LABEL = re.compile(r"^(\.L_x_\d+):", re.M)
_PREDICATE = re.compile(r"^@!?U?P(?:T|\d+)\s+")
_BRANCH = re.compile(r"\bBRA\s+`\((\.L_x_\d+)\)")

# What one sm_90 SM holds (the CUDA C++ Programming Guide's table for compute capability 9.0): registers,
# threads, resident programs (thread blocks), shared memory; in the occupancy model registers are allocated
# per warp in units of 256, and the runtime reserves 1 KiB of shared memory per program
SM90_REGISTERS, SM90_THREADS, SM90_PROGRAMS, SM90_SHARED = 65536, 2048, 32, 228 * 1024
_REGISTER_UNIT, _SHARED_RESERVED = 256, 1024


@dataclass(frozen=True)
class SassProfile:
    """What the machine code of one kernel says about its cost, without running it."""

    registers: int  #: per thread (``cuobjdump -res-usage``: REG)
    stack_bytes: int  #: per thread: the stack frame, where ptxas spills registers (STACK)
    instructions: int  #: in the whole kernel
    loops: tuple[tuple[str, ...], ...]  #: each loop's body (backward branch to its label), in code order
    shared_bytes: int = 0  #: per program: the shared memory a launch asks for (Triton's metadata)
    #: per loop of ``loops``, whether no other loop lies inside it (an innermost loop)
    innermost: tuple[bool, ...] = ()

    def programs_per_sm(self, threads: int) -> int:
        """How many programs of ``threads`` threads one sm_90 SM runs at once with these registers and this
        shared memory: the least of the register, thread, program and shared-memory limits."""
        warps = -(-threads // 32)
        per_warp = -(-self.registers * 32 // _REGISTER_UNIT) * _REGISTER_UNIT
        by_registers = (SM90_REGISTERS // per_warp) // warps if per_warp else SM90_PROGRAMS
        by_shared = SM90_SHARED // (self.shared_bytes + _SHARED_RESERVED)
        return min(by_registers, SM90_THREADS // (warps * 32), SM90_PROGRAMS, by_shared)

    def main_loop(self) -> tuple[str, ...]:
        """The walk over full blocks (tiles), one iteration per block: of the innermost loops (a loop around
        other loops, such as the tiled kernels' walk over tile columns, runs its body once per column, not
        per tile), the one with the most unpredicated 16-byte global stores (a full block's output; the
        masked edge blocks' stores carry a predicate), the longest of those."""
        if not self.loops:
            raise ValueError("the kernel has no loop")
        inner = [
            body
            for body, alone in zip(self.loops, self.innermost or (True,) * len(self.loops), strict=True)
            if alone
        ]
        return max(inner, key=lambda body: (sum(ins.startswith("STG.E.128") for ins in body), len(body)))

    @staticmethod
    def count(body: tuple[str, ...], opcode: str) -> int:
        """Instructions of ``body`` whose opcode (predicate dropped) starts with ``opcode`` (``"BAR"``,
        ``"SHFL"``, ``"STL"`` ...)."""
        return sum(1 for ins in body if _PREDICATE.sub("", ins).startswith(opcode))


def _loops(sass: str) -> tuple[tuple[tuple[str, ...], ...], tuple[bool, ...]]:
    """Each backward branch's span (from its target label to the branch) as the instructions in it, and
    per span whether no other span lies inside it."""
    events: list[tuple[int, str, str]] = [(m.start(), "label", m.group(1)) for m in _LABEL.finditer(sass)]
    events += [(m.start(), "ins", m.group(2)) for m in _INSTR.finditer(sass)]
    events.sort()
    seen: dict[str, int] = {}  # label -> index in code of the next instruction
    code: list[str] = []
    loops = []
    spans = []
    for _, kind, text in events:
        if kind == "label":
            seen[text] = len(code)
            continue
        code.append(text)
        target = _BRANCH.search(text)
        if target and target.group(1) in seen:  # backward: the label came first
            body = tuple(code[seen[target.group(1)] :])
            if len(body) > 1:  # not the branch to itself that ends the code
                loops.append(body)
                spans.append((seen[target.group(1)], len(code)))
    innermost = tuple(not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans) for a, b in spans)
    return tuple(loops), innermost


def sass_profile(compiled) -> SassProfile:
    """Registers, stack frame and loop bodies of a ``CompiledKernel`` for sm_90 (from ``sm90_compiler``)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True
        ).stdout
    regs = re.search(r"\bREG:(\d+)", usage)
    stack = re.search(r"\bSTACK:(\d+)", usage)
    if regs is None or stack is None:
        raise RuntimeError(f"cuobjdump -res-usage: no REG / STACK in {usage!r}")
    loops, innermost = _loops(sass)
    return SassProfile(
        registers=int(regs.group(1)),
        stack_bytes=int(stack.group(1)),
        instructions=len(_INSTR.findall(sass)),
        loops=loops,
        shared_bytes=int(getattr(compiled.metadata, "shared", 0) or 0),
        innermost=innermost,
    )
