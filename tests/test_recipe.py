"""FP8 formats, recipe validation and the amax -> scale formula."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_fp8 import FP8Recipe
from lightning_fp8.recipe import (
    AMAX_EPS,
    E4M3,
    E4M3_MAX,
    E5M2,
    E5M2_MAX,
    FP8_MAX,
    GRAD_OUTPUT,
    INPUT,
    WEIGHT,
    amax_to_scale,
    resolve_recipe,
)


def test_format_maxima_are_the_dtype_maxima():
    assert E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max == 448.0
    assert E5M2_MAX == torch.finfo(torch.float8_e5m2).max == 57344.0
    assert FP8_MAX == {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def test_defaults():
    r = FP8Recipe()
    # defaults are resolved per recipe; a setting the recipe does not use stays None
    assert (r.name, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.margin, r.power_of_2_scale) == (
        "tensorwise",
        "hybrid",
        16,
        None,
        0,
        False,
    )
    d = FP8Recipe(name="delayed")
    assert (d.fp8_format, d.amax_compute_algo, d.margin, d.power_of_2_scale) == ("hybrid", "max", 0, False)
    w = FP8Recipe(name="rowwise")
    assert (w.fp8_format, w.amax_compute_algo, w.margin, w.power_of_2_scale) == ("e4m3", None, 0, True)
    assert FP8Recipe(name="rowwise", power_of_2_scale=False).round_to_power_of_2 is False
    assert FP8Recipe(name="delayed") == FP8Recipe(name="delayed", amax_compute_algo="max", fp8_format="hybrid")


def test_settings_a_recipe_does_not_use_are_rejected():
    """The plugin-level cases are in test_regressions.py; here the recipe itself, and the message's shape."""
    with pytest.raises(ValueError, match=r"margin=1 has no effect with recipe='tensorwise': only recipe='delayed'"):
        FP8Recipe(name="tensorwise", margin=1)
    with pytest.raises(ValueError, match="fp8_format='hybrid' has no effect with recipe='rowwise'.*'e4m3'"):
        FP8Recipe(name="rowwise", fp8_format="hybrid")


def test_from_dict_reads_what_version_0_1_wrote():
    """0.1 stored every field for every recipe, including those the recipe ignored."""
    old = {"name": "tensorwise", "fp8_format": "hybrid", "amax_history_len": 16, "amax_compute_algo": "max",
           "margin": 2, "power_of_2_scale": False}  # fmt: skip
    assert FP8Recipe.from_dict(old, legacy=True) == FP8Recipe()
    old_rowwise = {**old, "name": "rowwise", "margin": 0}
    assert FP8Recipe.from_dict(old_rowwise, legacy=True) == FP8Recipe(name="rowwise")
    with pytest.raises(ValueError, match="margin"):
        FP8Recipe.from_dict(old)  # not a 0.1 dict: the ignored margin is an error


@pytest.mark.parametrize(
    "recipe",
    [FP8Recipe(), FP8Recipe(name="delayed", margin=1, amax_compute_algo="most_recent"), FP8Recipe(name="rowwise"),
     FP8Recipe(name="rowwise", power_of_2_scale=False), FP8Recipe(fp8_format="e4m3", power_of_2_scale=True)],
)  # fmt: skip
def test_to_dict_round_trips(recipe):
    assert FP8Recipe.from_dict(recipe.to_dict()) == recipe


@pytest.mark.parametrize(
    ("kwargs", "field", "valid"),
    [
        ({"name": "blockwize"}, "recipe", ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"]),
        ({"fp8_format": "e5m2"}, "fp8_format", ["hybrid", "e4m3"]),
        ({"amax_compute_algo": "mean"}, "amax_compute_algo", ["max", "most_recent"]),
    ],
)
def test_unknown_choice_raises_naming_field_and_valid_values(kwargs, field, valid):
    with pytest.raises(ValueError) as err:
        FP8Recipe(**kwargs)
    msg = str(err.value)
    assert field in msg
    assert repr(next(iter(kwargs.values()))) in msg
    for v in valid:
        assert v in msg


@pytest.mark.parametrize("value", [0, -1, -16, True, False, 16.0, "16", None])
def test_invalid_history_len(value):
    with pytest.raises(ValueError, match="amax_history_len") as err:
        FP8Recipe(name="delayed", amax_history_len=value)
    assert ">= 1" in str(err.value)


@pytest.mark.parametrize("value", [-1, -3, True, 1.0, "0"])
def test_invalid_margin(value):
    with pytest.raises(ValueError, match="margin") as err:
        FP8Recipe(name="delayed", margin=value)
    assert ">= 0" in str(err.value)


@pytest.mark.parametrize("value", [1, 0, "yes"])
def test_invalid_power_of_2_scale(value):
    with pytest.raises(ValueError, match="power_of_2_scale"):
        FP8Recipe(power_of_2_scale=value)


@pytest.mark.parametrize("length", [1, 2, 1024])
def test_valid_history_len_and_margin(length):
    r = FP8Recipe(name="delayed", amax_history_len=length, margin=3, amax_compute_algo="most_recent")
    assert r.amax_history_len == length and r.margin == 3


def test_recipe_is_frozen_and_plain():
    r = FP8Recipe(name="delayed", margin=1)
    with pytest.raises(Exception):
        r.margin = 2  # type: ignore[misc]
    d = r.to_dict()
    assert d == {
        "name": "delayed",
        "fp8_format": "hybrid",
        "amax_history_len": 16,
        "amax_compute_algo": "max",
        "margin": 1,
        "power_of_2_scale": False,
    }
    assert all(type(v) in (str, int, bool) for v in d.values())
    assert FP8Recipe(**d) == r


def test_resolve_recipe():
    assert resolve_recipe(None) == FP8Recipe()
    assert resolve_recipe("delayed") == FP8Recipe(name="delayed")
    r = FP8Recipe(name="rowwise")
    assert resolve_recipe(r) is r
    assert resolve_recipe("delayed", margin=2).margin == 2
    assert resolve_recipe(r, amax_history_len=4) == FP8Recipe(name="rowwise", amax_history_len=4)
    with pytest.raises(ValueError, match="tensorwise"):
        resolve_recipe("nope")
    with pytest.raises(ValueError, match="tensorwise"):
        resolve_recipe(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "fmt", "expected"),
    [
        ("tensorwise", "hybrid", (E4M3, E4M3, E5M2)),
        ("delayed", "hybrid", (E4M3, E4M3, E5M2)),
        ("tensorwise", "e4m3", (E4M3, E4M3, E4M3)),
        ("delayed", "e4m3", (E4M3, E4M3, E4M3)),
        ("rowwise", None, (E4M3, E4M3, E4M3)),
        ("rowwise", "e4m3", (E4M3, E4M3, E4M3)),
    ],
)
def test_dtype_per_role(name, fmt, expected):
    r = FP8Recipe(name=name, fp8_format=fmt)
    assert (r.dtype(INPUT), r.dtype(WEIGHT), r.dtype(GRAD_OUTPUT)) == expected


def test_power_of_2_flag():
    assert FP8Recipe(name="rowwise").round_to_power_of_2
    assert not FP8Recipe(name="tensorwise").round_to_power_of_2
    assert FP8Recipe(name="tensorwise", power_of_2_scale=True).round_to_power_of_2
    assert FP8Recipe(name="delayed", power_of_2_scale=True).round_to_power_of_2


# --- amax -> scale ---------------------------------------------------------------------------------


def _round_toward_zero_f32(s: float) -> float:
    """The largest float32 not above the (positive) float64 value ``s``."""
    t = torch.tensor(s, dtype=torch.float64).to(torch.float32)  # round to nearest
    if t.item() > s:
        t = torch.nextafter(t, torch.tensor(0.0))
    return t.item()


def _expected_scale(amax: float, fp8_max: float, margin: int, power_of_2: bool) -> float:
    """The documented formula in Python floats (float64), rounded toward zero to float32."""
    s = fp8_max / max(amax, AMAX_EPS) / 2.0**margin
    s32 = _round_toward_zero_f32(s) if math.isfinite(s) else s
    if power_of_2:
        if s32 == 0.0 or math.isinf(s32):
            return s32
        mantissa, exponent = math.frexp(s32)  # s32 = mantissa * 2**exponent, mantissa in [0.5, 1)
        return math.ldexp(1.0, exponent - 1)  # exactly 2**floor(log2(s32))
    return s32


def _amaxes() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    mant = torch.rand(2000, generator=g, dtype=torch.float64) + 0.5
    expo = torch.randint(-30, 30, (2000,), generator=g).to(torch.float64)
    random = (mant * 2.0**expo).to(torch.float32)
    # amaxes whose scale lands just below / on / above a power of two, and the eps clamp
    edges = []
    for fp8_max in (E4M3_MAX, E5M2_MAX):
        for k in range(-6, 20):
            a = torch.tensor(fp8_max / 2.0**k, dtype=torch.float32)
            edges += [a, torch.nextafter(a, torch.tensor(math.inf)), torch.nextafter(a, torch.tensor(0.0))]
    specials = torch.tensor([0.0, 1e-30, AMAX_EPS, 1e-13, 1.0, 448.0, 57344.0, 3.0e38])
    return torch.cat([random, torch.stack(edges), specials])


@pytest.mark.parametrize("fp8_max", [E4M3_MAX, E5M2_MAX])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("power_of_2", [False, True])
def test_amax_to_scale_formula(fp8_max, margin, power_of_2):
    amax = _amaxes()
    got = amax_to_scale(amax, fp8_max, margin, power_of_2)
    assert got.dtype == torch.float32
    expected = torch.tensor([_expected_scale(a, fp8_max, margin, power_of_2) for a in amax.tolist()])
    assert torch.equal(got, expected)
    if power_of_2:
        # rounded *down*: never above the unrounded scale, and at least half of it
        unrounded = amax_to_scale(amax, fp8_max, margin, False)
        assert (got <= unrounded).all() and (got * 2 > unrounded).all()
        assert torch.equal(torch.frexp(got).mantissa, torch.full_like(got, 0.5))


@pytest.mark.parametrize("fp8_max", [E4M3_MAX, E5M2_MAX])
def test_scaled_amax_never_exceeds_fp8_max(fp8_max):
    """amax * scale <= fp8_max in float32 arithmetic (a tensor's own amax is never an overflow), and the
    scale is the largest float32 with that property."""
    amax = _amaxes()
    amax = amax[amax > AMAX_EPS]
    scale = amax_to_scale(amax, fp8_max)
    assert ((amax * scale) <= fp8_max).all()
    exact = fp8_max / amax.double()
    assert (scale.double() <= exact).all()
    assert (torch.nextafter(scale, torch.full_like(scale, math.inf)).double() > exact).all()
    # round-to-nearest (torchao's float32 division) would overshoot for some of these amaxes
    assert ((amax * (fp8_max / amax)) > fp8_max).any()


def _rounded_then_power_of_two(amax: torch.Tensor, fp8_max: float, margin: int) -> torch.Tensor:
    """The power-of-two scale as it was computed before: the float64 quotient rounded toward zero to float32, then
    ``exp2(floor(log2(scale)))``, stepped down where float32 log2 rounded up."""
    exact = fp8_max / torch.clamp(amax.to(torch.float64), min=AMAX_EPS)
    if margin:
        exact = exact / 2.0**margin
    scale = exact.to(torch.float32)
    scale = torch.where(scale.to(torch.float64) > exact, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    rounded = torch.exp2(torch.floor(torch.log2(scale)))
    return torch.where(rounded > scale, rounded * 0.5, rounded)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("fp8_max, margin", [(E4M3_MAX, 0), (E5M2_MAX, 0), (E4M3_MAX, 3)])
def test_power_of_two_scale_from_the_quotients_exponent_bits(fp8_max, margin):
    """``power_of_2`` clears the float64 quotient's mantissa bits instead of rounding to float32 and then to a power
    of two: the same bits. Here on every 4099th positive float32 bit pattern (all exponents, subnormals, infinity,
    NaNs), each float32 whose quotient lies on, just above or just below a power of two, and float64 amaxes whose
    scale is a float32 subnormal or underflows to zero (all 2**31 positive float32 patterns were checked once, for
    both formats and a margin: the same bits). Eager and compiled."""
    bits = torch.arange(0, 2**31, 4099, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([fp8_max / 2.0**k for k in range(-60, 130)], dtype=torch.float32)
    ulp = torch.full_like(edges, math.inf)
    amax = torch.cat([bits.view(torch.float32), edges, torch.nextafter(edges, ulp), torch.nextafter(edges, -ulp)])
    expected = _rounded_then_power_of_two(amax, fp8_max, margin)
    assert _same_bits(amax_to_scale(amax, fp8_max, margin, power_of_2=True), expected)
    wide = torch.logspace(-320, 308, 20001, dtype=torch.float64)  # float64 models: scales down to zero
    assert _same_bits(amax_to_scale(wide, fp8_max, margin, True), _rounded_then_power_of_two(wide, fp8_max, margin))
    torch._dynamo.reset()
    compiled = torch.compile(amax_to_scale, backend="inductor", fullgraph=True)
    assert _same_bits(compiled(amax, fp8_max, margin, True), expected)


def test_power_of_two_scale_kernels():
    """Eager, a power-of-two scale is eight operations (to float64, clamp, reciprocal and product, mask, NaN carry
    (a product and a sum), to float32) where the float32 rounding and then the power-of-two rounding took sixteen:
    eager on a GPU each is a kernel launch, six casts per layer and step under ``rowwise``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket not in (torch.ops.aten.view, torch.ops.aten.detach):  # views launch nothing
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    amax = torch.rand(64, 1)
    with Count() as counted:
        amax_to_scale(amax, E4M3_MAX, 0, power_of_2=True)
    with Count() as before:
        _rounded_then_power_of_two(amax, E4M3_MAX, 0)
    assert len(counted.ops) == 8 and len(before.ops) == 16, (counted.ops, before.ops)


def test_amax_to_scale_non_finite():
    got = amax_to_scale(torch.tensor([math.nan, math.inf]), E4M3_MAX)
    assert math.isnan(got[0].item()) and got[1].item() == 0.0
    got = amax_to_scale(torch.tensor([math.nan, math.inf]), E4M3_MAX, power_of_2=True)
    assert math.isnan(got[0].item()) and got[1].item() == 0.0


def test_amax_to_scale_compiled_matches_eager():
    amax = _amaxes()
    torch._dynamo.reset()
    for margin, p2 in [(0, False), (3, True), (0, True)]:
        compiled = torch.compile(amax_to_scale, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(amax, E4M3_MAX, margin, p2), amax_to_scale(amax, E4M3_MAX, margin, p2))
        assert torch.equal(compiled(amax, E5M2_MAX, margin, p2), amax_to_scale(amax, E5M2_MAX, margin, p2))
