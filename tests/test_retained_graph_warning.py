"""The plugins warn once when a backward retains the graph while inductor is in use with its FX graph cache on: a
second backward over a retained graph of an inductor-compiled FP8 model can be silently wrong there (a torch defect:
``test_retained_graph_second_backward_after_a_cached_donated_backward`` in test_linear.py, and the troubleshooting
page). The check is process-wide, so importing inductor's compiler module stands in for a compile here."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch._inductor.compile_fx  # noqa: F401  (inductor "in use": what the plugins look for)
from lightning.fabric import Fabric
from torch import nn

import lightning_fp8 as lf
from lightning_fp8.fabric import FP8Precision as FabricFP8Precision
from utils import make_trainer

MESSAGE = "a backward retains the graph while torch.compile's inductor is in use"


class _TwoBackwards(L.LightningModule):
    """Manual optimization with two backwards over one graph (``retain_graph`` on the first, or not at all)."""

    def __init__(self, retain: bool):
        super().__init__()
        self.automatic_optimization = False
        self.retain = retain
        self.layer = nn.Linear(32, 32)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.layer(batch[0]).float().pow(2).mean()
        opt.zero_grad()
        if self.retain:
            self.manual_backward(loss, retain_graph=True)
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit_warnings(retain: bool, fx_graph_cache: bool = True) -> list[str]:
    data = torch.utils.data.TensorDataset(torch.randn(12, 32))
    with torch._inductor.config.patch(fx_graph_cache=fx_graph_cache), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(lf.FP8Precision(), max_steps=3).fit(
            _TwoBackwards(retain), torch.utils.data.DataLoader(data, batch_size=4)
        )
    return [str(w.message) for w in caught if MESSAGE in str(w.message)]


@pytest.mark.parametrize(
    ("retain", "fx_graph_cache", "expected"), [(True, True, 1), (False, True, 0), (True, False, 0)]
)
def test_trainer_warns_once_about_a_retained_graph_with_the_cache_on(retain, fx_graph_cache, expected):
    """Three steps with ``retain_graph=True``: one warning; none without a retained graph or with the cache off (the
    workaround)."""
    assert len(_fit_warnings(retain, fx_graph_cache)) == expected


def test_fabric_warns_once_about_a_retained_graph():
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision()])
    model = fabric.setup(nn.Sequential(nn.Linear(32, 32)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            loss = model(torch.randn(4, 32)).float().pow(2).mean()
            fabric.backward(loss, retain_graph=True)
            fabric.backward(loss)
    assert sum(MESSAGE in str(w.message) for w in caught) == 1
