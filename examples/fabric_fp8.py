"""FP8 training with Lightning Fabric: ``lightning_fp8.fabric.FP8Precision`` in a hand-written loop.

A small byte-level language model (an MLP over the previous 32 bytes) learns the Python standard
library's own source, so it runs anywhere without downloads. GPU if there is one, CPU otherwise::

    python examples/fabric_fp8.py                                     # 300 steps, under a minute on 2 CPU cores
    python examples/fabric_fp8.py --steps 100 --resume fabric_fp8.ckpt   # continue from the checkpoint

What the plugin does in this loop: ``fabric.setup`` converts the Linear layers to FP8 in place; every
forward through the wrapped model runs in bf16 autocast plus FP8; ``fabric.backward`` runs the backward
(with ``compute_dtype=torch.float16`` it would scale the loss; bf16 needs no scaling, so the gradients are
the true ones); ``fabric.clip_gradients`` sees unscaled gradients; ``optimizer.step`` skips steps with
non-finite gradients and updates the FP8 scales. ``FP8Stats`` reads the FP8 health statistics (one device
snapshot, one host copy) and ``fabric.log_dict`` writes them to the CSV logger. Passing the plugin to
``fabric.save`` / ``fabric.load`` stores the loss scaler and every layer's FP8 state (amax histories, scales)
next to the weights.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

# Let idle OpenMP threads sleep instead of spinning (read when torch loads, so set before importing it): on a CPU
# shared with other busy processes, spinning threads made each step up to 20x slower in our measurements.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fp8 import FP8Stats
from lightning_fp8.fabric import FP8Precision
from lightning_fp8.recipe import RECIPES

CONTEXT = 32  # bytes of context per prediction


def stdlib_text(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The first ``max_bytes`` of the standard library's top-level ``.py`` files, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(p.read_bytes() for p in sorted(root.glob("*.py")) if not p.name.startswith("_sysconfigdata"))
    return torch.frombuffer(bytearray(data[:max_bytes]), dtype=torch.uint8)


class ByteMLP(nn.Module):
    """Embed the previous ``CONTEXT`` bytes, then two hidden layers: every Linear has dims that are multiples of 16."""

    def __init__(self, emb: int = 32, hidden: int = 512) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, emb)
        self.net = nn.Sequential(
            nn.Linear(CONTEXT * emb, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 256)
        )

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.net(self.emb(context).flatten(1))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--recipe", default="delayed", choices=list(RECIPES))
    parser.add_argument("--checkpoint", default="fabric_fp8.ckpt", help="where to save at the end")
    parser.add_argument("--resume", default=None, help="checkpoint to continue from")
    parser.add_argument("--log-dir", default="fabric_fp8_logs", help="where the CSV logger writes metrics.csv")
    parser.add_argument("--log-every", type=int, default=50, help="log loss and FP8 statistics every N steps")
    args = parser.parse_args(argv)

    L.seed_everything(0)
    fp8 = FP8Precision(recipe=args.recipe)
    logger = L.fabric.loggers.CSVLogger(args.log_dir, name="", version="")
    fabric = L.Fabric(accelerator="auto", devices=1, plugins=[fp8], loggers=[logger])
    fabric.launch()

    data = stdlib_text()
    starts = torch.arange(len(data) - CONTEXT - 1)
    loader = torch.utils.data.DataLoader(starts, batch_size=args.batch_size, shuffle=True, drop_last=True)
    loader = fabric.setup_dataloaders(loader)  # moves each batch of start offsets to the device
    data = data.to(fabric.device)
    offsets = torch.arange(CONTEXT + 1, device=fabric.device)

    model = ByteMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)  # the Linear layers are now FP8Linear (same parameters)
    stats = FP8Stats(fp8)  # the FP8 statistics of every model set up with the plugin
    # the stats reader is saved too: resumed, its first reading covers the steps since the last reading before the
    # checkpoint, not the whole run (see FP8Stats)
    state = {"model": model, "optimizer": optimizer, "fp8": fp8, "stats": stats, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)  # weights, optimizer, loss scale and FP8 state; bit-exact resume
        fabric.print(f"Resumed from {args.resume} at step {state['step']}")

    losses = []
    batches = iter(loader)
    for _ in range(args.steps):
        try:
            start = next(batches)
        except StopIteration:
            batches = iter(loader)
            start = next(batches)
        window = data[start[:, None] + offsets].long()  # (batch, CONTEXT + 1) bytes
        logits = model(window[:, :-1])  # through the Fabric wrapper: autocast + FP8 region
        loss = F.cross_entropy(logits.float(), window[:, -1])
        optimizer.zero_grad()
        fabric.backward(loss)  # scaled by the plugin's loss scaler
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # unscales first
        optimizer.step()  # skipped if the gradients are not finite; then the FP8 bookkeeping
        state["step"] += 1
        losses.append(loss.detach())
        if state["step"] % args.log_every == 0:
            metrics = stats.metrics()  # one device-to-host copy (and, with several processes, one collective)
            fabric.log_dict({"train_loss": loss.item(), **metrics}, step=state["step"])
            fabric.print(
                f"step {state['step']:5d}  loss {loss.item():.4f}  worst FP8 overflow "
                f"{metrics.get('fp8/worst/overflow_frac', 0.0):.2e}  skipped steps {metrics['fp8/skipped_steps']:.0f}"
            )

    fabric.save(args.checkpoint, state)
    logger.finalize("success")
    fabric.print(
        f"Saved {os.path.abspath(args.checkpoint)} (model, optimizer, FP8 plugin state: "
        f"{', '.join(fp8.state_dict())}); metrics in {os.path.join(os.path.abspath(args.log_dir), 'metrics.csv')}"
    )
    return {"losses": [float(x) for x in losses], "checkpoint": args.checkpoint, "fp8": fp8, "model": model}


if __name__ == "__main__":
    main()
