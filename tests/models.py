"""Small real models and data for the plugin tests (no downloads: text is the stdlib's own source)."""

from __future__ import annotations

import inspect
import json
import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def stdlib_bytes(n: int = 40_000) -> torch.Tensor:
    """The first ``n`` bytes of the json package's source, as a uint8 token stream."""
    text = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)[:n]
    return data.long()


class ByteWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: (input, next-byte target)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyDecoder(L.LightningModule):
    """Decoder-only byte-level transformer: attention and MLP Linear layers in every block."""

    def __init__(
        self,
        dim: int = 64,
        heads: int = 4,
        layers: int = 2,
        seq_len: int = 32,
        lr: float = 3e-3,
        activation_checkpointing: bool = False,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, 256, bias=False)
        self.lr = lr
        self.activation_checkpointing = activation_checkpointing
        self.optimizer_name = optimizer
        self.inject_nan_at_step: int | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.activation_checkpointing else block(x)
        return self.lm_head(self.ln(x))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        idx, target = batch
        logits = self(idx)
        return F.cross_entropy(logits.float().view(-1, 256), target.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.inject_nan_at_step is not None and self.global_step == self.inject_nan_at_step:
            loss = loss * float("nan")
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("val_loss", loss)
        self.log("val_ppl", math.e ** loss.detach())

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":  # no host syncs of its own (AdamW without fused/capturable has one per tensor)
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.optimizer_name == "adamw_fused" or None)


def loader(seq_len: int = 32, batch_size: int = 8, n: int = 40_000) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ByteWindows(stdlib_bytes(n), seq_len), batch_size=batch_size, shuffle=False)
