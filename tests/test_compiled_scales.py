"""Under ``torch.compile``, a cast's scale is computed once per scale element, not once per data element.

Inductor inlines a chain of elementwise operations into every loop that reads its result. The scale formula
(``amax_to_scale``: a float64 division rounded toward zero, then power-of-two rounding) and the GEMM's inverse scales
were inlined into the cast and into the GEMM's output scaling, loops over the data: a per-column scale was re-derived
from its amax for every output element. ``lightning_fp8.recipe.stored`` makes inductor store them once.

The check reads the C++ that inductor generates for one training step of an FP8 layer on the CPU and finds, for
every evaluation of the formula (its ``nextafter``, or for a power-of-two scale the float64 exponent mask) and every
``reciprocal``, the loops around it: the elements they
cover must be fewer than those of the smallest tensor the step casts (a scale tensor has one element per tensor, row,
column or block; a loop over the data covers at least the smallest tensor).

The same code shows how the histograms of slice and block amaxes (``quantize.amax_bins``) are counted: never through
an accumulating ``aten.index_put_`` fallback. Inductor cannot add int64 atomically, so an int64 count fell back to
that op, which CUDA runs by sorting the indices and walking each bin's duplicates one by one: on an H200 it was 31%
of a compiled ``rowwise`` Llama3-8B-shaped block's device time (every row lands in a few bins). Under
``torch.use_deterministic_algorithms(True)`` inductor falls back for any dtype, so there the bins are counted by
comparison.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import lightning_fp8 as lf
from lightning_fp8.quantize import N_AMAX_BINS, amax_bins
from lightning_fp8.recipe import RECIPES, stored
from utils import reference_amax_bins

#: tokens, in features, out features: every tensor the step casts has at least TOKENS * IN elements, every scale
#: tensor far fewer (the largest, mxfp8's weight scales, OUT * IN / 32)
TOKENS, IN, OUT = 64, 128, 256

_FOR = re.compile(
    r"for\s*\(\s*int64_t\s+\w+\s*=\s*static_cast<int64_t>\((\d+)L?\);\s*\w+\s*<\s*static_cast<int64_t>\((\d+)L?\)"
)


def _loop_extents(code: str, needle: str) -> list[int]:
    """For each line of the generated C++ that contains ``needle``: the product of the extents of the loops around it
    (1 outside any loop). Inductor's CPU kernels put each brace on its own line, so the nesting is followed by
    counting braces."""
    extents: list[int] = []
    open_loops: list[tuple[int, int]] = []  # (brace depth of the loop body, extent)
    pending: int | None = None  # a for line whose body's brace has not been seen yet
    depth = 0
    for line in code.splitlines():
        match = _FOR.search(line)
        if match:
            pending = int(match.group(2)) - int(match.group(1))
        if needle in line:
            product = 1
            for _, extent in open_loops:
                product *= extent
            extents.append(product)
        for char in line:
            if char == "{":
                depth += 1
                if pending is not None:
                    open_loops.append((depth, pending))
                    pending = None
            elif char == "}":
                if open_loops and open_loops[-1][0] == depth:
                    open_loops.pop()
                depth -= 1
    return extents


def _compiled_step_code(recipe: str) -> str:
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = nn.Linear(IN, OUT, bias=False)
    lf.convert_to_fp8(layer, recipe=recipe, log_summary=False)
    compiled = torch.compile(layer)
    x = torch.randn(TOKENS, IN, requires_grad=True)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16), lf.fp8_autocast(defer_amax_history_roll=True):
            out = compiled(x)
        out.float().pow(2).mean().backward()

    _, codes = run_and_get_code(step)
    assert len(codes) == 2, "expected a forward and a backward graph"
    return "\n".join(codes)


def test_loop_extents_reads_nesting():
    code = """
    {
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(64L); x0+=static_cast<int64_t>(1L))
        {
            {
                for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>(128L); x1+=static_cast<int64_t>(8L))
                {
                    auto a = b.nextafter(c);
                }
            }
            auto d = std::nextafter(e, f);
        }
        auto g = nextafter(h);
    }
    """
    assert _loop_extents(code, "nextafter(") == [64 * 128, 64, 1]


#: one scale per tensor, per row or column, per 1x128 and 128x128 tile, per 1x32 block (``delayed``'s scales are
#: ``tensorwise``'s formula on the history's amax: one per tensor as well)
SCALE_RECIPES = [recipe for recipe in RECIPES if recipe != "delayed"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", SCALE_RECIPES)
def test_scales_are_computed_once_per_scale_element_under_compile(recipe):
    code = _compiled_step_code(recipe)
    smallest_cast = TOKENS * IN
    from lightning_fp8.recipe import _FLOAT64_EXPONENT_BITS

    formula = _loop_extents(code, "nextafter(") + _loop_extents(code, str(_FLOAT64_EXPONENT_BITS))
    assert formula, "the scale formula should appear in the generated code"
    assert max(formula) < smallest_cast, f"{recipe}: the scale formula runs in a loop over {max(formula)} elements"
    inverse = _loop_extents(code, "reciprocal()")
    assert max(inverse, default=0) < smallest_cast, (
        f"{recipe}: an inverse scale is computed in a loop over {max(inverse)} elements"
    )
    assert "index_put_(" not in code, f"{recipe}: a scatter falls back to aten.index_put_ (a sorting kernel on CUDA)"


#: slice amaxes as a cast sees them: most in a few bins (the case that serialised the sorting scatter), zeros,
#: values clamped into the outer bins, non-finite ones
_AMAXES = torch.cat([
    torch.rand(5000) * 3 + 0.5,
    torch.tensor([0.0, 0.0, 3e-30, 1e30, 2.0**-64, 2.0**63, float("inf"), float("-inf"), float("nan")]),
    # negative zero, subnormals, the edges of the float32 exponent range, a NaN with its sign bit set
    torch.tensor([-0.0, 1e-40, 2.0**-149, 2.0**-126, 2.0**-65, 2.0**64, 3.4e38]),
    torch.tensor([-1], dtype=torch.int32).view(torch.float32),
    torch.randn(997).abs() * 1e-3,
])


@pytest.fixture
def deterministic(request):
    """``torch.use_deterministic_algorithms`` set to the test's parameter, restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(request.param)
    yield request.param
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("deterministic", [False, True], indirect=True, ids=["default", "deterministic"])
def test_amax_bins_compiles_without_a_sorting_scatter(deterministic):
    torch._dynamo.reset()
    compiled = torch.compile(amax_bins, fullgraph=True)
    bins, codes = run_and_get_code(compiled, _AMAXES)
    code = "\n".join(codes)
    assert "index_put_(" not in code, "amax_bins falls back to aten.index_put_ (a sorting kernel on CUDA)"
    expected = reference_amax_bins(_AMAXES)
    assert bins.dtype == torch.int64 and torch.equal(bins, expected)
    assert torch.equal(amax_bins(_AMAXES), expected)  # eager: the same counts


#: views that ``stored`` may be handed: inductor's ``as_strided`` lowering, applied to a view of a buffer it computed,
#: read that buffer with the view's strides and without its offset (wrong values, no error) until ``stored`` cloned
_VIEWS = {
    "offset slice": lambda x: stored((x * 2)[1:, 1:]) + 1,
    "strided slice": lambda x: stored((x * 2)[1:, ::2]) + 1,
    "expanded": lambda x: stored(x[:, :1].abs().expand(5, 6)) * x,
    "transposed": lambda x: stored((x * 2).t()) + 1,
    "element of an input": lambda x: stored(x[2, 3]) * x,
}


@pytest.mark.parametrize("case", list(_VIEWS))
def test_stored_views_keep_their_values_under_inductor(case):
    torch._dynamo.reset()
    x = torch.randn(5, 6)
    fn = _VIEWS[case]
    assert torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x))
