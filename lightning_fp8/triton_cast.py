"""Fused FP8 casts with statistics: Triton kernels, one pass over ``x``.

:func:`lightning_fp8.quantize.cast_with_statistics` is the one place where a high-precision tensor becomes
FP8 with a per-tensor, per-row or per-column scale. Its torch reference is a handful of elementwise ops and
reductions: in eager mode each is its own kernel, so ``x`` (and the float32 ``x * scale``) is read and written
several times per cast. This module does the whole cast in one kernel that reads ``x`` once and writes the FP8
data once::

    x_scaled  = float32(x) * scale            scale: one element, one per row (M, 1) or per column (1, N)
    data      = saturate(x_scaled)            finite -> clamp to ±fp8_max, NaN/±Inf -> NaN
    counts    = [nonzero, overflow, underflow] int64, per-program partial sums + one torch.sum, no host sync

History-scaled per-tensor casts (the ``delayed`` recipe): :func:`triton_history_cast`, behind
:func:`lightning_fp8.quantize.quantize` for a ``"tensor"``, ``scale_source="history"`` cast spec, gets the amax from
the cast's own pass instead of a separate ``x.abs().amax()`` pass. ``ready`` (is the history usable) is a device flag
the host never reads, so the kernel runs twice, the second time gated on the flag in the kernel::

    launch 1: data, counts = cast(x, history_scale)      and amax_p[program] = max |x| over the program's elements
    amax      = torch.amax(amax_p)                       on the bits, NaN-propagating: NaN if x holds a NaN
    scale     = where(ready, history_scale, amax_to_scale(amax, fp8_max, margin, power_of_2))   (torch, as the reference)
    launch 2: if not ready (read in the kernel): data, counts = cast(x, scale), overwriting launch 1's

With the history ready, launch 2 masks off every load and store (one flag byte per program): one read of ``x``
produces the data, the amax and the counts. Not ready (the first steps), ``x`` is read twice, as by the reference
(amax, then cast). Either way the result is the reference's bit for bit: the amax is ``max |x|`` exactly, the scale is
the same torch expression of it, and the data and counts come from a cast with exactly that scale. (``tensorwise``,
whose scale needs the amax before the cast, keeps its two passes: torch's amax, then the kernel.)

Block mode: :func:`triton_block_cast`, behind :func:`lightning_fp8.quantize.quantize` for ``"block"`` cast specs
(``blockwise``: 1x128 / 128x1 tiles and 128x128 blocks, ``mxfp8``: 1x32 / 32x1 blocks), computes the whole
block-scaled cast in one pass too. For a 2-D ``x`` (R, C) and a block shape (bm, bn), each program holds a group
of whole blocks, and for each block ``b`` (a partial block at the bottom or right edge: the elements it has)::

    amax[b]   = max |x[b]|                    float32; NaN if the block holds a NaN (as torch's amax)
    scale[b]  = RZ32(fp8_max / max(amax[b], eps))      the division in float64, rounded toward zero to float32;
                power_of_2: 2**floor(log2(scale[b]))   NaN amax -> NaN scale, Inf amax -> 0
              = lightning_fp8.recipe.amax_to_scale(amax, fp8_max, margin, power_of_2), bit for bit
    data      = saturate(float32(x) * scale[b])        the same encoding as above
    counts    = [nonzero, overflow, underflow]         over x's elements, per-program partials + one torch.sum

``amax`` and ``scale`` have shape ``(ceil(R / bm), ceil(C / bn))``. With given block scales (a recomputation
reusing the forward's) the kernel casts with those instead. The amax is a max over the int32 bits of ``|x|`` (their
order is the float order, and every NaN is above Inf). The division is float64 because Triton lowers a float64
``/`` to an IEEE division (PTX ``div.rn.f64``; its float32 ``/`` is the approximate ``div.full.f32``). The rounding
toward zero (one step down when float32 rounding went up) and the power-of-two rounding (clearing the mantissa:
the largest power of two <= the scale, which is what ``amax_to_scale``'s corrected ``exp2(floor(log2(scale)))``
gives) work on the float32 bits; an amax below eps takes ``amax_to_scale``'s own scale of eps, computed on the host.

Why our own kernel: torchao's float8 casts (``to_fp8_saturated``, ``hp_tensor_and_scale_to_float8``)
scale and saturate but compute no statistics, so counting overflows and underflows would take extra
passes over the tensor; Transformer Engine's debug statistics run the layers unfused, so turning
statistics on costs the speed they are meant to observe. Here
the counts come for free with the cast. Under ``torch.compile`` the torch reference is used instead:
Inductor already fuses it into one kernel.

The FP8 encoding is computed with integer arithmetic on the float32 bits (round to nearest even, the
same formula as c10's ``Float8_e4m3fn``/``Float8_e5m2`` conversions that ``Tensor.to`` uses) and stored
as ``uint8`` into a view of the FP8 output, instead of Triton's ``.to(tl.float8e4nv)``. This makes the
result bit-identical to the torch reference on every GPU (Triton has no ``fp8e4nv`` before sm_89) and in
``TRITON_INTERPRET=1`` mode, whose float8 conversion is not round-to-nearest-even, so the kernel that
the CPU tests check is the kernel that runs on the GPU.

Triton is imported lazily, on the first call on a CUDA tensor: importing :mod:`lightning_fp8` never
needs it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
from torch import Tensor

from lightning_fp8.recipe import AMAX_EPS, E4M3, E5M2, FP8_MAX, amax_to_scale, fp8_max

#: Elements per program. 2048 elements on 8 warps is 8 per thread: two 16-byte loads for float32.
BLOCK_SIZE = 2048
NUM_WARPS = 8

#: Above this many elements the kernel indexes with int64 (offsets of the last block must fit in int32).
_MAX_INT32_NUMEL = 2**31 - 1 - BLOCK_SIZE

SUPPORTED_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Block cast: about this many elements per program (whole blocks), at least this many columns per program when
#: the blocks are narrower, and the largest block (padded to powers of two) one program holds.
BLOCK_CAST_ELEMENTS = 4096
BLOCK_CAST_MIN_WIDTH = 128
MAX_BLOCK_CAST_ELEMENTS = 16384
#: Above this offset (masked lanes included) the block kernel indexes with int64.
_MAX_INT32_OFFSET = 2**31 - 1

#: How the kernel indexes ``scale``.
SCALE_TENSORWISE, SCALE_PER_ROW, SCALE_PER_COLUMN = 0, 1, 2

# Per FP8 format, all on the float32 bit pattern of |x * scale|:
#   max_bits        float32 bits of fp8_max (the clamp, and the overflow threshold);
#   mantissa_shift  23 - fp8 mantissa bits (the float32 mantissa bits dropped);
#   rebias          (127 - fp8 exponent bias) << fp8 mantissa bits (float32 exponent -> fp8 exponent);
#   min_normal_bits float32 bits of the smallest normal fp8 value;
#   magic           2**(24 - bias - mantissa bits): adding it to a value below min normal rounds the value
#                   (nearest even, by the float32 adder) to a multiple of the smallest fp8 subnormal;
#   nan_code        the bits torch gives a positive NaN.
_FORMATS: dict[torch.dtype, dict[str, Any]] = {
    E4M3: dict(max_bits=0x43E00000, mantissa_shift=20, rebias=120 << 3, min_normal_bits=121 << 23,
               magic=2.0**14, magic_bits=0x46800000, nan_code=0x7F),
    E5M2: dict(max_bits=0x47600000, mantissa_shift=21, rebias=112 << 2, min_normal_bits=113 << 23,
               magic=2.0**7, magic_bits=0x43000000, nan_code=0x7F),
}

# Set by _import_triton() on first use (with `_fp8_encode` rebound to its jitted form); the kernels below resolve
# `tl` and `_fp8_encode` from this module's globals when Triton compiles (or interprets) them, which happens after
# _import_triton() has imported triton.
tl: Any = None


def use_triton(x: Tensor) -> bool:
    """Whether :func:`lightning_fp8.quantize.cast_with_statistics` (and ``quantize()`` for a ``"block"`` cast spec)
    runs the fused Triton kernel for ``x``.

    True only outside ``torch.compile`` (Inductor fuses the torch reference itself), for a contiguous
    float32/bfloat16/float16 ``x`` on a CUDA device, when triton can be imported. Every other case
    runs the torch reference, which gives the same bits and counts.
    """
    if torch.compiler.is_compiling():
        return False
    if x.device.type != "cuda" or x.dtype not in SUPPORTED_INPUT_DTYPES or not x.is_contiguous():
        return False
    return _triton_available()


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def _fp8_encode(
    x_scaled,
    MAX_BITS: tl.constexpr,
    MANTISSA_SHIFT: tl.constexpr,
    REBIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr,
    MAGIC: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
    NAN_CODE: tl.constexpr,
):
    """``(code, overflow)``: the FP8 bits (int32, 0..255) of ``saturate(x_scaled)``, ``not |x_scaled| <= fp8_max``."""
    # Everything below works on the bits, so flush-to-zero modes cannot change a result.
    bits = x_scaled.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    abs_bits = bits & 0x7FFFFFFF
    finite = abs_bits < 0x7F800000
    overflow = abs_bits > MAX_BITS  # not |x_scaled| <= fp8_max: saturated, or NaN/Inf
    clamped = tl.minimum(abs_bits, MAX_BITS)
    # Normal fp8 range: round the float32 mantissa to nearest even, then rebias the exponent.
    round_bias = ((1 << (MANTISSA_SHIFT - 1)) - 1) + ((clamped >> MANTISSA_SHIFT) & 1)
    normal = ((clamped + round_bias) >> MANTISSA_SHIFT) - REBIAS
    # Subnormal fp8 range: let the float32 adder round to a multiple of the smallest subnormal.
    subnormal = (clamped.to(tl.float32, bitcast=True) + MAGIC).to(tl.int32, bitcast=True) - MAGIC_BITS
    code = tl.where(clamped < MIN_NORMAL_BITS, subnormal, normal) | sign
    code = tl.where(finite, code, NAN_CODE)
    return code, overflow


def _cast_with_statistics_kernel(
    x_ptr,
    scale_ptr,
    out_ptr,
    partial_ptr,
    amax_ptr,
    gate_ptr,
    numel,
    n_cols,
    X_IS_BF16: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    AMAX: tl.constexpr,
    GATED: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MANTISSA_SHIFT: tl.constexpr,
    REBIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr,
    MAGIC: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
    NAN_CODE: tl.constexpr,
    INT64_INDEX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if INT64_INDEX:
        start = pid.to(tl.int64) * BLOCK
    else:
        start = pid * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < numel
    if GATED:
        # The fallback launch of a history-scaled cast: work only when the history is not ready (gate byte 0).
        # When it is, every load and store is masked off: the launch reads one byte per program and nothing of x.
        ready = tl.load(gate_ptr).to(tl.int32)
        mask = mask & ((tl.zeros([BLOCK], tl.int32) + ready) == 0)  # (a lane-wise flag, as the interpreter needs)

    if X_IS_BF16:
        # bf16 arrives as int16 bits; widening by a shift is exact everywhere (the interpreter's
        # bf16 -> fp32 conversion loses subnormals).
        x = (tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # exact for fp32 and fp16
    if SCALE_MODE == 0:
        scale = tl.load(scale_ptr)
    elif SCALE_MODE == 1:
        scale = tl.load(scale_ptr + offs // n_cols, mask=mask, other=1.0)
    else:
        scale = tl.load(scale_ptr + offs % n_cols, mask=mask, other=1.0)
    x_scaled = x * scale
    code, overflow = _fp8_encode(
        x_scaled, MAX_BITS, MANTISSA_SHIFT, REBIAS, MIN_NORMAL_BITS, MAGIC, MAGIC_BITS, NAN_CODE
    )
    tl.store(out_ptr + offs, code.to(tl.uint8), mask=mask)

    abs_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # masked lanes hold 0
    if AMAX:
        # This program's max |x|, on the bits (as in the block kernel): every NaN is above +Inf, so a NaN gives
        # the canonical NaN, as torch's amax propagates it.
        amax_bits = tl.max(abs_bits, axis=0)
        amax_bits = tl.where(amax_bits > 0x7F800000, 0x7FC00000, amax_bits)
        tl.store(amax_ptr + pid, amax_bits.to(tl.float32, bitcast=True))
    nonzero = (abs_bits != 0) & mask  # x != 0, NaN included
    underflow = nonzero & ((code & 0x7F) == 0)  # an fp8 value is zero iff all bits but the sign are
    overflow = overflow & mask
    if GATED:
        tl.store(partial_ptr + pid * 3 + 0, tl.sum(nonzero.to(tl.int32), axis=0), mask=ready == 0)
        tl.store(partial_ptr + pid * 3 + 1, tl.sum(overflow.to(tl.int32), axis=0), mask=ready == 0)
        tl.store(partial_ptr + pid * 3 + 2, tl.sum(underflow.to(tl.int32), axis=0), mask=ready == 0)
    else:
        tl.store(partial_ptr + pid * 3 + 0, tl.sum(nonzero.to(tl.int32), axis=0))
        tl.store(partial_ptr + pid * 3 + 1, tl.sum(overflow.to(tl.int32), axis=0))
        tl.store(partial_ptr + pid * 3 + 2, tl.sum(underflow.to(tl.int32), axis=0))


def _block_cast_kernel(
    x_ptr,
    scale_ptr,
    amax_ptr,
    out_ptr,
    partial_ptr,
    n_rows,
    n_cols,
    n_block_rows,
    n_block_cols,
    n_programs_n,
    X_IS_BF16: tl.constexpr,
    COMPUTE_SCALE: tl.constexpr,
    POWER_OF_2: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EPS_BITS: tl.constexpr,
    SCALE_AT_EPS_BITS: tl.constexpr,
    STATISTICS: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MANTISSA_SHIFT: tl.constexpr,
    REBIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr,
    MAGIC: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
    NAN_CODE: tl.constexpr,
    INT64_INDEX: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BM_P: tl.constexpr,
    BN_P: tl.constexpr,
    GM: tl.constexpr,
    GN: tl.constexpr,
):
    # One program: GM x GN blocks of BM x BN elements, held as a (GM, BM_P, GN, BN_P) tile (BM_P, BN_P: BM, BN
    # rounded up to powers of two, the extra lanes masked), so each block's amax is a reduction over axes 3 and 1.
    pid = tl.program_id(0)
    pid_m = pid // n_programs_n
    pid_n = pid % n_programs_n
    if INT64_INDEX:
        pid_m = pid_m.to(tl.int64)
    brow = pid_m * GM + tl.arange(0, GM)  # block row of each group row
    bcol = pid_n * GN + tl.arange(0, GN)
    inner_r = tl.arange(0, BM_P)
    inner_c = tl.arange(0, BN_P)
    rows = brow[:, None] * BM + inner_r[None, :]  # (GM, BM_P)
    cols = bcol[:, None] * BN + inner_c[None, :]  # (GN, BN_P)
    row_ok = (inner_r[None, :] < BM) & (rows < n_rows)
    col_ok = (inner_c[None, :] < BN) & (cols < n_cols)
    offs = rows[:, :, None, None] * n_cols + cols[None, None, :, :]
    mask = row_ok[:, :, None, None] & col_ok[None, None, :, :]

    if X_IS_BF16:
        x = (tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # amax on the bits: for |x| the int32 order is the float order, and every NaN is above +Inf, so a block
    # holding a NaN gets a NaN amax (as torch's amax); the masked lanes hold 0.
    abs_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax_bits = tl.max(tl.max(abs_bits, axis=3), axis=1)  # (GM, GN)
    amax_nan = amax_bits > 0x7F800000
    amax_bits = tl.where(amax_nan, 0x7FC00000, amax_bits)
    amax = amax_bits.to(tl.float32, bitcast=True)
    block_ok = (brow[:, None] < n_block_rows) & (bcol[None, :] < n_block_cols)
    block_offs = brow[:, None] * n_block_cols + bcol[None, :]
    tl.store(amax_ptr + block_offs, amax, mask=block_ok)

    if COMPUTE_SCALE:
        # recipe.amax_to_scale, bit for bit: fp8_max / max(amax, eps) in float64 (an IEEE division on every
        # backend), rounded toward zero to float32; amax < eps takes the host's scale of eps (SCALE_AT_EPS_BITS).
        clamped = amax_bits < EPS_BITS
        exact = tl.full([GM, GN], FP8_MAX, tl.float64) / tl.where(clamped, 1.0, amax).to(tl.float64)
        scale = exact.to(tl.float32)
        scale_bits = scale.to(tl.int32, bitcast=True)
        scale_bits = tl.where(scale.to(tl.float64) > exact, scale_bits - 1, scale_bits)  # nextafter toward 0
        if POWER_OF_2:
            scale_bits = scale_bits & 0x7F800000  # the largest power of two <= a positive normal scale; 0 stays 0
        scale_bits = tl.where(clamped, SCALE_AT_EPS_BITS, scale_bits)
        scale_bits = tl.where(amax_nan, 0x7FC00000, scale_bits)  # NaN amax: NaN scale (Inf amax gave 0 above)
        scale = scale_bits.to(tl.float32, bitcast=True)
        tl.store(scale_ptr + block_offs, scale, mask=block_ok)
    else:
        scale = tl.load(scale_ptr + block_offs, mask=block_ok, other=1.0)

    x_scaled = x * scale[:, None, :, None]
    code, overflow = _fp8_encode(
        x_scaled, MAX_BITS, MANTISSA_SHIFT, REBIAS, MIN_NORMAL_BITS, MAGIC, MAGIC_BITS, NAN_CODE
    )
    tl.store(out_ptr + offs, code.to(tl.uint8), mask=mask)

    if STATISTICS:
        nonzero = (abs_bits != 0) & mask  # x != 0, NaN included
        underflow = nonzero & ((code & 0x7F) == 0)
        overflow = overflow & mask  # the masked lanes are no elements, whatever their block's scale
        tl.store(partial_ptr + pid * 3 + 0, tl.sum(nonzero.to(tl.int32)))
        tl.store(partial_ptr + pid * 3 + 1, tl.sum(overflow.to(tl.int32)))
        tl.store(partial_ptr + pid * 3 + 2, tl.sum(underflow.to(tl.int32)))


@functools.cache
def _import_triton() -> Any:
    """Import triton, bind ``tl`` and jit the device helpers (the kernels resolve them from this module's globals)."""
    global tl, _fp8_encode
    import triton
    import triton.language

    tl = triton.language
    _fp8_encode = triton.jit(_fp8_encode)
    return triton


@functools.cache
def _kernel() -> Callable[..., Any]:
    return _import_triton().jit(_cast_with_statistics_kernel)


@functools.cache
def _block_kernel() -> Callable[..., Any]:
    return _import_triton().jit(_block_cast_kernel)


def _scale_mode(x: Tensor, scale: Tensor) -> tuple[int, int]:
    """``(SCALE_*, n_cols)`` for a ``scale`` that broadcasts to ``x`` without changing its shape."""
    if scale.ndim <= x.ndim:
        if scale.numel() == 1:
            return SCALE_TENSORWISE, 1
        n_cols = x.shape[-1]
        if scale.shape == (*x.shape[:-1], 1):
            return SCALE_PER_ROW, n_cols
        if scale.shape[-1] == n_cols and all(size == 1 for size in scale.shape[:-1]):
            return SCALE_PER_COLUMN, n_cols
    raise ValueError(
        f"the Triton cast supports a scale with one element, one per row {(*x.shape[:-1], 1)} or one per "
        f"column {(1, x.shape[-1]) if x.ndim else ()}; got scale of shape {tuple(scale.shape)} for x of "
        f"shape {tuple(x.shape)}"
    )


def triton_cast_with_statistics(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Fused ``(saturated_cast(x * scale), [nonzero, overflow, underflow])``, in one pass over ``x``.

    Same contract and bit-for-bit the same result as the torch reference in
    :func:`lightning_fp8.quantize.cast_with_statistics`: FP8 data of ``x``'s shape and the int64 counts
    (shape ``(3,)``) on ``x``'s device, with no host synchronisation.

    Args:
        x: contiguous float32, bfloat16 or float16 tensor, any shape and size.
        scale: float32 tensor on ``x``'s device with one element (tensorwise), shape
            ``(*x.shape[:-1], 1)`` (per row) or ``(1, x.shape[-1])`` (per column).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Raises:
        TypeError / ValueError: for any other dtype, layout, device or scale shape.
    """
    if fp8_dtype not in _FORMATS:
        raise ValueError(f"fp8_dtype={fp8_dtype} is not valid; choose one of {list(_FORMATS)}")
    if x.dtype not in SUPPORTED_INPUT_DTYPES:
        raise TypeError(f"the Triton cast expects x of dtype {list(SUPPORTED_INPUT_DTYPES)}, got {x.dtype}")
    if scale.dtype != torch.float32:
        raise TypeError(f"the Triton cast expects a float32 scale, got {scale.dtype}")
    if not x.is_contiguous():
        raise ValueError("the Triton cast expects a contiguous x; call .contiguous() first")
    if scale.device != x.device:
        raise ValueError(f"scale is on {scale.device} but x is on {x.device}")
    scale_mode, n_cols = _scale_mode(x, scale)

    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    numel = x.numel()
    if numel == 0:
        return data, torch.zeros(3, dtype=torch.int64, device=x.device)
    partial = torch.empty(_n_programs(numel), 3, dtype=torch.int32, device=x.device)
    _launch(x, scale, scale_mode, n_cols, data, partial)
    return data, partial.sum(dim=0)


def _n_programs(numel: int) -> int:
    return (numel + BLOCK_SIZE - 1) // BLOCK_SIZE


def _launch(
    x: Tensor,
    scale: Tensor,
    scale_mode: int,
    n_cols: int,
    data: Tensor,
    partial: Tensor,
    amax: Tensor | None = None,
    gate: Tensor | None = None,
) -> None:
    """One launch of the elementwise kernel over a non-empty ``x``: ``data`` and the ``partial`` counts; with ``amax``
    also each program's max ``|x|``; with ``gate`` (a one-byte device flag) only where the flag is 0."""
    kernel = _kernel()
    fmt = _FORMATS[data.dtype]
    numel = x.numel()
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        kernel[(_n_programs(numel),)](
            x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
            scale.reshape(-1),
            data.view(torch.uint8),
            partial,
            partial if amax is None else amax,  # unused without AMAX / GATED
            partial if gate is None else gate,
            numel,
            n_cols,
            X_IS_BF16=x.dtype == torch.bfloat16,
            SCALE_MODE=scale_mode,
            AMAX=amax is not None,
            GATED=gate is not None,
            MAX_BITS=fmt["max_bits"],
            MANTISSA_SHIFT=fmt["mantissa_shift"],
            REBIAS=fmt["rebias"],
            MIN_NORMAL_BITS=fmt["min_normal_bits"],
            MAGIC=fmt["magic"],
            MAGIC_BITS=fmt["magic_bits"],
            NAN_CODE=fmt["nan_code"],
            INT64_INDEX=numel > _MAX_INT32_NUMEL,
            BLOCK=BLOCK_SIZE,
            num_warps=NUM_WARPS,
        )


def history_cast_supported(x: Tensor, history_scale: Tensor, history_ready: Tensor) -> bool:
    """Whether :func:`triton_history_cast` takes these arguments (:func:`use_triton` aside): a non-empty ``x``, a
    float32 one-element history scale and a bool one-element readiness flag, both on ``x``'s device."""
    return (
        x.numel() > 0
        and history_scale.dtype == torch.float32
        and history_scale.numel() == 1
        and history_ready.dtype == torch.bool
        and history_ready.numel() == 1
        and history_scale.device == x.device
        and history_ready.device == x.device
    )


def triton_history_cast(
    x: Tensor,
    history_scale: Tensor,
    history_ready: Tensor,
    fp8_dtype: torch.dtype,
    *,
    margin: int = 0,
    power_of_2: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A per-tensor, history-scaled cast (the ``delayed`` recipe): ``(data, scale, amax, counts)``, no host sync.

    The same bits as the torch reference of :func:`lightning_fp8.quantize.quantize` for a ``"tensor"`` granularity,
    ``scale_source="history"`` cast spec:

    * ``amax``: float32 ``()``, ``max |x|`` (NaN if ``x`` holds a NaN);
    * ``scale``: ``torch.where(history_ready, history_scale, amax_to_scale(amax, fp8_max, margin, power_of_2))``;
    * ``data``: ``saturated_cast(x * scale)``; ``counts``: int64 ``(3,)`` ``[nonzero, overflow, underflow]``.

    Two launches of the elementwise kernel and a few scalar torch ops, whatever the flag says (the host never reads
    it): the first casts with ``history_scale`` and also computes per-program maxima of ``|x|``, reduced to ``amax``
    by one torch ``amax`` over them; the second is gated by ``history_ready`` on the device: when the history is
    ready it masks off every load and store (one read of ``x`` in all), when it is not it casts again with the
    current-amax scale, overwriting the data and counts of the first launch (two reads, as the reference's).

    Args:
        x: contiguous, non-empty float32, bfloat16 or float16 tensor, any shape.
        history_scale: float32, one element, on ``x``'s device.
        history_ready: bool, one element, on ``x``'s device.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        margin, power_of_2: as in :func:`lightning_fp8.recipe.amax_to_scale`, for the current-amax scale.
    """
    if fp8_dtype not in _FORMATS:
        raise ValueError(f"fp8_dtype={fp8_dtype} is not valid; choose one of {list(_FORMATS)}")
    if x.dtype not in SUPPORTED_INPUT_DTYPES:
        raise TypeError(f"the Triton cast expects x of dtype {list(SUPPORTED_INPUT_DTYPES)}, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("the Triton cast expects a contiguous x; call .contiguous() first")
    if not history_cast_supported(x, history_scale, history_ready):
        raise ValueError(
            "the Triton history cast expects a non-empty x, a float32 one-element history_scale and a bool "
            "one-element history_ready on x's device"
        )
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    n_programs = _n_programs(x.numel())
    partial = torch.empty(n_programs, 3, dtype=torch.int32, device=x.device)
    partial_amax = torch.empty(n_programs, dtype=torch.float32, device=x.device)
    _launch(x, history_scale, SCALE_TENSORWISE, 1, data, partial, amax=partial_amax)
    amax = partial_amax.amax()  # NaN-propagating, as the reference's x.abs().amax()
    scale = torch.where(history_ready, history_scale, amax_to_scale(amax, fp8_max(fp8_dtype), margin, power_of_2))
    _launch(x, scale, SCALE_TENSORWISE, 1, data, partial, gate=history_ready.reshape(-1).view(torch.uint8))
    return data, scale, amax, partial.sum(dim=0)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def _block_config(block: tuple[int, int]) -> tuple[int, int, int, int, int]:
    """``(BM_P, BN_P, GM, GN, num_warps)`` for ``block``: the padded block shape and the blocks per program.

    A program holds ``GM x GN`` whole blocks, about ``BLOCK_CAST_ELEMENTS`` elements (one block if a block is
    larger), at least ``BLOCK_CAST_MIN_WIDTH`` columns wide when the blocks are narrower (coalesced loads).
    """
    bm, bn = block
    bm_p, bn_p = _next_power_of_2(bm), _next_power_of_2(bn)
    if bm_p * bn_p > MAX_BLOCK_CAST_ELEMENTS:
        raise ValueError(
            f"the Triton block cast holds a block in one program: blocks of up to {MAX_BLOCK_CAST_ELEMENTS} elements "
            f"(rounded up to powers of two per dimension), got block {block}"
        )
    groups = max(1, BLOCK_CAST_ELEMENTS // (bm_p * bn_p))
    gn = 1
    while gn * bn_p < BLOCK_CAST_MIN_WIDTH and gn * 2 <= groups:
        gn *= 2
    gm = groups // gn
    elements = gm * bm_p * gn * bn_p
    return bm_p, bn_p, gm, gn, max(NUM_WARPS, elements // 1024)


@functools.cache
def _scale_constants(fp8_dtype: torch.dtype, margin: int, power_of_2: bool) -> tuple[float, int, int]:
    """``(fp8_max / 2**margin, EPS_BITS, SCALE_AT_EPS_BITS)`` of the block kernel's scale computation.

    ``EPS_BITS``: the float32 bits of the smallest float32 ``>= AMAX_EPS`` (a float32 amax is below ``AMAX_EPS`` iff
    its bits are below these); ``SCALE_AT_EPS_BITS``: the bits of ``amax_to_scale`` of a clamped amax, from
    ``amax_to_scale`` itself.
    """
    eps = torch.tensor(AMAX_EPS, dtype=torch.float64).to(torch.float32)
    if eps.double() < AMAX_EPS:
        eps = torch.nextafter(eps, torch.tensor(float("inf")))
    at_eps = amax_to_scale(torch.zeros(()), FP8_MAX[fp8_dtype], margin, power_of_2)
    # (fp8_max / a) / 2**margin == (fp8_max / 2**margin) / a in float64: dividing by a power of two is exact.
    return FP8_MAX[fp8_dtype] / 2.0**margin, int(eps.view(torch.int32)), int(at_eps.view(torch.int32))


def triton_block_cast(
    x: Tensor,
    block: tuple[int, int],
    fp8_dtype: torch.dtype,
    *,
    power_of_2: bool = False,
    margin: int = 0,
    scale: Tensor | None = None,
    statistics: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Fused block-scaled cast, in one pass over ``x``: ``(data, scale, amax, counts)``.

    The same bits as the torch reference of :func:`lightning_fp8.quantize.quantize` for a ``"block"`` cast spec:

    * ``amax``: float32 ``(ceil(R / bm), ceil(C / bn))``, ``max |x|`` over each block (over the elements it has, for a
      partial block at the bottom or right edge; NaN if the block holds a NaN);
    * ``scale``: float32, same shape: ``amax_to_scale(amax, fp8_max, margin, power_of_2)`` bit for bit, or the
      given ``scale`` (returned as is);
    * ``data``: ``saturated_cast(x * scale[block])``, FP8 of ``x``'s shape;
    * ``counts``: int64 ``(3,)`` ``[nonzero, overflow, underflow]`` over the elements of ``x`` (``None`` with
      ``statistics=False``); no host synchronisation.

    Args:
        x: contiguous 2-D float32, bfloat16 or float16 tensor.
        block: ``(bm, bn)``, each rounded up to a power of two at most ``MAX_BLOCK_CAST_ELEMENTS`` elements.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        power_of_2, margin: as in :func:`lightning_fp8.recipe.amax_to_scale` (ignored with a given ``scale``).
        scale: cast with these float32 block scales (shape ``(ceil(R / bm), ceil(C / bn))``) instead of computing
            them (a recomputation that reuses the forward's scales).
        statistics: compute the counts.

    Raises:
        TypeError / ValueError: for any other dtype, layout, device, block or scale shape.
    """
    if fp8_dtype not in _FORMATS:
        raise ValueError(f"fp8_dtype={fp8_dtype} is not valid; choose one of {list(_FORMATS)}")
    if x.dtype not in SUPPORTED_INPUT_DTYPES:
        raise TypeError(f"the Triton cast expects x of dtype {list(SUPPORTED_INPUT_DTYPES)}, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"block scaling needs a 2-D tensor, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("the Triton cast expects a contiguous x; call .contiguous() first")
    if len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block):
        raise ValueError(f"block must be two positive ints (rows, columns), got {block!r}")
    bm, bn = block
    bm_p, bn_p, gm, gn, num_warps = _block_config((bm, bn))
    rows, cols = x.shape
    n_block_rows, n_block_cols = -(-rows // bm), -(-cols // bn)
    compute_scale = scale is None
    if scale is None:
        scale = torch.empty(n_block_rows, n_block_cols, dtype=torch.float32, device=x.device)
    else:
        if scale.dtype != torch.float32:
            raise TypeError(f"the Triton cast expects a float32 scale, got {scale.dtype}")
        if tuple(scale.shape) != (n_block_rows, n_block_cols):
            raise ValueError(
                f"block {block} of x of shape {tuple(x.shape)} needs a scale of shape {(n_block_rows, n_block_cols)}, "
                f"got {tuple(scale.shape)}"
            )
        if scale.device != x.device:
            raise ValueError(f"scale is on {scale.device} but x is on {x.device}")
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    amax = torch.empty(n_block_rows, n_block_cols, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return data, scale, amax, torch.zeros(3, dtype=torch.int64, device=x.device) if statistics else None
    kernel = _block_kernel()
    n_programs_m, n_programs_n = -(-n_block_rows // gm), -(-n_block_cols // gn)
    n_programs = n_programs_m * n_programs_n
    partial = torch.empty(n_programs if statistics else 1, 3, dtype=torch.int32, device=x.device)
    # the largest offsets computed (masked lanes included): x's and the block arrays'
    last_row, last_col = n_programs_m * gm * bm + bm_p, n_programs_n * gn * bn + bn_p
    int64_index = max(last_row * cols + last_col, (n_programs_m * gm + 1) * n_block_cols) > _MAX_INT32_OFFSET
    fp8_max, eps_bits, scale_at_eps_bits = _scale_constants(fp8_dtype, margin, power_of_2)
    fmt = _FORMATS[fp8_dtype]
    scale_in = scale if compute_scale else scale.contiguous()
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        kernel[(n_programs,)](
            x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
            scale_in,
            amax,
            data.view(torch.uint8),
            partial,
            rows,
            cols,
            n_block_rows,
            n_block_cols,
            n_programs_n,
            X_IS_BF16=x.dtype == torch.bfloat16,
            COMPUTE_SCALE=compute_scale,
            POWER_OF_2=bool(power_of_2),
            FP8_MAX=fp8_max,
            EPS_BITS=eps_bits,
            SCALE_AT_EPS_BITS=scale_at_eps_bits,
            STATISTICS=bool(statistics),
            MAX_BITS=fmt["max_bits"],
            MANTISSA_SHIFT=fmt["mantissa_shift"],
            REBIAS=fmt["rebias"],
            MIN_NORMAL_BITS=fmt["min_normal_bits"],
            MAGIC=fmt["magic"],
            MAGIC_BITS=fmt["magic_bits"],
            NAN_CODE=fmt["nan_code"],
            INT64_INDEX=int64_index,
            BM=bm,
            BN=bn,
            BM_P=bm_p,
            BN_P=bn_p,
            GM=gm,
            GN=gn,
            num_warps=num_warps,
        )
    return data, scale, amax, partial.sum(dim=0) if statistics else None
