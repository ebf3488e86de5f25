"""FP8 GEMM: the CUDA ``torch._scaled_mm`` contract, padding, and the emulation vs the real kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_fp8 as lf
from lightning_fp8.recipe import BLOCK_RECIPES, RECIPES
from lightning_fp8 import gemm
from lightning_fp8.gemm import ScaledMMContractError, check_scaled_mm_contract, emulated_scaled_mm, fp8_mm, gemm_path
from utils import needs_cpu_rowwise_scaled_mm

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8(shape, dtype, spread=30.0, gen=None):
    return (torch.randn(shape, generator=gen) * spread).clamp(-400, 400).to(dtype)


def _row_major(m, k, dtype=E4):
    return _fp8((m, k), dtype)


def _col_major(k, n, dtype=E4):
    return _fp8((n, k), dtype).t()


ONE = torch.tensor(1.0)
BF16 = torch.bfloat16


def _a():
    return _row_major(32, 64)


def _b():
    return _col_major(64, 48)


def _rows(m=32):
    return torch.ones(m, 1)


def _cols(n=48):
    return torch.ones(1, n)


# --- contract ----------------------------------------------------------------------------------------


def test_contract_accepts_valid_operands():
    a, b = _row_major(32, 64), _col_major(64, 48)
    check_scaled_mm_contract(a, b, ONE, ONE, torch.bfloat16)
    check_scaled_mm_contract(a, _col_major(64, 48, E5), ONE, torch.tensor([2.0]), torch.float32)
    check_scaled_mm_contract(_row_major(32, 64, E5), b, ONE, ONE, torch.float32)
    check_scaled_mm_contract(a, b, torch.ones(32, 1), torch.ones(1, 48), torch.bfloat16)
    check_scaled_mm_contract(_row_major(7, 64), b, ONE, ONE, torch.float32)  # M is free
    check_scaled_mm_contract(_row_major(1, 16), _col_major(16, 16), ONE, ONE, torch.float32)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: (_fp8((64, 32), E4).t(), _col_major(64, 48), ONE, ONE, BF16), "a must be row-major"),
        (lambda: (_row_major(32, 64), _fp8((64, 48), E4), ONE, ONE, BF16), "b must be column-major"),
        (lambda: (_row_major(32, 64)[:, ::2], _col_major(32, 48), ONE, ONE, BF16), "a must be row-major"),
        (lambda: (_row_major(32, 24), _col_major(24, 48), ONE, ONE, BF16), "multiples of 16"),
        (lambda: (_row_major(32, 64), _col_major(64, 40), ONE, ONE, BF16), "multiples of 16"),
        (lambda: (_row_major(32, 64, E5), _col_major(64, 48, E5), ONE, ONE, BF16), "E5M2 x E5M2"),
        (lambda: (_a(), _b(), ONE.double(), ONE, BF16), "float32"),
        (lambda: (_a(), _b(), ONE, ONE.bfloat16(), BF16), "float32"),
        (lambda: (_a(), _b(), _rows(), ONE, BF16), "scales"),
        (lambda: (_a(), _b(), torch.ones(1, 32), _cols(), BF16), "scales"),
        (lambda: (_a(), _b(), _rows(), torch.ones(48, 1), BF16), "scales"),
        (lambda: (_a(), _b(), torch.ones(2), torch.ones(2), BF16), "scales"),
        (lambda: (_row_major(32, 64), _col_major(64, 48, E5), _rows(), _cols(), BF16), "E4M3"),
        (lambda: (_row_major(32, 64, E5), _col_major(64, 48), _rows(), _cols(), BF16), "E4M3"),
        (lambda: (_a(), _b(), _rows(), _cols(), torch.float32), "bfloat16"),
        (lambda: (_a(), _b(), _rows(), _cols(), torch.float16), "bfloat16"),
        (lambda: (_row_major(32, 64).float(), _col_major(64, 48), ONE, ONE, BF16), "float8"),
        (lambda: (_row_major(32, 64), _col_major(48, 48), ONE, ONE, BF16), "inner dimensions"),
        (lambda: (_fp8((2, 32, 64), E4), _col_major(64, 48), ONE, ONE, BF16), "2-D"),
    ],
)
def test_contract_rejects(make, message):
    with pytest.raises(ScaledMMContractError, match=message):
        check_scaled_mm_contract(*make())


def test_contract_error_is_an_assertion_error():
    assert issubclass(ScaledMMContractError, AssertionError)


# --- fp8_mm: padding and math ------------------------------------------------------------------------


def _small_int_fp8(shape, dtype=E4, gen=None):
    """Integers in [-8, 8]: products and sums are exact in float32, so any summation order agrees."""
    return torch.randint(-8, 9, shape, generator=gen).float().to(dtype)


@pytest.mark.parametrize(("m", "k", "n"), [(7, 24, 40), (1, 1, 1), (5, 17, 3), (16, 32, 48), (33, 16, 20)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_mm_pads_unaligned_shapes_tensorwise(m, k, n, out_dtype):
    a = _small_int_fp8((m, k))
    b = _small_int_fp8((n, k), E5).t()
    sa, sb = torch.tensor(4.0), torch.tensor(0.5)  # quantization scales: fp8 = x * scale
    out = fp8_mm(a, b, sa, sb, out_dtype)
    expected = (a.double() @ b.double()) / (4.0 * 0.5)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert torch.equal(out, expected.to(out_dtype))


@pytest.mark.parametrize(("m", "k", "n"), [(7, 24, 40), (3, 5, 9)])
def test_fp8_mm_pads_unaligned_shapes_rowwise(m, k, n):
    a = _small_int_fp8((m, k))
    b = _small_int_fp8((n, k)).t()
    sa = torch.exp2(torch.randint(-3, 4, (m, 1)).float())
    sb = torch.exp2(torch.randint(-3, 4, (1, n)).float())
    out = fp8_mm(a, b, sa, sb, torch.bfloat16)
    expected = (a.double() / sa.double()) @ (b.double() / sb.double())
    assert out.shape == (m, n)
    assert torch.equal(out, expected.to(torch.bfloat16))


def test_fp8_mm_random_matches_float64_math():
    a, b = _fp8((7, 24), E4), _fp8((40, 24), E4).t()
    sa, sb = torch.tensor(3.7), torch.tensor(0.11)
    out = fp8_mm(a, b, sa, sb, torch.float32)
    expected = (a.double() @ b.double()) / (sa.double() * sb.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


def test_fp8_mm_padding_equals_unpadded_math():
    # a padded GEMM (7,24)x(24,40) equals the same GEMM on explicitly zero-padded aligned operands
    a, b = _fp8((7, 24), E4), _fp8((40, 24), E4).t()
    sa, sb = torch.tensor(2.3), torch.tensor(0.7)
    out = fp8_mm(a, b, sa, sb, torch.bfloat16)
    a_p = torch.zeros(7, 32).to(E4)
    a_p[:, :24] = a.float().to(E4)
    b_p = torch.zeros(48, 32).to(E4)
    b_p[:40, :24] = b.t().float().to(E4)
    out_p = emulated_scaled_mm(a_p, b_p.t(), sa.reciprocal(), sb.reciprocal(), torch.bfloat16)
    assert torch.equal(out, out_p[:, :40])


def test_fp8_mm_checks_contract_of_what_it_runs(monkeypatch):
    seen = []

    def spy(a, b, scale_a, scale_b, out_dtype):
        seen.append((tuple(a.shape), tuple(b.shape), a.stride(), b.stride()))
        check_scaled_mm_contract(a, b, scale_a, scale_b, out_dtype)

    monkeypatch.setattr(gemm, "check_scaled_mm_contract", spy)
    fp8_mm(_fp8((7, 24), E4), _fp8((40, 24), E4).t(), ONE, ONE, torch.float32)
    assert seen == [((7, 32), (32, 48), (32, 1), (1, 32))]
    with pytest.raises(ScaledMMContractError, match="row-major"):
        fp8_mm(_fp8((32, 7), E4).t(), _fp8((48, 32), E4).t(), ONE, ONE, torch.float32)


def test_gemm_path_on_cpu_is_emulated():
    assert gemm_path("cpu") == "emulated"
    assert lf.gemm_path(torch.device("cpu")) == "emulated"
    assert "emulated" in gemm.describe_gemm_path("cpu")


# --- emulation vs the real torch._scaled_mm (CPU kernel, small shapes only) ----------------------------
#
# The CPU kernel of ``torch._scaled_mm`` applies the scales to the operands before its float32 matmul,
# CUDA's (which the emulation follows) to the product. With power-of-two scales both orders are exact,
# so the results must be identical; with arbitrary scales they agree to float32 rounding.

SHAPES = [(16, 32, 48), (32, 64, 16), (8, 128, 32), (1, 16, 16)]
PAIRS = [(E4, E4), (E4, E5), (E5, E4)]


def _pow2(shape, gen):
    return torch.exp2(torch.randint(-9, -2, shape, generator=gen).float())


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize(("da", "db"), PAIRS)
def test_emulation_matches_scaled_mm_tensorwise(m, k, n, da, db):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    a, b = _fp8((m, k), da, gen=gen), _fp8((n, k), db, gen=gen).t()
    # power-of-two scales: float32 out bit for bit
    ia, ib = _pow2((), gen), _pow2((), gen)
    real = torch._scaled_mm(a, b, scale_a=ia, scale_b=ib, out_dtype=torch.float32)
    assert torch.equal(emulated_scaled_mm(a, b, ia, ib, torch.float32), real)
    # arbitrary scales: float32 out to rounding, bf16 out within one bf16 ulp
    ia, ib = torch.rand((), generator=gen) * 0.01 + 1e-3, torch.rand((), generator=gen) * 0.02 + 1e-3
    real = torch._scaled_mm(a, b, scale_a=ia, scale_b=ib, out_dtype=torch.float32)
    emu = emulated_scaled_mm(a, b, ia, ib, torch.float32)
    torch.testing.assert_close(emu, real, rtol=2e-6, atol=2e-6 * real.abs().max().item())
    real = torch._scaled_mm(a, b, scale_a=ia, scale_b=ib, out_dtype=torch.bfloat16)
    emu = emulated_scaled_mm(a, b, ia, ib, torch.bfloat16)
    assert _max_ulp_diff(emu, real) <= 1


@needs_cpu_rowwise_scaled_mm
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_emulation_matches_scaled_mm_rowwise(m, k, n):
    gen = torch.Generator().manual_seed(7 + m + k * n)
    a, b = _fp8((m, k), E4, gen=gen), _fp8((n, k), E4, gen=gen).t()
    ia, ib = _pow2((m, 1), gen), _pow2((1, n), gen)
    real = torch._scaled_mm(a, b, scale_a=ia, scale_b=ib, out_dtype=torch.bfloat16)
    assert _max_ulp_diff(emulated_scaled_mm(a, b, ia, ib, torch.bfloat16), real) <= 1
    ia = torch.rand((m, 1), generator=gen) * 0.01 + 1e-3
    ib = torch.rand((1, n), generator=gen) * 0.01 + 1e-3
    real = torch._scaled_mm(a, b, scale_a=ia, scale_b=ib, out_dtype=torch.bfloat16)
    assert _max_ulp_diff(emulated_scaled_mm(a, b, ia, ib, torch.bfloat16), real) <= 1


def test_fp8_mm_matches_scaled_mm_with_padding():
    # the padded path against the real kernel on the unpadded operands (the CPU kernel accepts them)
    a, b = _fp8((7, 24), E4), _fp8((40, 24), E5).t()
    sa, sb = torch.tensor(8.0), torch.tensor(0.25)
    real = torch._scaled_mm(a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=torch.float32)
    assert torch.equal(fp8_mm(a, b, sa, sb, torch.float32), real)


def _max_ulp_diff(x: torch.Tensor, y: torch.Tensor) -> int:
    assert x.dtype == y.dtype == torch.bfloat16
    assert torch.equal(torch.isfinite(x), torch.isfinite(y))
    xi, yi = x.view(torch.int16).int(), y.view(torch.int16).int()
    # map sign-magnitude bit patterns to a monotonic integer line
    xi = torch.where(xi < 0, -(xi & 0x7FFF), xi)
    yi = torch.where(yi < 0, -(yi & 0x7FFF), yi)
    return int((xi - yi).abs().max())


# --- every GEMM of an FP8Linear goes through the contract check ------------------------------------------


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r not in BLOCK_RECIPES])  # blocks: test_block_recipes.py
@pytest.mark.parametrize("shape", [(2, 8, 64), (5, 64), (3, 7, 64)])
def test_contract_checked_on_every_gemm_of_fp8_linear(monkeypatch, recipe, shape):
    calls = []
    original = gemm.check_scaled_mm_contract

    def counting(a, b, scale_a, scale_b, out_dtype):
        calls.append((a.dtype, b.dtype, tuple(scale_a.shape), tuple(scale_b.shape), out_dtype))
        original(a, b, scale_a, scale_b, out_dtype)

    monkeypatch.setattr(gemm, "check_scaled_mm_contract", counting)
    emulated = []
    real_emulated = gemm.emulated_scaled_mm
    monkeypatch.setattr(gemm, "emulated_scaled_mm", lambda *a: emulated.append(1) or real_emulated(*a))

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 48))
    lf.convert_to_fp8(model, recipe=recipe)
    x = torch.randn(*shape, requires_grad=True)
    with lf.fp8_autocast():
        y = model(x)
    assert len(calls) == 2  # one forward GEMM per layer
    y.square().sum().backward()
    assert len(calls) == 6 == len(emulated)  # and two backward GEMMs per layer
    if recipe == "rowwise":
        assert all(c[:2] == (E4, E4) and c[4] == torch.bfloat16 for c in calls)
        assert all(len(c[2]) == 2 for c in calls)
    else:
        assert all(c[2] == () and c[3] == () for c in calls)
        # forward E4M3 x E4M3; backward the E5M2 gradient against E4M3
        assert [c[:2] for c in calls[:2]] == [(E4, E4), (E4, E4)]
        assert all(E5 in c[:2] for c in calls[2:])


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("in_f", "out_f"), [(16, 1), (1, 16), (1, 1)])
def test_unit_width_layers_run_every_gemm(recipe, in_f, out_f):
    """A layer with one input or one output feature (converted with ``skip_unaligned=False``): a row-wise GEMM with
    N=1 has a (1, 1) column scale, which must be padded with N like any other, not taken for a tensorwise scale."""
    torch.manual_seed(0)
    plain = nn.Linear(in_f, out_f)
    layer = nn.Sequential(nn.Linear(in_f, out_f))
    layer[0].load_state_dict(plain.state_dict())
    report = lf.convert_to_fp8(layer, recipe=recipe, skip_unaligned=False, log_summary=False)
    assert report.converted
    x = torch.randn(8, in_f, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with lf.fp8_autocast():
        y = layer(x)
    y.square().sum().backward()
    plain(x_ref).square().sum().backward()
    assert y.shape == (8, out_f)
    for got, ref in ((y, plain(x_ref)), (x.grad, x_ref.grad), (layer[0].weight.grad, plain.weight.grad)):
        assert torch.allclose(got.float(), ref.float(), rtol=0.15, atol=0.15 * ref.abs().max().item() + 1e-6)
