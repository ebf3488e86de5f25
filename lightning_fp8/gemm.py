"""FP8 x FP8 -> high-precision GEMM: ``torch._scaled_mm`` on FP8 hardware, exact emulation elsewhere.

Operands follow ``torch._scaled_mm``'s contract (the *CUDA* one, which is stricter than the CPU
kernel's): ``a`` is ``(M, K)`` row-major, ``b`` is ``(K, N)`` column-major, both FP8 and not both
E5M2, ``K`` and ``N`` multiples of 16, and the scales float32 of shape ``()``/``(1,)`` (tensorwise) or
``(M, 1)`` and ``(1, N)`` (rowwise, E4M3 only). :func:`check_scaled_mm_contract` asserts this on every
call, also on CPU, so CPU tests catch what the CUDA kernel would reject. Shapes that break the
multiple-of-16 rule (any ``nn.Linear`` shape is allowed) are zero-padded, which leaves the product
unchanged, and the result is sliced back.

The emulation does what CUDA's ``_scaled_mm`` does, with one rounding::

    product = float32(a) @ float32(b)          FP8 values are exact in float32, so is every product;
                                               the sums accumulate in float32
    out     = (product * inv_a * inv_b).to(out_dtype)     the dequantization scales applied to the
                                               float32 accumulator, then one rounding to out_dtype

It differs from the CUDA kernel only in the order of the float32 additions (which no two GEMM kernels
share) and in ``use_fast_accum`` (CUDA's faster, less precise accumulation of the forward GEMM, which
the emulation does not imitate). For ``rowwise`` the CUDA kernel only outputs bfloat16; callers then
convert to their dtype, as on CUDA. The float32 product is also the fast choice on CPUs without bf16
matrix units (on the AVX2 machines of this project's CI a float32 GEMM is ~150x faster than a bf16 one).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_fp8.recipe import E4M3, E5M2

log = logging.getLogger(__name__)

GemmPath = Literal["native", "emulated"]
_FP8_DTYPES = (E4M3, E5M2)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scaled_mm_out_dtype(requested: torch.dtype, rowwise: bool) -> torch.dtype:
    """The output dtype to ask the FP8 GEMM for, given the dtype the caller wants.

    Row-wise scaling produces bfloat16 only (CUDA's kernel); otherwise the requested dtype if the GEMM
    can output it (float32, bfloat16, float16), else float32 (e.g. for float64 parameters). Callers
    convert the result to their dtype.
    """
    if rowwise:
        return torch.bfloat16
    return requested if requested in _OUT_DTYPES else torch.float32


def gemm_path(device: torch.device | str) -> GemmPath:
    """``"native"`` (``torch._scaled_mm``) on CUDA devices with compute capability 8.9+, else ``"emulated"``."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_capability(index) >= (8, 9):
            return "native"
    return "emulated"


def describe_gemm_path(device: torch.device | str) -> str:
    """One human-readable line naming the GEMM path for ``device``."""
    device = torch.device(device)
    if gemm_path(device) == "native":
        return f"native FP8 GEMM (torch._scaled_mm) on {device}"
    return (
        f"emulated FP8 GEMM on {device} (the FP8 casts as on FP8 hardware; products of the FP8 values in float32 "
        "with float32 accumulation, scales applied to the float32 result, one rounding to the output dtype; "
        "slower than bf16: no FP8 speedup without FP8 tensor cores, compute capability 8.9+)"
    )


class ScaledMMContractError(AssertionError):
    """An FP8 GEMM was called with operands that CUDA's ``torch._scaled_mm`` would reject."""


def check_scaled_mm_contract(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> None:
    """Assert CUDA ``torch._scaled_mm``'s operand contract (metadata only: no data is read)."""

    def fail(msg: str) -> None:
        raise ScaledMMContractError(
            f"torch._scaled_mm contract: {msg} (a {tuple(a.shape)} {a.dtype} stride {a.stride()}, "
            f"b {tuple(b.shape)} {b.dtype} stride {b.stride()}, scale_a {tuple(scale_a.shape)}, "
            f"scale_b {tuple(scale_b.shape)})"
        )

    if a.dim() != 2 or b.dim() != 2:
        fail("operands must be 2-D")
    if a.dtype not in _FP8_DTYPES or b.dtype not in _FP8_DTYPES:
        fail("operands must be float8_e4m3fn or float8_e5m2")
    if a.dtype == E5M2 and b.dtype == E5M2:
        fail("E5M2 x E5M2 is not supported")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        fail("inner dimensions differ")
    if a.stride(1) != 1 or (m > 1 and a.stride(0) != k):
        fail("a must be row-major")
    if b.stride(0) != 1 or (n > 1 and b.stride(1) != k):
        fail("b must be column-major")
    if k % 16 or n % 16:
        fail("K and N must be multiples of 16")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        fail("scales must be float32")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1 and scale_a.dim() <= 1 and scale_b.dim() <= 1
    rowwise = tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)
    if not (tensorwise or rowwise):
        fail("scales must both be single-element (tensorwise) or of shapes (M, 1) and (1, N) (rowwise)")
    if rowwise and not tensorwise:
        if a.dtype != E4M3 or b.dtype != E4M3:
            fail("rowwise scaling needs E4M3 operands")
        if out_dtype != torch.bfloat16:
            fail("rowwise scaling needs out_dtype=torch.bfloat16")
        if not (scale_a.is_contiguous() and scale_b.is_contiguous()):
            fail("rowwise scales must be contiguous")


def _pad_fp8(x: Tensor, rows: int, cols: int) -> Tensor:
    """Zero-pad a row-major FP8 matrix (byte 0 is +0.0 in both FP8 formats)."""
    return F.pad(x.view(torch.uint8), (0, cols, 0, rows)).view(x.dtype)


def _pad_to_contract(a: Tensor, b: Tensor, scale_b: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    k, n = b.shape
    pad_k, pad_n = -k % 16, -n % 16
    if pad_k:
        a = _pad_fp8(a, 0, pad_k)
    if pad_k or pad_n:
        b = _pad_fp8(b.t(), pad_n, pad_k).t()  # b.t() is row-major (N, K)
        if scale_b.numel() > 1:
            scale_b = F.pad(scale_b, (0, pad_n), value=1.0)
    return a, b, scale_b, n


def fp8_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
) -> Tensor:
    """``(a / scale_a) @ (b / scale_b)`` in ``out_dtype``, for FP8 ``a`` (M, K) and ``b`` (K, N).

    ``scale_a`` and ``scale_b`` are *quantization* scales (``fp8 = x * scale``); their reciprocals are
    what ``torch._scaled_mm`` applies. ``a`` must be row-major and ``b`` column-major.
    """
    a, b, scale_b, n = _pad_to_contract(a, b, scale_b)
    inv_a, inv_b = scale_a.reciprocal(), scale_b.reciprocal()
    check_scaled_mm_contract(a, b, inv_a, inv_b, out_dtype)
    if gemm_path(a.device) == "native":
        out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    else:
        out = emulated_scaled_mm(a, b, inv_a, inv_b, out_dtype)
    return out[:, :n] if out.shape[1] != n else out


def emulated_scaled_mm(a: Tensor, b: Tensor, inv_a: Tensor, inv_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``torch._scaled_mm``'s math without FP8 hardware, rounded once (see the module docstring).

    Autocast is switched off around the product: an enclosing autocast would otherwise cast the float32
    operands to its low-precision dtype (and an fp16 one would overflow the unscaled product).
    """
    with torch.autocast(a.device.type, enabled=False):
        product = a.to(torch.float32) @ b.to(torch.float32)
    if inv_a.numel() == 1 and inv_b.numel() == 1:
        return (product * (inv_a * inv_b)).to(out_dtype)  # one alpha, as cuBLAS applies it
    return (product * inv_a * inv_b).to(out_dtype)
