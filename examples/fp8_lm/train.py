"""FP8 training of a byte-level decoder-only transformer on the Python standard library's own source.

Runs anywhere without downloads: the text is the ``.py`` files of the interpreter that runs this script
(``sysconfig.get_paths()["stdlib"]``). It uses the GPU when there is one and the CPU otherwise::

    python examples/fp8_lm/train.py fit --config examples/fp8_lm/configs/cpu.yaml    # ~2.5 min on 2 CPU cores
    python examples/fp8_lm/train.py fit --config examples/fp8_lm/configs/bf16.yaml   # same model, bf16-mixed, ~1 min
    python examples/fp8_lm/train.py fit --config examples/fp8_lm/configs/gpu.yaml    # larger model, one GPU

FP8 is two entries of the yaml (``trainer.plugins`` and ``trainer.callbacks``); everything else is a
plain LightningModule, a LightningDataModule and ``LightningCLI``.
"""

from __future__ import annotations

import math
import os
import sysconfig
import time
import warnings
import zlib
from pathlib import Path

# Let idle OpenMP threads sleep instead of spinning (read when torch loads, so set before importing it): on a CPU
# shared with other busy processes, spinning threads made each step up to 20x slower in our measurements.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torchmetrics.text import Perplexity

from lightning_fp8.cli import FP8ArgumentParser

VOCAB = 256  # bytes
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}

# The data sits in memory: worker processes would not make loading faster.
warnings.filterwarnings("ignore", ".*does not have many workers.*")


# ----------------------------------------------------------------------------------------------- data
def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted (installed packages, tests and build-specific files excluded)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        if rel.name.startswith("_sysconfigdata"):  # generated per build
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_val_file(rel_path: str, val_percent: int) -> bool:
    """A file's split depends only on its own path, so adding or removing files does not reshuffle others."""
    return zlib.crc32(rel_path.encode()) % 100 < val_percent


class ByteWindows(torch.utils.data.Dataset):
    """Windows of ``seq_len + 1`` bytes starting at ``starts``: (input bytes, next bytes)."""

    def __init__(self, data: torch.Tensor, seq_len: int, starts: torch.Tensor) -> None:
        self.data, self.seq_len, self.starts = data, seq_len, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[i])
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibBytes(L.LightningDataModule):
    """Byte-level language modelling data: the standard library's source, split by file into train / val.

    Args:
        seq_len: context length in bytes (linked to the model's ``seq_len`` by the CLI).
        batch_size: sequences per batch.
        val_percent: share of the files (by a hash of their path) held out for validation.
        val_windows: number of validation sequences, evenly spaced over the validation text.
        max_train_bytes: keep only the first this many training bytes (``null``: all, ~13 MB).
        stdlib_dir: read another directory of ``.py`` files instead of this interpreter's stdlib.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        seq_len: int = 128,
        batch_size: int = 32,
        val_percent: int = 5,
        val_windows: int = 256,
        max_train_bytes: int | None = None,
        stdlib_dir: str | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0 < val_percent < 100:
            raise ValueError(f"val_percent must be in (0, 100), got {val_percent}")
        self.save_hyperparameters()
        self.train_data: torch.Tensor | None = None
        self.val_data: torch.Tensor | None = None

    def setup(self, stage: str) -> None:
        if self.train_data is not None:
            return
        hp = self.hparams
        root = Path(hp.stdlib_dir or sysconfig.get_paths()["stdlib"])
        files = stdlib_files(root)
        if not files:
            raise FileNotFoundError(f"No .py files under {root}")
        parts: dict[bool, list[bytes]] = {False: [], True: []}
        for path in files:
            parts[is_val_file(path.relative_to(root).as_posix(), hp.val_percent)].append(path.read_bytes())
        train, val = b"".join(parts[False]), b"".join(parts[True])
        if hp.max_train_bytes is not None:
            train = train[: hp.max_train_bytes]
        self.train_data = torch.frombuffer(bytearray(train), dtype=torch.uint8)
        self.val_data = torch.frombuffer(bytearray(val), dtype=torch.uint8)
        if self.trainer is None or self.trainer.is_global_zero:
            print(
                f"Data: {root}: {len(parts[False])} train files ({len(train) / 1e6:.1f} MB used), "
                f"{len(parts[True])} validation files ({len(val) / 1e6:.1f} MB)"
            )

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        n = (len(self.train_data) - 1) // self.hparams.seq_len  # non-overlapping windows, shuffled each epoch
        starts = torch.arange(n) * self.hparams.seq_len
        return self._loader(ByteWindows(self.train_data, self.hparams.seq_len, starts), shuffle=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        last = len(self.val_data) - self.hparams.seq_len - 1  # a fixed sample spread over every val file
        starts = torch.linspace(0, last, self.hparams.val_windows).long()
        return self._loader(ByteWindows(self.val_data, self.hparams.seq_len, starts), shuffle=False)

    def _loader(self, dataset: torch.utils.data.Dataset, shuffle: bool) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            num_workers=self.hparams.num_workers,
            pin_memory=torch.cuda.is_available(),
        )


# ----------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm transformer block. Its four Linear layers (qkv, proj, fc, out) are the ones FP8 runs."""

    def __init__(self, dim: int, n_heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.fc = nn.Linear(dim, mlp_ratio * dim, bias=False)
        self.out = nn.Linear(mlp_ratio * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + F.dropout(self.proj(att.transpose(1, 2).reshape(b, t, d)), drop, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), drop, self.training)


class ByteTransformerLM(L.LightningModule):
    """Decoder-only transformer over bytes (vocabulary 256).

    Args:
        dim: model width (a multiple of 16, so every Linear layer can run in FP8).
        n_layers: number of transformer blocks.
        n_heads: attention heads (``dim`` must be divisible by it).
        mlp_ratio: hidden width of the MLP, in multiples of ``dim``.
        seq_len: longest context (set from ``data.seq_len`` by the CLI).
        dropout: dropout probability.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay on the matrices (not on norms and embeddings).
        warmup_steps: linear warm-up steps, then cosine decay to ``lr * min_lr_ratio`` at the last step.
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        fused: use ``AdamW(fused=True)``. With FP8Precision this removes the one device-to-host sync per
            step of loss scaling, and gradient clipping still works; Lightning's ``bf16-mixed`` /
            ``16-mixed`` plugins refuse gradient clipping with a fused optimizer.
    """

    def __init__(
        self,
        dim: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        mlp_ratio: int = 4,
        seq_len: int = 128,
        dropout: float = 0.0,
        lr: float = 2e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        fused: bool = False,
    ) -> None:
        super().__init__()
        if dim % 16 or dim % n_heads:
            raise ValueError(f"dim must be a multiple of 16 and of n_heads, got dim={dim}, n_heads={n_heads}")
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(VOCAB, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, mlp_ratio, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.apply(self._init_weights)
        self.val_ppl = Perplexity()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, target = batch
        loss = F.cross_entropy(self(idx).float().view(-1, VOCAB), target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        idx, target = batch
        logits = self(idx).float()
        self.log("val_loss", F.cross_entropy(logits.view(-1, VOCAB), target.view(-1)), prog_bar=True)
        self.val_ppl(logits, target)
        self.log("val_ppl", self.val_ppl, prog_bar=True)

    def configure_optimizers(self):
        hp = self.hparams
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        others = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": hp.weight_decay}, {"params": others, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=(0.9, 0.95), fused=hp.fused or None)
        total = max(1, self.trainer.estimated_stepping_batches)

        def schedule(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ----------------------------------------------------------------------------------------------- CLI
class LMCLI(LightningCLI):
    """LightningCLI plus two things: the context length is set once (``data.seq_len``), and the end of
    ``fit`` says where the results are."""

    def __init__(self, *args, **kwargs) -> None:
        # FP8ArgumentParser: a misspelled init_args key gets "did you mean ...?" and the accepted arguments,
        # a dtype written without "torch." gets the right spelling.
        kwargs.setdefault("parser_class", FP8ArgumentParser)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.seq_len", "model.seq_len")

    def before_fit(self) -> None:
        self._start = time.perf_counter()

    def after_fit(self) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith("fp8/")}
        shown = ", ".join(f"{k} {metrics[k]:.4f}" for k in ("train_loss", "val_loss", "val_ppl") if k in metrics)
        took = time.perf_counter() - self._start
        plugin = type(trainer.precision_plugin).__name__
        lines = [
            "",
            f"Finished {trainer.global_step} steps in {took:.0f} s ({plugin}, {trainer.strategy.root_device}): {shown}",
        ]
        logger = trainer.logger
        if logger is not None and logger.log_dir:
            lines.append(f"Logs:       {os.path.abspath(logger.log_dir)}")
            if type(logger).__name__ == "TensorBoardLogger":
                lines.append(f"            tensorboard --logdir {os.path.abspath(logger.save_dir)}")
        heatmap_dir = logger.log_dir if logger is not None and logger.log_dir else trainer.default_root_dir
        heatmap = os.path.abspath(os.path.join(heatmap_dir, "fp8_amax_heatmap.png"))
        if os.path.exists(heatmap):
            lines.append(f"Heatmap:    {heatmap}")
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and (ckpt.best_model_path or ckpt.last_model_path):
            lines.append(f"Checkpoint: {os.path.abspath(ckpt.best_model_path or ckpt.last_model_path)}")
        print("\n".join(lines), flush=True)


def main(args: list[str] | None = None, **kwargs) -> LMCLI:
    return LMCLI(ByteTransformerLM, StdlibBytes, args=args, **kwargs)


if __name__ == "__main__":
    main()
