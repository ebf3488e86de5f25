"""The eager cast statistics (``_cast_statistics_eager``) against the definitions in ``cast_statistics``' docstring:
every bf16 and fp16 bit pattern, float32 subnormals, wide float32/float64 ranges, per-tensor, row, column and block
scales (0, inf, NaN, tiny, huge), non-contiguous views, with and without flush-to-zero."""

from __future__ import annotations


import pytest
import torch

from lightning_fp8.quantize import _NAN_MAGNITUDE, _cast_statistics_eager, saturated_cast
from lightning_fp8.recipe import FP8_MAX

SPECIAL = [0.0, float("inf"), float("nan"), -1.0, 1e-30, 1e30, 1.0, 2.0**-20, 2.0**20, 3.4e38, 1e-45, 2.0**-126]


def _reference(x, x_scaled, data, overflow_free):
    magnitude = data.view(torch.uint8) & 0x7F
    nonzero = torch.count_nonzero(x != 0)
    if overflow_free:
        overflow = torch.count_nonzero(magnitude >= _NAN_MAGNITUDE[data.dtype])
    else:
        overflow = torch.count_nonzero(~(x_scaled.abs() <= FP8_MAX[data.dtype]))
    underflow = torch.count_nonzero((x != 0) & (magnitude == 0))
    return torch.stack([nonzero, overflow, underflow])


def _check(x, scale, fp8):
    x_scaled = x.to(torch.float32) * scale
    data = saturated_cast(x_scaled, fp8)
    for of in (False, True):
        got = _cast_statistics_eager(x, x_scaled, data, of)
        want = _reference(x, x_scaled, data, of)
        assert torch.equal(got, want), (x.dtype, fp8, of, got.tolist(), want.tolist())


def _all_patterns(dtype):
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return bits.view(dtype).reshape(256, 256)


def _f32_subnormals(n=65536, seed=0):
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(1, 2**23, (n,), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int32) << 31
    return (bits | sign).view(torch.float32).reshape(256, 256)


SOURCES = {
    "bf16_all": lambda: _all_patterns(torch.bfloat16),
    "fp16_all": lambda: _all_patterns(torch.float16),
    "f32_subnormal": _f32_subnormals,
    "f32_random": lambda: torch.randn(256, 256) * torch.logspace(-40, 38, 256).reshape(256, 1),
    "f64_random": lambda: (
        torch.randn(256, 256, dtype=torch.float64) * torch.logspace(-300, 300, 256, dtype=torch.float64).reshape(256, 1)
    ),
}


@pytest.mark.parametrize("flush", [False, True])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("source", list(SOURCES))
def test_eager_counts_equal_the_definitions(source, fp8, flush):
    x = SOURCES[source]()
    # set_flush_denormal returns whether the CPU supports it, not the previous setting: torch's default is off
    torch.set_flush_denormal(flush)
    try:
        for s in SPECIAL:  # tensorwise
            _check(x, torch.tensor(s), fp8)
        g = torch.Generator().manual_seed(1)
        row = torch.tensor(SPECIAL)[torch.randint(0, len(SPECIAL), (256, 1), generator=g)]
        col = torch.tensor(SPECIAL)[torch.randint(0, len(SPECIAL), (1, 256), generator=g)]
        _check(x, row, fp8)
        _check(x, col, fp8)
        _check(x.t(), row, fp8)  # non-contiguous input
        _check(x[::2, 1::3], row[::2], fp8)
        # block scales: (8, 8) blocks of 32 x 32
        blk = torch.tensor(SPECIAL)[torch.randint(0, len(SPECIAL), (8, 8), generator=g)]
        xb = x.reshape(8, 32, 8, 32)
        x_scaled = (xb.to(torch.float32) * blk[:, None, :, None]).reshape(256, 256)[:250, :250]
        data = saturated_cast(x_scaled, fp8)
        for of in (False, True):
            got = _cast_statistics_eager(x[:250, :250], x_scaled, data, of)
            want = _reference(x[:250, :250], x_scaled, data, of)
            assert torch.equal(got, want), (source, "block", of, got.tolist(), want.tolist())
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("source", ["bf16_all", "f32_subnormal", "f32_random"])
def test_compiled_counts_of_self_scaled_casts_equal_the_definitions(source, fp8):
    """Compiled, a cast whose scales came from its own amaxes (``overflow_free``: per tensor, row or column) counts
    from the stored FP8 data (``_cast_statistics_from_stored``, read as float32 values): the same data as eager, and
    the definitions' counts, for every bf16 pattern, float32 subnormals and wide ranges, under every special scale
    (0, inf, NaN, tiny, huge), a tensor's, rows' and columns' (mixed), on a transposed input too."""
    from lightning_fp8.quantize import cast_with_statistics

    x = SOURCES[source]()
    torch._dynamo.reset()  # one code object for every parametrization: its recompilations would add up
    compiled = torch.compile(lambda x, scale: cast_with_statistics(x, scale, fp8, overflow_free=True), fullgraph=True)
    g = torch.Generator().manual_seed(1)
    row = torch.tensor(SPECIAL)[torch.randint(0, len(SPECIAL), (256, 1), generator=g)]
    col = torch.tensor(SPECIAL)[torch.randint(0, len(SPECIAL), (1, 256), generator=g)]
    cases = [(x, torch.tensor(s)) for s in SPECIAL] + [(x, row), (x, col), (x.t(), row)]
    for inp, scale in cases:
        data, counts = compiled(inp, scale)
        x_scaled = inp.to(torch.float32) * scale
        eager = saturated_cast(x_scaled, fp8)
        assert torch.equal(data.view(torch.uint8), eager.view(torch.uint8)), (source, fp8, scale.shape)
        want = _reference(inp, x_scaled, eager, True)
        assert torch.equal(counts, want), (source, fp8, scale.flatten()[:3], counts.tolist(), want.tolist())


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("source", ["bf16_all", "f32_random"])
def test_compiled_counts_of_history_scaled_casts_equal_the_definitions(source, fp8):
    """Compiled, a ``delayed`` cast (the history's scale where usable, else the tensor's own amax's) counts from the
    stored FP8 data (as float32 values), its history overflows from ``x``: the definitions' counts under every
    special history scale (usable; a finite one saturates elements), and with the history not usable (the own-amax
    scale)."""
    from lightning_fp8.quantize import cast_with_statistics
    from lightning_fp8.recipe import amax_to_scale

    x = SOURCES[source]()
    torch._dynamo.reset()

    def cast(x, history_scale, usable):
        own = amax_to_scale(x.abs().amax().float(), FP8_MAX[fp8])
        scale = torch.where(usable, history_scale, own)
        data, counts = cast_with_statistics(x, scale, fp8, history=(history_scale, usable))
        return data, counts, scale

    compiled = torch.compile(cast, fullgraph=True)
    for s in SPECIAL:
        for usable in (True, False):
            data, counts, scale = compiled(x, torch.tensor([s]), torch.tensor([usable]))
            x_scaled = x.to(torch.float32) * scale
            eager = saturated_cast(x_scaled, fp8)
            assert torch.equal(data.view(torch.uint8), eager.view(torch.uint8)), (source, fp8, s, usable)
            want = _reference(x, x_scaled, eager, False)  # overflow as defined: not |x * scale| <= fp8_max
            assert torch.equal(counts, want), (source, fp8, s, usable, counts.tolist(), want.tolist())


@pytest.mark.parametrize("reader", ["product", "bytes"])
def test_compiled_cpu_counts_read_the_fp8_data_in_vector_code(reader):
    """Inductor's C++ backend reinterprets FP8 as bytes through a scalar copy of every vector (``bit_cast<uint8_t>``
    in a loop over a stack buffer): counted from the bytes, a compiled Llama-style step on a CPU took about a sixth
    more time than torchao's. The product's counts read the FP8 data as float32 values, which that backend converts
    in vector code; ``bytes`` counts the same elements from the bytes (and shows the scalar copy, so the check can
    fail)."""
    from torch._inductor.utils import run_and_get_code

    from lightning_fp8.quantize import cast_with_statistics

    torch._dynamo.reset()
    x = torch.randn(64, 256)
    x[0, :2] = torch.tensor([0.0, 1e-30])

    def cast(x):
        scale = 448.0 / x.abs().amax().clamp(min=1e-12)
        if reader == "product":
            return cast_with_statistics(x, scale, torch.float8_e4m3fn, overflow_free=True)
        data = saturated_cast(x * scale, torch.float8_e4m3fn)
        magnitude = data.view(torch.uint8) & 0x7F
        nonzero = (x != 0).sum()
        return data, torch.stack([nonzero, (magnitude == 0x7F).sum(), (magnitude == 0).sum() - (x.numel() - nonzero)])

    (data, counts), (code, *_) = run_and_get_code(torch.compile(cast, fullgraph=True, dynamic=False), x)
    x_scaled = x * (448.0 / x.abs().amax().clamp(min=1e-12))
    assert torch.equal(counts, _reference(x, x_scaled, saturated_cast(x_scaled, torch.float8_e4m3fn), True))
    assert counts.tolist() == [x.numel() - 1, 0, 1]  # the zero left out, the underflow counted
    scalar_byte_copy = "bit_cast<uint8_t>" in code
    assert scalar_byte_copy == (reader == "bytes"), code


@pytest.mark.parametrize("history", [False, True], ids=["self-scaled", "delayed"])
def test_compiled_gpu_counts_never_read_fp8_data_as_bytes(history):
    """The Triton code inductor writes for a GPU (written here on the CPU, ``benchmarks/gpu_kernels.py``) reads no FP8
    value as bytes (``.to(tl.uint8, bitcast=True)``). On the H200 (torch 2.11, Triton 3.6, CUDA 13.0's ``ptxas``),
    ptxas crashed (SIGSEGV) compiling a cast kernel that stored its FP8 data and tested the same values as bytes to
    count them: compiled ``rowwise`` and checkpointed ``tensorwise`` blocks failed to compile. The same kernel with the
    values tested as float32 compiled (offline, with those two versions)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from compiled_saved import gpu_gemm_path
    from gpu_kernels import triton_code_on_cpu

    from lightning_fp8.quantize import cast_with_statistics
    from lightning_fp8.recipe import amax_to_scale

    x = torch.randn(64, 256)

    def cast(x, history_scale):
        own = amax_to_scale(x.abs().amax(), 448.0)
        if history:
            usable = history_scale.isfinite()
            scale = torch.where(usable, history_scale, own)
            return cast_with_statistics(x, scale, torch.float8_e4m3fn, history=(history_scale, usable))
        return cast_with_statistics(x, own, torch.float8_e4m3fn, overflow_free=True)

    sources: dict[str, str] = {}
    torch._dynamo.reset()
    with gpu_gemm_path(), triton_code_on_cpu(sources):
        torch.compile(cast, fullgraph=True, dynamic=False)(x, torch.tensor(4.0))
    assert sources and any("tl.float8e4nv" in code for code in sources.values())  # the cast is in the Triton code
    as_bytes = [name for name, code in sources.items() if "tl.uint8, bitcast=True" in code]
    assert not as_bytes, as_bytes
