"""Quantization: a high-precision tensor and a :class:`~lightning_fp8.recipe.CastSpec` -> FP8 data, scale, statistics.

``fp8 = saturate(x * scale)``, where ``saturate`` clamps finite values to ``±fp8_max`` and maps
non-finite values to NaN (E4M3 has no infinity; keeping E5M2 the same makes the two formats agree).
Finite inputs give bit-for-bit the result of the torch reference cast
``(x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)``.

The scale of a cast (see :mod:`lightning_fp8.recipe` for the formulas)::

    granularity "tensor":  amax = max |x|                    scale: ()
    granularity "row":     amax = max |x| along spec.axis     scale: (M, 1) for axis -1, (1, N) for axis 0
    scale_source "current": scale = amax_to_scale(amax)
    scale_source "history": scale = the history's scale once the history holds an amax, else as "current"

Statistics of one cast (:class:`CastStats`), all computed on the device:

* ``amax``: max ``|x|`` over the whole tensor (NaN if ``x`` holds a NaN);
* ``overflow``: elements with ``not |x * scale| <= fp8_max`` (saturated, or NaN/Inf);
* ``underflow``: non-zero elements whose FP8 value is zero (flushed);
* ``nonzero`` and ``numel``: the denominators.

:func:`cast_with_statistics` is the one dispatch point between the torch reference (a handful of
elementwise ops and reductions that ``torch.compile`` fuses into one or two kernels) and the fused
Triton kernel of ``lightning_fp8.triton_cast`` (CUDA, eager), which gives the same bits and counts.
This module knows nothing about modules or state.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lightning_fp8.recipe import FP8_MAX, CastSpec, amax_to_scale
from lightning_fp8.triton_cast import triton_cast_with_statistics, use_triton


class CastStats(NamedTuple):
    """What one cast contributes to its tensor's statistics (device tensors, no host sync)."""

    amax: Tensor  #: float32, 0-d: max |x| over the tensor
    scale: Tensor  #: float32, 0-d: the scale used (the smallest slice scale for "row" granularity)
    numel: int  #: elements cast
    counts: Tensor  #: int64, (3,): nonzero, overflow, underflow


class Quantized(NamedTuple):
    """An FP8 tensor: ``data ≈ x * scale``."""

    data: Tensor  #: FP8, the shape of ``x``
    scale: Tensor  #: float32: ``()`` for "tensor" granularity, ``(M, 1)`` or ``(1, N)`` for "row"
    stats: CastStats | None  #: ``None`` when statistics were not asked for


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
    return torch.stack(
        [torch.count_nonzero(nonzero), torch.count_nonzero(overflow), torch.count_nonzero(nonzero & flushed)]
    )


def cast_with_statistics(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(saturated_cast(x * scale), [nonzero, overflow, underflow])``: the one dispatch point for casts.

    ``scale`` is a float32 tensor broadcastable to ``x`` (0-d, or per row/column). On CUDA, outside
    ``torch.compile``, this runs the fused Triton kernel of ``lightning_fp8.triton_cast`` (same bits).
    """
    if use_triton(x):
        return triton_cast_with_statistics(x, scale, fp8_dtype)
    x_scaled = x.to(torch.float32) * scale
    data = saturated_cast(x_scaled, fp8_dtype)
    return data, cast_statistics(x, x_scaled, data)


def current_amax(x: Tensor, spec: CastSpec) -> Tensor:
    """``max |x|`` in float32: one value (``()``) or one per slice along ``spec.axis`` (kept as a dim)."""
    if spec.granularity == "tensor":
        return x.abs().amax().to(torch.float32)
    return x.abs().amax(dim=spec.axis, keepdim=True).to(torch.float32)


def quantize(
    x: Tensor,
    spec: CastSpec,
    *,
    statistics: bool = True,
    history_scale: Tensor | None = None,
    history_ready: Tensor | None = None,
    scale: Tensor | None = None,
) -> Quantized:
    """Quantize ``x`` as ``spec`` says, with the cast's statistics unless ``statistics=False``.

    Args:
        x: the high-precision tensor (2-D for "row" granularity).
        spec: the cast spec.
        statistics: compute the :class:`CastStats` (skipped in evaluation, where they would be thrown away).
        history_scale: for ``scale_source="history"``: the scale derived from the amax history.
        history_ready: a bool device scalar: whether ``history_scale`` is usable (the history holds an amax);
            otherwise the current amax gives the scale.
        scale: use exactly this scale (an activation-checkpointing recomputation reuses the forward's).
    """
    x = x.detach()
    amax = current_amax(x, spec)
    if scale is None:
        scale = amax_to_scale(amax, spec.fp8_max, spec.margin, spec.power_of_2)
        if spec.scale_source == "history":
            if history_scale is None or history_ready is None:
                raise ValueError("a history-scaled cast needs history_scale and history_ready")
            scale = torch.where(history_ready, history_scale, scale)
    if not statistics:
        return Quantized(saturated_cast(x.to(torch.float32) * scale, spec.dtype), scale, None)
    data, counts = cast_with_statistics(x, scale, spec.dtype)
    if spec.granularity == "tensor":
        stats = CastStats(amax, scale, x.numel(), counts)
    else:
        stats = CastStats(amax.amax(), scale.amin(), x.numel(), counts)
    return Quantized(data, scale, stats)
