"""Regression tests for the silent wrong results of issue 8 ("FP8 core v2"), one section per bug.

Every test here failed on the main branch before the redesign (commit a36b0d8) and uses only the public API,
so it states the user-visible contract, not an implementation detail.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from models import TinyDecoder, loader
from torch import nn
from torch.utils.checkpoint import checkpoint
from utils import make_trainer

import lightning_fp8 as lf
from lightning_fp8.recipe import RECIPES
from lightning_fp8 import FP8Linear, FP8Precision
from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
SEEN, NONZERO, OVERFLOW, UNDERFLOW = 0, 1, 2, 3


def fp8_layers(model: nn.Module) -> dict[str, FP8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}


# ---------------------------------------------------------------- 1. the Trainer plugin cast every batch


class FloatTargets(L.LightningModule):
    """Regression on float targets, masks and sample weights: records exactly what each loop received."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.received: dict[str, list[torch.Tensor]] = {"train": [], "val": [], "predict": []}

    def _record(self, stage, batch):
        x, target, weight = batch
        self.received[stage].append(torch.stack([target.flatten()[0], weight.flatten()[0]]).detach().clone())
        self.received[stage + "_dtype"] = [x.dtype, target.dtype, weight.dtype]
        return x, target, weight

    def training_step(self, batch, batch_idx):
        x, target, weight = self._record("train", batch)
        return (weight * (self.net(x).float() - target).square().mean(-1)).mean()

    def validation_step(self, batch, batch_idx):
        self._record("val", batch)

    def predict_step(self, batch, batch_idx):
        self._record("predict", batch)
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)


@pytest.mark.parametrize(("compute_dtype", "value"), [(torch.bfloat16, 1.0 + 2.0**-10), (torch.float16, 1.0e5)])
def test_trainer_leaves_float_batches_untouched(compute_dtype, value):
    """bf16 rounded 1 + 2**-10 to 1.0; float16 turned 1e5 into inf. Lightning's bf16-mixed casts nothing."""
    x = torch.randn(8, 16)
    target = torch.full((8, 16), value)
    weight = torch.full((8,), value)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, target, weight), batch_size=4)
    model = FloatTargets()
    trainer = make_trainer(FP8Precision(compute_dtype=compute_dtype), max_steps=2, limit_val_batches=1)
    trainer.fit(model, data, data)
    trainer.predict(model, data)
    for stage in ("train", "val", "predict"):
        assert model.received[stage], stage
        assert all(r.tolist() == [value, value] for r in model.received[stage]), (stage, model.received[stage])
        assert model.received[stage + "_dtype"] == [torch.float32] * 3, stage


# ---------------------------------------------------------------- 2. reentrant checkpointing rolled on every backward


class ReentrantDecoder(TinyDecoder):
    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.lm_head(self.ln(x))


def test_reentrant_checkpointing_rolls_once_per_optimizer_step():
    """With accumulate_grad_batches=4 the grad_output history gained 4 entries per optimizer step."""
    torch.manual_seed(0)
    model = ReentrantDecoder()
    plugin = FP8Precision(recipe="delayed", amax_history_len=64)
    make_trainer(plugin, max_steps=3, accumulate_grad_batches=4).fit(model, loader(n=16_000))
    for name, layer in fp8_layers(model).items():
        filled = (layer.fp8_amax_history != 0).sum(dim=1).tolist()
        assert filled == [3, 3, 3], (name, filled)  # input, weight, grad_output: one entry per optimizer step
        assert int(layer.fp8_counts[GRAD_OUTPUT, SEEN]) == int(layer.fp8_counts[INPUT, SEEN]) // layer.in_features * (
            layer.out_features
        ), name  # grad_output recorded once per micro-batch, like the input


@pytest.mark.parametrize("recipe", RECIPES)
def test_trainer_checkpointing_reentrant_or_not_trains_bit_identically(recipe):
    """Activation checkpointing (both flavours) must not change a single bit of the training run."""
    runs = []
    for model_cls in (TinyDecoder, ReentrantDecoder, None):
        torch.manual_seed(0)
        model = TinyDecoder(activation_checkpointing=True) if model_cls is None else model_cls()
        make_trainer(FP8Precision(recipe=recipe), max_steps=3, accumulate_grad_batches=2).fit(model, loader(n=16_000))
        runs.append(model)
    plain = runs[0]
    for other in runs[1:]:
        for (name, p), q in zip(plain.named_parameters(), other.parameters()):
            assert torch.equal(p, q), name
        for name, layer in fp8_layers(plain).items():
            twin = other.get_submodule(name)
            assert torch.equal(layer.fp8_amax_history, twin.fp8_amax_history), name
            assert torch.equal(layer.fp8_counts, twin.fp8_counts), name
            assert torch.equal(layer.fp8_scale, twin.fp8_scale), name


# ---------------------------------------------------------------- 3. standalone fp8_autocast + checkpointing


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_standalone_checkpointing_gradients_are_bit_identical(recipe, use_reentrant):
    """Standalone delayed scaling rolled the input scale after the forward's cast, so the recomputation
    quantized x with another scale (grad_weight off by 65% of its maximum)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    lf.convert_to_fp8(plain, recipe=recipe)
    ckpt = copy.deepcopy(plain)
    for step in range(4):
        x, g = torch.randn(8, 32) * (1 + 3 * step), torch.randn(8, 32) / (1 + step)
        grads = []
        for model, use_ckpt in ((plain, False), (ckpt, True)):
            xx = x.clone().requires_grad_()
            with lf.fp8_autocast():
                y = checkpoint(model, xx, use_reentrant=use_reentrant) if use_ckpt else model(xx)
            y.backward(g)
            grads.append([xx.grad] + [p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        for a, b in zip(*grads):
            assert torch.equal(a, b), f"step {step}"


# ---------------------------------------------------------------- 4. training_step returning None + clipping


class SometimesNone(TinyDecoder):
    """Returns None from training_step on odd batches (Lightning skips backward and step)."""

    def __init__(self, set_to_none: bool = True):
        super().__init__(optimizer="sgd")
        self.set_to_none = set_to_none
        self.grad_max_at_step: list[float] = []

    def training_step(self, batch, batch_idx):
        if batch_idx % 2 == 1:
            return None
        return super().training_step(batch, batch_idx)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=self.set_to_none)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        original = optimizer.step

        def step(*args, **kwargs):  # what the optimizer really applies
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                self.grad_max_at_step.append(max(float(g.abs().max()) for g in grads))
            return original(*args, **kwargs)

        optimizer.step = step
        return optimizer


def _fit_sometimes_none(set_to_none, **plugin_kwargs):
    torch.manual_seed(0)
    model = SometimesNone(set_to_none)
    # a clipping threshold that true gradients never reach, but gradients still multiplied by 65536 do
    trainer = make_trainer(FP8Precision(**plugin_kwargs), max_steps=6, gradient_clip_val=1000.0)
    trainer.fit(model, loader(n=16_000))
    assert trainer.global_step == 6
    return model


@pytest.mark.parametrize("set_to_none", [True, False])
def test_training_step_returning_none_with_clipping(set_to_none):
    """set_to_none=True crashed ('No inf checks were recorded'); set_to_none=False trained silently on gradients
    still multiplied by the loss scale (65536) on the step after a skipped one."""
    scaled = _fit_sometimes_none(set_to_none, loss_scaling=True)
    reference = _fit_sometimes_none(set_to_none, loss_scaling=False)
    assert len(scaled.grad_max_at_step) == len(reference.grad_max_at_step) >= 3
    # the optimizer sees the true gradients: the same as in a run without loss scaling
    for a, b in zip(scaled.grad_max_at_step, reference.grad_max_at_step):
        assert a == pytest.approx(b, rel=1e-3), (scaled.grad_max_at_step, reference.grad_max_at_step)
    for p, q in zip(scaled.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------- 5. delayed grad_output history vs the loss scale


class LossScaleLog(L.Callback):
    def __init__(self):
        self.scales: list[float] = []
        self.overflow: list[int] = []
        self.history: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        layers = fp8_layers(pl_module).values()
        self.scales.append(float(trainer.precision_plugin.loss_scale))
        self.overflow.append(sum(int(m.fp8_counts[GRAD_OUTPUT, OVERFLOW]) for m in layers))
        self.history.append(torch.stack([m.fp8_amax_history[GRAD_OUTPUT].clone() for m in layers]))


def _fit_with_loss_scale(growth_interval):
    torch.manual_seed(0)
    model = TinyDecoder()
    model.inject_nan_at_step = 7
    log = LossScaleLog()
    plugin = FP8Precision(recipe="delayed", loss_scaling=True, init_scale=2.0**8, growth_interval=growth_interval)
    make_trainer(plugin, max_steps=10, callbacks=[log]).fit(model, loader(n=16_000))
    return model, log


def test_delayed_grad_output_history_follows_the_loss_scale():
    """The history was kept in the loss-scaled domain of past steps: after the scale grew it underestimated the
    amax by the growth factor and the largest gradients saturated; after a back-off it overestimated.

    Loss scales are powers of two, so with consistent histories the FP8 gradients, the overflow counts and the
    trained weights cannot depend on how the scale moved: a run whose scale grows every 2 steps must match, bit
    for bit, a run whose scale never grows."""
    moving_model, moving = _fit_with_loss_scale(growth_interval=2)
    steady_model, steady = _fit_with_loss_scale(growth_interval=1000)
    # the loss scale logged after step i is the one backward i used: its update follows the steps before i
    grew = [i for i in range(1, 10) if moving.scales[i] == 2 * moving.scales[i - 1]]
    backed_off = [i for i in range(1, 10) if moving.scales[i] == 0.5 * moving.scales[i - 1]]
    assert grew and backed_off == [8], moving.scales  # step 7 was skipped: the scale backs off for step 8
    assert steady.scales[:8] == [2.0**8] * 8 and steady.scales[8] == 2.0**7, steady.scales
    assert moving.overflow == steady.overflow, (moving.overflow, steady.overflow)
    for (name, p), q in zip(moving_model.named_parameters(), steady_model.parameters()):
        assert torch.equal(p, q), name
    # After a scale change the older history entries are the previous step's entries, rescaled.
    for i in grew + backed_off:
        ratio = moving.scales[i] / moving.scales[i - 1]
        before, after = moving.history[i - 1], moving.history[i]
        expected = before[:, :-1] * ratio
        finite = torch.isfinite(expected) & (expected > 0)
        assert torch.equal(after[:, 1:][finite], expected[finite]), (i, ratio)


# ---------------------------------------------------------------- Fabric with two models (the GAN pattern)


def test_fabric_two_models_are_both_tracked_and_checkpointed(tmp_path):
    def build():
        torch.manual_seed(0)
        plugin = FabricFP8Precision(recipe="delayed")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        gen = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
        disc = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
        opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
        gen, opt_g = fabric.setup(gen, opt_g)
        disc, opt_d = fabric.setup(disc, opt_d)
        return fabric, plugin, gen, disc, opt_g, opt_d

    def steps(gen, disc, opt_g, opt_d, fabric, n, seed):
        torch.manual_seed(seed)
        for _ in range(n):
            z = torch.randn(8, 16)
            opt_d.zero_grad()
            fabric.backward(disc(gen(z).detach()).float().square().mean())
            opt_d.step()
            opt_g.zero_grad()
            fabric.backward(-disc(gen(z)).float().square().mean())
            opt_g.step()

    fabric, plugin, gen, disc, opt_g, opt_d = build()
    steps(gen, disc, opt_g, opt_d, fabric, 3, seed=1)
    for model in (gen.module, disc.module):
        for name, layer in fp8_layers(model).items():
            filled = (layer.fp8_amax_history != 0).sum(dim=1)
            assert filled.min() >= 3, (name, filled)  # rolled at least once per step of its optimizer
    # Each model rolls at its own optimizer's step: the generator just stepped; the discriminator's forward in the
    # generator's step stays pending until the discriminator's next step.
    for name, layer in fp8_layers(gen.module).items():
        assert torch.all(layer.fp8_amax_pending == 0), name
    for name, layer in fp8_layers(disc.module).items():
        assert torch.all(layer.fp8_amax_pending[:2] > 0), name
    fabric.save(tmp_path / "gan.ckpt", {"gen": gen, "disc": disc, "opt_g": opt_g, "opt_d": opt_d, "fp8": plugin})

    fabric2, plugin2, gen2, disc2, opt_g2, opt_d2 = build()
    fabric2.load(tmp_path / "gan.ckpt", {"gen": gen2, "disc": disc2, "opt_g": opt_g2, "opt_d": opt_d2, "fp8": plugin2})
    for a, b in ((gen, gen2), (disc, disc2)):
        for name, layer in fp8_layers(a.module).items():
            twin = b.module.get_submodule(name)
            assert torch.equal(layer.fp8_amax_history, twin.fp8_amax_history), name
            assert torch.equal(layer.fp8_scale, twin.fp8_scale), name
    steps(gen, disc, opt_g, opt_d, fabric, 2, seed=2)
    steps(gen2, disc2, opt_g2, opt_d2, fabric2, 2, seed=2)
    for p, q in zip(list(gen.parameters()) + list(disc.parameters()), list(gen2.parameters()) + list(disc2.parameters())):
        assert torch.equal(p, q)


def test_fabric_setup_line_counts_every_model(caplog):
    import logging

    plugin = FabricFP8Precision()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    a = fabric.setup(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)))
    b = fabric.setup(nn.Sequential(nn.Linear(16, 16)))
    with caplog.at_level(logging.INFO):
        a(torch.randn(2, 16))
        b(torch.randn(2, 16))
    lines = [r.getMessage() for r in caplog.records if "FP8 active" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "2 Linear layer(s) in FP8" in lines[0] and "1 Linear layer(s) in FP8" in lines[1], lines


# ---------------------------------------------------------------- loss scaling under bf16 compute


def _fabric_grads(**plugin_kwargs):
    torch.manual_seed(0)
    plugin = FabricFP8Precision(**plugin_kwargs)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    x = torch.randn(8, 32)
    fabric.backward(model(x).float().square().mean())
    return plugin, [p.grad.clone() for p in model.parameters()]


def test_bf16_default_reads_true_gradients_after_backward():
    """bf16 has fp32's exponent range: the default no longer multiplies the gradients by 65536."""
    plugin, grads = _fabric_grads()
    _, reference = _fabric_grads(loss_scaling=False)
    for g, r in zip(grads, reference):
        assert torch.equal(g, r)
    assert float(plugin.loss_scale) == 1.0


def test_scaler_exists_before_training():
    plugin = FP8Precision(compute_dtype=torch.float16)
    assert plugin.scaler is not None
    state = plugin.state_dict()
    assert state["loss_scaler"]["scale"] == 2.0**16


# ---------------------------------------------------------------- MFU peak: the FLOPs entry Lightning uses


@pytest.mark.parametrize(
    ("compute_dtype", "path", "expected"),
    [
        (torch.bfloat16, "emulated", torch.bfloat16),
        (torch.float16, "emulated", torch.float16),
        (torch.bfloat16, "native", torch.int8),
        (torch.float16, "native", torch.int8),
    ],
)
def test_throughput_monitor_uses_the_right_peak(monkeypatch, compute_dtype, path, expected):
    """Lightning's ThroughputMonitor mapped the plugin to float16 even for bf16 compute."""
    from lightning.fabric.utilities import throughput as fabric_throughput
    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning.pytorch.callbacks import throughput_monitor

    from lightning_fp8 import gemm

    monkeypatch.setattr(gemm, "gemm_path", lambda device, recipe="tensorwise": path)
    seen = []
    monkeypatch.setattr(throughput_monitor, "get_available_flops", lambda device, dtype: seen.append(dtype) or 1e12)
    model = nn.Sequential(nn.Linear(16, 16))

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model

        def training_step(self, batch, batch_idx):
            return self.net(batch).float().sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch.shape[0])
    data = torch.utils.data.DataLoader(torch.randn(8, 16), batch_size=4)
    make_trainer(FP8Precision(compute_dtype=compute_dtype), max_steps=1, callbacks=[monitor]).fit(Model(), data)
    assert seen == [expected]

    monkeypatch.setattr(fabric_throughput, "get_available_flops", lambda device, dtype: seen.append(dtype) or 1e12)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision(compute_dtype=compute_dtype)])
    fabric.setup(nn.Sequential(nn.Linear(16, 16)))
    fabric_throughput.ThroughputMonitor(fabric)
    assert seen == [expected, expected]


# ---------------------------------------------------------------- settings a recipe ignores


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"recipe": "tensorwise", "margin": 1}, "margin"),
        ({"recipe": "rowwise", "margin": 2}, "margin"),
        ({"recipe": "rowwise", "fp8_format": "hybrid"}, "fp8_format"),
        ({"recipe": "tensorwise", "amax_compute_algo": "most_recent"}, "amax_compute_algo"),
        ({"recipe": "rowwise", "amax_compute_algo": "max"}, "amax_compute_algo"),
    ],
)
def test_settings_the_recipe_ignores_fail_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        FP8Precision(**kwargs)
    assert "delayed" in str(err.value) or "e4m3" in str(err.value)


# ---------------------------------------------------------------- the emulated GEMM rounds once


def test_emulated_gemm_rounds_once_to_the_output_dtype():
    """The emulation rounded the product to bf16, then applied the scales and rounded again: with float16 output
    87% of the elements differed from the correctly rounded value."""
    from lightning_fp8.gemm import fp8_mm

    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(64, 128, generator=gen) * 20).to(torch.float8_e4m3fn)
    b = (torch.randn(96, 128, generator=gen) * 20).to(torch.float8_e4m3fn).t()
    sa, sb = torch.tensor(3.3), torch.tensor(0.77)  # quantization scales: fp8 = x * scale
    exact = (a.double() @ b.double()) / (3.3 * 0.77)
    for out_dtype in (torch.float16, torch.bfloat16):
        out = fp8_mm(a, b, sa.float(), sb.float(), out_dtype)
        agree = (out == exact.to(out_dtype)).double().mean().item()
        assert agree > 0.99, (out_dtype, agree)  # float32 accumulation order may flip a rare tie
