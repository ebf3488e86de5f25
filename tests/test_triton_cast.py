"""The fused Triton cast (``lightning_fp8.triton_cast``) against the torch reference, bit for bit.

``TRITON_INTERPRET=1`` must be set before triton is imported, so the kernel runs in a child process:
this file, run as a script. The child builds every case of :func:`_cases`, runs the kernel on CPU
tensors under the Triton interpreter, compares data (``.view(torch.uint8)``) and counts with
``saturated_cast`` / ``cast_statistics``, counts kernel launches, and prints one JSON line after a
marker. The tests in this process read that report: a wrong kernel, a crash or a missing launch fails.

The block kernel (:func:`~lightning_fp8.triton_cast.triton_block_cast`) is checked the same way against the torch
reference ``quantize(x, spec)`` of a ``"block"`` cast spec (:func:`_block_cases`): data, block scales and block
amaxes bit for bit (NaNs in the same places) and the exact counts; and ``quantize()`` must dispatch to it.

The history-scaled per-tensor cast (:func:`~lightning_fp8.triton_cast.triton_history_cast`, the ``delayed`` recipe)
is checked through ``quantize()`` against its torch reference (:func:`_history_cases`): data, amax and scale bits and
the counts, with the history ready and not ready; it must launch the elementwise kernel twice (the fused cast with the
amax, then the fallback gated on the readiness flag), and the gated launch must do nothing when the history is ready.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_fp8 import triton_cast
from lightning_fp8.quantize import cast_statistics, cast_with_statistics, current_amax, quantize, saturated_cast
from lightning_fp8.recipe import AMAX_EPS, E4M3, E5M2, FP8_MAX, INPUT, CastSpec, amax_to_scale
from lightning_fp8.triton_cast import (
    BLOCK_SIZE,
    history_cast_supported,
    triton_block_cast,
    triton_cast_with_statistics,
    triton_history_cast,
    use_triton,
)

MARKER = "TRITON_CAST_INTERPRETER_REPORT "
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _reference(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x_scaled = x.to(torch.float32) * scale
    data = saturated_cast(x_scaled, fp8_dtype)
    return data, cast_statistics(x, x_scaled, data)


# ----------------------------------------------------------------------------------------- the cases


def _rounding_boundaries(fp8_dtype: torch.dtype) -> torch.Tensor:
    """Every FP8 value, every midpoint between neighbours (ties) and the float32 values next to each
    midpoint, both signs, and the special values around them."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(fp8_dtype).float()  # 0 .. max, no NaN
    codes = codes[torch.isfinite(codes)]
    mid = (codes[:-1] + codes[1:]) / 2  # exact in float32
    inf = torch.full_like(mid, float("inf"))
    fp8_max = FP8_MAX[fp8_dtype]
    tiny = torch.finfo(torch.float32).tiny
    specials = torch.tensor(
        [0.0, float("nan"), float("inf"), fp8_max, fp8_max * 1.0001, fp8_max * 2, 3e38, 1e-30, tiny, tiny / 4, 1e-45]
    )
    positive = torch.cat([codes, mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf), specials])
    return torch.cat([positive, -positive])


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Magnitudes spread over 1e-9 .. 1e7 (overflows and flushes at any scale), plus specials."""
    x = torch.randn(shape, generator=g) * 10 ** (torch.rand(shape, generator=g) * 16 - 9)
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-38, -1e-38, 6e4, -6e4])
    idx = torch.randperm(flat.numel(), generator=g)[: min(flat.numel(), len(specials))]
    flat[idx] = specials[: len(idx)]
    return x.to(dtype)


def _amax_scale(x: torch.Tensor, fp8_dtype: torch.dtype, dim: int | None = None) -> torch.Tensor:
    """A scale as the recipes compute it (from the finite values)."""
    a = torch.where(torch.isfinite(x), x, torch.zeros_like(x)).abs().float()
    amax = a.amax() if dim is None else a.amax(dim=dim, keepdim=True)
    return amax_to_scale(amax, FP8_MAX[fp8_dtype])


def _cases() -> dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor, torch.dtype]]]:
    """name -> builder of ``(x, scale, fp8_dtype)``; deterministic, small (the interpreter is slow)."""
    cases: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor, torch.dtype]]] = {}
    for fmt, fp8 in FORMATS.items():
        one = torch.tensor(1.0)
        cases[f"{fmt}-fp32-rounding-boundaries"] = lambda fp8=fp8, one=one: (_rounding_boundaries(fp8), one, fp8)
        # ~262k float32 bit patterns spread over all 2**32 (NaNs, infinities, denormals included).
        cases[f"{fmt}-fp32-bit-sweep"] = lambda fp8=fp8, one=one: (
            torch.arange(0, 2**32, 16411, dtype=torch.int64).to(torch.int32).view(torch.float32),
            one,
            fp8,
        )
        # Every bf16 / fp16 bit pattern, one tensorwise and one per-row scale.
        cases[f"{fmt}-bf16-every-value"] = lambda fp8=fp8: (
            torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256),
            torch.tensor(0.75),
            fp8,
        )
        cases[f"{fmt}-fp16-every-value-per-row"] = lambda fp8=fp8: (
            torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).reshape(256, 256),
            torch.exp2(torch.arange(256, dtype=torch.float32).reshape(256, 1) % 41 - 20) * 1.3,
            fp8,
        )
        for dname, dtype in DTYPES.items():
            for shape in [(37, 129), (3, 5), (1, 1), (5, BLOCK_SIZE + 3)]:
                seed = zlib.crc32(f"{fmt}-{dname}-{shape}".encode())

                def build(kind: str, shape=shape, dtype=dtype, fp8=fp8, seed=seed):
                    g = torch.Generator().manual_seed(seed)
                    x = _random(shape, dtype, g)
                    if kind == "tensorwise":
                        return x, _amax_scale(x, fp8), fp8
                    if kind == "per-row":
                        return x, _amax_scale(x, fp8, dim=-1), fp8
                    return x, _amax_scale(x, fp8, dim=0), fp8

                for kind in ("tensorwise", "per-row", "per-column"):
                    name = f"{fmt}-{dname}-{kind}-{'x'.join(map(str, shape))}"
                    cases[name] = lambda build=build, kind=kind: build(kind)
            cases[f"{fmt}-{dname}-flat-{BLOCK_SIZE * 2 + 1}"] = lambda dtype=dtype, fp8=fp8: (
                _random((BLOCK_SIZE * 2 + 1,), dtype, torch.Generator().manual_seed(7)),
                torch.tensor([3.0]),
                fp8,
            )
        # Scales the recipes can produce from a bad amax (0 from an infinite amax, NaN from a NaN one).
        cases[f"{fmt}-fp32-per-row-degenerate-scales"] = lambda fp8=fp8: (
            _random((6, 33), torch.float32, torch.Generator().manual_seed(3)),
            torch.tensor([[0.0], [float("inf")], [float("nan")], [1.0], [1e-30], [1e30]]),
            fp8,
        )
        for bad in ("inf", "nan"):  # every element overflows; padding lanes of the last block must not count
            cases[f"{fmt}-fp32-tensorwise-{bad}-scale"] = lambda fp8=fp8, bad=bad: (
                _random((3, 1001), torch.float32, torch.Generator().manual_seed(5)),
                torch.tensor(float(bad)),
                fp8,
            )
        cases[f"{fmt}-fp32-empty"] = lambda fp8=fp8: (torch.empty(0, 16), torch.tensor(1.0), fp8)
    return cases


DISPATCH_CASES = ["e4m3-bf16-per-row-37x129", "e5m2-fp32-tensorwise-37x129"]
INT64_INDEX_CASES = ["e4m3-fp32-per-row-5x2051", "e5m2-bf16-per-column-5x2051", "e4m3-fp16-tensorwise-37x129"]


# ------------------------------------------------------------------------------------------ block cases

BLOCKS = {
    "1x128": (1, 128),
    "128x1": (128, 1),
    "128x128": (128, 128),
    "1x32": (1, 32),
    "32x1": (32, 1),
    "3x40": (3, 40),
}
NAN, INF = float("nan"), float("inf")


def _block_spec(block: tuple[int, int], fp8: torch.dtype, power_of_2: bool) -> CastSpec:
    return CastSpec(INPUT, fp8, "block", None, "current", 0, power_of_2, block)


def _block_input(shape: tuple[int, int], dtype: torch.dtype, block: tuple[int, int], seed: int) -> torch.Tensor:
    """Blocks whose amaxes spread over 2**-67 .. 2**113 (some below eps), elements over ~30 binades within a block
    (FP8 subnormals and flushes), a block of zeros, NaN in the bottom-right block (partial in both dimensions),
    Inf in two edge blocks, float32 subnormal inputs, and the specials of :func:`_random`."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    if dtype == torch.float16:  # |x| in 1e-8 .. 1e4: fp16 subnormals, no accidental infinities
        x = torch.randn(shape, generator=g) * 10 ** (torch.rand(shape, generator=g) * 12 - 8)
    else:
        x = _random(shape, torch.float32, g)
        x = x * torch.exp2(torch.linspace(-60, 60, rows).round())[:, None] * torch.exp2(torch.linspace(-30, 30, cols))
        x[rows // 2, 1::7] = 1e-40  # float32 (and bfloat16) subnormals
    bm, bn = block
    x[:bm, :bn] = 0.0  # a block of zeros: amax 0, scale of eps
    x[-1, -1] = NAN
    x[-1, 0], x[0, -1] = INF, -INF
    return x.to(dtype)


def _block_cases() -> dict[str, Callable[[], dict]]:
    """name -> builder of ``dict(x, spec, scale, statistics)``: the kernel's (and quantize's) arguments.

    Main cases: (200, 300) (no dimension a multiple of 32 or 128, so both edges have partial blocks) with each
    block shape, both formats, every input dtype and power_of_2 on and off (not the full product: the interpreter
    is slow). ``amax-sweep``: one block per element (block (1, 1)), so 65536 amaxes across the float32 range (eps,
    powers of two and their neighbours included) each go through the scale computation. ``given-scale``: the
    kernel casts with given block scales (finite overflows, and 0, Inf and NaN scales, one on a partial block).
    """
    cases: dict[str, Callable[[], dict]] = {}
    main = [
        ("1x128", "e4m3", "fp32", False), ("1x128", "e5m2", "bf16", True),
        ("128x1", "e4m3", "bf16", False), ("128x1", "e5m2", "fp32", True),
        ("128x128", "e4m3", "fp32", False), ("128x128", "e4m3", "bf16", True), ("128x128", "e5m2", "fp16", False),
        ("1x32", "e4m3", "fp32", True), ("1x32", "e5m2", "fp16", True),
        ("32x1", "e4m3", "bf16", True), ("32x1", "e5m2", "fp32", False),
    ]  # fmt: skip
    for bname, fmt, dname, pow2 in main:
        seed = zlib.crc32(f"{bname}-{fmt}-{dname}".encode())

        def build(block=BLOCKS[bname], fp8=FORMATS[fmt], dtype=DTYPES[dname], pow2=pow2, seed=seed) -> dict:
            x = _block_input((200, 300), dtype, block, seed)
            return {"x": x, "spec": _block_spec(block, fp8, pow2), "scale": None, "statistics": True}

        cases[f"{bname}-{fmt}-{dname}-{'pow2' if pow2 else 'exact'}-200x300"] = build
    # A block shape that is no power of two (padded lanes inside every block), on a small tensor.
    cases["3x40-e4m3-fp32-pow2-50x130"] = lambda: {
        "x": _block_input((50, 130), torch.float32, (3, 40), 11),
        "spec": _block_spec((3, 40), E4M3, True),
        "scale": None,
        "statistics": True,
    }
    for fmt, fp8 in FORMATS.items():
        for pow2 in (False, True):
            cases[f"amax-sweep-{fmt}-{'pow2' if pow2 else 'exact'}"] = lambda fp8=fp8, pow2=pow2: {
                "x": _amax_sweep(),
                "spec": _block_spec((1, 1), fp8, pow2),
                "scale": None,
                "statistics": True,
            }
    for bname, fmt, dname in [("1x128", "e4m3", "fp32"), ("32x1", "e5m2", "bf16")]:

        def given(block=BLOCKS[bname], fp8=FORMATS[fmt], dtype=DTYPES[dname]) -> dict:
            return _given_scale_case(block, fp8, dtype)

        cases[f"given-scale-{bname}-{fmt}-{dname}-200x300"] = given
    cases["statistics-off-1x128-e4m3-bf16-200x300"] = lambda: {
        "x": _block_input((200, 300), torch.bfloat16, (1, 128), 13),
        "spec": _block_spec((1, 128), E4M3, False),
        "scale": None,
        "statistics": False,
    }
    return cases


def _amax_sweep() -> torch.Tensor:
    """65536 float32 values (both signs) for block (1, 1): a sweep of the bit patterns of 0 .. Inf, the neighbours of
    eps, the powers of two and 1.75 * the powers of two (whose scales are exact), NaN."""
    eps = torch.tensor(AMAX_EPS, dtype=torch.float64).to(torch.float32)
    near_eps = eps.view(torch.int32) + torch.arange(-3, 4, dtype=torch.int32)
    powers = torch.exp2(torch.arange(-130, 128, dtype=torch.float32))
    exact = torch.cat([powers, powers[:-1] * 1.75]).view(torch.int32)
    special = torch.cat(
        [near_eps, exact - 1, exact, exact + 1, torch.tensor([0, 1, 0x7F800000, 0x7FC00000], dtype=torch.int32)]
    )
    sweep = torch.linspace(0, 0x7F800000, 65536 - special.numel(), dtype=torch.float64).to(torch.int32)
    bits = torch.cat([special, sweep])
    x = bits.view(torch.float32).clone()
    x[1::2] = -x[1::2]
    return x.reshape(256, 256)


def _given_scale_case(block: tuple[int, int], fp8: torch.dtype, dtype: torch.dtype) -> dict:
    x = _block_input((200, 300), dtype, block, 17)
    spec = _block_spec(block, fp8, False)
    amax = current_amax(x, spec)
    g = torch.Generator().manual_seed(19)
    scale = amax_to_scale(amax, spec.fp8_max) * torch.exp2(torch.randint(-3, 4, amax.shape, generator=g).float())
    scale = torch.where(torch.isfinite(scale), scale, torch.ones_like(scale))
    scale[0, 1], scale[1, 0], scale[-1, -1] = 0.0, INF, NAN  # the NaN on the partial bottom-right block
    return {"x": x, "spec": spec, "scale": scale, "statistics": True}


BLOCK_DISPATCH_CASES = [
    "1x128-e5m2-bf16-pow2-200x300",
    "32x1-e4m3-bf16-pow2-200x300",
    "given-scale-1x128-e4m3-fp32-200x300",
    "statistics-off-1x128-e4m3-bf16-200x300",
]
BLOCK_INT64_INDEX_CASES = ["128x1-e5m2-fp32-pow2-200x300", "3x40-e4m3-fp32-pow2-50x130"]


# ---------------------------------------------------------------------------------- history cases


def _history_spec(fp8: torch.dtype, margin: int = 0, power_of_2: bool = False) -> CastSpec:
    return CastSpec(INPUT, fp8, "tensor", None, "history", margin, power_of_2)


def _history_args(ready: bool, history_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(history scale, ready)`` as the layers pass them: 0-d views into a state table (at an offset, between
    neighbours that say the opposite), so the kernel must read the right element."""
    flags = torch.full((4, 3), not ready)
    flags[2, 1] = ready
    scales = torch.full((4,), float("nan"))
    scales[2] = history_scale
    return scales[2], flags[2, 1]


def _history_cases() -> dict[str, Callable[[], dict]]:
    """name -> builder of ``dict(x, spec, history_scale, history_ready, statistics)``.

    Main cases: both formats, float32 and bfloat16 inputs, history ready and not; ``random`` holds NaN, ±Inf, zeros and
    values that overflow at the history scale (one program and a partial one), ``finite`` no NaN nor Inf over six
    programs (a finite amax reduced across programs). Extra: an Inf without NaN (amax Inf: the current scale is 0),
    all zeros (amax 0: the scale of eps), float16 with margin and power_of_2, a 1-element tensor, statistics off.
    """
    cases: dict[str, Callable[[], dict]] = {}

    def case(x: torch.Tensor, spec: CastSpec, ready: bool, history_scale: float = 2.0**8, statistics: bool = True):
        scale, flag = _history_args(ready, history_scale)
        return {"x": x, "spec": spec, "history_scale": scale, "history_ready": flag, "statistics": statistics}

    for fmt, fp8 in FORMATS.items():
        for dname in ("fp32", "bf16"):
            dtype = DTYPES[dname]
            for ready in (True, False):
                state = "ready" if ready else "not-ready"
                seed = zlib.crc32(f"history-{fmt}-{dname}".encode())
                cases[f"{fmt}-{dname}-{state}-random-37x129"] = lambda fp8=fp8, dtype=dtype, ready=ready, seed=seed: (
                    case(_random((37, 129), dtype, torch.Generator().manual_seed(seed)), _history_spec(fp8), ready)
                )

                def finite(fp8=fp8, dtype=dtype, ready=ready, seed=seed):
                    x = _random((5, BLOCK_SIZE + 3), torch.float32, torch.Generator().manual_seed(seed + 1))
                    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x)).to(dtype)
                    return case(x, _history_spec(fp8), ready, history_scale=1e-3)

                cases[f"{fmt}-{dname}-{state}-finite-5x{BLOCK_SIZE + 3}"] = finite
    for ready in (True, False):
        state = "ready" if ready else "not-ready"

        def inf_no_nan(ready=ready):
            x = _random((3, 1001), torch.float32, torch.Generator().manual_seed(23))
            x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
            return case(x, _history_spec(E4M3), ready)

        cases[f"e4m3-fp32-{state}-inf-no-nan-3x1001"] = inf_no_nan
        cases[f"e5m2-fp32-{state}-zeros-7x9"] = lambda ready=ready: case(torch.zeros(7, 9), _history_spec(E5M2), ready)
    cases["e4m3-fp16-not-ready-margin-pow2-37x129"] = lambda: case(
        _random((37, 129), torch.float16, torch.Generator().manual_seed(29)), _history_spec(E4M3, 2, True), False
    )
    cases["e5m2-fp32-not-ready-one-element"] = lambda: case(torch.tensor([-3.5]), _history_spec(E5M2), False)
    cases["e4m3-bf16-ready-statistics-off-37x129"] = lambda: case(
        _random((37, 129), torch.bfloat16, torch.Generator().manual_seed(31)), _history_spec(E4M3), True, 0.5, False
    )
    cases["e4m3-bf16-not-ready-statistics-off-37x129"] = lambda: case(
        _random((37, 129), torch.bfloat16, torch.Generator().manual_seed(31)), _history_spec(E4M3), False, 0.5, False
    )
    return cases


# ------------------------------------------------------------------------------- the child process


def _compare(run: Callable[..., tuple[torch.Tensor, torch.Tensor]], x, scale, fp8) -> dict[str, object]:
    data, counts = run(x, scale, fp8)
    ref_data, ref_counts = _reference(x, scale, fp8)
    result: dict[str, object] = {
        "data_meta": [str(data.dtype), list(data.shape)],
        "ref_data_meta": [str(ref_data.dtype), list(ref_data.shape)],
        "counts_meta": [str(counts.dtype), list(counts.shape), str(counts.device)],
        "counts": counts.tolist(),
        "ref_counts": ref_counts.tolist(),
        "mismatches": None,
    }
    if data.shape == ref_data.shape and data.dtype == ref_data.dtype:
        bad = (data.view(torch.uint8) != ref_data.view(torch.uint8)).reshape(-1)
        result["mismatches"] = int(bad.sum())
        if bad.any():
            i = int(bad.nonzero()[0])
            xs = (x.to(torch.float32) * scale).reshape(-1)[i] if scale.numel() == 1 else "n/a"
            result["first_mismatch"] = (
                f"flat index {i}: x={x.reshape(-1)[i].item()!r} x*scale={xs!r} "
                f"kernel=0x{int(data.view(torch.uint8).reshape(-1)[i]):02x} "
                f"reference=0x{int(ref_data.view(torch.uint8).reshape(-1)[i]):02x}"
            )
    return result


def _bit_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements of two float32 tensors whose bits differ, NaN matching any NaN; -1 if dtype or shape differ."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return -1
    a_nan, b_nan = torch.isnan(a), torch.isnan(b)
    differ = (a.view(torch.int32) != b.view(torch.int32)) & ~a_nan & ~b_nan
    return int((a_nan != b_nan).sum() + differ.sum())


def _data_mismatches(data: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> dict[str, object]:
    if data.dtype != ref.dtype or data.shape != ref.shape:
        return {"data_mismatches": -1}
    bad = (data.view(torch.uint8) != ref.view(torch.uint8)).reshape(-1)
    result: dict[str, object] = {"data_mismatches": int(bad.sum())}
    if bad.any():
        i = int(bad.nonzero()[0])
        result["first_mismatch"] = (
            f"flat index {i} (row {i // x.shape[-1]}, column {i % x.shape[-1]}): x={x.reshape(-1)[i].item()!r} "
            f"kernel=0x{int(data.view(torch.uint8).reshape(-1)[i]):02x} "
            f"reference=0x{int(ref.view(torch.uint8).reshape(-1)[i]):02x}"
        )
    return result


def _compare_block(x: torch.Tensor, spec: CastSpec, scale: torch.Tensor | None, statistics: bool) -> dict[str, object]:
    """The kernel against the torch reference ``quantize(x, spec)`` (and its block amaxes, ``current_amax``)."""
    data, kernel_scale, amax, counts = triton_block_cast(
        x, spec.block, spec.dtype, power_of_2=spec.power_of_2, margin=spec.margin, scale=scale, statistics=statistics
    )
    ref = quantize(x, spec, scale=scale, statistics=statistics)
    result: dict[str, object] = {
        "data_meta": [str(data.dtype), list(data.shape)],
        "ref_data_meta": [str(ref.data.dtype), list(ref.data.shape)],
        "scale_mismatches": _bit_mismatches(kernel_scale, ref.scale),
        "amax_mismatches": _bit_mismatches(amax, current_amax(x, spec)),
        "counts_meta": None if counts is None else [str(counts.dtype), list(counts.shape)],
        "counts": None if counts is None else counts.tolist(),
        "ref_counts": None if ref.stats is None else ref.stats.counts.tolist(),
        **_data_mismatches(data, ref.data, x),
    }
    return result


def _compare_block_dispatch(
    x: torch.Tensor, spec: CastSpec, scale: torch.Tensor | None, statistics: bool, cast_module
) -> dict[str, object]:
    """``quantize()`` with ``use_triton`` true (as on CUDA) against ``quantize()`` running the torch reference."""
    cast_module.use_triton = lambda x: False
    ref = quantize(x, spec, scale=scale, statistics=statistics)
    cast_module.use_triton = lambda x: True
    q = quantize(x, spec, scale=scale, statistics=statistics)
    result: dict[str, object] = {
        "data_meta": [str(q.data.dtype), list(q.data.shape)],
        "ref_data_meta": [str(ref.data.dtype), list(ref.data.shape)],
        "scale_mismatches": _bit_mismatches(q.scale, ref.scale),
        "block": [list(q.block or ()), list(ref.block or ())],
        "stats": [q.stats is None, ref.stats is None],
        **_data_mismatches(q.data, ref.data, x),
    }
    if q.stats is not None and ref.stats is not None:
        result["stats_mismatches"] = {
            "amax": _bit_mismatches(q.stats.amax, ref.stats.amax),
            "scale": _bit_mismatches(q.stats.scale, ref.stats.scale),
            "numel": int(q.stats.numel != ref.stats.numel),
            "counts": int(not torch.equal(q.stats.counts, ref.stats.counts)),
            "amax_bins": int(not torch.equal(q.stats.amax_bins, ref.stats.amax_bins)),
        }
    return result


def _bits(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).view(torch.int32).tolist()


def _compare_history(
    x: torch.Tensor,
    spec: CastSpec,
    history_scale: torch.Tensor,
    history_ready: torch.Tensor,
    statistics: bool,
    cast_module,
) -> dict[str, object]:
    """``quantize()`` with ``use_triton`` true (as on CUDA) against ``quantize()`` running the torch reference."""
    kwargs = {"statistics": statistics, "history_scale": history_scale, "history_ready": history_ready}
    cast_module.use_triton = lambda x: False
    ref = quantize(x, spec, **kwargs)
    cast_module.use_triton = lambda x: True
    q = quantize(x, spec, **kwargs)
    result: dict[str, object] = {
        "data_meta": [str(q.data.dtype), list(q.data.shape)],
        "ref_data_meta": [str(ref.data.dtype), list(ref.data.shape)],
        "scale": [str(q.scale.dtype), list(q.scale.shape), _bits(q.scale)],
        "ref_scale": [str(ref.scale.dtype), list(ref.scale.shape), _bits(ref.scale)],
        "scale_mismatches": _bit_mismatches(q.scale, ref.scale),
        "stats": [q.stats is None, ref.stats is None],
        **_data_mismatches(q.data, ref.data, x),
    }
    if q.stats is not None and ref.stats is not None:
        result["amax"] = [str(q.stats.amax.dtype), list(q.stats.amax.shape), _bits(q.stats.amax)]
        result["ref_amax"] = [str(ref.stats.amax.dtype), list(ref.stats.amax.shape), _bits(ref.stats.amax)]
        result["amax_mismatches"] = _bit_mismatches(q.stats.amax, ref.stats.amax)
        result["stats_scale_mismatches"] = _bit_mismatches(q.stats.scale, ref.stats.scale)
        result["numel"] = [q.stats.numel, ref.stats.numel]
        result["counts"] = [str(q.stats.counts.dtype), q.stats.counts.tolist()]
        result["ref_counts"] = [str(ref.stats.counts.dtype), ref.stats.counts.tolist()]
        result["amax_bins"] = [q.stats.amax_bins is None, ref.stats.amax_bins is None]
    return result


def _gated_launch_is_a_no_op() -> dict[str, object]:
    """The fallback launch with the history ready: no FP8 byte and no partial count written (every load and store of
    the program is masked off), whatever ``x`` and the scale; with the history not ready, it casts."""
    x = _random((5, BLOCK_SIZE + 3), torch.float32, torch.Generator().manual_seed(37))
    result = {}
    for ready in (True, False):
        data = torch.full(x.shape, 0x55, dtype=torch.uint8).view(E4M3)
        partial = torch.full((triton_cast._n_programs(x.numel()), 3), -7, dtype=torch.int32)
        gate = _history_args(ready, 1.0)[1].reshape(-1).view(torch.uint8)
        triton_cast._launch(x, torch.tensor(0.5), triton_cast.SCALE_TENSORWISE, 1, data, partial, gate=gate)
        ref_data, ref_counts = _reference(x, torch.tensor(0.5), E4M3)
        result["ready" if ready else "not_ready"] = {
            "data_untouched": bool((data.view(torch.uint8) == 0x55).all()),
            "partial_untouched": bool((partial == -7).all()),
            "data_is_cast": torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8)),
            "counts_are_cast": torch.equal(partial.sum(0), ref_counts),
        }
    return result


def _run_in_interpreter() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run this with TRITON_INTERPRET=1"
    import lightning_fp8.quantize as cast_module

    kernel = triton_cast._kernel()
    block_kernel = triton_cast._block_kernel()
    launches: list[object] = []
    block_launches: list[object] = []
    launch_flags: list[list[bool]] = []  # [AMAX, GATED] of each elementwise launch

    class CountingKernel:
        def __getitem__(self, grid):
            launches.append(grid)

            def launch(*args, **kwargs):
                launch_flags.append([bool(kwargs.get("AMAX")), bool(kwargs.get("GATED"))])
                return kernel[grid](*args, **kwargs)

            return launch

    class CountingBlockKernel:
        def __getitem__(self, grid):
            block_launches.append(grid)
            return block_kernel[grid]

    triton_cast._kernel = CountingKernel  # type: ignore[assignment]
    triton_cast._block_kernel = CountingBlockKernel  # type: ignore[assignment]
    cases = _cases()
    block_cases = _block_cases()

    def run_block_cases(compare: Callable[..., dict], names: list[str], *extra) -> dict[str, dict]:
        results = {}
        for name in names:
            before, block_before = len(launches), len(block_launches)
            try:
                case = block_cases[name]()
                result = compare(case["x"], case["spec"], case["scale"], case["statistics"], *extra)
            except Exception:
                result = {"error": traceback.format_exc()}
            result["launches"] = len(launches) - before
            result["block_launches"] = len(block_launches) - block_before
            results[name] = result
        return results

    def run_cases(run: Callable[..., tuple[torch.Tensor, torch.Tensor]], names: list[str]) -> dict[str, dict]:
        results = {}
        for name in names:
            before = len(launches)
            try:
                result = _compare(run, *cases[name]())
            except Exception:
                result = {"error": traceback.format_exc()}
            result["launches"] = len(launches) - before
            results[name] = result
        return results

    report = {"kernel_type": type(kernel).__name__, "block_kernel_type": type(block_kernel).__name__}
    report["cases"] = run_cases(triton_cast_with_statistics, list(cases))
    report["block_cases"] = run_block_cases(_compare_block, list(block_cases))
    # Through quantize(), as on CUDA: a block spec must run the block kernel, once (and the reference otherwise).
    report["block_dispatch"] = run_block_cases(_compare_block_dispatch, BLOCK_DISPATCH_CASES, cast_module)
    # The history-scaled per-tensor cast, through quantize() as on CUDA.
    history_cases = _history_cases()
    report["history"] = {}
    for name, build in history_cases.items():
        before = len(launch_flags)
        try:
            case = build()
            result = _compare_history(**case, cast_module=cast_module)
        except Exception:
            result = {"error": traceback.format_exc()}
        result["launch_flags"] = launch_flags[before:]
        report["history"][name] = result
    try:
        report["gated_no_op"] = _gated_launch_is_a_no_op()
    except Exception:
        report["gated_no_op"] = {"error": traceback.format_exc()}
    # Through the dispatch point, as on CUDA: cast_with_statistics must call the kernel.
    cast_module.use_triton = lambda x: True
    report["dispatch"] = run_cases(cast_with_statistics, DISPATCH_CASES)
    # The int64-index variants (tensors of 2**31 elements and more), forced on small tensors.
    triton_cast._MAX_INT32_NUMEL = 0
    report["int64_index"] = run_cases(triton_cast_with_statistics, INT64_INDEX_CASES)
    triton_cast._MAX_INT32_OFFSET = 0
    cast_module.use_triton = lambda x: False
    report["block_int64_index"] = run_block_cases(_compare_block, BLOCK_INT64_INDEX_CASES)
    print(MARKER + json.dumps(report), flush=True)


def _interpreter_run(workdir: Path) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return {"args": [sys.executable, str(Path(__file__).resolve())], "cwd": os.getcwd(), "env": env, "timeout": 600}


def _without_triton_run(workdir: Path) -> dict:
    return {"args": [sys.executable, "-c", _WITHOUT_TRITON], "cwd": os.getcwd(), "timeout": 300}


# started when collection ends and run while other tests run (tests/conftest.py, "subprocesses started early")
EARLY_RUNS = {"interpreter_report": _interpreter_run, "without_triton_run": _without_triton_run}


@pytest.fixture(scope="module")
def interpreter_report(early_runs) -> dict:
    proc = early_runs.result(__name__, "interpreter_report")
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or len(lines) != 1:
        pytest.fail(
            f"the Triton interpreter run failed (exit code {proc.returncode}):\n"
            f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[0][len(MARKER) :])


def _check(result: dict, expect_launch: bool) -> None:
    assert "error" not in result, result.get("error")
    assert result["launches"] == (1 if expect_launch else 0), "the Triton kernel did not run exactly once"
    assert result["data_meta"] == result["ref_data_meta"], "data dtype/shape differ from the reference"
    assert result["mismatches"] == 0, f"{result['mismatches']} FP8 bytes differ; {result.get('first_mismatch')}"
    assert result["counts_meta"][:2] == ["torch.int64", [3]]
    assert result["counts"] == result["ref_counts"], "[nonzero, overflow, underflow] differ from the reference"


def test_interpreter_ran_the_triton_kernel(interpreter_report):
    assert interpreter_report["kernel_type"] == "InterpretedFunction"
    assert set(interpreter_report["cases"]) == set(_cases())


@pytest.mark.parametrize("name", list(_cases()))
def test_triton_cast_matches_reference_bit_for_bit(interpreter_report, name):
    _check(interpreter_report["cases"][name], expect_launch=not name.endswith("-empty"))


@pytest.mark.parametrize("name", DISPATCH_CASES)
def test_cast_with_statistics_dispatches_to_triton(interpreter_report, name):
    _check(interpreter_report["dispatch"][name], expect_launch=True)


@pytest.mark.parametrize("name", INT64_INDEX_CASES)
def test_triton_cast_int64_indexing_matches_reference(interpreter_report, name):
    _check(interpreter_report["int64_index"][name], expect_launch=True)


@pytest.mark.parametrize("name", list(_history_cases()))
def test_triton_history_cast_matches_reference_bit_for_bit(interpreter_report, name):
    """data, scale, amax (NaN bits included) and counts of the fused history cast, as the torch reference's; two
    launches of the elementwise kernel: the cast with the amax, then the fallback gated on the readiness flag."""
    result = interpreter_report["history"][name]
    assert "error" not in result, result.get("error")
    assert result["launch_flags"] == [[True, False], [False, True]], "expected the fused cast, then the gated one"
    assert result["data_meta"] == result["ref_data_meta"], "data dtype/shape differ from the reference"
    assert result["data_mismatches"] == 0, (
        f"{result['data_mismatches']} FP8 bytes differ; {result.get('first_mismatch')}"
    )
    # bits compared exactly, except that a NaN matches any NaN: torch's own NaN payloads depend on the backend
    # (its CPU amax of a float16 NaN is 0x7FFFFFFF), the kernel's amax NaN is the canonical 0x7FC00000
    assert result["scale"][:2] == result["ref_scale"][:2], "the scale's dtype or shape differs from the reference"
    assert result["scale_mismatches"] == 0, f"scale bits {result['scale'][2]} != reference {result['ref_scale'][2]}"
    statistics = "statistics-off" not in name
    assert result["stats"] == [not statistics, not statistics]
    if statistics:
        assert result["amax"][:2] == result["ref_amax"][:2], "the amax's dtype or shape differs from the reference"
        assert result["amax_mismatches"] == 0, f"amax bits {result['amax'][2]} != reference {result['ref_amax'][2]}"
        assert result["stats_scale_mismatches"] == 0
        assert result["numel"][0] == result["numel"][1]
        assert result["counts"] == result["ref_counts"], "[nonzero, overflow, underflow] differ from the reference"
        assert result["amax_bins"] == [True, True]


def test_gated_launch_does_nothing_when_the_history_is_ready(interpreter_report):
    """Steady state (history ready): the fallback launch writes nothing (its loads of x are masked off too), so the
    cast reads x once; with the history not ready it is the full cast."""
    result = interpreter_report["gated_no_op"]
    assert "error" not in result, result.get("error")
    assert result["ready"]["data_untouched"] and result["ready"]["partial_untouched"]
    assert result["not_ready"]["data_is_cast"] and result["not_ready"]["counts_are_cast"]


def test_history_cases_cover_what_they_claim():
    cases = _history_cases()
    seen = {"nan": 0, "inf": 0, "overflow": 0, "underflow": 0, "multi_program": 0}
    for name, build in cases.items():
        case = build()
        x, ready = case["x"], case["history_ready"]
        assert ready.dim() == 0 and ready.item() == ("not-ready" not in name) and ready.storage_offset() > 0
        assert case["history_scale"].dim() == 0 and case["history_scale"].storage_offset() > 0
        if "random" in name:
            assert torch.isnan(x).any() and torch.isinf(x).any() and (x == 0).any()
        q = quantize(x, case["spec"], history_scale=case["history_scale"], history_ready=ready)
        _, overflow, underflow = q.stats.counts.tolist()
        seen["nan"] += bool(torch.isnan(q.stats.amax))
        seen["inf"] += bool(torch.isinf(q.stats.amax))
        seen["overflow"] += overflow > 0
        seen["underflow"] += underflow > 0
        seen["multi_program"] += x.numel() > BLOCK_SIZE
    assert all(n >= 2 for n in seen.values()), seen


def test_quantize_history_on_cpu_runs_the_reference(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the Triton history cast must not run on CPU tensors")

    monkeypatch.setattr("lightning_fp8.quantize.triton_history_cast", fail)
    x = _random((7, 9), torch.float32, torch.Generator().manual_seed(1))
    q = quantize(x, _history_spec(E4M3), history_scale=torch.tensor(2.0), history_ready=torch.tensor(True))
    assert torch.equal(q.scale, torch.tensor(2.0)) and q.stats is not None


def test_history_cast_supported_conditions():
    x, scale, ready = torch.randn(3, 4), torch.tensor(1.0), torch.tensor(True)
    assert history_cast_supported(x, scale, ready)
    assert history_cast_supported(x, scale.reshape(1), ready.reshape(1, 1))
    assert not history_cast_supported(torch.empty(0, 4), scale, ready)
    assert not history_cast_supported(x, scale.double(), ready)
    assert not history_cast_supported(x, torch.ones(2), ready)
    assert not history_cast_supported(x, scale, torch.tensor(1))
    assert not history_cast_supported(x, scale, torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError):
        triton_history_cast(x, torch.ones(2), ready, E4M3)
    with pytest.raises(ValueError):
        triton_history_cast(x, scale, ready, torch.float16)
    with pytest.raises(TypeError):
        triton_history_cast(x.double(), scale, ready, E4M3)


def _check_block(result: dict, statistics: bool = True) -> None:
    assert "error" not in result, result.get("error")
    assert result["block_launches"] == 1, "the Triton block kernel did not run exactly once"
    assert result["launches"] == 0, "the elementwise Triton kernel ran for a block cast"
    assert result["data_meta"] == result["ref_data_meta"], "data dtype/shape differ from the reference"
    assert result["data_mismatches"] == 0, (
        f"{result['data_mismatches']} FP8 bytes differ; {result.get('first_mismatch')}"
    )
    assert result["scale_mismatches"] == 0, f"{result['scale_mismatches']} block scales differ from the reference"
    if "amax_mismatches" in result:
        assert result["amax_mismatches"] == 0, f"{result['amax_mismatches']} block amaxes differ from the reference"
    if "stats" in result:  # through quantize()
        assert result["block"][0] == result["block"][1]
        assert result["stats"] == [not statistics, not statistics]
        if statistics:
            assert result["stats_mismatches"] == dict.fromkeys(["amax", "scale", "numel", "counts", "amax_bins"], 0)
    elif statistics:
        assert result["counts_meta"] == ["torch.int64", [3]]
        assert result["counts"] == result["ref_counts"], "[nonzero, overflow, underflow] differ from the reference"
    else:
        assert result["counts"] is None and result["ref_counts"] is None


def test_interpreter_ran_the_triton_block_kernel(interpreter_report):
    assert interpreter_report["block_kernel_type"] == "InterpretedFunction"
    assert set(interpreter_report["block_cases"]) == set(_block_cases())


@pytest.mark.parametrize("name", list(_block_cases()))
def test_triton_block_cast_matches_reference_bit_for_bit(interpreter_report, name):
    _check_block(interpreter_report["block_cases"][name], statistics=not name.startswith("statistics-off"))


@pytest.mark.parametrize("name", BLOCK_DISPATCH_CASES)
def test_quantize_dispatches_block_specs_to_triton(interpreter_report, name):
    _check_block(interpreter_report["block_dispatch"][name], statistics=not name.startswith("statistics-off"))


@pytest.mark.parametrize("name", BLOCK_INT64_INDEX_CASES)
def test_triton_block_cast_int64_indexing_matches_reference(interpreter_report, name):
    _check_block(interpreter_report["block_int64_index"][name])


def test_block_cases_cover_what_they_claim():
    """The block inputs hold what the bit-for-bit tests rely on, and the reference counts it."""
    cases = _block_cases()
    for name, build in cases.items():
        case = build()
        x, spec = case["x"], case["spec"]
        amax = current_amax(x, spec)
        if name.startswith("amax-sweep"):
            assert amax.numel() == x.numel() == 65536 and torch.isnan(amax).any() and torch.isinf(amax).any()
            assert (amax < AMAX_EPS).sum() > 100 and (amax == 0).any()
            continue
        assert all(n % b for n, b in zip(x.shape, spec.block) if b > 1), "partial blocks at the edges"
        assert torch.isnan(amax[-1, -1]) and torch.isinf(amax).any() and (amax == 0).any()
        if x.dtype != torch.float16:
            assert (amax < AMAX_EPS).any() and (amax > 1e30).any()  # the eps clamp, and very large amaxes
            assert (x.abs() < torch.finfo(torch.float32).tiny).logical_and(x != 0).any()  # float32 subnormals
        q = quantize(x, spec, scale=case["scale"])
        nonzero, overflow, underflow = q.stats.counts.tolist()
        assert underflow > 0 and 0 < overflow <= nonzero <= x.numel()
        if case["scale"] is not None:  # given scales saturate finite values too
            data = q.data.float()
            assert (data.abs() == spec.fp8_max).sum() > 0 and torch.isnan(q.scale).any() and (q.scale == 0).any()


def test_block_reference_counts_no_padding():
    """A NaN in a partial block makes its scale NaN: the reference counts x's elements only, not the zero padding
    (0 * NaN = NaN) of the block, so overflow never exceeds numel (the kernel masks the padding the same way)."""
    x = torch.ones(3, 44)
    x[1, 0] = NAN
    q = quantize(x, _block_spec((1, 128), E4M3, False))
    assert q.stats.counts.tolist() == [132, 44, 0]
    assert torch.isnan(q.data.float()[1]).all() and not torch.isnan(q.data.float()[[0, 2]]).any()


def test_quantize_block_on_cpu_runs_the_reference(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the Triton block kernel must not run on CPU tensors")

    monkeypatch.setattr("lightning_fp8.quantize.triton_block_cast", fail)
    x = _block_input((40, 70), torch.float32, (1, 32), 1)
    q = quantize(x, _block_spec((1, 32), E4M3, True))
    assert q.data.shape == x.shape and q.scale.shape == (40, 3) and q.stats is not None


@pytest.mark.parametrize(
    "x, block, fp8, scale, error",
    [
        (torch.randn(3, 4, 5), (1, 128), E4M3, None, ValueError),  # not 2-D
        (torch.randn(4, 3).t(), (1, 128), E4M3, None, ValueError),  # not contiguous
        (torch.randn(3, 4, dtype=torch.float64), (1, 128), E4M3, None, TypeError),
        (torch.randn(3, 4), (1, 128), torch.float16, None, ValueError),
        (torch.randn(3, 4), (0, 128), E4M3, None, ValueError),
        (torch.randn(3, 4), (256, 128), E4M3, None, ValueError),  # a block larger than one program holds
        (torch.randn(3, 200), (1, 128), E4M3, torch.ones(3, 1), ValueError),  # wrong scale shape
        (torch.randn(3, 200), (1, 128), E4M3, torch.ones(3, 2, dtype=torch.float64), TypeError),
    ],
)
def test_triton_block_cast_rejects_what_it_does_not_support(x, block, fp8, scale, error):
    with pytest.raises(error):
        triton_block_cast(x, block, fp8, scale=scale)


def test_cases_cover_what_they_claim():
    """The special values the bit-for-bit tests rely on are really in the inputs, and counted."""
    cases = _cases()
    for fmt, fp8 in FORMATS.items():
        x, scale, _ = cases[f"{fmt}-fp32-rounding-boundaries"]()
        assert torch.isnan(x).any() and torch.isinf(x).any() and (x == 0).any()
        _, counts = _reference(x, scale, fp8)
        assert counts[1] > 0 and counts[2] > 0  # overflows and flushed values
        x, scale, _ = cases[f"{fmt}-bf16-per-row-37x129"]()
        assert x.numel() % BLOCK_SIZE != 0 and scale.shape == (37, 1)
        _, counts = _reference(x, scale, fp8)
        assert counts[1] > 0 and counts[2] > 0


# ----------------------------------------------------------------------------- in this process


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_use_triton_is_false_for_cpu_tensors(dtype):
    assert not use_triton(torch.randn(8, 16, dtype=dtype))
    assert not use_triton(torch.randn(8, 16, dtype=dtype).t())


def test_cast_with_statistics_on_cpu_runs_the_reference(monkeypatch):
    def fail(*args):
        raise AssertionError("the Triton kernel must not run on CPU tensors")

    monkeypatch.setattr("lightning_fp8.quantize.triton_cast_with_statistics", fail)
    x = _random((7, 9), torch.float32, torch.Generator().manual_seed(1))
    scale = _amax_scale(x, E4M3)
    data, counts = cast_with_statistics(x, scale, E4M3)
    ref_data, ref_counts = _reference(x, scale, E4M3)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(counts, ref_counts)


def test_use_triton_conditions_on_a_cuda_tensor(monkeypatch):
    """Device-free check of the conditions, with fake CUDA tensors (no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(triton_cast, "_triton_available", lambda: True)
    with FakeTensorMode():
        x = torch.empty(8, 16, device="cuda")
        assert use_triton(x)
        assert use_triton(x.to(torch.bfloat16)) and use_triton(x.to(torch.float16))
        assert not use_triton(x.t()), "non-contiguous"
        assert not use_triton(x.to(torch.float64)), "unsupported dtype"
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not use_triton(x), "under torch.compile Inductor fuses the reference"
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
        monkeypatch.setattr(triton_cast, "_triton_available", lambda: False)
        assert not use_triton(x), "triton not importable"


@pytest.mark.parametrize(
    "x, scale, fp8, error",
    [
        (torch.randn(3, 4), torch.ones(3, 4), E4M3, ValueError),  # elementwise scale
        (torch.randn(3, 4), torch.ones(1, 1, 1), E4M3, ValueError),  # would broadcast x to 3-D
        (torch.randn(3, 4), torch.ones((), dtype=torch.float64), E4M3, TypeError),
        (torch.randn(3, 4, dtype=torch.float64), torch.ones(()), E4M3, TypeError),
        (torch.randn(4, 3).t(), torch.ones(()), E4M3, ValueError),
        (torch.randn(3, 4), torch.ones(()), torch.float16, ValueError),
    ],
)
def test_triton_cast_rejects_what_it_does_not_support(x, scale, fp8, error):
    with pytest.raises(error):
        triton_cast_with_statistics(x, scale, fp8)


_WITHOUT_TRITON = (
    "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
    "import torch, lightning_fp8\n"
    "from lightning_fp8.quantize import cast_with_statistics\n"
    "from lightning_fp8.triton_cast import _triton_available\n"
    "assert not _triton_available()\n"
    "data, counts = cast_with_statistics(torch.tensor([1.0, 1e9, 0.0]), torch.tensor(1.0), torch.float8_e4m3fn)\n"
    "assert counts.tolist() == [2, 1, 0], counts\n"
    "print('OK')\n"
)


@pytest.fixture
def without_triton_run(early_runs):
    return early_runs.result(__name__, "without_triton_run")


def test_package_imports_and_casts_without_triton(without_triton_run):
    """``_WITHOUT_TRITON`` in a fresh interpreter (started early: tests/conftest.py)."""
    proc = without_triton_run
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-4000:]


if __name__ == "__main__":
    _run_in_interpreter()
