"""Writes tests/data/fp8_state_v0_1.pt with lightning-fp8 0.1 (commit a36b0d8): a Fabric plugin's state after
3 delayed-scaling steps on a 2-layer MLP, and the model's weights."""
import sys
import torch
from torch import nn
from lightning.fabric import Fabric
from lightning_fp8.fabric import FP8Precision

torch.manual_seed(0)
plugin = FP8Precision(recipe="delayed", amax_history_len=4)
fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model, opt = fabric.setup(model, opt)
for i in range(3):
    opt.zero_grad()
    fabric.backward(model(torch.randn(8, 32) * (i + 1)).float().square().mean())
    opt.step()
torch.save({"model": model.module.state_dict(), "fp8": plugin.state_dict()}, sys.argv[1])
