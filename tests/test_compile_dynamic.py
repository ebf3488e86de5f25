"""``torch.compile`` with dynamic shapes.

Automatic dynamic shapes (torch's default: a second input shape recompiles the graph with a symbolic size) work
and match eager. ``torch.compile(dynamic=True)``, which makes every size symbolic from the first call, does not yet:
dynamo fails inside its trace of the layer's backward with an internal assertion ("lift_tracked_freevar_to_input
should not be called on root SubgraphTracer", torch 2.13). The xfail is strict, so the test reports when it starts
to work.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lightning_fp8 as lf


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    with lf.fp8_autocast():
        y = model(x)
    y.float().pow(2).sum().backward()
    return y.detach(), x.grad


def test_automatic_dynamic_shapes_match_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Linear(64, 96, bias=False)
    lf.convert_to_fp8(eager, recipe="tensorwise", log_summary=False)
    compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager")
    for tokens in (32, 48, 80):  # the second shape recompiles with a symbolic token count
        x = torch.randn(tokens, 64)
        for a, b in zip(_step(eager, x), _step(compiled, x)):
            assert torch.equal(a, b), tokens


@pytest.mark.xfail(strict=True, reason="dynamo of torch 2.13 fails tracing the FP8 backward with every size symbolic")
def test_compile_dynamic_true():
    torch._dynamo.reset()
    model = nn.Linear(64, 96, bias=False)
    lf.convert_to_fp8(model, recipe="tensorwise", log_summary=False)
    _step(torch.compile(model, backend="aot_eager", dynamic=True), torch.randn(32, 64))
