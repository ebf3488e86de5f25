"""Fused FP8 cast with statistics: one Triton kernel, one pass over ``x``.

:func:`lightning_fp8.quantize.cast_with_statistics` is the one place where a high-precision tensor becomes
FP8. Its torch reference is a handful of elementwise ops and reductions: in eager mode each is its
own kernel, so ``x`` (and the float32 ``x * scale``) is read and written several times per cast. This
module does the whole cast in one kernel that reads ``x`` once and writes the FP8 data once::

    x_scaled  = float32(x) * scale            scale: one element, one per row (M, 1) or per column (1, N)
    data      = saturate(x_scaled)            finite -> clamp to ±fp8_max, NaN/±Inf -> NaN
    counts    = [nonzero, overflow, underflow] int64, per-block partial sums + one torch.sum, no host sync

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

from lightning_fp8.recipe import E4M3, E5M2

#: Elements per program. 2048 elements on 8 warps is 8 per thread: two 16-byte loads for float32.
BLOCK_SIZE = 2048
NUM_WARPS = 8

#: Above this many elements the kernel indexes with int64 (offsets of the last block must fit in int32).
_MAX_INT32_NUMEL = 2**31 - 1 - BLOCK_SIZE

SUPPORTED_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

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

# Set by _kernel() on first use; the kernel below resolves `tl` from this module's globals when Triton
# compiles (or interprets) it, which happens after _kernel() has imported triton.
tl: Any = None


def use_triton(x: Tensor) -> bool:
    """Whether :func:`lightning_fp8.quantize.cast_with_statistics` runs the fused Triton kernel for ``x``.

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


def _cast_with_statistics_kernel(
    x_ptr,
    scale_ptr,
    out_ptr,
    partial_ptr,
    numel,
    n_cols,
    X_IS_BF16: tl.constexpr,
    SCALE_MODE: tl.constexpr,
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
    tl.store(out_ptr + offs, code.to(tl.uint8), mask=mask)

    nonzero = ((x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) != 0) & mask  # x != 0, NaN included
    underflow = nonzero & ((code & 0x7F) == 0)  # an fp8 value is zero iff all bits but the sign are
    overflow = overflow & mask
    tl.store(partial_ptr + pid * 3 + 0, tl.sum(nonzero.to(tl.int32), axis=0))
    tl.store(partial_ptr + pid * 3 + 1, tl.sum(overflow.to(tl.int32), axis=0))
    tl.store(partial_ptr + pid * 3 + 2, tl.sum(underflow.to(tl.int32), axis=0))


@functools.cache
def _kernel() -> Callable[..., Any]:
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_cast_with_statistics_kernel)


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
    kernel = _kernel()
    n_blocks = (numel + BLOCK_SIZE - 1) // BLOCK_SIZE
    partial = torch.empty(n_blocks, 3, dtype=torch.int32, device=x.device)
    fmt = _FORMATS[fp8_dtype]
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        kernel[(n_blocks,)](
            x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
            scale.reshape(-1),
            data.view(torch.uint8),
            partial,
            numel,
            n_cols,
            X_IS_BF16=x.dtype == torch.bfloat16,
            SCALE_MODE=scale_mode,
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
    return data, partial.sum(dim=0)
