"""Quantization: high-precision tensor -> FP8 data + scale, with the statistics the state records.

``fp8 = saturate(x * scale)``, where ``saturate`` clamps finite values to ``±fp8_max`` and maps
non-finite values to NaN (E4M3 has no infinity; keeping E5M2 the same makes the two formats agree).
Finite inputs give bit-for-bit the result of the torch reference cast
``(x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)``.

Statistics of one cast, all computed on the device:

* ``overflow``: elements with ``not |x * scale| <= fp8_max`` (saturated, or NaN/Inf);
* ``underflow``: non-zero elements whose FP8 value is zero (flushed);
* ``nonzero`` and ``seen``: the denominators.

The functions are written as a handful of elementwise ops and reductions so that
``torch.compile`` fuses them into one or two kernels; in eager mode they are the torch reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fp8.recipe import FP8_MAX, FP8Recipe, amax_to_scale
from lightning_fp8.scaling import FP8State, record_cast
from lightning_fp8.triton_cast import triton_cast_with_statistics, use_triton


def saturated_cast(x_scaled: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """Cast an already-scaled float32 tensor to ``fp8_dtype``: finite values saturate, NaN/Inf -> NaN."""
    fp8_max = FP8_MAX[fp8_dtype]
    # nan_to_num maps ±Inf to NaN (one pass; NaN survives the clamp), cheaper than isfinite + where.
    nan = float("nan")
    return torch.nan_to_num(x_scaled, nan=nan, posinf=nan, neginf=nan).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def cast_statistics(x: Tensor, x_scaled: Tensor, data: Tensor) -> Tensor:
    """``[nonzero, overflow, underflow]`` element counts (int64, on the device) of one cast."""
    fp8_max = FP8_MAX[data.dtype]
    nonzero = x != 0
    overflow = ~(x_scaled.abs() <= fp8_max)
    # An FP8 value is zero iff all bits but the sign are zero, in both E4M3 and E5M2.
    flushed = (data.view(torch.uint8) & 0x7F) == 0
    # count_nonzero is several times faster than a boolean sum on CPU.
    return torch.stack([torch.count_nonzero(nonzero), torch.count_nonzero(overflow), torch.count_nonzero(nonzero & flushed)])


def cast_with_statistics(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(saturated_cast(x * scale), [nonzero, overflow, underflow])``: the one dispatch point for casts.

    ``scale`` is a float32 tensor broadcastable to ``x`` (0-d, or per row/column). On CUDA, outside
    ``torch.compile``, this runs the fused Triton kernel of :mod:`lightning_fp8.triton_cast` (same bits).
    """
    if use_triton(x):
        return triton_cast_with_statistics(x, scale, fp8_dtype)
    x_scaled = x.to(torch.float32) * scale
    data = saturated_cast(x_scaled, fp8_dtype)
    return data, cast_statistics(x, x_scaled, data)


def quantize_tensorwise(
    x: Tensor,
    state: FP8State,
    recipe: FP8Recipe,
    role: int,
    update: bool,
    roll: bool,
) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` with one scale (``tensorwise`` or ``delayed`` recipe).

    Returns ``(fp8_data, scale)`` with ``scale`` a float32 0-d tensor (``fp8 = x * scale``). With
    ``update=True`` the cast is recorded in ``state``.
    """
    fp8_dtype = recipe.dtype(role)
    x = x.detach()
    amax = x.abs().amax().to(torch.float32)
    margin = recipe.margin if recipe.name == "delayed" else 0
    scale = amax_to_scale(amax, FP8_MAX[fp8_dtype], margin, recipe.round_to_power_of_2)
    if recipe.name == "delayed":
        scale = torch.where(state.initialized[role], state.scale[role], scale)
    if not update:  # evaluation: the statistics would be thrown away
        return saturated_cast(x.to(torch.float32) * scale, fp8_dtype), scale
    data, counts = cast_with_statistics(x, scale, fp8_dtype)
    record_cast(state, recipe, role, amax, scale, x.numel(), counts, roll)
    return data, scale


def quantize_rowwise(
    x: Tensor,
    dim: int,
    fp8_dtype: torch.dtype,
    state: FP8State | None = None,
    recipe: FP8Recipe | None = None,
    role: int = 0,
    roll: bool = True,
) -> tuple[Tensor, Tensor]:
    """Quantize a 2-D ``x`` with one power-of-two scale per slice along ``dim`` (torchao ``rowwise``).

    ``dim=-1`` gives one scale per row (shape ``(M, 1)``), ``dim=0`` one per column (``(1, N)``).
    With ``state`` (and ``recipe``) given the cast is recorded there: the tensor amax (max of the slice
    amaxes) and the smallest slice scale.
    """
    x = x.detach()
    amax = x.abs().amax(dim=dim, keepdim=True).to(torch.float32)
    scale = amax_to_scale(amax, FP8_MAX[fp8_dtype], 0, True)
    if state is None or recipe is None:
        return saturated_cast(x.to(torch.float32) * scale, fp8_dtype), scale
    data, counts = cast_with_statistics(x, scale, fp8_dtype)
    record_cast(state, recipe, role, amax.amax(), scale.amin(), x.numel(), counts, roll)
    return data, scale
