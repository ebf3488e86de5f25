"""``torch.compile`` with dynamic shapes.

Automatic dynamic shapes (torch's default: a second input shape recompiles the graph with a symbolic size) and
``torch.compile(dynamic=True)`` (every size symbolic from the first call) both work and match eager bit for bit
(``aot_eager``: the traced graph without inductor's codegen), for every recipe (``blockwise`` through ``mxfp8``'s
branches: see ``CASES``).

``dynamic=True`` also turns the Python floats a function reads from module-level names into symbolic graph inputs;
dynamo (torch 2.13) cannot lift one first read in the backward of an ``autograd.Function`` and failed the compile
("lift_tracked_freevar_to_input should not be called on root SubgraphTracer") for ``tensorwise`` and ``delayed``,
whose E5M2 gradient cast reads ``FP8_MAX[E5M2]`` only there. The package reads its float constants through
``torch.compiler.assume_constant_result`` functions (``lightning_fp8.recipe.fp8_max``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import lightning_fp8 as lf
from lightning_fp8.recipe import RECIPES

#: token counts: multiples of 16 and of the mxfp8 block, of 16 only, and odd
TOKENS = (32, 48, 80, 33)


def _step(model: nn.Module, x: torch.Tensor, deferred: bool = False) -> tuple[torch.Tensor, ...]:
    """One step in a standalone region (which rolls on exit), or ``deferred``: the roll after the backward, as the
    plugins do (the compiled layers then read and record their table row through a tensor index)."""
    x = x.clone().requires_grad_()
    with lf.fp8_autocast(defer_amax_history_roll=deferred):
        y = model(x)
    y.float().pow(2).sum().backward()
    if deferred:
        lf.roll_amax_history(model)
    grads = tuple(p.grad.clone() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    return (y.detach(), x.grad, *grads)


def _pair(recipe: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = nn.Linear(64, 96)
    lf.convert_to_fp8(eager, recipe=recipe, log_summary=False)
    return eager, copy.deepcopy(eager)


def _assert_same_state(eager: nn.Module, twin: nn.Module) -> None:
    for a, b in zip(eager.state_dict().values(), twin.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    eager_table, twin_table = lf.fp8_state_dict(eager)["tables"][0], lf.fp8_state_dict(twin)["tables"][0]
    for name, value in eager_table.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, twin_table[name]), name


@pytest.mark.parametrize("deferred", [False, True], ids=["region", "deferred"])
def test_automatic_dynamic_shapes_match_eager(deferred):
    """The second token count recompiles the graph with a symbolic token count, and the later ones reuse it: under
    the deferred roll too, where a record that specialised on the cast's element count compiled a graph per token
    count (``F.pad`` with the count as its float ``value``) until the recompile limit, and the rest ran eager."""
    torch._dynamo.reset()
    eager, twin = _pair("tensorwise")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(twin, backend=counter)
    for tokens in (32, 48, 80, 96, 112):
        x = torch.randn(tokens, 64)
        for a, b in zip(_step(eager, x, deferred), _step(compiled, x, deferred)):
            assert torch.equal(a, b), tokens
    assert counter.frame_count == 2, counter.frame_count
    _assert_same_state(eager, twin)


#: in a standalone region, each recipe but ``blockwise``, whose dynamic-shape branches are ``mxfp8``'s (the same
#: ``fp8_block_mm`` padding a token count to its block; only the block size differs); under the deferred roll (the
#: plugins'), where the compiled layers record through a tensor row (one code path for every recipe), a per-tensor one
CASES = [(recipe, False) for recipe in RECIPES if recipe != "blockwise"] + [("tensorwise", True)]


@pytest.mark.parametrize(("recipe", "deferred"), CASES, ids=[f"{r}-{'deferred' if d else 'region'}" for r, d in CASES])
def test_compile_dynamic_true_matches_eager(recipe, deferred):
    """The same bits as eager and the same state, for every token count; a few graphs, not one per token count.

    A symbolic size still specialises where the code branches on it: the GEMMs pad a token count that is not a
    multiple of 16 (the layout cuBLAS needs, followed by the emulation too), the block recipes one that is not a
    multiple of the block (the token axis is blocked for the weight gradient). A further token count of a kind
    already seen compiles nothing new."""
    torch._dynamo.reset()
    eager, twin = _pair(recipe)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(twin, backend=counter, dynamic=True)
    for tokens in TOKENS:
        x = torch.randn(tokens, 64)
        for a, b in zip(_step(eager, x, deferred), _step(compiled, x, deferred)):
            assert torch.equal(a, b), (recipe, tokens)
    graphs = counter.frame_count
    assert 1 <= graphs <= 4, graphs
    x = torch.randn(112, 64)  # a multiple of 16, not of 32 or 128, like 48 and 80
    for a, b in zip(_step(eager, x, deferred), _step(compiled, x, deferred)):
        assert torch.equal(a, b), (recipe, 112)
    assert counter.frame_count == graphs
    _assert_same_state(eager, twin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compile_dynamic_true_under_autocast_matches_eager(recipe, dtype):
    """``dynamic=True`` under CPU autocast: the compiled 16-bit roundings (``rounded_to``: the bias, the output, the
    ``rowwise`` input) read their float constants (the rounding's split factor and bounds) as constants, not as
    symbolic inputs, which dynamo cannot lift inside an ``autograd.Function`` (the bias's rounding failed the compile:
    "lift_tracked_freevar_to_input should not be called on root SubgraphTracer"). The same bits as eager."""
    torch._dynamo.reset()
    eager, twin = _pair(recipe)
    compiled = torch.compile(twin, backend="aot_eager", dynamic=True)
    for tokens in TOKENS:
        x = torch.randn(tokens, 64)
        with torch.autocast("cpu", dtype=dtype):
            pairs = list(zip(_step(eager, x), _step(compiled, x)))
        for a, b in pairs:
            assert torch.equal(a, b), (recipe, dtype, tokens)
    _assert_same_state(eager, twin)
