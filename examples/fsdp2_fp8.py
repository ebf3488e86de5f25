"""FP8 training sharded with FSDP2 (and optionally tensor parallelism) through the Trainer's ``ModelParallelStrategy``.

A small byte-level GPT learns the Python standard library's own source (nothing is downloaded). The one rule: call
``lightning_fp8.prepare_for_sharding(self)`` first in ``configure_model``, before ``parallelize_module`` and
``fully_shard``; FP8 weights (``tensorwise``, ``delayed``) are then all-gathered in FP8. Runs on 2 CPU processes (gloo)
as well as on GPUs::

    python examples/fsdp2_fp8.py                                           # 2 CPU processes, FSDP2, ~1 min
    python examples/fsdp2_fp8.py --tensor-parallel 2                       # 2 CPU processes, tensor parallel
    python examples/fsdp2_fp8.py --accelerator gpu --devices 8 --tensor-parallel 2 --steps 1000   # 4 x 2 GPUs

At the end it saves a distributed checkpoint (a folder, one shard per rank, the FP8 state in its metadata) that
``python -m lightning.fabric.utilities.consolidate_checkpoint`` turns into an ordinary checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep (before torch loads)

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import parallelize_module

import lightning_fp8 as lf

SEQ = 64


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(L.LightningModule):
    def __init__(self, dim: int = 128, layers: int = 2, heads: int = 4, lr: float = 3e-3) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, dim), nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, 256, bias=False)
        self.lr = lr

    def configure_model(self) -> None:
        if isinstance(self, FSDPModule):  # Lightning calls configure_model again for validate / test / predict
            return
        lf.prepare_for_sharding(self)  # 1. FP8 layers, with FP8 all-gather, before anything is sharded
        tp = self.device_mesh["tensor_parallel"]
        if tp.size() > 1:  # 2. tensor parallel MLPs and LM head (the attention stays replicated in this example)
            for block in self.blocks:
                parallelize_module(block, tp, {"fc": lf.FP8ColwiseParallel(), "out": lf.FP8RowwiseParallel()})
            parallelize_module(self.head, tp, lf.FP8ColwiseParallel(output_layouts=Replicate()))
        dp, policy = self.device_mesh["data_parallel"], MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for block in self.blocks:  # 3. FSDP2: each block, then the rest
            fully_shard(block, mesh=dp, mp_policy=policy)
        fully_shard(self, mesh=dp, mp_policy=policy)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Windows(torch.utils.data.Dataset):
    """Windows of ``SEQ + 1`` bytes of the standard library's top-level ``.py`` files."""

    def __init__(self, max_bytes: int = 2_000_000) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        data = b"".join(p.read_bytes() for p in sorted(root.glob("*.py")) if not p.name.startswith("_sysconfigdata"))
        self.data = torch.frombuffer(bytearray(data[:max_bytes]), dtype=torch.uint8).long()

    def __len__(self) -> int:
        return (len(self.data) - 1) // SEQ

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i * SEQ : i * SEQ + SEQ + 1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tensor-parallel", type=int, default=1, help="tensor-parallel size (the rest is FSDP2)")
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8, help="per data-parallel rank")
    parser.add_argument("--checkpoint", default="fsdp2_fp8.ckpt", help="distributed checkpoint folder written at the end")
    args = parser.parse_args(argv)

    L.seed_everything(0)
    strategy = ModelParallelStrategy(
        data_parallel_size=args.devices // args.tensor_parallel, tensor_parallel_size=args.tensor_parallel
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        plugins=[lf.FP8Precision(recipe=args.recipe)],
        callbacks=[lf.FP8StatsCallback(log_every_n_steps=20, summary=False)],
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(GPT(), torch.utils.data.DataLoader(Windows(), batch_size=args.batch_size, shuffle=True))
    trainer.save_checkpoint(args.checkpoint)
    if trainer.global_rank == 0:
        print(f"train_loss {trainer.callback_metrics['train_loss']:.4f} after {trainer.global_step} steps; "
              f"distributed checkpoint: {os.path.abspath(args.checkpoint)}")


if __name__ == "__main__":
    main()
