"""``benchmarks/fp8_conversions.py``: compiled FP8 conversions against the same rounding in float32 arithmetic."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fp8_conversions  # noqa: E402


@pytest.mark.parametrize("fmt", sorted(fp8_conversions.FORMATS))
def test_the_float32_formula_rounds_as_the_conversion_on_every_edge_value(fmt):
    """Eager, on every FP8 value, every tie between neighbours and the float32 neighbours of both (both signs,
    zeros and subnormals included): the bits of ``v.to(fp8).to(float32)``. A wrong multiplier, subnormal constant or
    branch point moves some of these (checked: with E4M3's constants for E5M2, hundreds differ)."""
    dtype = fp8_conversions.FORMATS[fmt][0]
    v = fp8_conversions.edge_values(fmt)
    # per sign: the non-negative finite values (127 for E4M3, 124 for E5M2), the ties between neighbours (one fewer),
    # each with its two float32 neighbours, less the one above the top: 2 * (3 * 253 - 1) and 2 * (3 * 247 - 1)
    assert v.numel() == {"e4m3": 1516, "e5m2": 1480}[fmt]
    assert bool((v == 0).any()) and bool((v < 0).any()) and float(v.abs().max()) == fp8_conversions.FORMATS[fmt][-1]
    expected = v.to(dtype).to(torch.float32)
    assert torch.equal(fp8_conversions.rounded_in_float32(v, fmt).view(torch.int32), expected.view(torch.int32))


def test_other_constants_would_fail_the_edge_check():
    """The edge values tell the formats apart: E4M3's constants applied to E5M2's edges give other bits."""
    v = fp8_conversions.edge_values("e5m2")
    v = v[v.abs() <= 448]
    wrong = fp8_conversions.rounded_in_float32(v, "e4m3")
    assert not torch.equal(wrong, v.to(torch.float8_e5m2).to(torch.float32))


@pytest.mark.parametrize("fmt", sorted(fp8_conversions.FORMATS))
def test_the_script_check_counts_the_elements_a_wrong_formula_gets_wrong(fmt):
    """``check`` (what the script's exit status rests on) counts differing bits on the data and the edge values: 0
    for the formula, the differing elements for a formula with the other format's constants."""
    dtype, *_, top = fp8_conversions.FORMATS[fmt]
    other = "e5m2" if fmt == "e4m3" else "e4m3"

    def roundtrip(t, s):
        return (t * s).clamp(-top, top).to(dtype).to(torch.float32)

    def formula(name):
        return lambda t, s: fp8_conversions.rounded_in_float32((t * s).clamp(-top, top), name)

    data = torch.randn(4096) * 64
    assert fp8_conversions.check(fmt, data, roundtrip, formula(fmt)) == 0
    wrong = fp8_conversions.check(fmt, data, roundtrip, formula(other))
    assert wrong > 100


def test_the_script_times_every_variant_and_checks_the_compiled_formula(tmp_path):
    """One small run: every variant timed, the compiled formula equal to the compiled conversion (exit status 0),
    the machine recorded, and the report written. The script sets torch's threads and seed; both, and dynamo's
    caches, are put back after it."""
    path, report = tmp_path / "conversions.json", tmp_path / "conversions.md"
    threads = torch.get_num_threads()
    try:
        status = fp8_conversions.main(["--numel", "4096", "--rounds", "1", "--calls", "1", "--json", str(path),
                                       "--out", str(report)])
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    assert status == 0
    data = json.loads(path.read_text())
    assert data["mismatches"] == {"e4m3": 0, "e5m2": 0}
    names = {"multiply", "to-bf16"} | {f"{kind}-{fmt}" for kind in ("to", "from", "roundtrip", "arithmetic")
                                       for fmt in ("e4m3", "e5m2")}
    assert set(data["timings"]) == names
    assert all(t["median"] > 0 and t["calls"] == 1 for t in data["timings"].values())
    assert data["environment"]["torch"] == torch.__version__
    assert "| roundtrip-e4m3 |" in report.read_text()
