"""The block-scaled recipes (``blockwise``: DeepSeek-V3 tiles, ``mxfp8``: OCP MX blocks of 32): recipe rules, the
scale formulas against independent float64 implementations, the CUDA operand contract of each scaling type, the
numerics against torchao's prototypes, the outlier case they exist for, and odd shapes."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

import lightning_fp8 as lf
from lightning_fp8 import FP8Linear, FP8Recipe, gemm
from lightning_fp8.gemm import ScaledMMContractError, check_block_scaled_mm_contract, fp8_block_mm, swizzle_mx_scales
from lightning_fp8.quantize import N_AMAX_BINS, amax_bins, quantize
from lightning_fp8.recipe import BLOCK_RECIPES, E4M3, E5M2, GRAD_OUTPUT, INPUT, WEIGHT
from utils import reference_amax_bins

E4 = E4M3


# --- recipe rules ---------------------------------------------------------------------------------------------------


def test_block_recipes_resolve_their_defaults():
    b, m = FP8Recipe(name="blockwise"), FP8Recipe(name="mxfp8")
    assert (b.fp8_format, b.power_of_2_scale, b.amax_compute_algo) == ("e4m3", False, None)
    assert (m.fp8_format, m.power_of_2_scale) == ("e4m3", True)
    assert FP8Recipe(name="blockwise", power_of_2_scale=True).round_to_power_of_2
    hybrid = FP8Recipe(name="mxfp8", fp8_format="hybrid")  # E5M2 gradients are an MX option
    assert [hybrid.dtype(r) for r in (INPUT, WEIGHT, GRAD_OUTPUT)] == [E4, E4, E5M2]
    assert FP8Recipe.from_dict(hybrid.to_dict()) == hybrid


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "blockwise", "fp8_format": "hybrid"}, r"fp8_format='hybrid' has no effect with recipe='blockwise'.*E4M3"),
        ({"name": "mxfp8", "power_of_2_scale": False}, r"power_of_2_scale=False has no effect with recipe='mxfp8'.*E8M0"),
        ({"name": "blockwise", "margin": 1}, r"margin=1 has no effect with recipe='blockwise'"),
        ({"name": "mxfp8", "amax_compute_algo": "max"}, r"amax_compute_algo='max' has no effect with recipe='mxfp8'"),
    ],
)
def test_invalid_block_recipe_settings_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FP8Recipe(**kwargs)
    with pytest.raises(ValueError, match=message):  # and through the plugin, as yaml would build it
        lf.FP8Precision(recipe=kwargs.pop("name"), **kwargs)


def test_cast_specs_tile_every_operand_along_its_gemms_reduction_dimension():
    b = FP8Recipe(name="blockwise").cast_specs()
    assert [s.block for s in b.forward] == [(1, 128), (128, 128)]  # x (M, K) tiles along K; W blocks
    assert [s.block for s in b.grad_input] == [(1, 128), (128, 128)]  # grad_out (M, N) tiles along N
    assert [s.block for s in b.grad_weight] == [(128, 1), (128, 1)]  # grad_out and x tiled along the tokens
    assert b.weight_reused and not b.input_reused and not b.grad_output_reused and not b.history_scaled
    m = FP8Recipe(name="mxfp8").cast_specs()
    assert [s.block for s in m.forward] == [(1, 32), (1, 32)]
    assert [s.block for s in m.grad_input] == [(1, 32), (32, 1)]  # W (N, K) reduced over N in grad_input
    assert [s.block for s in m.grad_weight] == [(32, 1), (32, 1)]
    assert all(s.scale_format == "e8m0" and s.power_of_2 for pair in (m.forward, m.grad_input) for s in pair)


# --- the scale formulas, against float64 implementations written here ---------------------------------------------


def _blocks64(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float64 amax of each (bm, bn) block of x, partial edge blocks over the elements they have."""
    bm, bn = block
    rows, cols = x.shape
    out = torch.empty(math.ceil(rows / bm), math.ceil(cols / bn), dtype=torch.float64)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = x[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].double().abs().max()
    return out


@pytest.mark.parametrize("block", [(1, 128), (128, 1), (128, 128)])
def test_blockwise_scale_is_fp8_max_over_the_tile_amax(block):
    x = torch.randn(200, 300) * torch.logspace(-3, 3, 300)  # every tile a different range
    spec = _spec("blockwise", block)
    q = quantize(x, spec)
    amax = _blocks64(x, block)
    exact = 448.0 / amax.clamp(min=1e-12)
    assert q.scale.shape == amax.shape
    assert torch.all(q.scale.double() <= exact) and torch.all(q.scale.double() > exact * (1 - 2**-23))
    assert q.stats.counts[1] == 0  # a tile's own amax never saturates


@pytest.mark.parametrize("block", [(1, 32), (32, 1)])
def test_mx_scale_is_the_rounded_up_power_of_two_of_the_ocp_block(block):
    x = torch.randn(100, 96) * torch.logspace(-20, 20, 96)
    x[3, :32] = 448.0 * 2.0**5  # exactly a power of two times fp8_max: e = 5, no saturation
    x[5, :32] = 449.0  # just above fp8_max: the decoding scale rounds up to 2
    spec = _spec("mxfp8", block)
    q = quantize(x, spec)
    amax = _blocks64(x, block)
    e = torch.ceil(torch.log2(amax.clamp(min=1e-12) / 448.0))  # NVIDIA's MXFP8 rule (OCP block, rounded up)
    assert torch.equal(q.scale.double(), torch.exp2(-e))
    assert q.stats.counts[1] == 0  # the rounded-up scale never saturates an element
    assert torch.equal(q.scale.reciprocal().to(gemm.E8M0).float(), q.scale.reciprocal())  # E8M0-exact
    if block == (1, 32):
        assert q.scale[3, 0] == 2.0**-5 and q.scale[5, 0] == 0.5


def _spec(recipe: str, block: tuple[int, int]) -> lf.recipe.CastSpec:
    import dataclasses

    return dataclasses.replace(FP8Recipe(name=recipe).cast_specs().forward[0], block=block)


def test_amax_histogram_bins_powers_of_two():
    amax = torch.tensor([0.0, 1.0, 1.99, 2.0, 0.25, 3e-30, 1e30, float("inf"), float("nan")])
    bins = amax_bins(amax)
    assert bins.shape == (N_AMAX_BINS,) and int(bins.sum()) == amax.numel()
    nonzero = {int(i): int(bins[i]) for i in bins.nonzero().flatten()}
    zero_bin, one_bin, last = 0, 1 + 0 - lf.quantize.AMAX_BIN_LOW, N_AMAX_BINS - 1
    assert nonzero[zero_bin] == 1 and nonzero[one_bin] == 2 and nonzero[one_bin + 1] == 1 and nonzero[one_bin - 2] == 1
    assert nonzero[last] == 2  # inf and NaN
    assert nonzero[1] == 1 and nonzero[last - 1] == 1  # 3e-30 and 1e30 clamp into the outer bins


def test_amax_histogram_of_any_float32_matches_the_bin_rule():
    """Every float32 bit pattern (random ones: subnormals, negative values, NaNs with either sign) lands in the bin
    the documented rule gives its magnitude, eager and compiled alike."""
    torch.manual_seed(0)
    values = torch.randint(-(2**31), 2**31 - 1, (50000,), dtype=torch.int32).view(torch.float32)
    values = torch.cat([values, torch.tensor([0.0, -0.0, 1e-40, -1e-40, 2.0**-126, 2.0**-65, 2.0**-64, 2.0**63, 2.0**64])])
    expected = reference_amax_bins(values)
    assert torch.equal(amax_bins(values), expected)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(amax_bins, fullgraph=True, backend="aot_eager")(values), expected)


def test_amax_histogram_is_six_kernels_eager():
    """Eager, one histogram (at every row-wise or block cast with statistics) is six kernels: a GPU launches each
    one, and the formula with ``frexp`` and ``isfinite`` took about twenty."""
    from torch.utils._python_dispatch import TorchDispatchMode

    free = {"view", "_unsafe_view", "detach", "expand", "scalar_tensor", "reshape"}  # no kernel: views, CPU scalars

    class Kernels(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] not in free:
                self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    amax = torch.rand(4096, 1) * 10
    amax_bins(amax)  # the lookup table is made once per device
    with Kernels() as kernels:
        amax_bins(amax)
    assert len(kernels.ops) == 6, kernels.ops


def test_amax_histogram_constants_survive_modes(monkeypatch):
    """The eager histogram's per-device constants: made under ``inference_mode`` they still serve a training step
    after it; made under a ``FakeTensorMode`` (a tracer) they are not kept, so a real call after it counts right; on
    the meta device the histogram has its shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(lf.quantize, "_CONSTANTS", {})
    amax = torch.tensor([0.0, 1.5, 3.0, float("nan")])
    expected = torch.zeros(N_AMAX_BINS, dtype=torch.int64)
    one_bin = 1 - lf.quantize.AMAX_BIN_LOW
    expected[[0, one_bin, one_bin + 1, N_AMAX_BINS - 1]] = 1
    with FakeTensorMode() as mode:
        assert amax_bins(mode.from_tensor(amax)).shape == (N_AMAX_BINS,)
    assert lf.quantize._CONSTANTS == {}
    with torch.inference_mode():
        assert torch.equal(amax_bins(amax), expected)
    assert torch.equal(amax_bins(amax), expected)
    w = torch.randn(8, 4, requires_grad=True)  # a training-mode cast after it, with autograd recording
    q = quantize(w, FP8Recipe(name="rowwise").cast_specs().forward[1])
    assert int(q.stats.amax_bins.sum()) == 8
    assert amax_bins(torch.rand(5, device="meta")).shape == (N_AMAX_BINS,)
    # a tracer after real calls (the table is cached by now): its FakeTensors never meet the real table
    with FakeTensorMode() as mode:
        assert amax_bins(mode.from_tensor(amax)).shape == (N_AMAX_BINS,)
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(amax_bins, tracing_mode="symbolic")(amax)
    assert torch.equal(traced(amax), expected)


# --- GEMM: emulation math and the CUDA contract of each scaling type ------------------------------------------------


@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
@pytest.mark.parametrize(("m", "k", "n"), [(256, 256, 256), (200, 300, 130), (7, 40, 24), (1, 1, 1)])
def test_block_gemm_is_the_float64_product_of_the_dequantized_operands(recipe, m, k, n):
    specs = FP8Recipe(name=recipe).cast_specs()
    x, w = torch.randn(m, k), torch.randn(n, k)
    qx, qw = quantize(x, specs.forward[0]), quantize(w, specs.forward[1])
    out = fp8_block_mm(qx.data, qw.data.t(), qx.scale, qw.scale.t(), qx.block, qw.t().block, torch.float32)
    # float64 dequantization of the same FP8 bits (divided by each block's scale), float64 product
    exact = (qx.data.double() / _expand(qx.scale, qx.block, (m, k))) @ (qw.data.double() / _expand(qw.scale, qw.block, (n, k))).t()
    assert torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    return scale.double().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


@pytest.mark.parametrize(
    ("recipe", "kinds"),
    [
        ("blockwise", [("1x128", "128x128"), ("1x128", "128x128"), ("1x128", "1x128")]),
        ("mxfp8", [("1x32", "1x32")] * 3),
    ],
)
@pytest.mark.parametrize("shape", [(2, 8, 64), (5, 64), (3, 7, 208)])  # 208: K not a multiple of 128
def test_contract_checked_on_every_gemm_of_a_block_scaled_layer(monkeypatch, recipe, kinds, shape):
    calls = []
    original = gemm.check_block_scaled_mm_contract

    def counting(a, b, scale_a, kind_a, scale_b, kind_b, out_dtype, use_fast_accum=False):
        calls.append((kind_a, kind_b, a.dtype, b.dtype, scale_a.dtype, out_dtype))
        original(a, b, scale_a, kind_a, scale_b, kind_b, out_dtype, use_fast_accum)

    monkeypatch.setattr(gemm, "check_block_scaled_mm_contract", counting)
    k = shape[-1]
    model = nn.Sequential(nn.Linear(k, 32), nn.ReLU(), nn.Linear(32, 48))
    lf.convert_to_fp8(model, recipe=recipe)
    x = torch.randn(*shape, requires_grad=True)
    with lf.fp8_autocast():
        y = model(x)
    y.square().sum().backward()
    # per layer: forward and grad_input (1x128 x 128x128), grad_weight (1x128 x 1x128); MX: 1x32 everywhere
    assert len(calls) == 6 and sorted(set(c[:2] for c in calls)) == sorted(set(kinds))
    assert all(c[5] == torch.bfloat16 for c in calls)  # the block kernels output bfloat16
    want_scale = torch.float32 if recipe == "blockwise" else gemm.E8M0
    assert all(c[4] == want_scale for c in calls)
    assert torch.isfinite(x.grad).all()


def _operands(m=256, k=256, n=256, dtype=E4):
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(n, k).to(dtype).t()  # column-major (K, N)
    return a, b


def test_block_contract_accepts_the_kernel_layouts():
    a, b = _operands()
    sa = torch.ones(2, 256).t()  # (M, K/128) with strides (1, M)
    sb = torch.ones(2, 4).t()  # (round_up(K/128, 4) = 4, N/128 = 2) with strides (1, 4)
    check_block_scaled_mm_contract(a, b, sa, "1x128", sb, "128x128", torch.bfloat16)
    check_block_scaled_mm_contract(a, b, sa, "1x128", torch.ones(2, 256).t(), "1x128", torch.bfloat16)
    mx = torch.ones(256 * 8).to(gemm.E8M0)
    check_block_scaled_mm_contract(a, b, mx, "1x32", mx, "1x32", torch.bfloat16)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda a, b: (a, b, torch.ones(256, 2), "1x128", torch.ones(2, 4).t(), "128x128"), "scale_a must have strides"),
        (lambda a, b: (a, b, torch.ones(2, 256).t(), "1x128", torch.ones(2, 2).t(), "128x128"), "scale_b must have shape \\(4, 2\\)"),
        (lambda a, b: (a, b, torch.ones(2, 256).t().double(), "1x128", torch.ones(2, 4).t(), "128x128"), "scale_a must be float32"),
        (lambda a, b: (a.to(E5M2), b, torch.ones(2, 256).t(), "1x128", torch.ones(2, 4).t(), "128x128"), "needs E4M3 operands"),
        (lambda a, b: (a, b, torch.ones(2, 4).t(), "128x128", torch.ones(2, 4).t(), "128x128"), "no kernel for this pair"),
        (lambda a, b: (a, b.t().contiguous(), torch.ones(2, 256).t(), "1x128", torch.ones(2, 4).t(), "128x128"), "b must be column-major"),
        (lambda a, b: (a, b, torch.ones(256 * 8), "1x32", torch.ones(256 * 8).to(gemm.E8M0), "1x32"), "scale_a must be float8_e8m0fnu"),
        (lambda a, b: (a, b, torch.ones(256 * 7).to(gemm.E8M0), "1x32", torch.ones(256 * 8).to(gemm.E8M0), "1x32"), "swizzled"),
        (lambda a, b: (a, b, torch.ones(256, 8).to(gemm.E8M0).t(), "1x32", torch.ones(256 * 8).to(gemm.E8M0), "1x32"), "swizzled"),
    ],
)
def test_block_contract_rejects_what_the_cuda_kernel_rejects(make, message):
    a, b = _operands()
    with pytest.raises(ScaledMMContractError, match=message):
        check_block_scaled_mm_contract(*make(a, b), torch.bfloat16)


def test_block_contract_rejects_the_shapes_cublas_refused():
    """M=91 and a 128x128-scaled N=304 (cuBLAS: CUBLAS_STATUS_NOT_SUPPORTED on an H200): fp8_block_mm pads them, so
    the odd-shape layer tests pass this check on every GEMM."""
    sa, sb = torch.ones(2, 256).t(), torch.ones(2, 4).t()
    a, b = _operands(m=91)
    with pytest.raises(ScaledMMContractError, match="M must be a multiple of 16"):
        check_block_scaled_mm_contract(a, b, torch.ones(2, 91).t(), "1x128", sb, "128x128", torch.bfloat16)
    a, b = _operands(n=304)
    with pytest.raises(ScaledMMContractError, match="multiple of 128"):
        check_block_scaled_mm_contract(a, b, sa, "1x128", torch.ones(3, 4).t(), "128x128", torch.bfloat16)
    check_block_scaled_mm_contract(a, b, sa, "1x128", torch.ones(304, 2).t().contiguous().t(), "1x128", torch.bfloat16)


def test_block_contract_rejects_fast_accumulation():
    """CUDA's 1x128 and 128x128 scalings refuse ``use_fast_accum`` (seen on an H200: the blockwise layer's forward
    raised "scaled_gemm doesn't support fast accum with 128x128 blockwise scaling")."""
    a, b = _operands()
    sa, sb = torch.ones(2, 256).t(), torch.ones(2, 4).t()
    check_block_scaled_mm_contract(a, b, sa, "1x128", sb, "128x128", torch.bfloat16, use_fast_accum=False)
    for kind_b, scale_b in (("128x128", sb), ("1x128", torch.ones(2, 256).t())):
        with pytest.raises(ScaledMMContractError, match="does not support fast accumulation"):
            check_block_scaled_mm_contract(a, b, sa, "1x128", scale_b, kind_b, torch.bfloat16, use_fast_accum=True)


_KERNEL_PAIRS = {  # (kind_a, kind_b): block of a in (M, K), block of b in (K, N), recipe
    ("1x128", "128x128"): ((1, 128), (128, 128), "blockwise"),
    ("128x128", "1x128"): ((128, 128), (128, 1), "blockwise"),
    ("1x128", "1x128"): ((1, 128), (128, 1), "blockwise"),
    ("1x32", "1x32"): ((1, 32), (32, 1), "mxfp8"),
}


def _kernel_dequantize(x: torch.Tensor, scale: torch.Tensor, scaling) -> torch.Tensor:
    """float64 ``x`` (outer, K) times its *kernel-layout* decoding scales, read as the CUDA kernel reads them."""
    outer, k = x.shape
    if scaling == torch.nn.functional.ScalingType.BlockWise1x128:  # (outer, K / 128)
        s = scale.double().repeat_interleave(128, 1)
    elif scaling == torch.nn.functional.ScalingType.BlockWise128x128:  # (round_up(K / 128, 4), outer / 128)
        s = scale.double().t().repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:  # BlockWise1x32: swizzled (SWIZZLE_32_4_4 is its own inverse permutation), E8M0
        rows, cols = -(-outer // 128) * 128, -(-(k // 32) // 4) * 4
        s = scale.float().reshape(rows // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(rows, cols)
        s = s.double().repeat_interleave(32, 1)
    return x.double() * s[:outer, :k]


@pytest.mark.skipif(getattr(torch.nn.functional, "scaled_mm", None) is None, reason="no F.scaled_mm in this torch")
@pytest.mark.parametrize("pair", sorted(_KERNEL_PAIRS))
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(91, 200, 304), (1, 512, 16), (16, 512, 64), (304, 91, 128), (129, 640, 129), (256, 128, 17), (17, 32, 16)],
)
def test_native_block_gemm_arguments_pass_torchs_checks_and_compute_the_product(monkeypatch, pair, m, k, n):
    """What the native path would send to ``F.scaled_mm``: torch's own checks (its meta function, run on meta tensors
    with the same shapes and strides), the exact scale strides the CUDA kernel wants (a size-1 dimension included:
    the H200 refused strides (1, 1)), no fast accumulation, and the result of the kernel's math on those layouts
    (float64) is the product of the dequantized operands, sliced back to (M, N)."""
    F = torch.nn.functional
    block_a, block_b, recipe = _KERNEL_PAIRS[pair]
    sent = []

    def kernel(a, b, scale_a, scaling_a, scale_b, scaling_b, swizzle_a=None, swizzle_b=None, output_dtype=None,
               use_fast_accum=None):
        assert use_fast_accum is False
        meta = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        out = F.scaled_mm(meta(a), meta(b), meta(scale_a), scaling_a, meta(scale_b), scaling_b, swizzle_a=swizzle_a,
                          swizzle_b=swizzle_b, output_dtype=output_dtype, use_fast_accum=False)
        for scale, scaling, outer in ((scale_a, scaling_a, a.shape[0]), (scale_b, scaling_b, b.shape[1])):
            if scaling == F.ScalingType.BlockWise1x128:
                assert scale.stride() == (1, outer)
            elif scaling == F.ScalingType.BlockWise128x128:
                assert scale.stride() == (1, scale.shape[0])
        sent.append(pair)
        product = _kernel_dequantize(a, scale_a, scaling_a) @ _kernel_dequantize(b.t(), scale_b, scaling_b).t()
        assert out.shape == product.shape and out.dtype == output_dtype
        return product.to(output_dtype)

    monkeypatch.setattr(gemm, "gemm_path", lambda device, recipe="tensorwise": "native")
    monkeypatch.setattr(gemm, "_PUBLIC_SCALED_MM", kernel)
    torch.manual_seed(0)
    x, w = torch.randn(m, k), torch.randn(n, k)
    qx = quantize(x, dataclasses.replace(FP8Recipe(name=recipe).cast_specs().forward[0], block=block_a))
    qw = quantize(w, dataclasses.replace(FP8Recipe(name=recipe).cast_specs().forward[0], block=block_b[::-1]))
    out = fp8_block_mm(qx.data, qw.data.t(), qx.scale, qw.scale.t(), block_a, block_b, torch.bfloat16)
    assert sent == [pair] and out.shape == (m, n) and out.dtype == torch.bfloat16
    x_deq = qx.data.double() / _expand(qx.scale, block_a, (m, k))
    w_deq = qw.data.double() / _expand(qw.scale, block_b[::-1], (n, k))
    exact = x_deq @ w_deq.t()
    assert torch.allclose(out.double(), exact, rtol=1e-2, atol=1e-3 * exact.abs().max().item())


def test_block_contract_wants_whole_tiles_of_a_128x128_scaled_a():
    """(128x128, 1x128): torch checks ``M // 128`` scale columns, so M must be whole tiles (fp8_block_mm pads it)."""
    sa, sb = torch.ones(1, 4).t(), torch.ones(2, 256).t()  # (round_up(K/128, 4), ceil(M/128)), (N, K/128)
    a, b = _operands(m=96)
    with pytest.raises(ScaledMMContractError, match="M of a 128x128-scaled a must be a multiple of 128"):
        check_block_scaled_mm_contract(a, b, sa, "128x128", sb, "1x128", torch.bfloat16)
    a, b = _operands(m=128)
    check_block_scaled_mm_contract(a, b, sa, "128x128", sb, "1x128", torch.bfloat16)


def test_mx_scales_are_swizzled_as_cublas_reads_them():
    rows, cols = 130, 5  # padded to 256 x 8: two row tiles, two column tiles
    scale = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    flat = swizzle_mx_scales(scale)
    assert flat.shape == (256 * 8,)
    for r, c in [(0, 0), (1, 0), (31, 3), (32, 0), (127, 3), (128, 0), (129, 4), (5, 4)]:
        tile = (r // 128) * 2 + c // 4  # tiles in row-major order
        rr, cc = r % 128, c % 4
        assert flat[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] == scale[r, c]
    assert flat[0 * 512 + (2 % 32) * 16 + 0 * 4 + 1 + 512 * 3] == 1.0  # padding decodes as 2**0


# --- numerics: against torchao's prototypes, and the outlier case ---------------------------------------------------


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref = ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got.double()).pow(2).sum()))


@pytest.fixture(scope="module")
def gemm_setup():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 512, generator=gen)
    w = torch.randn(1024, 512, generator=gen) / math.sqrt(512)
    go = torch.randn(1024, 1024, generator=gen)
    ref = (x.double() @ w.double().t(), go.double() @ w.double(), go.double().t() @ x.double())
    return x, w, go, ref


def _ours(recipe: str, x, w, go):
    layer = FP8Linear(512, 1024, bias=False, recipe=recipe)
    with torch.no_grad():
        layer.weight.copy_(w)
    xx = x.clone().requires_grad_()
    with lf.fp8_autocast():
        y = layer(xx)
    y.backward(go)
    return y.detach(), xx.grad, layer.weight.grad


def _torchao_blockwise(x, w, go):
    """torchao's prototype DeepSeek quantizers (their torch reference functions run on CPU; their GEMMs are Triton or
    CUDA only, so the products of the dequantized operands are taken in float64 here)."""
    from torchao.prototype.blockwise_fp8_training import kernels as k

    xq, xs = k.torch_blockwise_scale_act_quant_lhs(x.contiguous(), 128)  # (M, K), decoding scales (M, K/128)
    wq, ws = k.torch_blockwise_scale_weight_quant(w.contiguous(), 128)  # (N, K), (N/128, K/128)
    goq, gos = k.torch_blockwise_scale_act_quant_lhs(go.contiguous(), 128)  # (M, N) tiles along N
    go_t, go_ts = k.torch_blockwise_scale_act_quant_rhs(go.contiguous(), 128)  # tiles along M: (M/128, N)
    x_t, x_ts = k.torch_blockwise_scale_act_quant_rhs(x.contiguous(), 128)  # (M/128, K)

    def deq(q, s, block):
        return q.double() * s.double().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)

    xd, wd, god = deq(xq, xs, (1, 128)), deq(wq, ws, (128, 128)), deq(goq, gos, (1, 128))
    return xd @ wd.t(), god @ wd, deq(go_t, go_ts, (128, 1)).t() @ deq(x_t, x_ts, (128, 1))


def _torchao_mx(x, w, go):
    """torchao's prototype MX quantizer (``to_mx``, NVIDIA's rounded-up scale ``RCEIL``) and dequantizer, float64
    products (their MX GEMM needs a Blackwell GPU)."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    def mx(t):  # blocks of 32 along the last dimension
        scale, data = to_mx(t.contiguous(), E4, 32, ScaleCalculationMode.RCEIL)
        return to_dtype(data, scale, E4, 32, torch.float32).double()

    return mx(x) @ mx(w).t(), mx(go) @ mx(w.t()).t(), mx(go.t()) @ mx(x.t()).t()


@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_sqnr_at_least_torchao_prototype(gemm_setup, recipe):
    x, w, go, ref = gemm_setup
    ours = _ours(recipe, x, w, go)
    theirs = (_torchao_blockwise if recipe == "blockwise" else _torchao_mx)(x, w, go)
    names = ("output", "grad_input", "grad_weight")
    for name, r, a, b in zip(names, ref, ours, theirs):
        ours_db, theirs_db = _sqnr(r, a), _sqnr(r, b)
        print(f"{recipe} {name}: ours {ours_db:.2f} dB, torchao prototype {theirs_db:.2f} dB")
        assert ours_db >= theirs_db - 0.5, f"{recipe} {name}: ours {ours_db:.2f} dB < torchao {theirs_db:.2f} - 0.5"
        assert 20 < ours_db < 36  # FP8, not a high-precision fallback


def _per_token_sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return float((10 * torch.log10(ref.pow(2).sum(-1) / (ref - got).pow(2).sum(-1))).mean())


def test_massive_activation_outliers_need_block_scaling():
    """Two tokens 1e5 times larger than the rest (the "massive activations" of large language models): per-tensor
    scaling flushes the other tokens; one scale per tile or block keeps them."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=gen)
    x[[3, 100]] *= 1e5
    w = torch.randn(256, 512, generator=gen) / math.sqrt(512)
    ref = x.double() @ w.double().t()
    results = {}
    for recipe in lf.recipe.RECIPES:
        layer = FP8Linear(512, 256, bias=False, recipe=recipe)
        with torch.no_grad():
            layer.weight.copy_(w)
        with lf.fp8_autocast(), torch.no_grad():
            results[recipe] = _per_token_sqnr(ref, layer(x))
    print("mean per-token output SQNR (dB):", {k: round(v, 1) for k, v in results.items()})
    for block in BLOCK_RECIPES:
        assert results[block] >= results["tensorwise"] + 10, results
        assert results[block] > 25, results


# --- odd shapes, empty batches, dtypes ------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
# (4, 512) -> 64 and (4, 64) -> 512: one 128x128 weight tile across N and a whole number of 4 K-blocks, the case where
# the 128x128 kernel scales kept the strides (1, 1) of a size-1 dimension and the exact-stride contract refused them
@pytest.mark.parametrize(
    ("shape", "in_f", "out_f"),
    [((1, 1), 1, 1), ((3, 5), 5, 3), ((2, 3, 129), 129, 33), ((0, 16), 16, 8), ((4, 512), 512, 64), ((4, 64), 64, 512)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_linear_shape_runs_forward_and_backward(recipe, shape, in_f, out_f, dtype):
    torch.manual_seed(0)
    plain = nn.Linear(in_f, out_f).to(dtype)
    layer = copy.deepcopy(plain)
    lf.convert_to_fp8(layer, recipe=recipe)
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with lf.fp8_autocast():
        y = layer(x)
    y.float().square().sum().backward()
    plain(x_ref).float().square().sum().backward()
    assert y.shape == (*shape[:-1], out_f) and y.dtype == dtype
    assert x.grad.shape == x.shape and layer.weight.grad.shape == plain.weight.shape
    if x.numel():
        assert torch.allclose(x.grad.float(), x_ref.grad.float(), rtol=0.15, atol=0.15 * x_ref.grad.abs().max().item())
    assert torch.allclose(layer.weight.grad.float(), plain.weight.grad.float(), rtol=0.15, atol=0.15 * (plain.weight.grad.abs().max().item() + 1e-6))


@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_nan_in_one_block_reaches_the_output(recipe):
    layer = FP8Linear(256, 16, recipe=recipe)
    x = torch.randn(4, 256)
    x[1, 7] = float("nan")
    with lf.fp8_autocast(), torch.no_grad():
        y = layer(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()


@pytest.mark.parametrize("recipe", lf.recipe.RECIPES)
def test_grad_weight_is_the_gemm_of_the_backward_casts_bit_for_bit(recipe):
    """The input is saved in FP8 as the grad_weight GEMM casts it (cast in the forward for the recipes whose backward
    casts it differently): the gradient is bit for bit the GEMM of the casts a backward-time quantization makes."""
    torch.manual_seed(0)
    layer = FP8Linear(160, 48, recipe=recipe)
    x = torch.randn(3, 70, 160, requires_grad=True)
    go = torch.randn(3, 70, 48)
    with lf.fp8_autocast():
        y = layer(x)
    y.backward(go)
    specs = layer.fp8_state.table.specs
    go_spec, x_spec = specs.grad_weight
    x2d, go2d = x.detach().reshape(-1, 160), go.reshape(-1, 48)
    history = (layer.fp8_scale[GRAD_OUTPUT].clone(), layer.fp8_initialized[GRAD_OUTPUT].clone())
    if go_spec.scale_source == "history":  # delayed: the forward's first cast ran on an empty history
        history = (history[0], torch.tensor(False))
    q_go = quantize(go2d, go_spec, statistics=False, history_scale=history[0], history_ready=history[1])
    q_x = quantize(x2d, x_spec, statistics=False, history_scale=torch.ones(()), history_ready=torch.tensor(False))
    expected = gemm.fp8_mm(
        q_go.data.t().contiguous(),
        q_x.data.t().contiguous().t(),
        q_go.scale.t().contiguous(),
        q_x.scale,
        gemm.scaled_mm_out_dtype(torch.float32, rowwise=go_spec.granularity != "tensor"),
        block_a=go_spec.transposed_block(),
        block_b=x_spec.block,
    ).float()
    assert torch.equal(layer.weight.grad, expected)


# --- statistics through a real Trainer -------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_stats_callback_reports_block_statistics_to_real_loggers(tmp_path, recipe):
    import csv
    import os

    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from models import TinyDecoder, loader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from utils import make_trainer

    from lightning_fp8.stats import block_amax_median

    torch.manual_seed(0)
    csv_logger, tb_logger = CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")
    model = TinyDecoder()
    trainer = make_trainer(
        lf.FP8Precision(recipe=recipe), callbacks=[lf.FP8StatsCallback(log_every_n_steps=3)], logger=[csv_logger, tb_logger],
        max_steps=6, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, loader(n=8_000))
    with open(os.path.join(csv_logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("fp8/loss_scale")]
    assert [int(r["step"]) for r in rows] == [2, 5]
    layer = model.blocks[0].fc
    table, index = layer.fp8_state.table, layer.fp8_state.index
    bins = table.amax_bins[index]  # cumulative over the run, per role
    for r, role in enumerate(lf.recipe.ROLES):
        # the interval's median block amax lies below the largest (the tensor's amax)
        median = float(rows[-1][f"fp8/blocks.0.fc/{role}/block_amax_median"])
        assert 0 < median <= float(rows[-1][f"fp8/blocks.0.fc/{role}/amax"])
        assert 0.0 <= float(rows[-1][f"fp8/blocks.0.fc/{role}/overflow_frac"]) <= 1.0
    # every cast's blocks are in the histogram: one count per block of each cast
    spec = table.specs.forward[0]
    tokens = 8 * 32
    blocks_per_cast = tokens * math.ceil(64 / spec.block[1])
    assert int(bins[INPUT].sum()) == 6 * blocks_per_cast
    assert block_amax_median(bins[INPUT].tolist()) is not None
    events = EventAccumulator(tb_logger.log_dir, size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    assert "fp8/blocks.0.fc/input/block_amax_log2" in events.Tags()["histograms"]
    assert "fp8/blocks.0.fc/input/block_amax_median" in events.Tags()["scalars"]
    histogram = events.Histograms("fp8/blocks.0.fc/input/block_amax_log2")[-1].histogram_value
    assert histogram.num == 6 * blocks_per_cast


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_a_state_saved_before_the_amax_histograms_loads(recipe):
    """lightning-fp8 0.2 saved no ``amax_bins``: such a state loads, with empty histograms."""
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    lf.convert_to_fp8(model, recipe=recipe)
    with lf.fp8_autocast():
        model(torch.randn(4, 32)).sum().backward()
    state = lf.fp8_state_dict(model)
    for table in state["tables"]:
        del table["amax_bins"]
    fresh = copy.deepcopy(model)
    lf.load_fp8_state_dict(fresh, state)
    table = fresh[0].fp8_state.table
    assert torch.equal(table.scale, model[0].fp8_state.table.scale)
    assert int(table.amax_bins.sum()) == 0 and table.amax_bins.shape[-1] == (N_AMAX_BINS if recipe == "blockwise" else 0)


def test_interval_block_amax_median_starts_at_the_baseline():
    """take_baseline sets the histogram's baseline too: the first interval holds only its own casts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128))
    lf.convert_to_fp8(model, recipe="blockwise")
    with lf.fp8_autocast(), torch.no_grad():
        for _ in range(3):
            model(torch.randn(256, 128) * 1024.0)  # before the baseline: block amaxes near 2**12
    stats = lf.FP8Stats(model)
    stats.take_baseline()
    with lf.fp8_autocast(), torch.no_grad():
        model(torch.randn(256, 128) * 2.0**-10)  # the interval: block amaxes near 2**-8
    metrics = stats.metrics()
    assert 2.0**-10 <= metrics["fp8/0/input/block_amax_median"] <= 2.0**-7
