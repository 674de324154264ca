"""Block-scaled FP8 GEMMs: PyTorch's block-scaled ``scaled_mm`` where the GPU has one, emulation elsewhere.

``block_gemm(a, b, gemm)`` computes ``A @ B.T`` in float32 for two ``BlockQuantized`` operands held as
``(rows, K)`` with their blocks along K (``fp8_trainer/block_linear.py``: fprop, dgrad and wgrad all take
this form). It calls ``torch.nn.functional.scaled_mm`` (PyTorch's ``_scaled_mm_v2``, explicit scaling
recipes) when the operands' device, dtypes, block shapes and sizes allow it, and otherwise
``fp8_kernels.reference.block_quantize.block_scaled_mm`` (dequantize both, one float32 matmul: the CPU path,
and the path for everything listed under "falls back" below). ``gemm_paths()`` reports which path each GEMM
took.

What PyTorch offers (docs/fp8-semantics.md, "The native block-scaled GEMM", has the sources):

* FP8 block scaling (DeepSeek-style, cuBLASLt ``VEC128_32F`` / ``BLK128x128_32F``): the recipe pairs
  ``(1x128, 1x128)``, ``(1x128, 128x128)`` and ``(128x128, 1x128)`` (never two 128x128 operands, as TE),
  both operands E4M3, float32 scales, **sm_90 only** and cuBLASLt >= 12.9. TE runs the recipe the same way
  on Hopper; on Blackwell TE converts it to MXFP8, which fp8scope does not (it falls back there).
* MXFP8 (``VEC32_UE8M0``): ``(1x32, 1x32)``, both E4M3, E8M0 scales in cuBLAS's swizzled tile layout
  (``SWIZZLE_32_4_4``), sm_100 and later. Hopper has no MXFP8 GEMM.
* API: ``torch.nn.functional.scaled_mm`` with ``ScalingType`` / ``SwizzleType`` (PyTorch 2.10 and later;
  the GPU machine runs 2.11). The private ``torch._scaled_mm`` also takes 1x128 / 128x128 scales (since
  mid-2025), inferring the recipe from the scales' shapes, but its check wants 128x128 scales without the
  K-block padding cuBLASLt needs, which gave silent wrong results where ``ceil(K / 128) % 4 != 0``
  (PyTorch PR #166752 made the v2 path require the padding), so it is not used. Availability is detected
  at run time (``native_kinds``); a call the library refuses at run time falls back too (``RuntimeError``
  from its argument checks or cuBLASLt), with a warning, once per shape.

Layouts handed over (``prepare_native_args``; ``check_block_scaled_mm_args`` checks them on the host):

* ``mat_a`` ``(M, K)`` row-major, ``mat_b`` ``(K, N)`` column-major (``b.data.t()``): the "TN" layout, the
  only one Hopper's FP8 GEMM takes. K and N multiples of 16; data and scales 16-byte aligned.
* 1x128 scales ``(rows, K / 128)`` **outer-dim-major** (stride ``(1, rows)``): the compact
  ``BlockQuantized.scale_inv`` transposed in memory, as TE's GEMM-ready layout stores them.
* 128x128 scales stored ``(row blocks, L4)`` with ``L4 = round_up(K-blocks, 4)`` (each row of K-block scales
  padded to 16 bytes), handed over as the ``(L4, row blocks)`` transpose, stride ``(1, L4)``.
* E8M0 scales (uint8 codes viewed as ``float8_e8m0fnu``): the ``(rows, K / 32)`` codes (a 32x32 weight's
  repeated per row) padded to ``(round_up(rows, 128), round_up(K / 32, 4))`` and swizzled in 128x4 tiles,
  tile-major, inside a tile ``offset = (row % 32) * 16 + (row % 128 // 32) * 4 + col % 4``.
* Conservative size rules beyond PyTorch's own checks: for FP8 block scaling K, and the rows of a 128x128
  operand, multiples of 128 (PyTorch's meta checks size the scales with ``K // 128`` and ``rows // 128``,
  its CUDA checks with ``ceil``: whole blocks satisfy both), M a multiple of 8 for a 1x128-scaled ``mat_a``
  (TE's check on the GEMM's outer dimensions, ``cublaslt_gemm.cu``); K a multiple of 32 for MXFP8.

Falls back to the emulation: the CPU; a GPU or PyTorch without the recipe pair (sm_89, sm_90 for MXFP8,
sm_100+ for FP8 block scaling, ROCm, PyTorch < 2.10); an E5M2 operand (the HYBRID format's gradients:
dgrad and wgrad); sizes outside the rules above; ``emulated_block_gemms()``.

Accumulation. Native (both kinds): ``use_fast_accum=False``, as TE fixes ``use_split_accumulator=True`` for
block scaling: partial sums in the tensor core (about 14 significant bits per addition on Hopper), promoted
to float32 and scaled at least once per 128-long K-block. The emulation: the dequantized operands (each FP8
value times its block's power-of-two scale: exact in float32) in one float32 matmul; with non-power-of-two
scales the dequantization rounds once per element. ``emulate_native_call`` is the CPU model of the native
call from its own arguments (float64 products and sums, the float32 result), which the tests hold to both.
"""

from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from fp8_kernels import SCALE_ALIGN_BYTES
from fp8_kernels.reference.block_quantize import BlockQuantized, block_scaled_mm, e8m0_to_scale_inv

from .gemm import check_once_per_layout

__all__ = [
    "BLOCK",
    "MXFP8",
    "NativeArgs",
    "PathRecord",
    "block_gemm",
    "check_block_scaled_mm_args",
    "describe_native_support",
    "emulate_native_call",
    "emulated_block_gemms",
    "gemm_paths",
    "native_kinds",
    "prepare_native_args",
    "reset_gemm_paths",
    "swizzle_mx_scales",
    "unsupported_reason",
]

#: the two kinds of native block-scaled GEMM
BLOCK, MXFP8 = "block", "mxfp8"
NATIVE, EMULATED = "native", "emulated"

_E4M3 = torch.float8_e4m3fn
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_VEC, _MX = 128, 32  # block lengths along K: FP8 block scaling, MXFP8
_TILE_ROWS, _TILE_COLS = 128, 4  # cuBLAS's E8M0 scale tile
#: the recipe pairs cuBLASLt has a kernel for (TE asserts the same set), by kind
_PAIRS = {
    ("1x128", "1x128"): BLOCK,
    ("1x128", "128x128"): BLOCK,
    ("128x128", "1x128"): BLOCK,
    ("1x32", "1x32"): MXFP8,
}
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# --- which operands can take the native path ---------------------------------------------------------------


def operand_recipe(q: BlockQuantized) -> str | None:
    """The ``ScalingType`` (by name: ``"1x128"``, ``"128x128"``, ``"1x32"``) that describes ``q`` as a GEMM
    operand with K along its columns, ``None`` if none does. A 32x32-block MXFP8 weight is ``"1x32"``: each
    row's block carries its square block's scale."""
    if q.scale_format == "fp32" and q.block in ((1, _VEC), (_VEC, _VEC)):
        return f"{q.block[0]}x{q.block[1]}"
    if q.scale_format == "e8m0" and q.block in ((1, _MX), (_MX, _MX)):
        return "1x32"
    return None


def _size_reason(kind: str, recipe_a: str, recipe_b: str, m: int, n: int, k: int) -> str | None:
    """Why ``(M, N, K)`` is not taken natively, ``None`` if it is (module docstring, "size rules")."""
    if k % 16 or n % 16:
        return f"K ({k}) and N ({n}) must be multiples of 16"
    if kind == BLOCK and k % _VEC:
        return f"K ({k}) must be a multiple of {_VEC} for FP8 block scaling"
    if kind == BLOCK and recipe_a == "1x128" and m % 8:
        return f"M ({m}) of a 1x128-scaled mat_a must be a multiple of 8"
    for name, rows, recipe in (("M", m, recipe_a), ("N", n, recipe_b)):
        if recipe == "128x128" and rows % _VEC:
            return f"{name} ({rows}) of a 128x128-scaled operand must be a multiple of {_VEC}"
    if kind == MXFP8 and k % _MX:
        return f"K ({k}) must be a multiple of {_MX} for MXFP8"
    return None


def unsupported_reason(a: BlockQuantized, b: BlockQuantized, kinds: frozenset[str]) -> str | None:
    """Why ``A @ B.T`` does not run natively where the ``kinds`` of native GEMM exist, ``None`` if it does."""
    ra, rb = operand_recipe(a), operand_recipe(b)
    kind = _PAIRS.get((ra, rb))
    if kind is None:
        return f"no native GEMM for {a.scale_format} {a.block} x {b.scale_format} {b.block} blocks"
    if kind not in kinds:
        return f"no native {kind} GEMM on {a.data.device}"
    if a.data.dtype != _E4M3 or b.data.dtype != _E4M3:
        return f"{a.data.dtype} x {b.data.dtype}: PyTorch's block-scaled GEMMs take E4M3 operands only"
    return _size_reason(kind, ra, rb, a.data.shape[0], b.data.shape[0], a.data.shape[1])


def _api_available() -> bool:
    f = torch.nn.functional
    names = ("BlockWise1x128", "BlockWise128x128", "BlockWise1x32")
    return (
        hasattr(f, "scaled_mm")
        and all(hasattr(getattr(f, "ScalingType", None), n) for n in names)
        and hasattr(getattr(f, "SwizzleType", None), "SWIZZLE_32_4_4")
    )


def _cuda_version() -> tuple[int, ...]:
    return tuple(int(p) for p in (torch.version.cuda or "0").split(".")[:2])


@functools.cache
def _kinds_of_device(index: int) -> frozenset[str]:
    if torch.version.hip or not _api_available():
        return frozenset()
    major = torch.cuda.get_device_capability(index)[0]
    kinds = set()
    if major == 9 and _cuda_version() >= (12, 9):  # PyTorch gates the DeepSeek recipes to sm_90
        kinds.add(BLOCK)
    if major >= 10:  # cuBLAS's MXFP8 kernels: Blackwell and later
        kinds.add(MXFP8)
    return frozenset(kinds)


_force_emulation = False  # a plain global: autograd runs CUDA backward on its own threads


def native_kinds(device: torch.device) -> frozenset[str]:
    """The kinds of native block-scaled GEMM (``BLOCK``, ``MXFP8``) this device and PyTorch have."""
    if _force_emulation or device.type != "cuda":
        return frozenset()
    return _kinds_of_device(device.index if device.index is not None else torch.cuda.current_device())


def describe_native_support(device: torch.device) -> str:
    """One line on what runs natively on ``device`` and why (for logs and the GPU check)."""
    kinds = native_kinds(device)
    where = f"{device}, torch {torch.__version__}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where += f", sm_{major}{minor}, CUDA {torch.version.cuda}"
    if _force_emulation:
        return f"{where}: emulated (emulated_block_gemms())"
    if not _api_available():
        return f"{where}: emulated (no torch.nn.functional.scaled_mm with block recipes: PyTorch < 2.10)"
    if not kinds:
        return f"{where}: emulated (FP8 block scaling needs sm_90 and CUDA >= 12.9, MXFP8 sm_100+)"
    return f"{where}: native {', '.join(sorted(kinds))} (E4M3 operands), the rest emulated"


@contextmanager
def emulated_block_gemms():
    """Run every block-scaled GEMM through the emulation inside the block (to compare the two paths)."""
    global _force_emulation
    before, _force_emulation = _force_emulation, True
    try:
        yield
    finally:
        _force_emulation = before


# --- the arguments of the native call ----------------------------------------------------------------------


@dataclass(frozen=True)
class NativeArgs:
    """The arguments of one ``torch.nn.functional.scaled_mm`` call: ``mat_a`` ``(M, K)`` row-major,
    ``mat_b`` ``(K, N)`` column-major, the scales in the layouts of the module docstring, the recipes by
    name, ``swizzle`` whether both scales are in ``SWIZZLE_32_4_4`` layout (MXFP8)."""

    mat_a: torch.Tensor
    mat_b: torch.Tensor
    scale_a: torch.Tensor
    recipe_a: str
    scale_b: torch.Tensor
    recipe_b: str
    swizzle: bool
    output_dtype: torch.dtype = torch.float32
    use_fast_accum: bool = False


def _vec128_scale(q: BlockQuantized) -> torch.Tensor:
    """1x128: ``(rows, K-blocks)`` with the rows adjacent in memory (stride ``(1, rows)``): no copy for the
    CUDA kernel's scales, which it stores so (``triton.block_quantize``), a transposed copy of others."""
    return q.scale_inv.t().contiguous().t()


def _blk128_scale(q: BlockQuantized) -> torch.Tensor:
    """128x128: ``(row blocks, L4)`` storage, K-blocks adjacent and zero-padded to 16 bytes, handed over as
    its ``(L4, row blocks)`` transpose."""
    rb, kb = q.scale_inv.shape
    store = q.scale_inv.new_zeros((rb, _round_up(kb, 4)))
    store[:, :kb] = q.scale_inv
    return store.t()


def _mx_codes(q: BlockQuantized) -> torch.Tensor:
    """``(rows, K / 32)`` E8M0 codes: a 32x32-block weight's scale repeated for each of its rows."""
    codes = q.scale_inv
    if q.block[0] > 1:
        codes = codes.repeat_interleave(q.block[0], dim=0)[: q.data.shape[0]]
    return codes


def swizzle_mx_scales(codes: torch.Tensor) -> torch.Tensor:
    """``(rows, cols)`` uint8 E8M0 codes in cuBLAS's block-scaling layout, flat, as ``float8_e8m0fnu``:
    zero-padded to whole 128x4 tiles, tiles in row-major order, each tile's 128 rows interleaved in four
    groups of 32 so that row ``r`` of a tile starts at byte ``(r % 32) * 16 + (r // 32) * 4``."""
    rows, cols = codes.shape
    pr, pc = _round_up(rows, _TILE_ROWS), _round_up(cols, _TILE_COLS)
    padded = codes.new_zeros((pr, pc))
    padded[:rows, :cols] = codes
    # (row tile, row // 32 within the tile, row % 32, column tile, column % 4)
    tiles = padded.reshape(pr // _TILE_ROWS, 4, 32, pc // _TILE_COLS, _TILE_COLS)
    flat = tiles.permute(0, 3, 2, 1, 4).contiguous().reshape(-1)
    return flat.view(torch.float8_e8m0fnu)


def prepare_native_args(a: BlockQuantized, b: BlockQuantized) -> NativeArgs:
    """The arguments ``torch.nn.functional.scaled_mm`` takes for ``A @ B.T`` (no host read, no check:
    ``check_block_scaled_mm_args`` validates them)."""
    ra, rb = operand_recipe(a), operand_recipe(b)
    kind = _PAIRS.get((ra, rb))
    if kind is None:
        raise ValueError(f"a, b: no native GEMM for {a.block} x {b.block} {a.scale_format} blocks")
    if kind == MXFP8:
        scales = [swizzle_mx_scales(_mx_codes(q)) for q in (a, b)]
    else:
        scales = [_vec128_scale(q) if r == "1x128" else _blk128_scale(q) for q, r in ((a, ra), (b, rb))]
    mat_a = a.data.contiguous()
    mat_b = b.data.contiguous().t()  # (K, N) column-major: b's rows are the columns
    return NativeArgs(mat_a, mat_b, scales[0], ra, scales[1], rb, swizzle=kind == MXFP8)


# --- the host-side check -----------------------------------------------------------------------------------


def _check_operands(args: NativeArgs) -> tuple[int, int, int]:
    a, b = args.mat_a, args.mat_b
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"mat_a, mat_b: expected (M, K) @ (K, N), got {tuple(a.shape)} @ {tuple(b.shape)}")
    m, k = a.shape
    n = b.shape[1]
    for name, t in (("mat_a", a), ("mat_b", b)):
        if t.dtype != _E4M3:
            raise ValueError(f"{name}: PyTorch's block-scaled GEMMs take E4M3 operands, got {t.dtype}")
    if a.stride(1) != 1 or a.stride(0) != k:
        raise ValueError(f"mat_a: expected row-major (M, K), got strides {a.stride()} for {tuple(a.shape)}")
    if b.stride(0) != 1 or b.stride(1) != k:
        raise ValueError(
            f"mat_b: expected column-major (K, N) (a row-major (N, K) transposed), got strides {b.stride()}"
        )
    if b.device != a.device:
        raise ValueError(f"mat_b: on {b.device}, expected {a.device}")
    return m, n, k


def _expect(cond: bool, name: str, what: str, t: torch.Tensor) -> None:
    if not cond:
        raise ValueError(f"{name}: expected {what}, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")


def _check_scale(s: torch.Tensor, recipe: str, rows: int, k: int, name: str, device) -> None:
    """One operand's scale against PyTorch's v2 rules (``ScaledBlas.cpp``) for ``recipe``."""
    if s.device != device:
        raise ValueError(f"{name}: on {s.device}, expected {device}")
    if recipe == "1x128":
        shape = (rows, k // _VEC)
        _expect(s.dtype == torch.float32 and tuple(s.shape) == shape, name, f"float32 {shape}", s)
        _expect(s.stride(0) == 1 and (s.stride(1) == rows or shape[1] == 1), name, "stride (1, rows)", s)
    elif recipe == "128x128":
        l4 = _round_up(k // _VEC, 4)
        shape = (l4, -(-rows // _VEC))
        _expect(s.dtype == torch.float32 and tuple(s.shape) == shape, name, f"float32 {shape}", s)
        _expect(s.stride(0) == 1 and (s.stride(1) == l4 or shape[1] == 1), name, f"stride (1, {l4})", s)
    elif recipe == "1x32":
        n = _round_up(rows, _TILE_ROWS) * _round_up(-(-k // _MX), _TILE_COLS)
        ok = s.dtype == torch.float8_e8m0fnu and s.numel() == n and s.is_contiguous()
        _expect(ok, name, f"{n} contiguous float8_e8m0fnu codes (swizzled 128x4 tiles)", s)
    else:
        raise ValueError(f"{name}: unknown recipe {recipe!r}")


def check_block_scaled_mm_args(args: NativeArgs) -> None:
    """Raise ``ValueError`` naming the argument where ``args`` break a rule of PyTorch's block-scaled
    ``scaled_mm`` or cuBLASLt (module docstring), before a GPU would. Host metadata only."""
    m, n, k = _check_operands(args)
    kind = _PAIRS.get((args.recipe_a, args.recipe_b))
    if kind is None:
        raise ValueError(f"recipe_a, recipe_b: no native GEMM for ({args.recipe_a}, {args.recipe_b})")
    reason = _size_reason(kind, args.recipe_a, args.recipe_b, m, n, k)
    if reason is not None:
        raise ValueError(f"mat_a, mat_b: {reason}")
    _check_scale(args.scale_a, args.recipe_a, m, k, "scale_a", args.mat_a.device)
    _check_scale(args.scale_b, args.recipe_b, n, k, "scale_b", args.mat_a.device)
    if args.swizzle != (kind == MXFP8):
        raise ValueError(f"swizzle: {kind} scales {'are' if kind == MXFP8 else 'are not'} swizzled")
    for name in ("mat_a", "mat_b", "scale_a", "scale_b"):
        if getattr(args, name).data_ptr() % SCALE_ALIGN_BYTES:
            raise ValueError(f"{name}: data pointer not 16-byte aligned (cuBLASLt needs 16 bytes)")
    if args.output_dtype not in _OUT_DTYPES:
        raise ValueError(f"output_dtype: expected one of {_OUT_DTYPES}, got {args.output_dtype}")
    if args.use_fast_accum:
        raise ValueError("use_fast_accum: block scaling uses the split accumulator, not fast accumulation")


_CHECKED: set[tuple] = set()  # argument layouts ``check_block_scaled_mm_args`` passed


# --- what the native call computes -------------------------------------------------------------------------


def _unswizzle_mx(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The ``(rows, cols)`` codes a swizzled scale holds, read at each element's offset (the inverse of
    ``swizzle_mx_scales``, written from the offset formula)."""
    r = torch.arange(rows, device=s.device).unsqueeze(1)
    c = torch.arange(cols, device=s.device).unsqueeze(0)
    tiles_per_row = _round_up(cols, _TILE_COLS) // _TILE_COLS
    tile = (r // _TILE_ROWS) * tiles_per_row + c // _TILE_COLS
    offset = tile * (_TILE_ROWS * _TILE_COLS) + (r % 32) * 16 + (r % _TILE_ROWS // 32) * 4 + c % _TILE_COLS
    return s.view(torch.uint8).reshape(-1)[offset]


def _scale_per_element(s: torch.Tensor, recipe: str, rows: int, k: int) -> torch.Tensor:
    """The float32 factor the native call applies to each element of a ``(rows, K)`` operand, read from
    the scale as handed over (its logical indices: the strides are the checker's business)."""
    if recipe == "1x128":  # s[row, k-block]
        per_block = s
        block = (1, _VEC)
    elif recipe == "128x128":  # s[k-block, row block]
        per_block = s.t()[:, : -(-k // _VEC)]
        block = (_VEC, _VEC)
    else:  # "1x32": swizzled codes
        per_block = e8m0_to_scale_inv(_unswizzle_mx(s, rows, -(-k // _MX)))
        block = (1, _MX)
    full = per_block.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[:rows, :k]


def emulate_native_call(args: NativeArgs) -> torch.Tensor:
    """What ``torch.nn.functional.scaled_mm`` computes from ``args``, on any device: every FP8 value times
    the factor its scale layout assigns it, products and sums in float64, the result in ``output_dtype``."""
    m, k = args.mat_a.shape
    n = args.mat_b.shape[1]
    a = args.mat_a.double() * _scale_per_element(args.scale_a, args.recipe_a, m, k).double()
    b = args.mat_b.t().double() * _scale_per_element(args.scale_b, args.recipe_b, n, k).double()
    return (a @ b.t()).to(args.output_dtype)


# --- the entry point ---------------------------------------------------------------------------------------


def _call_native(args: NativeArgs) -> torch.Tensor:
    f = torch.nn.functional
    recipes = {
        "1x128": f.ScalingType.BlockWise1x128,
        "128x128": f.ScalingType.BlockWise128x128,
        "1x32": f.ScalingType.BlockWise1x32,
    }
    swizzle = f.SwizzleType.SWIZZLE_32_4_4 if args.swizzle else None
    return f.scaled_mm(
        args.mat_a,
        args.mat_b,
        args.scale_a,
        recipes[args.recipe_a],
        args.scale_b,
        recipes[args.recipe_b],
        swizzle_a=swizzle,
        swizzle_b=swizzle,
        output_dtype=args.output_dtype,
        use_fast_accum=args.use_fast_accum,
    )


@dataclass
class PathRecord:
    """How one GEMM (``"fprop"``, ``"dgrad"``, ``"wgrad"``) ran: calls per path, and why the last emulated
    call was not native (``None`` before any)."""

    native: int = 0
    emulated: int = 0
    reason: str | None = None


_PATHS: dict[str, PathRecord] = {}
_REFUSED: dict[tuple, str] = {}  # shapes the library refused at run time -> its message


def gemm_paths() -> dict[str, PathRecord]:
    """A copy of the per-GEMM path counts since the last ``reset_gemm_paths()``."""
    return {g: replace(r) for g, r in _PATHS.items()}


def reset_gemm_paths() -> None:
    _PATHS.clear()


def _record(gemm: str, path: str, reason: str | None) -> None:
    rec = _PATHS.setdefault(gemm, PathRecord())
    if path == NATIVE:
        rec.native += 1
    else:
        rec.emulated += 1
        rec.reason = reason


def _refuse(key: tuple, err: Exception) -> str:
    reason = f"refused by scaled_mm: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    _REFUSED[key] = reason
    warnings.warn(f"block-scaled GEMM {key}: {reason}; emulating this shape from now on", stacklevel=3)
    return reason


def block_gemm(a: BlockQuantized, b: BlockQuantized, gemm: str = "gemm") -> torch.Tensor:
    """``A @ B.T`` in float32 for ``a`` ``(M, K)`` and ``b`` ``(N, K)``, both with blocks along K: natively
    where ``unsupported_reason`` finds nothing against it, else ``block_scaled_mm``'s emulation. ``gemm``
    names the GEMM in ``gemm_paths()``."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"a, b: K differs ({a.data.shape[1]} vs {b.data.shape[1]})")
    reason = unsupported_reason(a, b, native_kinds(a.data.device))
    key = (a.data.device, operand_recipe(a), operand_recipe(b), *a.data.shape, b.data.shape[0])
    reason = reason or _REFUSED.get(key)
    if reason is None:
        args = prepare_native_args(a, b)
        # a failure here is a bug in the layouts above: raised, not emulated
        check_once_per_layout(
            _CHECKED,
            lambda: check_block_scaled_mm_args(args),
            (args.mat_a, args.mat_b, args.scale_a, args.scale_b),
            (args.recipe_a, args.recipe_b, args.swizzle, args.output_dtype, args.use_fast_accum),
        )
        try:
            out = _call_native(args)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError, NotImplementedError) as err:
            reason = _refuse(key, err)
        else:
            _record(gemm, NATIVE, None)
            return out
    _record(gemm, EMULATED, reason)
    return block_scaled_mm(a, b)
