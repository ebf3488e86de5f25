"""The fused Triton cast (``lightning_fp8.triton_cast``) against the torch reference, bit for bit.

``TRITON_INTERPRET=1`` must be set before triton is imported, so the kernel runs in a child process:
this file, run as a script. The child builds every case of :func:`_cases`, runs the kernel on CPU
tensors under the Triton interpreter, compares data (``.view(torch.uint8)``) and counts with
``saturated_cast`` / ``cast_statistics``, counts kernel launches, and prints one JSON line after a
marker. The tests in this process read that report: a wrong kernel, a crash or a missing launch fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_fp8 import triton_cast
from lightning_fp8.quantize import cast_statistics, cast_with_statistics, saturated_cast
from lightning_fp8.recipe import E4M3, E5M2, FP8_MAX, amax_to_scale
from lightning_fp8.triton_cast import BLOCK_SIZE, triton_cast_with_statistics, use_triton

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


def _run_in_interpreter() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run this with TRITON_INTERPRET=1"
    import lightning_fp8.quantize as cast_module

    kernel = triton_cast._kernel()
    launches: list[object] = []

    class CountingKernel:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    triton_cast._kernel = CountingKernel  # type: ignore[assignment]
    cases = _cases()

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

    report = {"kernel_type": type(kernel).__name__}
    report["cases"] = run_cases(triton_cast_with_statistics, list(cases))
    # Through the dispatch point, as on CUDA: cast_with_statistics must call the kernel.
    cast_module.use_triton = lambda x: True
    report["dispatch"] = run_cases(cast_with_statistics, DISPATCH_CASES)
    # The int64-index variant (tensors of 2**31 elements and more), forced on small tensors.
    triton_cast._MAX_INT32_NUMEL = 0
    report["int64_index"] = run_cases(triton_cast_with_statistics, INT64_INDEX_CASES)
    print(MARKER + json.dumps(report), flush=True)


@pytest.fixture(scope="module")
def interpreter_report() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())], env=env, capture_output=True, text=True, timeout=600
    )
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


def test_package_imports_and_casts_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, lightning_fp8\n"
        "from lightning_fp8.quantize import cast_with_statistics\n"
        "from lightning_fp8.triton_cast import _triton_available\n"
        "assert not _triton_available()\n"
        "data, counts = cast_with_statistics(torch.tensor([1.0, 1e9, 0.0]), torch.tensor(1.0), torch.float8_e4m3fn)\n"
        "assert counts.tolist() == [2, 1, 0], counts\n"
        "print('OK')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-4000:]


if __name__ == "__main__":
    _run_in_interpreter()
