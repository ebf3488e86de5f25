"""Run by tests/test_callback.py: FP8StatsCallback under DDP (2 CPU processes, gloo).

Layer ``extra`` runs on rank 0 only (its output is multiplied by zero on rank 1 so DDP still sees
a gradient for it): the reduction must neither hang nor mix up values. Each rank saves its local FP8
state after training; rank 0's CSVLogger writes the reduced metrics.

Usage: ddp_stats.py OUT_DIR, or ``main(OUT_DIR)`` from tests/scripts/gloo_checks.py.
"""

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn

import lightning_fp8 as lf


class TwoLayer(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.extra = nn.Linear(32, 32)

    def training_step(self, batch, batch_idx):
        h = self.body(batch)
        if self.global_rank == 0:
            h = h + self.extra(h)
        else:
            h = h + 0.0 * (self.extra.weight.sum() + self.extra.bias.sum())
        return F.mse_loss(h, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(out_dir):
    torch.manual_seed(0)
    model = TwoLayer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        plugins=[lf.FP8Precision()],
        callbacks=[lf.FP8StatsCallback(log_every_n_steps=2)],
        logger=CSVLogger(out_dir, name="logs", version=""),
        max_steps=4,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = torch.utils.data.DataLoader(torch.randn(64, 32) * (1 + torch.arange(64)[:, None] / 8), batch_size=8)
    trainer.fit(model, data)
    torch.save(lf.fp8_state_dict(model), os.path.join(out_dir, f"state_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
