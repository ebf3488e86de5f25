"""Run by tests/test_ddp_unused_branch.py: DDP on 2 CPU processes (gloo) with an FP8 branch that only rank 1 runs
(unused parameters on rank 0). Rank r saves its FP8 state and its weights to OUT_DIR/rank{r}.pt.

Usage: ddp_unused_branch.py OUT_DIR RECIPE, or ``main(OUT_DIR, RECIPE)`` from tests/scripts/gloo_checks.py.
"""

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import lightning_fp8 as lf


class Branchy(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.branch = nn.Linear(64, 64)  # rank 1 only
        self.out = nn.Linear(64, 32)

    def forward(self, x):
        h = F.gelu(self.inp(x))
        if self.global_rank == 1:
            h = h + self.branch(h) * 100.0  # large values: the branch's amaxes must reach every rank's histories
        return self.out(h)

    def training_step(self, batch, batch_idx):
        return self(batch).float().square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main(out_dir, recipe):
    torch.manual_seed(0)
    model = Branchy()
    data = torch.utils.data.DataLoader(torch.randn(64, 32), batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(find_unused_parameters=True),
        plugins=[lf.FP8Precision(recipe=recipe)],
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    torch.save(
        {"fp8": lf.fp8_state_dict(model), "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}},
        os.path.join(out_dir, f"rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
