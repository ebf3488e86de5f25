"""Run by tests/test_fallback.py: FP8FallbackCallback under DDP (2 CPU processes, gloo).

From global step ``START`` on, the input of layer ``mid`` grows 4x per step on rank 1 only (its output is divided
back, so the loss stays sane): the delayed scale, MAX-reduced across the ranks, lags it, and ``mid`` overflows on rank
1's data alone. The readings are reduced across the ranks, so both must switch ``mid`` at the same step; a rank that
switched alone would compute differently from the other (and a reading that is a collective on one rank only would
hang). Each rank saves, per global step, whether ``mid`` ran in FP8 in its training forward, the callback's
``fallen_back``, and its parameters after training.

Usage: ddp_fallback.py OUT_DIR, or ``main(OUT_DIR)`` from tests/scripts/gloo_checks.py.
"""

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8 as lf

START = 3


class Planted(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def training_step(self, batch, batch_idx):
        x, y = batch
        k = self.global_step - START + 1
        factor = 4.0**k if k > 0 and self.global_rank == 1 else 1.0
        h = torch.relu(self.inp(x))
        h = self.mid(h * factor) / factor
        return F.cross_entropy(self.out(torch.relu(h)).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Record(L.Callback):
    def __init__(self, out_dir, fallback):
        self.out_dir, self.fallback = out_dir, fallback
        self.in_forward = {}

    def on_fit_start(self, trainer, pl_module):
        def record(module, args, output):
            self.in_forward[trainer.global_step] = isinstance(module, lf.FP8Linear)

        pl_module.mid.register_forward_hook(record)

    def on_fit_end(self, trainer, pl_module):
        torch.save(
            {
                "in_forward": self.in_forward,
                "fallen_back": self.fallback.fallen_back,
                "params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


def main(out_dir):
    torch.manual_seed(0)
    fallback = lf.FP8FallbackCallback(every_n_steps=2, patience=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        plugins=[lf.FP8Precision(recipe="delayed")],
        callbacks=[fallback, Record(out_dir, fallback)],
        logger=False,
        max_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(320, 32, generator=g), torch.randint(0, 16, (320,), generator=g))
    trainer.fit(Planted(), torch.utils.data.DataLoader(data, batch_size=16))
    assert trainer.global_step == 10


if __name__ == "__main__":
    main(*sys.argv[1:])
