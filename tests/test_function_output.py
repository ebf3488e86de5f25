"""The tensor the FP8 autograd function returns is its own: never a view and, under ``torch.compile``, never the same
tensor object as anything else the traced forward made.

* **Under compile** dynamo traces ``_FP8LinearFn.forward`` into a subgraph that returns the forward's intermediates
  besides the output (``autograd_function_apply``). A no-op ``.to`` (the GEMM's output dtype is already the layer's)
  made the output the same tensor object as an intermediate; on torch 2.11 autograd then delivered the output's
  gradient to the intermediate's slot and the layer's ``grad_input`` and ``grad_weight`` came back as zeros, with no
  error (found on an H200 with torch 2.11; reproduced on a CPU with torch 2.11; torch 2.12 and 2.13 deliver it right,
  but the traced forward returns the duplicate there too, which is what this file checks on any torch).
* **In eager mode** an autograd function's output that is a view (the unpadded slice of a padded GEMM: an output
  feature count that is not a multiple of 16) cannot be modified in place: ``y.relu_()`` after an ``nn.Linear`` is
  fine, after the FP8 layer it raised.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_compile_dynamic import _step
from torch import nn

import lightning_fp8 as lf
from lightning_fp8.recipe import RECIPES

#: (tokens, in, out): aligned; unaligned out features (the GEMM pads N: its output is sliced); odd tokens
SHAPES = ((32, 64, 96), (32, 200, 300), (33, 64, 96))


def _layer(recipe: str, fin: int, fout: int, bias: bool) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.Linear(fin, fout, bias=bias)
    lf.convert_to_fp8(layer, recipe=recipe, skip_unaligned=False, log_summary=False)
    return layer


@pytest.mark.parametrize(
    ("recipe", "shape"), [(r, SHAPES[0]) for r in RECIPES] + [("tensorwise", SHAPES[1])], ids=lambda v: str(v)
)
def test_traced_forward_returns_its_output_once(recipe, shape):
    """The function's output is not returned a second time by the traced forward subgraph (as one of the
    intermediates dynamo adds): the property whose violation zeroed the gradients on torch 2.11. From torch 2.12 the
    subgraph returns the output alone, so this fails only on a torch that adds the intermediates (checked by hand
    with torch 2.11: it fails without ``linear._own_output``'s copy)."""
    tokens, fin, fout = shape
    layer = _layer(recipe, fin, fout, bias=False)
    duplicates: list[int] = []
    run = torch.fx.Interpreter.run

    def checking_run(self, *args, **kwargs):
        result = run(self, *args, **kwargs)
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], tuple):  # (outputs, saved)
            first, *rest = (t for t in result[0] if isinstance(t, torch.Tensor))
            duplicates.append(sum(t is first for t in rest))
        return result

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    x = torch.randn(tokens, fin, requires_grad=True)
    with lf.fp8_autocast():
        y = compiled(x)
    # the graph is traced by now; the function's forward subgraph runs through an fx Interpreter
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.fx.Interpreter, "run", checking_run)
        with lf.fp8_autocast():
            y = compiled(x)
    y.float().sum().backward()
    assert duplicates and duplicates == [0] * len(duplicates), duplicates
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_gradients_match_eager(recipe):
    """Compiled with dynamo alone (where torch 2.11 lost the gradients; ``tests/test_compile_dynamic.py`` checks every
    recipe with AOTAutograd) gives eager's output and gradients bit for bit, aligned and unaligned, with and without
    bias, and the input gradient is not zero."""
    backend = "eager"
    for tokens, fin, fout in SHAPES[:2]:
        for bias in (True, False):
            eager = _layer(recipe, fin, fout, bias)
            twin = copy.deepcopy(eager)
            torch._dynamo.reset()
            compiled = torch.compile(twin, backend=backend)
            x = torch.randn(tokens, fin)
            for a, b in zip(_step(eager, x), _step(compiled, x)):
                assert torch.equal(a, b), (recipe, backend, tokens, fin, fout, bias)
            assert _step(compiled, x)[1].abs().sum() > 0


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("recipe", RECIPES)
def test_output_can_be_modified_in_place(recipe, shape):
    """As after ``nn.Linear``: an in-place op on the layer's output works, and the gradients are those of the same
    op done out of place."""
    tokens, fin, fout = shape
    for bias in (True, False):
        results = []
        for inplace in (True, False):
            layer = _layer(recipe, fin, fout, bias)
            x = torch.randn(tokens, fin, generator=torch.Generator().manual_seed(1)).requires_grad_()
            with lf.fp8_autocast():
                y = layer(x)
            y = y.mul_(2) if inplace else y * 2
            y.float().pow(2).sum().backward()
            results.append([y.detach(), x.grad, layer.weight.grad])
        for a, b in zip(*results):
            assert torch.equal(a, b), (recipe, shape, bias)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_output_can_be_modified_in_place_under_compile(recipe):
    """The same in a compiled region (an unaligned layer's output was a view there too: the compile failed)."""
    tokens, fin, fout = SHAPES[1]

    class InPlace(nn.Module):
        def __init__(self, layer: nn.Module) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x).mul_(2).relu_()

    eager = InPlace(_layer(recipe, fin, fout, bias=False))
    twin = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    x = torch.randn(tokens, fin)
    for a, b in zip(_step(eager, x), _step(compiled, x)):
        assert torch.equal(a, b), recipe
