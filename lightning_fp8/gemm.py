"""FP8 x FP8 -> high-precision GEMM: PyTorch's scaled GEMMs on FP8 hardware, exact emulation elsewhere.

The native path calls ``torch._scaled_mm`` for per-tensor and row-wise scaling: the cuBLAS kernel behind the public
``torch.nn.functional.scaled_mm``, which ``torch.compile`` traces on every torch version (dynamo of torch 2.11 cannot
trace the public function's ``torch._scaled_mm_v2``: a graph break per GEMM, seen on an H200). Block scaling needs
the public API: ``BlockWise1x128`` / ``BlockWise128x128`` (``blockwise``; CUDA compute capability 9.x and CUDA
12.9+, as PyTorch's kernel requires) or ``BlockWise1x32`` with swizzled E8M0 scales (``mxfp8``; compute capability
10.0+), called through a custom operator so that a compiled graph keeps it as one node.
:func:`gemm_path` says which path a recipe takes on a device.

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

Block-scaled GEMMs (:func:`fp8_block_mm`) cannot apply their scales after one product: the hardware
multiplies each K-block's partial sum by that block's two decoding scales. The emulation dequantizes each
operand in float32 (``fp8 * (1 / scale)`` per block: exact for the power-of-two ``mxfp8`` scales, one
float32 rounding per element for float32 ``blockwise`` scales) and multiplies in float32, then rounds once
to bfloat16 (the block kernels' output dtype). The operands are padded along K to whole blocks and the
scales are laid out as the CUDA kernel wants them (column-major, padded, swizzled, E8M0) on every device,
so :func:`check_block_scaled_mm_contract` checks on the CPU what the kernel would reject.
"""

from __future__ import annotations

import logging
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_fp8.quantize import blocked
from lightning_fp8.recipe import BLOCKWISE_TILE, E4M3, E5M2, MX_BLOCK, rounded_to, stored

log = logging.getLogger(__name__)

GemmPath = Literal["native", "emulated"]
_FP8_DTYPES = (E4M3, E5M2)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The public scaled GEMM of torch 2.10+ (``torch._scaled_mm`` is the fallback on older torch).
_PUBLIC_SCALED_MM = getattr(F, "scaled_mm", None)
_ScalingType = getattr(F, "ScalingType", None)
_SwizzleType = getattr(F, "SwizzleType", None)
E8M0 = getattr(torch, "float8_e8m0fnu", None)

#: What a recipe's GEMMs need natively: ``(minimum compute capability, maximum major or None, minimum CUDA)``.
_NATIVE_NEEDS: dict[str, tuple[tuple[int, int], int | None, tuple[int, int]]] = {
    "tensor": ((8, 9), None, (0, 0)),
    "row": ((8, 9), None, (0, 0)),
    "blockwise": ((9, 0), 9, (12, 9)),  # PyTorch's 1x128 / 128x128 kernel: Hopper only, cuBLAS 12.9+
    "mxfp8": ((10, 0), None, (12, 8)),  # MX block scaling: Blackwell tensor cores
}
_RECIPE_KIND = {"tensorwise": "tensor", "delayed": "tensor", "rowwise": "row", "blockwise": "blockwise", "mxfp8": "mxfp8"}


def scaled_mm_out_dtype(requested: torch.dtype, rowwise: bool) -> torch.dtype:
    """The output dtype to ask the FP8 GEMM for, given the dtype the caller wants.

    Row-wise and block scaling (``rowwise=True``) produce bfloat16 only (CUDA's kernels); otherwise the
    requested dtype if the GEMM can output it (float32, bfloat16, float16), else float32 (e.g. for float64
    parameters). Callers convert the result to their dtype.
    """
    if rowwise:
        return torch.bfloat16
    return requested if requested in _OUT_DTYPES else torch.float32


def _cuda_version() -> tuple[int, int]:
    try:
        major, minor = (torch.version.cuda or "0.0").split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


def gemm_path(device: torch.device | str, recipe: str = "tensorwise") -> GemmPath:
    """``"native"`` where the device runs ``recipe``'s FP8 GEMMs in hardware, else ``"emulated"``.

    Native: per-tensor and row-wise scaling on CUDA compute capability 8.9+; ``blockwise`` on 9.x with CUDA
    12.9+ (PyTorch's DeepSeek-style kernel exists for Hopper only); ``mxfp8`` on 10.0+ (Blackwell).
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "emulated"
    low, max_major, cuda = _NATIVE_NEEDS[_RECIPE_KIND.get(recipe, "tensor")]
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    if capability < low or (max_major is not None and capability[0] > max_major) or _cuda_version() < cuda:
        return "emulated"
    if recipe in ("blockwise", "mxfp8") and _PUBLIC_SCALED_MM is None:
        return "emulated"
    return "native"


def describe_gemm_path(device: torch.device | str, recipe: str = "tensorwise") -> str:
    """One human-readable line naming the GEMM path of ``recipe`` on ``device``."""
    device = torch.device(device)
    block = recipe in ("blockwise", "mxfp8")
    api = "torch.nn.functional.scaled_mm" if block else "torch._scaled_mm"
    if gemm_path(device, recipe) == "native":
        return f"native FP8 GEMM ({api}) on {device}"
    if block:
        need = "compute capability 9.x and CUDA 12.9+" if recipe == "blockwise" else "compute capability 10.0+"
        return (
            f"emulated block-scaled FP8 GEMM on {device} (the FP8 casts as on FP8 hardware; each operand dequantized "
            "block by block in float32, float32 product and accumulation, one rounding to bfloat16; slower than "
            f"bf16: the native {recipe} GEMM needs {need})"
        )
    return (
        f"emulated FP8 GEMM on {device} (the FP8 casts as on FP8 hardware; products of the FP8 values in float32 "
        "with float32 accumulation, scales applied to the float32 result, one rounding to the output dtype; "
        "slower than bf16: no FP8 speedup without FP8 tensor cores, compute capability 8.9+)"
    )


class ScaledMMContractError(AssertionError):
    """An FP8 GEMM was called with operands that CUDA's ``torch._scaled_mm`` would reject."""


def _check_operands(a: Tensor, b: Tensor, fail: Callable[[str], None]) -> tuple[int, int, int]:
    """The operand rules every scaled GEMM shares: 2-D FP8, ``a`` (M, K) row-major, ``b`` (K, N) column-major, K and N
    multiples of 16. Returns ``(M, K, N)``."""
    if a.dim() != 2 or b.dim() != 2:
        fail("operands must be 2-D")
    if a.dtype not in _FP8_DTYPES or b.dtype not in _FP8_DTYPES:
        fail("operands must be float8_e4m3fn or float8_e5m2")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        fail("inner dimensions differ")
    if a.stride(1) != 1 or (m > 1 and a.stride(0) != k):
        fail("a must be row-major")
    if b.stride(0) != 1 or (n > 1 and b.stride(1) != k):
        fail("b must be column-major")
    if k % 16 or n % 16:
        fail("K and N must be multiples of 16")
    return m, k, n


def check_scaled_mm_contract(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> None:
    """Assert CUDA ``torch._scaled_mm``'s operand contract (metadata only: no data is read)."""

    def fail(msg: str) -> None:
        raise ScaledMMContractError(
            f"torch._scaled_mm contract: {msg} (a {tuple(a.shape)} {a.dtype} stride {a.stride()}, "
            f"b {tuple(b.shape)} {b.dtype} stride {b.stride()}, scale_a {tuple(scale_a.shape)}, "
            f"scale_b {tuple(scale_b.shape)})"
        )

    m, k, n = _check_operands(a, b, fail)
    if a.dtype == E5M2 and b.dtype == E5M2:
        fail("E5M2 x E5M2 is not supported")
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
        if scale_b.dim() == 2:  # a (1, N) column scale (row-wise), also when N == 1; tensorwise scales are 0-d/1-d
            scale_b = F.pad(scale_b, (0, pad_n), value=1.0)
    return a, b, scale_b, n


def fp8_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
    block_a: tuple[int, int] | None = None,
    block_b: tuple[int, int] | None = None,
    own_output: bool = False,
) -> Tensor:
    """``(a / scale_a) @ (b / scale_b)`` in ``out_dtype``, for FP8 ``a`` (M, K) and ``b`` (K, N).

    ``scale_a`` and ``scale_b`` are *quantization* scales (``fp8 = x * scale``); their reciprocals are
    what the scaled GEMM applies. ``a`` must be row-major and ``b`` column-major. With ``block_a`` and
    ``block_b`` (the block shapes in ``a``'s and ``b``'s own layouts), the scales are per block:
    :func:`fp8_block_mm`. A GEMM padded to the kernel's layout returns a view of the padded result; with
    ``own_output`` a copy of it instead (an ``autograd.Function``'s output must not be a view to be modified in place).
    """
    if block_a is not None or block_b is not None:
        if block_a is None or block_b is None:
            raise ValueError("a block-scaled GEMM needs the block shape of both operands")
        return fp8_block_mm(a, b, scale_a, scale_b, block_a, block_b, out_dtype, use_fast_accum, own_output)
    a, b, scale_b, n = _pad_to_contract(a, b, scale_b)
    inv_a, inv_b = stored(scale_a.reciprocal()), stored(scale_b.reciprocal())  # once per scale, not per output
    check_scaled_mm_contract(a, b, inv_a, inv_b, out_dtype)
    if gemm_path(a.device) == "native":
        # torch._scaled_mm, not the public F.scaled_mm: the same cuBLAS kernel, and torch.compile traces it on every
        # torch version (F.scaled_mm calls torch._scaled_mm_v2, which dynamo of torch 2.11 cannot trace: a graph
        # break per GEMM, seen on an H200); torchao's Float8Linear calls it too.
        out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    else:
        out = emulated_scaled_mm(a, b, inv_a, inv_b, out_dtype)
    if out.shape[1] == n:
        return out
    return out[:, :n].clone() if own_output else out[:, :n]


def emulated_scaled_mm(a: Tensor, b: Tensor, inv_a: Tensor, inv_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``torch._scaled_mm``'s math without FP8 hardware, rounded once (see the module docstring).

    Autocast is switched off around the product: an enclosing autocast would otherwise cast the float32
    operands to its low-precision dtype (and an fp16 one would overflow the unscaled product).
    """
    with torch.autocast(a.device.type, enabled=False):
        product = a.to(torch.float32) @ b.to(torch.float32)
    if inv_a.numel() == 1 and inv_b.numel() == 1:
        return rounded_to(product * (inv_a * inv_b), out_dtype)  # one alpha, as cuBLAS applies it
    return rounded_to(product * inv_a * inv_b, out_dtype)


# ---------------------------------------------------------------------------------------------- block scaling


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _scaling_kind(block: tuple[int, int], operand: str) -> str:
    """The kernel's name of a block shape: ``a``'s blocks are in (M, K) layout, ``b``'s in (K, N) layout."""
    along_k = block if operand == "a" else (block[1], block[0])  # (rows, K) in the kernel's "outer x K" terms
    names = {(1, BLOCKWISE_TILE): "1x128", (BLOCKWISE_TILE, BLOCKWISE_TILE): "128x128", (1, MX_BLOCK): "1x32"}
    if along_k not in names:
        raise ScaledMMContractError(
            f"scaled GEMM contract: no kernel scales operand {operand} by blocks of {block} (supported: 1x128 and "
            "128x128 tiles along K, 1x32 MX blocks along K)"
        )
    return names[along_k]


#: The pairs of block scalings PyTorch's CUDA kernels accept (``a``, ``b``).
_NATIVE_BLOCK_PAIRS = {("1x128", "128x128"), ("128x128", "1x128"), ("1x128", "1x128"), ("1x32", "1x32")}


def swizzle_mx_scales(scale: Tensor) -> Tensor:
    """Lay out a ``(rows, K / 32)`` matrix of MX scales as cuBLAS's block-scaling kernels read them
    (``SwizzleType.SWIZZLE_32_4_4``): padded to 128-row by 4-column tiles, tiles in row-major order, and inside
    each 128x4 tile element ``(r, c)`` at ``(r % 32) * 16 + (r // 32) * 4 + c``. Returns a flat contiguous tensor
    of ``round_up(rows, 128) * round_up(K / 32, 4)`` elements.

    Written here rather than taken from torchao: the layout is NVIDIA's documented one and torchao has it only
    in a prototype module whose import pulls in its CUDA extensions.
    """
    rows, cols = scale.shape
    padded_rows, padded_cols = _round_up(rows, 128), _round_up(cols, 4)
    if (padded_rows, padded_cols) != (rows, cols):
        scale = F.pad(scale, (0, padded_cols - cols, 0, padded_rows - rows), value=1.0)
    tiles = scale.reshape(padded_rows // 128, 4, 32, padded_cols // 4, 4)  # (row tile, r // 32, r % 32, col tile, c)
    return tiles.permute(0, 3, 2, 1, 4).contiguous().reshape(-1)


def _native_block_scale(inv: Tensor, kind: str, operand: str, k_blocks: int) -> Tensor:
    """A decoding-scale matrix in our layout (``a``: (M-blocks, K-blocks); ``b``: (K-blocks, N-blocks)) laid out
    as PyTorch's CUDA kernel wants it (see the module docstring)."""
    if operand == "b":
        inv = inv.t()  # (N-side, K-blocks) like a's
    if kind == "1x128":
        # (outer, K-blocks), strides (1, outer) exactly: inv.t().contiguous() would keep strides (1, 1) for one K-block
        return inv.new_empty(inv.shape[1], inv.shape[0]).copy_(inv.t()).t()
    if kind == "128x128":
        rows = _round_up(k_blocks, 4)
        padded = F.pad(inv, (0, rows - inv.shape[1]), value=1.0)  # (outer-blocks, round_up(K-blocks, 4))
        # (round_up(K-blocks, 4), outer-blocks), strides (1, round_up(K-blocks, 4)) exactly: for one outer block and
        # no K padding, padded.contiguous().t() would keep the strides (1, 1) of b's transposed (K-blocks, 1) scales
        return inv.new_empty(padded.shape).copy_(padded).t()
    # 1x32: E8M0, swizzled
    assert E8M0 is not None
    return swizzle_mx_scales(inv).to(E8M0)


def check_block_scaled_mm_contract(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    kind_a: str,
    scale_b: Tensor,
    kind_b: str,
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
) -> None:
    """Assert the CUDA block-scaled GEMM's operand contract (metadata only) on operands and *kernel-layout* scales.

    ``kind_a``/``kind_b``: ``"1x128"``, ``"128x128"`` or ``"1x32"``. Checks what PyTorch's CUDA kernels check: the
    pair of scalings, the operand layouts and dtypes, and the scales' dtype, shape and strides (DeepSeek-style
    float32 scales: outer-dimension-major, the 128x128 ones padded to a multiple of 4 K-blocks; MX: E8M0,
    swizzled, ``round_up(rows, 128) * round_up(K / 32, 4)`` elements, contiguous); ``use_fast_accum``, the flag
    the kernel would get: the 1x128 and 128x128 scalings refuse fast accumulation (cuBLAS's DeepSeek-style
    kernels accumulate in full float32).
    """

    def fail(msg: str) -> None:
        raise ScaledMMContractError(
            f"scaled GEMM contract ({kind_a} x {kind_b}): {msg} (a {tuple(a.shape)} {a.dtype} stride {a.stride()}, "
            f"b {tuple(b.shape)} {b.dtype} stride {b.stride()}, scale_a {tuple(scale_a.shape)} {scale_a.dtype} stride "
            f"{scale_a.stride()}, scale_b {tuple(scale_b.shape)} {scale_b.dtype} stride {scale_b.stride()})"
        )

    if (kind_a, kind_b) not in _NATIVE_BLOCK_PAIRS:
        fail(f"no kernel for this pair (supported: {sorted(_NATIVE_BLOCK_PAIRS)})")
    m, k, n = _check_operands(a, b, fail)
    if kind_a == "1x32":
        if a.dtype == E5M2 and b.dtype == E5M2:
            fail("E5M2 x E5M2 is not supported")
        if k % MX_BLOCK:
            fail("K must be a multiple of 32 (whole MX blocks)")
        for name, scale, outer in (("scale_a", scale_a, m), ("scale_b", scale_b, n)):
            if scale.dtype != E8M0:
                fail(f"{name} must be float8_e8m0fnu (E8M0)")
            want = _round_up(outer, 128) * _round_up(k // MX_BLOCK, 4)
            if scale.numel() != want or not scale.is_contiguous():
                fail(f"{name} must be swizzled (SWIZZLE_32_4_4): {want} contiguous elements")
        return
    if a.dtype != E4M3 or b.dtype != E4M3:
        fail("1x128 / 128x128 block scaling needs E4M3 operands")
    if use_fast_accum:
        fail("1x128 / 128x128 block scaling does not support fast accumulation")
    # cuBLAS answered CUBLAS_STATUS_NOT_SUPPORTED for a 1x128 x 128x128 GEMM with M=91, N=304 on an H200 (CUDA 13.0)
    # and ran the aligned shapes: fp8_block_mm pads M to a multiple of 16 and a 128x128-scaled b to whole tiles
    if m % 16:
        fail("M must be a multiple of 16 (fp8_block_mm pads it)")
    if kind_b == "128x128" and n % BLOCKWISE_TILE:
        fail(f"N of a 128x128-scaled b must be a multiple of {BLOCKWISE_TILE} (fp8_block_mm pads it)")
    # the same for a 128x128-scaled a (torch's meta function of _scaled_mm_v2 wants M // 128 scale columns)
    if kind_a == "128x128" and m % BLOCKWISE_TILE:
        fail(f"M of a 128x128-scaled a must be a multiple of {BLOCKWISE_TILE} (fp8_block_mm pads it)")
    k_blocks = -(-k // BLOCKWISE_TILE)
    for name, scale, kind, outer in (("scale_a", scale_a, kind_a, m), ("scale_b", scale_b, kind_b, n)):
        if scale.dtype != torch.float32:
            fail(f"{name} must be float32")
        if kind == "1x128":
            shape, strides = (outer, k_blocks), (1, outer)
        else:
            padded = _round_up(k_blocks, 4)
            shape, strides = (padded, -(-outer // BLOCKWISE_TILE)), (1, padded)
        if tuple(scale.shape) != shape:
            fail(f"{name} must have shape {shape}")
        # strides exactly, a single K-block included: torch's kernel refused (1, 1) for a (304, 1) scale on an H200
        if scale.stride() != strides:
            fail(f"{name} must have strides {strides}")


def dequantize_blocks(data: Tensor, inv_scale: Tensor, block: tuple[int, int]) -> Tensor:
    """``float32(data) * inv_scale`` per block: the high-precision value of a block-scaled FP8 matrix."""
    rows, cols = data.shape
    values = blocked(data.to(torch.float32), block) * inv_scale[:, None, :, None]
    values = values.reshape(values.shape[0] * values.shape[1], values.shape[2] * values.shape[3])
    return values[:rows, :cols]


def fp8_block_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    block_a: tuple[int, int],
    block_b: tuple[int, int],
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
    own_output: bool = False,
) -> Tensor:
    """Block-scaled ``(a / scale_a) @ (b / scale_b)`` (see the module docstring), in ``out_dtype``; ``own_output`` as
    for :func:`fp8_mm`.

    ``a`` (M, K) row-major with quantization scales ``(ceil(M / bm), ceil(K / bk))`` for ``block_a = (bm, bk)``;
    ``b`` (K, N) column-major with scales ``(ceil(K / bk), ceil(N / bn))`` for ``block_b = (bk, bn)``. K is
    zero-padded to whole blocks, N to a multiple of 16 (of 128 for a 128x128-scaled ``b``) and, for the 1x128 /
    128x128 scalings, M to a multiple of 16 (of 128 for a 128x128-scaled ``a``); the result is sliced back.

    ``use_fast_accum`` is accepted for symmetry with :func:`fp8_mm` and not passed on: CUDA's 1x128 / 128x128
    kernels refuse fast accumulation, and the MX kernel is run without it; block-scaled GEMMs always accumulate in
    full float32, as their emulation does.
    """
    del use_fast_accum  # see the docstring
    kind_a, kind_b = _scaling_kind(block_a, "a"), _scaling_kind(block_b, "b")
    tile_k = block_a[1]
    if block_b[0] != tile_k:
        raise ScaledMMContractError(f"the operands' blocks {block_a} and {block_b} do not share a K-block size")
    (m, _), (k, n) = a.shape, b.shape
    deepseek = kind_a != "1x32"
    # DeepSeek-style pairs: M to a multiple of 16, and the outer dimension of a 128x128-scaled operand to whole tiles
    # (see the contract)
    pad_m = -m % (BLOCKWISE_TILE if kind_a == "128x128" else 16) if deepseek else 0
    pad_k, pad_n = -k % tile_k, -n % (BLOCKWISE_TILE if kind_b == "128x128" else 16)
    if pad_k or pad_m:
        a = _pad_fp8(a, pad_m, pad_k)
        if block_a[0] == 1 and pad_m:
            scale_a = F.pad(scale_a, (0, 0, 0, pad_m), value=1.0)
    if pad_k or pad_n:
        b = _pad_fp8(b.t(), pad_n, pad_k).t()
        if block_b[1] == 1 and pad_n:
            scale_b = F.pad(scale_b, (0, pad_n), value=1.0)
    inv_a, inv_b = stored(scale_a.reciprocal()), stored(scale_b.reciprocal())  # once per scale, not per element
    k_blocks = a.shape[1] // tile_k
    native_a = _native_block_scale(inv_a, kind_a, "a", k_blocks)
    native_b = _native_block_scale(inv_b, kind_b, "b", k_blocks)
    fast = False  # the flag the kernel gets (see the docstring); the contract check refuses True for 1x128 / 128x128
    check_block_scaled_mm_contract(a, b, native_a, kind_a, native_b, kind_b, out_dtype, fast)
    recipe = "mxfp8" if kind_a == "1x32" else "blockwise"
    if gemm_path(a.device, recipe) == "native":
        assert _block_scaled_mm_op is not None
        out = _block_scaled_mm_op(a, b, native_a, kind_a, native_b, kind_b, out_dtype)
    else:
        with torch.autocast(a.device.type, enabled=False):
            out = rounded_to(dequantize_blocks(a, inv_a, block_a) @ dequantize_blocks(b, inv_b, block_b), out_dtype)
    if out.shape == (m, n):
        return out
    return out[:m, :n].clone() if own_output else out[:m, :n]


def _block_scaled_mm(
    a: Tensor, b: Tensor, scale_a: Tensor, kind_a: str, scale_b: Tensor, kind_b: str, out_dtype: torch.dtype
) -> Tensor:
    """The native block-scaled GEMM: ``F.scaled_mm`` on kernel-layout decoding scales, without fast accumulation."""
    assert _PUBLIC_SCALED_MM is not None and _ScalingType is not None and _SwizzleType is not None
    types = {"1x128": _ScalingType.BlockWise1x128, "128x128": _ScalingType.BlockWise128x128, "1x32": _ScalingType.BlockWise1x32}
    swizzle = _SwizzleType.SWIZZLE_32_4_4 if kind_a == "1x32" else None  # DeepSeek-style scales: not swizzled
    return _PUBLIC_SCALED_MM(
        a, b, scale_a, types[kind_a], scale_b, types[kind_b], swizzle_a=swizzle, swizzle_b=swizzle,
        output_dtype=out_dtype, use_fast_accum=False,
    )


#: :func:`_block_scaled_mm` as a custom operator: ``torch.compile`` keeps it in the graph as one opaque node (dynamo
#: of torch 2.11 cannot trace ``F.scaled_mm``'s ``torch._scaled_mm_v2``: a graph break per GEMM), on every version
#: that has the public API; ``None`` where torch has none (the block recipes then run emulated).
_block_scaled_mm_op = None
if _PUBLIC_SCALED_MM is not None:
    _block_scaled_mm_op = torch.library.custom_op("lightning_fp8::block_scaled_mm", mutates_args=())(_block_scaled_mm)

    @_block_scaled_mm_op.register_fake
    def _(a, b, scale_a, kind_a, scale_b, kind_b, out_dtype):
        return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)
