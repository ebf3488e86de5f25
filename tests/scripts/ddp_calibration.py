"""Run by tests/test_calibration.py: FP8Precision(calibration_batches=2) under DDP (2 CPU processes, gloo).

The ranks see different batches (the data grows with the sample index, and DistributedSampler splits it): each rank
records the input amaxes of its own calibration batches (hooks) and saves them with the FP8 state at the start of the
first training batch; training then runs a few DDP steps (calibration must leave DDP's gradient reducer alone).

Usage: ddp_calibration.py OUT_DIR, or ``main(OUT_DIR)`` from tests/scripts/gloo_checks.py.
"""

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8 as lf


class TwoLayer(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, 32)
        self.input_amax = []
        self.body.register_forward_hook(lambda m, args, out: self.input_amax.append(args[0].abs().amax().float()))

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.head(F.gelu(self.body(batch))), batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Save(L.Callback):
    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0:
            state = {"fp8": lf.fp8_state_dict(pl_module), "calibration_input_amax": torch.stack(pl_module.input_amax)}
            torch.save(state, os.path.join(self.out_dir, f"start_rank{trainer.global_rank}.pt"))


def main(out_dir):
    torch.manual_seed(0)
    model = TwoLayer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        plugins=[lf.FP8Precision(recipe="delayed", calibration_batches=2)],
        callbacks=[Save(out_dir)],
        logger=False,
        max_steps=3,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = torch.utils.data.DataLoader(torch.randn(64, 32) * (1 + torch.arange(64)[:, None] / 8), batch_size=8)
    trainer.fit(model, data)
    assert trainer.global_step == 3


if __name__ == "__main__":
    main(*sys.argv[1:])
