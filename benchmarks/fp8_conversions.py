#!/usr/bin/env python
"""What a compiled FP8 conversion costs on this CPU, and what the same rounding costs done in float32 arithmetic.

Usage::

    python benchmarks/fp8_conversions.py                    # 2**20 elements, 15 interleaved rounds of 20 calls
    python benchmarks/fp8_conversions.py --numel 114688      # one tiny SwiGLU activation (call overhead shows)

Why: on a CPU every compiled FP8 cast of the emulated path (ours and torchao's ``emulate=True``) converts float32 to
FP8 and, for the float32 GEMM, back; inductor's C++ backend writes both as ``at::vec::convert``, which has vector code
for the FP8 types only in torch's AVX-512 headers (``ATen/cpu/vec/vec512/vec512_float8.h``; there is no
``vec256`` counterpart). On an AVX2-only CPU each conversion then runs element by element. The FP8 values can also
be computed without converting: the rounding to the FP8 grid written in float32 operations, as
:func:`lightning_fp8.recipe.rounded_to` already does for bfloat16 and float16 on this backend. With ``p`` the
significand bits of the format (4 for E4M3, 3 for E5M2) and ``a = |v|`` of a value ``v`` already clamped to
``±fp8_max`` (so no overflow)::

    normal     (a >= 2**emin):  c = v * (2**(24 - p) + 1);  c - (c - v)     Veltkamp's split, ties to even
    subnormal  (a <  2**emin):  ((a + M) - M) with the sign of v,  M = 1.5 * 2**(e + 23)   e the subnormal spacing

``emin`` is -6 for E4M3 and -14 for E5M2, the subnormal spacing ``2**e`` is ``2**-9`` and ``2**-16``. Before timing,
the script checks that this equals ``v.to(fp8).to(float32)`` bit for bit, compiled, on the timed data and on every FP8
value, every midpoint between neighbouring FP8 values (the ties) and the float32 neighbours of both.

Variants, each a ``torch.compile``d function (static shapes: the graph checked is the graph timed) of one float32
tensor and a scale, timed interleaved
(``harness.interleaved``): ``multiply`` (``x * scale`` clamped: the floor any pass pays), ``to-bf16`` (a vectorised
16-bit conversion, for scale), and per format ``to-<fmt>`` (the FP8 tensor a cast stores), ``from-<fmt>`` (an FP8
tensor converted to float32, as the emulated GEMM reads its operands), ``roundtrip-<fmt>`` (both in one kernel: what
a compiled cast that feeds the GEMM does) and ``arithmetic-<fmt>`` (the formula above: the same float32 values
without converting). Reported per element, and as a ratio to ``multiply``. Results: ``--json`` (default
``benchmarks/results/fp8_conversions.json``) and a Markdown report on stdout (``--out`` to keep it).
A Python call of a compiled function costs some tens of microseconds on top of its kernel: the per-element numbers
include it, hence the default of 2**20 elements (a few percent of a call there; about two fifths of one at 114688).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

#: per FP8 format: significand bits p (with the implicit bit), the smallest normal exponent, the subnormal spacing
#: exponent, the largest finite value
FORMATS = {
    "e4m3": (torch.float8_e4m3fn, 4, -6, -9, 448.0),
    "e5m2": (torch.float8_e5m2, 3, -14, -16, 57344.0),
}


def rounded_in_float32(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """``v`` (float32, finite, ``|v| <= fp8_max``) rounded to the nearest value of ``fmt``, ties to even, kept in
    float32, in float32 operations only (the formulas of the module docstring)."""
    _, p, emin, e, _ = FORMATS[fmt]
    c = v * float(2 ** (24 - p) + 1)
    normal = c - (c - v)
    big = 1.5 * 2.0 ** (e + 23)
    a = v.abs()
    subnormal = ((a + big) - big).copysign(v)
    return torch.where(a < 2.0**emin, subnormal, normal)


def edge_values(fmt: str) -> torch.Tensor:
    """Every finite value of ``fmt``, the midpoints between neighbours (the ties) and the float32 neighbours of
    both, as float32, both signs."""
    dtype, *_, top = FORMATS[fmt]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)
    grid = torch.unique(codes[torch.isfinite(codes) & (codes >= 0)])
    mids = (grid[1:] + grid[:-1]) / 2  # exact in float32: FP8 values have at most 4 significant bits
    points = torch.cat([grid, mids])
    tiny = torch.full_like(points, float("inf"))
    around = torch.cat([points, torch.nextafter(points, tiny), torch.nextafter(points, -tiny)])
    around = around[around <= top]
    return torch.cat([around, -around])


def check(fmt: str, data: torch.Tensor, roundtrip: Callable, arithmetic: Callable) -> int:
    """The elements where the compiled formula and the compiled conversion differ in their bits (0 expected)."""
    one = torch.tensor(1.0)
    bad = 0
    for v in (data, edge_values(fmt)):
        bad += int((roundtrip(v, one).view(torch.int32) != arithmetic(v, one).view(torch.int32)).sum())
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2**20, help="elements per call (default 2**20)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20, help="calls per timed round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "fp8_conversions.json"))
    parser.add_argument("--out", default=None, help="also write the Markdown report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.numel)
    # the tails of a unit normal saturate at E4M3's top; few elements reach the subnormals (the check's edge values do)
    scale = torch.tensor(64.0)

    variants: dict[str, Callable[[], torch.Tensor]] = {}
    mismatches: dict[str, int] = {}

    def compiled(fn: Callable) -> Callable:
        return torch.compile(fn, fullgraph=True, dynamic=False)

    multiply = compiled(lambda t, s: (t * s).clamp(-448.0, 448.0))
    to_bf16 = compiled(lambda t, s: (t * s).to(torch.bfloat16))
    variants["multiply"] = lambda: multiply(x, scale)
    variants["to-bf16"] = lambda: to_bf16(x, scale)
    for fmt, (dtype, *_, top) in FORMATS.items():
        def clamped(t: torch.Tensor, s: torch.Tensor, top: float = top) -> torch.Tensor:
            return (t * s).clamp(-top, top)

        to_fp8 = compiled(lambda t, s, dtype=dtype, clamped=clamped: clamped(t, s).to(dtype))
        from_fp8 = compiled(lambda d: d.to(torch.float32))
        roundtrip = compiled(lambda t, s, dtype=dtype, clamped=clamped: clamped(t, s).to(dtype).to(torch.float32))
        arithmetic = compiled(lambda t, s, fmt=fmt, clamped=clamped: rounded_in_float32(clamped(t, s), fmt))
        stored = to_fp8(x, scale)
        mismatches[fmt] = check(fmt, x * scale, roundtrip, arithmetic)
        variants[f"to-{fmt}"] = lambda f=to_fp8: f(x, scale)
        variants[f"from-{fmt}"] = lambda f=from_fp8, d=stored: f(d)
        variants[f"roundtrip-{fmt}"] = lambda f=roundtrip: f(x, scale)
        variants[f"arithmetic-{fmt}"] = lambda f=arithmetic: f(x, scale)

    env = harness.environment("cpu")
    timings = harness.interleaved(variants, rounds=args.rounds, calls=args.calls, warmup=3)
    base = timings["multiply"].median
    rows = [[name, f"{t.median / args.numel * 1e9:.2f}", f"{t.fastest / args.numel * 1e9:.2f}",
             harness.ratio(t.median, base)] for name, t in timings.items()]
    sections = [
        f"{args.numel} float32 elements per call, {args.threads} thread(s), "
        f"{args.rounds} rounds of {args.calls} calls.",
        harness.markdown_table(["variant", "ns / element (median)", "ns / element (fastest)", "vs multiply"], rows),
        "Bits that differ between `arithmetic-<fmt>` and `roundtrip-<fmt>` (timed data and edge values): "
        + ", ".join(f"{fmt} {n}" for fmt, n in mismatches.items()),
    ]
    data = {"numel": args.numel, "threads": args.threads, "timings": timings, "mismatches": mismatches}
    harness.write_report("Compiled FP8 conversions on this CPU", env, sections, data, args.out, args.json)
    return 1 if any(mismatches.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
