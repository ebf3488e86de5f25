"""``delayed`` sibling layers sharing their input's cast in a real Trainer with ``FP8Precision(recipe="delayed")`` on a
model with q/k/v and gate/up siblings: ``SHARE_INPUT_CASTS`` on vs off, bit for bit (accumulation, validation,
activation checkpointing, fp16 loss scaling, calibration, resume), and the shared runs cast fewer inputs (sharing
happens, also after resuming: the tokens come back from the loaded values)."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from utils import make_trainer

import lightning_fp8 as lf
from lightning_fp8 import FP8Precision
from lightning_fp8 import linear as fp8_linear
from lightning_fp8.recipe import INPUT

_QUANTIZE = fp8_linear.quantize


def _count_input_casts(monkeypatch) -> list[int]:
    """Counts the training-mode (recording) input casts from now on."""
    count = [0]

    def counting(x, spec, *, statistics=True, **kwargs):
        if spec.role == INPUT and statistics:
            count[0] += 1
        return _QUANTIZE(x, spec, statistics=statistics, **kwargs)

    monkeypatch.setattr(fp8_linear, "quantize", counting)
    return count


class SibBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.gate, self.up = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, 4, d // 4).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(a)
        h = self.ln2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class SibModel(L.LightningModule):
    def __init__(self, ckpt=None, d=64):
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.blocks = nn.ModuleList(SibBlock(d) for _ in range(2))
        self.head = nn.Linear(d, 256)
        self.ckpt = ckpt
        self.val_losses = []

    def forward(self, idx):
        x = self.emb(idx)
        for blk in self.blocks:
            if self.ckpt is None:
                x = blk(x)
            else:
                x = checkpoint(blk, x, use_reentrant=self.ckpt == "reentrant")
        return self.head(x)

    def training_step(self, batch, i):
        idx, tgt = batch
        return F.cross_entropy(self(idx).float().view(-1, 256), tgt.view(-1))

    def validation_step(self, batch, i):
        idx, tgt = batch
        loss = F.cross_entropy(self(idx).float().view(-1, 256), tgt.view(-1))
        self.val_losses.append(loss.detach().clone())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def _data(n=48, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (n, t + 1), generator=g)
    # growing range across batches so that delayed scales move
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(idx[:, :-1], idx[:, 1:]), batch_size=4)


def _fit(share, monkeypatch, ckpt=None, trainer_kw=None, **plugin_kw):
    """Six optimizer steps of two micro-batches each, validation after the fourth (``trainer_kw`` overrides)."""
    monkeypatch.setattr(fp8_linear, "SHARE_INPUT_CASTS", share)
    torch.manual_seed(0)
    model = SibModel(ckpt)
    model.input_casts = _count_input_casts(monkeypatch)
    plugin = FP8Precision(recipe="delayed", amax_history_len=4, **plugin_kw)
    kw = dict(max_steps=6, accumulate_grad_batches=2, val_check_interval=4, limit_val_batches=2,
              check_val_every_n_epoch=None)
    kw.update(trainer_kw or {})
    trainer = make_trainer(plugin, **kw)
    trainer.fit(model, _data(), _data(8, seed=1))
    return model, plugin


def _compare(a, b):
    (ma, _), (mb, _) = a, b
    bad = [n for (n, x), (_, y) in zip(ma.state_dict().items(), mb.state_dict().items()) if not torch.equal(x, y)]
    va, vb = torch.stack(ma.val_losses), torch.stack(mb.val_losses)
    assert torch.equal(va, vb), (va, vb)
    assert not bad, bad[:5]
    ta, tb = lf.fp8_state_dict(ma)["tables"][0], lf.fp8_state_dict(mb)["tables"][0]
    for key in ("scale", "amax_history", "counts"):
        torch.testing.assert_close(ta[key], tb[key], rtol=0, atol=0, equal_nan=True, msg=key)
    # 15 FP8 layers (7 per block and the head) read 9 distinct inputs (per block: h for q/k/v, the attention output,
    # h for gate/up, the MLP product): sharing casts 9 inputs where each layer casting its own casts 15. A reentrant
    # checkpoint runs the (recording) forward under no_grad, where nothing is shared: its inputs are leaves
    shared = 15 if ma.ckpt != "reentrant" else 9
    assert shared * ma.input_casts[0] == 9 * mb.input_casts[0] > 0, (ma.input_casts, mb.input_casts)


@pytest.mark.parametrize("ckpt", [None, "nonreentrant", "reentrant"])
def test_trainer_delayed_siblings_bit_for_bit(ckpt, monkeypatch):
    _compare(_fit(True, monkeypatch, ckpt), _fit(False, monkeypatch, ckpt))


@pytest.mark.parametrize("init_scale", [2.0**30, 2.0**16])
def test_trainer_delayed_siblings_fp16_loss_scaling(init_scale, monkeypatch):
    _compare(_fit(True, monkeypatch, compute_dtype=torch.float16, init_scale=init_scale),
             _fit(False, monkeypatch, compute_dtype=torch.float16, init_scale=init_scale))


@pytest.mark.parametrize("variant", ["no_inference_mode", "calibration", "no_accumulate_most_recent"])
def test_trainer_delayed_siblings_variants(variant, monkeypatch):
    if variant == "no_inference_mode":
        args = dict(trainer_kw=dict(inference_mode=False))
    elif variant == "calibration":
        args = dict(calibration_batches=2)
    else:
        args = dict(trainer_kw=dict(accumulate_grad_batches=1), amax_compute_algo="most_recent")
    _compare(_fit(True, monkeypatch, **args), _fit(False, monkeypatch, **args))


def _fit_resume(share, monkeypatch, tmp):
    monkeypatch.setattr(fp8_linear, "SHARE_INPUT_CASTS", share)
    torch.manual_seed(0)
    model = SibModel()
    model.input_casts = _count_input_casts(monkeypatch)
    kw = dict(accumulate_grad_batches=2, val_check_interval=4, limit_val_batches=2, check_val_every_n_epoch=None)
    trainer = make_trainer(FP8Precision(recipe="delayed", amax_history_len=4), max_steps=3, **kw)
    trainer.fit(model, _data(), _data(8, seed=1))
    path = os.path.join(tmp, f"mid_{share}.ckpt")
    trainer.save_checkpoint(path)
    torch.manual_seed(1)
    model2 = SibModel()
    model2.input_casts = _count_input_casts(monkeypatch)  # the resumed fit's casts alone
    plugin = FP8Precision(recipe="delayed", amax_history_len=4)
    trainer = make_trainer(plugin, max_steps=7, **kw)
    trainer.fit(model2, _data(), _data(8, seed=1), ckpt_path=path)
    model2.val_losses = model.val_losses + model2.val_losses
    return model2, plugin


def test_trainer_delayed_siblings_resume(monkeypatch, tmp_path):
    _compare(_fit_resume(True, monkeypatch, str(tmp_path)), _fit_resume(False, monkeypatch, str(tmp_path)))
