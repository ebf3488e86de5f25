"""Quantization: a high-precision tensor and a :class:`~lightning_fp8.recipe.CastSpec` -> FP8 data, scale, statistics.

``fp8 = saturate(x * scale)``, where ``saturate`` clamps finite values to ``±fp8_max`` and maps
non-finite values to NaN (E4M3 has no infinity; keeping E5M2 the same makes the two formats agree).
Finite inputs give bit-for-bit the result of the torch reference cast
``(x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)``.

The scale of a cast (see :mod:`lightning_fp8.recipe` for the formulas)::

    granularity "tensor":  amax = max |x|                    scale: ()
    granularity "row":     amax = max |x| along spec.axis     scale: (M, 1) for axis -1, (1, N) for axis 0
    granularity "block":   amax = max |x| over each block     scale: (ceil(M / bm), ceil(N / bn)) for block (bm, bn)
                           (a partial block at the edge: over the elements it has)
    scale_source "current": scale = amax_to_scale(amax)
    scale_source "history": scale = the history's scale once the history holds an amax, else as "current"

Statistics of one cast (:class:`CastStats`), all computed on the device:

* ``amax``: max ``|x|`` over the whole tensor (NaN if ``x`` holds a NaN);
* ``overflow``: elements with ``not |x * scale| <= fp8_max`` (saturated, or NaN/Inf);
* ``underflow``: non-zero elements whose FP8 value is zero (flushed);
* ``nonzero`` and ``numel``: the denominators;
* ``amax_bins`` (``"row"`` and ``"block"`` granularity): a histogram of the slice (block) amaxes over powers of
  two (:func:`amax_bins`), so the statistics can show how the blocks' ranges spread without one number per
  block.

``quantize(counters=False)`` keeps the amax and the scale (what the scaling and the amax history need) and skips the
counts, ``numel`` included, and the histogram: a step that does not count leaves the counters as they were.

:func:`cast_with_statistics` is the one dispatch point between the torch reference (a handful of
elementwise ops and reductions that ``torch.compile`` fuses into one or two kernels) and the fused
Triton kernel of ``lightning_fp8.triton_cast`` (CUDA, eager), which gives the same bits and counts. On CUDA eager,
:func:`quantize` also hands a whole ``"block"`` cast from ``x``'s own amaxes to ``triton_block_cast`` and a
``"tensor"``, ``scale_source="history"`` cast to ``triton_history_cast``, which computes the amax in the same pass as
the cast (one read of ``x`` once the history is ready, no host sync).
This module knows nothing about modules or state.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from lightning_fp8.recipe import GRAD_OUTPUT, CastSpec, amax_to_scale, fp8_max, inductor_cpp_backend, stored
from lightning_fp8.triton_cast import (
    history_cast_supported,
    triton_block_cast,
    triton_cast_with_statistics,
    triton_history_cast,
    use_triton,
)


#: Bins of the slice-amax histogram: ``[zero, 2**AMAX_BIN_LOW .. 2**(AMAX_BIN_HIGH + 1)), ..., non-finite]``.
AMAX_BIN_LOW, AMAX_BIN_HIGH = -64, 63
N_AMAX_BINS = AMAX_BIN_HIGH - AMAX_BIN_LOW + 3


class CastStats(NamedTuple):
    """What one cast contributes to its tensor's statistics (device tensors, no host sync)."""

    amax: Tensor  #: float32, 0-d: max |x| over the tensor
    scale: Tensor  #: float32, 0-d: the scale used (the smallest slice or block scale for "row" / "block")
    numel: int  #: elements cast
    #: int64, (3,): nonzero, overflow, underflow; ``None`` when the cast did not count (``quantize(counters=False)``)
    counts: Tensor | None
    amax_bins: Tensor | None = None  #: int64, (N_AMAX_BINS,): histogram of the slice amaxes ("row", "block")


def amax_bins(amax: Tensor) -> Tensor:
    """Histogram (int64, ``(N_AMAX_BINS,)``, on the device, no sync) of a tensor of slice or block amaxes.

    Bin 0 counts zero amaxes, bin ``1 + e - AMAX_BIN_LOW`` those with ``floor(log2(amax)) == e`` (``e`` clamped to
    ``[AMAX_BIN_LOW, AMAX_BIN_HIGH]``), the last bin non-finite ones.

    ``floor(log2(amax))`` is read from the float32 bits: ``biased exponent - 127`` for a normal number (a subnormal's
    is below -126, clamped to ``AMAX_BIN_LOW`` like the normal numbers there); biased exponent 255 is infinity or NaN.
    Eager, a 256-entry table maps the biased exponent to its bin, so one cast's histogram is six kernels (shift,
    table lookup, zero test, select, zeros, ``index_add_``): it runs at every row-wise or block cast with statistics,
    and eager on a GPU each small kernel costs a launch (the formula with ``frexp`` and ``isfinite`` was about
    twenty). Compiled (and for a tensor subclass or a tracer's ``FakeTensor``), the same bins come from the exponent
    arithmetic, which inductor fuses into one kernel.

    The compiled count is done in int32 and widened to int64 after: inductor cannot add int64 atomically, so an int64
    ``index_add_`` compiled to an accumulating ``aten.index_put_``, which CUDA runs by sorting the indices and walking
    each bin's duplicates one by one (almost every slice lands in a few bins: on an H200, 8.9 ms of a compiled
    ``rowwise`` Llama3-8B-shaped block's 29 ms). In int32 inductor emits one atomic-add kernel. One cast has fewer than
    2**31 slices or blocks, so int32 cannot overflow here; the tables accumulate the int64 result. Compiled under
    ``torch.use_deterministic_algorithms(True)`` (``Trainer(deterministic=True)``) inductor refuses atomics and would
    fall back to that sorting scatter whatever the dtype, so there each bin is counted by comparison instead (a
    reduction inductor fuses, no atomics; dynamo guards on the flag). Eager deterministic runs keep ``index_add_``,
    which torch then runs deterministically.
    """
    amax = amax.reshape(-1).to(torch.float32)
    biased = amax.view(torch.int32) >> 23  # sign and exponent: a negative value (never an amax) wraps below
    if type(amax) is torch.Tensor and not torch.compiler.is_compiling():  # eager on a plain tensor: the table
        index = torch.where(amax == 0, 0, _exponent_bins(amax.device)[biased])  # -256..-1 index the same entries
        bins = torch.zeros(N_AMAX_BINS, dtype=torch.int64, device=amax.device)
        return bins.index_add_(0, index, _one(amax.device).expand(index.shape))
    # compiled, or a tensor subclass or a tracer's tensor (a FakeTensor), which a cached real table must not meet
    index = torch.where(amax == 0, 0, _exponent_bin(biased & 0xFF))
    if torch.compiler.is_compiling() and torch.are_deterministic_algorithms_enabled():
        every_bin = torch.arange(N_AMAX_BINS, device=amax.device, dtype=index.dtype)
        return (index.unsqueeze(-1) == every_bin).sum(0, dtype=torch.int64)
    bins = torch.zeros(N_AMAX_BINS, dtype=torch.int32, device=amax.device)
    bins.index_add_(0, index.to(torch.int64), torch.ones_like(index, dtype=torch.int32))
    return bins.to(torch.int64)


_CONSTANTS: dict[tuple[str, torch.device], Tensor] = {}


def _device_constant(name: str, device: torch.device, make: Callable[[torch.device], Tensor]) -> Tensor:
    """``make(device)``, made once per device and name. A tensor made under a tracing mode (a ``FakeTensor``) is used
    but not kept, so a later real call never sees it."""
    key = (name, device)
    value = _CONSTANTS.get(key)
    if value is None:
        value = make(device)
        if type(value) is torch.Tensor:
            _CONSTANTS[key] = value
    return value


def _exponent_bin(biased: Tensor) -> Tensor:
    """The :func:`amax_bins` bin of a non-zero float32 whose biased exponent is ``biased`` (0 to 255): ``biased - 127``
    (``floor(log2)``) clamped to ``[AMAX_BIN_LOW, AMAX_BIN_HIGH]``, and the last bin for 255 (infinity, NaN)."""
    # one subtraction and a clamp: few graph nodes compiled (see the counts record in FP8StateTable._record_at)
    index = (biased - (127 + AMAX_BIN_LOW - 1)).clamp(1, N_AMAX_BINS - 2)
    return torch.where(biased == 255, N_AMAX_BINS - 1, index)


def _exponent_bins(device: torch.device) -> Tensor:
    """The eager lookup table of :func:`amax_bins`: :func:`_exponent_bin` of every biased exponent, int64, on
    ``device``."""
    return _device_constant("exponent bins", device, lambda device: _exponent_bin(torch.arange(256, device=device)))


def _one(device: torch.device) -> Tensor:
    """An int64 one on ``device``, expanded to the size of each eager histogram's index."""
    return _device_constant("one", device, lambda device: torch.ones(1, dtype=torch.int64, device=device))


class Quantized(NamedTuple):
    """An FP8 tensor: ``data ≈ x * scale``."""

    data: Tensor  #: FP8, the shape of ``x``
    scale: Tensor  #: float32: ``()`` for "tensor", ``(M, 1)`` or ``(1, N)`` for "row", one per block for "block"
    stats: CastStats | None  #: ``None`` when statistics were not asked for
    block: tuple[int, int] | None = None  #: the block shape of "block" granularity (``None`` otherwise)

    def t(self) -> Quantized:
        """The transposed tensor (data, scales and block shape), as a view: a GEMM operand seen from the other side."""
        block = None if self.block is None else (self.block[1], self.block[0])
        return Quantized(self.data.t(), self.scale.t() if self.scale.dim() == 2 else self.scale, self.stats, block)


def saturated_cast(x_scaled: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """Cast an already-scaled float32 tensor to ``fp8_dtype``: finite values saturate, NaN/Inf -> NaN."""
    max_value = fp8_max(fp8_dtype)
    if torch.compiler.is_compiling():
        # the same bits in a form inductor vectorises on CPU (its nan_to_num tests each element for NaN in a scalar
        # loop): every non-finite value becomes the positive NaN that nan_to_num writes (chosen after the clamp, whose
        # vectorised form may flip a NaN's sign bit). The NaN is computed (inf - inf, NaN - NaN; abs clears the sign),
        # not a literal: graph nodes holding a NaN constant never compare equal (nan != nan), so AOTAutograd's
        # common-subexpression elimination could not merge the identical casts of one input by sibling layers
        # (q/k/v, gate/up), and the partitioner then saved each sibling's FP8 copy for backward.
        clamped = x_scaled.clamp(-max_value, max_value)
        return torch.where(x_scaled.abs() < float("inf"), clamped, (x_scaled - x_scaled).abs()).to(fp8_dtype)
    # nan_to_num maps ±Inf to NaN (one pass; NaN survives the clamp), cheaper than isfinite + where.
    nan = float("nan")
    return torch.nan_to_num(x_scaled, nan=nan, posinf=nan, neginf=nan).clamp(-max_value, max_value).to(fp8_dtype)


#: The smallest magnitude byte (bits 0-6) of an FP8 NaN: E4M3 has one NaN pattern, E5M2 several (``0x7C`` is its
#: infinity, which :func:`saturated_cast` never produces).
_NAN_MAGNITUDE = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7D}

#: The largest float32 magnitude each format rounds to zero: half its smallest subnormal (2**-9 for E4M3, 2**-16 for
#: E5M2), which round-to-nearest-even sends to 0 (the even neighbour); anything larger rounds to a non-zero value.
_ZERO_BOUND = {torch.float8_e4m3fn: 2.0**-10, torch.float8_e5m2: 2.0**-17}


@torch.compiler.assume_constant_result
def _zero_bound(fp8_dtype: torch.dtype) -> float:
    """``_ZERO_BOUND[fp8_dtype]`` as a constant under ``torch.compile`` (see :func:`~lightning_fp8.recipe.fp8_max`)."""
    return _ZERO_BOUND[fp8_dtype]


def cast_statistics(x: Tensor, x_scaled: Tensor, data: Tensor, overflow_free: bool = False) -> Tensor:
    """``[nonzero, overflow, underflow]`` element counts (int64, on the device) of one cast.

    ``overflow``: elements with ``not |x * scale| <= fp8_max``; ``underflow``: non-zero elements whose FP8 value is
    zero (an FP8 value is zero iff all its bits but the sign are zero, in both formats). With ``overflow_free=True``
    (the scale came from this tensor's own amax, per tensor, row or block, so no finite element can exceed
    ``fp8_max``: see :func:`lightning_fp8.recipe.amax_to_scale`) the overflows are the elements the cast turned
    into NaN, read from the FP8 bits instead of from the float32 ``x_scaled``: the same count, with fewer passes
    over float32 data.

    Eager, the counts come from ``_cast_statistics_eager`` (about a third cheaper on a CPU than boolean
    masks); under ``torch.compile`` from the float values (``_cast_statistics_from_values``), which inductor
    fuses into the cast's loop, except for the casts through :func:`cast_with_statistics` that are ``overflow_free``
    or take a history scale (``delayed``'s grad_output casts), which count from the stored FP8 data
    (``_cast_statistics_from_stored``). All equal the definitions above exactly.
    """
    if torch.compiler.is_compiling():
        return _cast_statistics_from_values(x, x_scaled, data.dtype)
    return _cast_statistics_eager(x, x_scaled, data, overflow_free)


def _cast_statistics_eager(x: Tensor, x_scaled: Tensor, data: Tensor, overflow_free: bool) -> Tensor:
    """:func:`cast_statistics` in eager mode, with few passes and few temporaries (on a CPU, comparisons that produce
    boolean tensors, and fresh temporaries, cost more than the arithmetic):

    * ``nonzero = count_nonzero(x)``;
    * ``underflow = nonzero - count_nonzero(x * magnitude)``, ``magnitude`` the FP8 bits but the sign as an
      integer: the product is non-zero exactly where both are (``magnitude >= 1``, so it cannot underflow; a NaN or
      infinite ``x`` gives a non-zero product). Exact whatever the scales: a zero ``x`` that a NaN scale turned into
      NaN counts in neither term;
    * ``overflow`` (``overflow_free``): the FP8 NaNs, ``magnitude >= _NAN_MAGNITUDE``, counted as the carry into
      bit 7 of ``magnitude + (0x80 - _NAN_MAGNITUDE)`` (at most ``0x82``: no wrap-around in uint8);
    * ``overflow`` (otherwise): ``not |x_scaled| <= fp8_max`` is ``max(|x_scaled| - fp8_max, 0) != 0`` (the
      difference of floats above ``fp8_max`` is exact and positive; NaN stays NaN, which is non-zero).
    """
    magnitude = data.view(torch.uint8) & 0x7F
    if overflow_free:
        overflow = torch.count_nonzero((magnitude + (0x80 - _NAN_MAGNITUDE[data.dtype])).bitwise_and_(0x80))
    else:
        overflow = torch.count_nonzero(x_scaled.abs().sub_(fp8_max(data.dtype)).clamp_(min=0))
    nonzero = torch.count_nonzero(x)
    return torch.stack([nonzero, overflow, nonzero - torch.count_nonzero(x * magnitude)])


def _cast_statistics_from_values(
    x: Tensor, x_scaled: Tensor, fp8_dtype: torch.dtype, inside: Tensor | None = None
) -> Tensor:
    """:func:`cast_statistics` from the float32 ``x_scaled`` alone (the same counts), for ``torch.compile``: the cast,
    the amax and the counts fuse into one loop that reads ``x`` once, and inductor vectorises comparisons of float
    values but reads FP8 bytes one element at a time. Underflow: ``x != 0`` and ``|x * scale| <=`` half the format's
    smallest subnormal (:data:`_ZERO_BOUND`), the values that round to ±0. Counted in int32 (half the vector width of
    int64) below 2**31 elements. ``inside`` (broadcast to ``x``): the elements that count as overflows, where ``x``
    holds zero padding (see :func:`_cast_blocks_compiled`)."""
    magnitude = x_scaled.abs()
    nonzero = x != 0
    overflow = ~(magnitude <= fp8_max(fp8_dtype))
    if inside is not None:
        overflow = overflow & inside
    count = torch.int32 if x.numel() < 2**31 else torch.int64
    return torch.stack(
        [
            nonzero.sum(dtype=count),
            overflow.sum(dtype=count),
            (nonzero & (magnitude <= _zero_bound(fp8_dtype))).sum(dtype=count),
        ]
    ).to(torch.int64)


def cast_with_statistics(
    x: Tensor,
    scale: Tensor,
    fp8_dtype: torch.dtype,
    overflow_free: bool = False,
    history: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """``(saturated_cast(x * scale), [nonzero, overflow, underflow])``: the one dispatch point for casts.

    ``scale`` is a float32 tensor broadcastable to ``x`` (0-d, or per row/column). On CUDA, outside
    ``torch.compile``, this runs the fused Triton kernel of ``lightning_fp8.triton_cast`` (same bits).
    ``overflow_free``: the scale came from ``x``'s own amax (see :func:`cast_statistics`). ``history``: ``(history
    scale, usable flag)`` where ``scale`` is ``where(usable, history scale, x's own amax's scale)`` (``delayed``);
    under ``torch.compile`` both let the counts come from the stored FP8 data (``_cast_statistics_from_stored``).
    """
    if use_triton(x):
        return triton_cast_with_statistics(x, scale, fp8_dtype)
    x_scaled = x.to(torch.float32) * scale
    data = saturated_cast(x_scaled, fp8_dtype)
    if (overflow_free or history is not None) and torch.compiler.is_compiling():
        return data, _cast_statistics_from_stored(x, data, scale, history)
    return data, cast_statistics(x, x_scaled, data, overflow_free)


def _cast_statistics_from_stored(
    x: Tensor, data: Tensor, scale: Tensor, history: tuple[Tensor, Tensor] | None = None
) -> Tensor:
    """:func:`cast_statistics` under ``torch.compile`` from the stored FP8 data, for a cast whose scales came from
    ``x``'s own amaxes (``overflow_free``: one scale, or one per row or column) or, with ``history`` (``(history
    scale, usable)``, ``delayed``), from the history where it is usable and from ``x``'s own amax where not: the
    counts need no float32 copy of the scaled values.

    Compiled, the cast of a GEMM operand is a kernel of its own (often a 2-D tiled one that also writes the transposed
    copy the other GEMM reads), which cannot hold a reduction; counted from the scaled values, the counts got kernels
    of their own that recomputed the cast (and the chain before it: the SwiGLU backward for gate/up) or read float32
    and boolean buffers the cast kernel wrote for them. Here they read the FP8 buffer, one byte per element
    (``as_strided``: inductor reads a stored input there instead of recomputing the cast), and count over ``x`` only
    what needs no scale known after the amax: ``x != 0`` per scale slice, and a history scale's overflows (known
    before the pass), reductions of the pass that computes the amaxes, which they join:

    * ``overflow``: with an overflow-free scale, the elements cast to NaN (such a scale saturates no finite element);
      with a usable history, the elements with ``not |x * history scale| <= fp8_max``;
    * ``underflow``: in the slices with a finite scale, the zero elements of the FP8 data less the zeros of ``x``
      (there a zero ``x`` casts to zero, and a non-zero ``x`` casts to zero exactly when it underflows); a slice with
      a non-finite scale has no zero (``0 * inf`` and every product with NaN are NaN) and no underflow. The same counts
      as the definitions (``tests/test_cast_statistics_definitions.py``).

    The FP8 data is tested as float32 values, ``value != value`` (NaN) and ``value == 0``: the same elements as its
    bits (every FP8 value is exactly a float32, and :func:`saturated_cast` writes no infinity), but never
    reinterpreted as bytes (``view(torch.uint8)``), for two reasons found by measuring. On a GPU: with torch 2.11
    (Triton 3.6) and CUDA 13.0's ``ptxas`` on an H200, ``ptxas`` crashed (SIGSEGV) compiling the Triton kernel of a
    cast that stored its FP8 data and tested the same values as bytes, so checkpointed ``tensorwise`` blocks (and,
    presumably for the same reason, ``rowwise`` Llama blocks) did not compile; that kernel with the float32 test
    compiled (offline, with the same Triton and ``ptxas``: ``benchmarks/results/ptxas_sigsegv_kernel.py``). On a CPU: inductor's C++ backend converts FP8 to float32 with the conversion the emulated GEMM
    reads anyway (vector code on AVX-512 CPUs only; elsewhere element by element: ``benchmarks/fp8_conversions.py``)
    but reinterprets FP8 as bytes through a further scalar copy of each vector: counted from the bytes, a compiled
    Llama-style training step on a CPU took about a sixth more time than torchao's, at most about a fourteenth more
    from the values (A/B runs on a shared CPU: CHANGELOG.md).
    """
    count = torch.int32 if x.numel() < 2**31 else torch.int64
    values = data.as_strided(data.shape, data.stride()).to(torch.float32)  # never as bytes: see the docstring
    is_nan, is_zero = values != values, values == 0
    overflow = is_nan.sum(dtype=count)
    if history is not None:
        history_scale, usable = history
        saturated = (~((x.to(torch.float32) * history_scale).abs() <= fp8_max(data.dtype))).sum(dtype=count)
        overflow = torch.where(usable, saturated, overflow).reshape(())
    shape = (1,) * (x.dim() - scale.dim()) + tuple(scale.shape)
    slice_dims = [d for d in range(x.dim()) if shape[d] == 1]  # one scale along these
    slices_nonzero = (x != 0).sum(dim=slice_dims, keepdim=True, dtype=count)
    # finite: ``s - s == 0`` (NaN for an infinite or NaN ``s``), two graph nodes where isfinite decomposes into four,
    # which lengthened the forward chain that AOTAutograd's partitioner measures past its limit (compiled rowwise
    # Llama blocks saved their SwiGLU product again: tests/test_compiled_saved_casts.py). Not ``s * 0 == 0``: inductor
    # folds a product with the integer 0 to zero, NaN or not (``* 0.0`` it keeps).
    s = scale.reshape(shape)
    finite = s - s == 0
    zeros = torch.where(finite, x.numel() // scale.numel() - slices_nonzero, 0)
    nonzero, underflow = slices_nonzero.sum(dtype=count), is_zero.sum(dtype=count) - zeros.sum(dtype=count)
    return torch.stack([nonzero, overflow, underflow]).to(torch.int64)


def blocked(x: Tensor, block: tuple[int, int]) -> Tensor:
    """A 2-D ``x`` (R, C) as ``(ceil(R / bm), bm, ceil(C / bn), bn)`` blocks, zero-padded at the far edges (a view
    when no padding is needed). Zeros add nothing to a block's amax and are never counted as non-zero.

    Under ``torch.compile`` with a symbolic size, whether it is a multiple of the block is a guard: sizes that need
    padding and multiples of the block (which read ``x`` as a view) compile separate graphs.

    Compiled by inductor's C++ backend (a CPU), a padded ``x`` is written once into a buffer of its own
    (``stored``) that its readers (the block amaxes, the cast, the counts, an emulated GEMM's
    dequantization) read with plain vector loads. Inlined, the padding became a masked vector load of ``x`` in every
    loop that read it, repeated for each use in the loop (inductor does not merge them), and a layer with a partial
    block was much slower than one with the next multiple of the block: one compiled ``blockwise`` layer, 256 x 448
    input, 128 outputs, forward and backward, 2.9 ms against 1.8 ms for 256 x 512; stored, 1.95 ms for both. Triton
    (a GPU) masks its loads at no cost, so there the padding stays inlined, one pass fewer."""
    if x.dim() != 2:
        raise ValueError(f"block scaling needs a 2-D tensor, got shape {tuple(x.shape)}")
    (rows, cols), (bm, bn) = x.shape, block
    pad_r, pad_c = -rows % bm, -cols % bn
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
        if inductor_cpp_backend(x.device.type):
            x = stored(x)
    return x.reshape((rows + pad_r) // bm, bm, (cols + pad_c) // bn, bn)


def current_amax(x: Tensor, spec: CastSpec) -> Tensor:
    """``max |x|`` in float32: one value (``()``), one per slice along ``spec.axis`` (kept as a dim), or one per
    block (``(ceil(R / bm), ceil(C / bn))``)."""
    if spec.granularity == "tensor":
        return x.abs().amax().to(torch.float32)
    if spec.granularity == "block":
        assert spec.block is not None
        return blocked(x, spec.block).abs().amax(dim=(1, 3)).to(torch.float32)
    return x.abs().amax(dim=spec.axis, keepdim=True).to(torch.float32)


def _cast_blocks(
    x: Tensor, scale: Tensor, spec: CastSpec, statistics: bool, overflow_free: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Cast ``x`` with one scale per block: ``(FP8 data of x's shape, counts or None)``. The counts are over the
    elements of ``x``, never over the zero padding of a partial block (which a NaN block scale turns into NaN)."""
    assert spec.block is not None
    if use_triton(x):
        data, _, _, counts = triton_block_cast(x, spec.block, spec.dtype, scale=scale, statistics=statistics)
        return data, counts
    xb = blocked(x, spec.block)
    rows, cols = x.shape
    x_scaled = xb.to(torch.float32) * scale[:, None, :, None]
    if torch.compiler.is_compiling():
        return _cast_blocks_compiled(xb, x_scaled, rows, cols, spec.dtype, statistics)
    x_scaled = x_scaled.reshape(xb.shape[0] * xb.shape[1], xb.shape[2] * xb.shape[3])[:rows, :cols]  # no padding
    data = saturated_cast(x_scaled, spec.dtype)
    return data, cast_statistics(x, x_scaled, data, overflow_free) if statistics else None


def _cast_blocks_compiled(
    xb: Tensor, x_scaled: Tensor, rows: int, cols: int, fp8_dtype: torch.dtype, statistics: bool
) -> tuple[Tensor, Tensor | None]:
    """:func:`_cast_blocks` under ``torch.compile``: the cast and its counts computed in the blocked layout
    ``(ceil(R / bm), bm, ceil(C / bn), bn)``, stored, and only then viewed as ``(R, C)`` (copied when a partial block
    was padded). The same bits and counts as eagerly.

    Why: computed over ``(R, C)`` directly, each element reads its block's scale at ``(i // bm, j // bn)``, and
    inductor's C++ loop split (torch 2.13) splits such a loop at the block size and rounds the dimension down to a
    multiple of it: a partial block's last elements were never written, no error (FP8 data, underflow masks;
    ``tests/test_compiled_rounding.py`` reproduces it in plain torch). In the blocked layout every index is a plain
    one; the copy of the padded data reads a stored buffer. The padding is left out of the counts: it is zero, so
    it is neither non-zero nor an underflow, and the overflows are counted inside ``(R, C)`` only (a NaN block scale
    turns the padding into NaN)."""
    data = stored(saturated_cast(x_scaled, fp8_dtype))
    padded_rows, padded_cols = data.shape[0] * data.shape[1], data.shape[2] * data.shape[3]
    data = data.reshape(padded_rows, padded_cols)
    padded = (padded_rows, padded_cols) != (rows, cols)
    if padded:
        data = data[:rows, :cols].contiguous()
    if not statistics:
        return data, None
    inside = None
    if padded:
        bm, bn = xb.shape[1], xb.shape[3]
        row = torch.arange(xb.shape[0], device=xb.device)[:, None] * bm + torch.arange(bm, device=xb.device)
        col = torch.arange(xb.shape[2], device=xb.device)[:, None] * bn + torch.arange(bn, device=xb.device)
        inside = (row < rows)[:, :, None, None] & (col < cols)[None, None]
    return data, _cast_statistics_from_values(xb, x_scaled, fp8_dtype, inside)


def _quantize_blocks_fused(x: Tensor, spec: CastSpec, statistics: bool, counters: bool) -> Quantized:
    """A block cast with scales from ``x``'s own block amaxes, in the fused Triton kernel: one pass over ``x``."""
    assert spec.block is not None
    data, scale, amax, counts = triton_block_cast(
        x, spec.block, spec.dtype, power_of_2=spec.power_of_2, margin=spec.margin, statistics=statistics and counters
    )
    return Quantized(data, scale, _block_stats(x, amax, scale, counts) if statistics else None, spec.block)


def _block_stats(x: Tensor, amax: Tensor, scale: Tensor, counts: Tensor | None) -> CastStats:
    """The :class:`CastStats` of a block or slice cast: the largest amax, the smallest scale and, with the counts
    (``None``: not counted, no histogram either), the histogram of the block amaxes."""
    return CastStats(amax.amax(), scale.amin(), x.numel(), counts, None if counts is None else amax_bins(amax))


def quantize(
    x: Tensor,
    spec: CastSpec,
    *,
    statistics: bool = True,
    counters: bool = True,
    history_scale: Tensor | None = None,
    history_ready: Tensor | None = None,
    scale: Tensor | None = None,
    amax_reduce: Callable[[Tensor], Tensor] | None = None,
) -> Quantized:
    """Quantize ``x`` as ``spec`` says, with the cast's statistics unless ``statistics=False``.

    Args:
        x: the high-precision tensor (2-D for "row" granularity).
        spec: the cast spec.
        statistics: compute the :class:`CastStats` (skipped in evaluation, where they would be thrown away).
        counters: with ``statistics``, also count (``[nonzero, overflow, underflow]``, and the histogram of slice or
            block amaxes); ``False`` keeps the amax and the scale alone (``CastStats.counts is None``): what the
            scaling needs, without the counting passes (``statistics_every_n_steps`` of the precision plugins).
        history_scale: for ``scale_source="history"``: the scale derived from the amax history.
        history_ready: a bool device scalar: whether ``history_scale`` is usable (the history holds an amax);
            otherwise the current amax gives the scale.
        scale: use exactly this scale (an activation-checkpointing recomputation reuses the forward's).
        amax_reduce: combines the amaxes of ``x`` with those of the other pieces of the same tensor (tensor
            parallelism: a MAX all-reduce over the group), so that every piece is cast with the whole tensor's scales.
    """
    x = x.detach()
    if amax_reduce is not None:
        return _quantize_reference(x, spec, statistics, counters, history_scale, history_ready, scale, amax_reduce)
    if spec.granularity == "block" and scale is None and spec.scale_source == "current" and use_triton(x):
        return _quantize_blocks_fused(x, spec, statistics, counters)
    if (
        spec.granularity == "tensor"
        and scale is None
        and spec.scale_source == "history"
        and history_scale is not None
        and history_ready is not None
        and use_triton(x)
        and history_cast_supported(x, history_scale, history_ready)
    ):
        # one pass over x once the history is ready (the amax comes with the cast): see triton_history_cast
        data, scale, amax, counts = triton_history_cast(
            x, history_scale, history_ready, spec.dtype, margin=spec.margin, power_of_2=spec.power_of_2
        )
        stats = CastStats(amax, scale, x.numel(), counts if counters else None) if statistics else None
        return Quantized(data, scale, stats)
    return _quantize_reference(x, spec, statistics, counters, history_scale, history_ready, scale, None)


def _quantize_reference(
    x: Tensor,
    spec: CastSpec,
    statistics: bool,
    counters: bool,
    history_scale: Tensor | None,
    history_ready: Tensor | None,
    scale: Tensor | None,
    amax_reduce: Callable[[Tensor], Tensor] | None,
) -> Quantized:
    """The torch reference of :func:`quantize` (the amaxes optionally reduced across the pieces of a tensor)."""
    amax = current_amax(x, spec)
    if amax_reduce is not None:
        amax = amax_reduce(amax)
    # a scale from x's own amax (per tensor, row or block) cannot saturate a finite element: see cast_statistics
    # (a reduced amax, the whole tensor's, is at least this piece's: still no saturation)
    overflow_free = scale is None and spec.scale_source == "current"
    history = None  # the history's (scale, usable) where the cast took the history's scale or, if not usable, x's own
    if scale is None:
        scale = amax_to_scale(amax, spec.fp8_max, spec.margin, spec.power_of_2)
        if spec.scale_source == "history":
            if history_scale is None or history_ready is None:
                raise ValueError("a history-scaled cast needs history_scale and history_ready")
            scale = torch.where(history_ready, history_scale, scale)
            if spec.role == GRAD_OUTPUT:
                # the backward's casts only: counted from the stored data, a forward cast adds graph nodes that take
                # delayed's forward chain past the partitioner's recompute limit (tests/test_compiled_saved_casts.py)
                history = (history_scale, history_ready)
    if spec.granularity == "block":
        data, counts = _cast_blocks(x, scale, spec, statistics and counters, overflow_free)
        return Quantized(data, scale, _block_stats(x, amax, scale, counts) if statistics else None, spec.block)
    if statistics and (counters or use_triton(x)):
        # on CUDA eager the fused Triton cast counts in the same pass (at no cost worth a second path): dropped there
        data, counts = cast_with_statistics(x, scale, spec.dtype, overflow_free, history)
        counts = counts if counters else None
    else:
        data, counts = saturated_cast(x.to(torch.float32) * scale, spec.dtype), None
        if not statistics:
            return Quantized(data, scale, None)
    if spec.granularity == "tensor":
        return Quantized(data, scale, CastStats(amax, scale, x.numel(), counts))
    return Quantized(data, scale, _block_stats(x, amax, scale, counts))
