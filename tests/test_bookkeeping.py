"""The FP8 bookkeeping of an optimizer step costs the same for 8 and 96 layers (issue 8's target).

On a GPU every dispatched tensor operation of the bookkeeping is a kernel launch, so its count is the cost a
CPU can measure. Counted under a ``TorchDispatchMode`` around the plugin's per-step bookkeeping
(``after_optimizer_step``: the cross-rank reduction and the roll, and ``apply_loss_scale_update``: the rescale of the
grad_output amaxes when the loss scale moved, at the start of the next backward).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_fp8 as lf
from lightning_fp8.recipe import RECIPES
from lightning_fp8.fabric import FP8Precision


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _deep_model(n_layers: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(32, 32) for _ in range(n_layers)))


def _bookkeeping_ops(n_layers: int, recipe: str, loss_scaling: str) -> Counter[str]:
    torch.manual_seed(0)
    plugin = FP8Precision(recipe=recipe, loss_scaling=loss_scaling, growth_interval=1)  # the scale moves every step
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = _deep_model(n_layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    counted: list[Counter[str]] = []
    for name in ("after_optimizer_step", "apply_loss_scale_update"):
        original = getattr(plugin, name)

        def counting(*args, _original=original, **kwargs):
            with OpCounter() as counter:
                _original(*args, **kwargs)
            counted.append(counter.ops)

        setattr(plugin, name, counting)
    for _ in range(3):
        optimizer.zero_grad()
        fabric.backward(model(torch.randn(4, 32)).float().square().mean())
        optimizer.step()
    assert len(counted) == 6  # per step: the loss-scale update at the backward, the bookkeeping after the step
    if loss_scaling == "dynamic":  # the scale grew at every step: the last backward rescaled the histories
        assert sum(counted[-2].values()) > 0
    layers = [m for m in model.modules() if isinstance(m, lf.FP8Linear)]
    assert len(layers) == n_layers and len({id(m.fp8_state.table) for m in layers}) == 1
    assert all(int((m.fp8_amax_history[:2] != 0).sum()) == 6 for m in layers)  # every layer rolled every step
    return counted[-2] + counted[-1]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("loss_scaling", ["dynamic", "skip_nonfinite"])
def test_bookkeeping_op_count_does_not_grow_with_depth(recipe, loss_scaling):
    shallow = _bookkeeping_ops(8, recipe, loss_scaling)
    deep = _bookkeeping_ops(96, recipe, loss_scaling)
    assert sum(shallow.values()) > 5  # the counter sees the roll
    assert deep == shallow, (sum(shallow.values()), sum(deep.values()))
    print(f"\n{recipe} {loss_scaling}: {sum(deep.values())} dispatched ops per step for 8 and for 96 layers")


def test_layers_not_bound_to_one_table_cost_per_layer():
    """Positive control: the counter does see per-layer work (layers built on their own, one table each)."""

    def ops(n):
        model = nn.Sequential(*(lf.FP8Linear(32, 32, recipe="delayed") for _ in range(n)))
        with lf.fp8_autocast(defer_amax_history_roll=True):
            model(torch.randn(4, 32))
        with OpCounter() as counter:
            lf.roll_amax_history(model)
        return sum(counter.ops.values())

    assert ops(16) == 2 * ops(8) > 0
    model = nn.Sequential(*(lf.FP8Linear(32, 32, recipe="delayed") for _ in range(16)))
    lf.convert_to_fp8(model, recipe="delayed")  # binds the layers into one table
    assert len({id(m.fp8_state.table) for m in model}) == 1
