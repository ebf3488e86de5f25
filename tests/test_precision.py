"""FP8Precision with the Lightning Trainer: construction, conversion, loss scaling, hooks, checkpoints."""

from __future__ import annotations

import logging
import math
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from models import TinyDecoder, loader
from torch import nn
from utils import SyncCounter, make_trainer, per_layer

import lightning_fp8 as lf
from lightning_fp8.recipe import RECIPES
from lightning_fp8 import FP8Linear, FP8Precision


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("kwargs", "field", "valid"),
    [
        ({"recipe": "fp8"}, "recipe", "tensorwise"),
        ({"fp8_format": "e5m2"}, "fp8_format", "hybrid"),
        ({"amax_compute_algo": "mean"}, "amax_compute_algo", "most_recent"),
        ({"amax_history_len": -1}, "amax_history_len", ">= 1"),
        ({"margin": -2}, "margin", ">= 0"),
        ({"compute_dtype": torch.float64}, "compute_dtype", "torch.bfloat16"),
        ({"exclude": "lm_head"}, "exclude", "list"),
        ({"backoff_factor": 2.0}, "backoff_factor", "(0, 1)"),
        ({"growth_interval": 0}, "growth_interval", ">= 1"),
        ({"init_scale": 0.0}, "init_scale", "> 0"),
    ],
)
def test_invalid_arguments_name_field_and_choices(kwargs, field, valid):
    with pytest.raises(ValueError, match=field) as err:
        FP8Precision(**kwargs)
    assert valid in str(err.value)


def test_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        FP8Precision("delayed")  # type: ignore[misc]


def test_precision_string_and_lightning_utilities():
    plugin = FP8Precision(compute_dtype=torch.float16)
    assert plugin.precision == "32-true"
    # Lightning's throughput utilities see the compute dtype, not float32.
    assert _plugin_to_compute_dtype(plugin) in (torch.float16, torch.bfloat16)
    from lightning.fabric.utilities.throughput import _plugin_to_compute_dtype as fabric_dtype

    assert fabric_dtype(lf.fabric.FP8Precision(compute_dtype=torch.float16)) == torch.float16


def test_model_summary_has_no_precision_warning():
    model = TinyDecoder()
    trainer = make_trainer(FP8Precision(), max_steps=1, enable_model_summary=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(n=2_000))
    assert not [w for w in caught if "not supported by the model summary" in str(w.message)]


# ---------------------------------------------------------------- misuse


def test_bf16_mixed_plus_plugin_is_rejected():
    with pytest.raises(ValueError, match="Choose one"):
        L.Trainer(precision="bf16-mixed", plugins=[FP8Precision()])


def test_two_precision_plugins_are_rejected():
    with pytest.raises(Exception, match="multiple values for Precision"):
        L.Trainer(plugins=[FP8Precision(), FP8Precision(recipe="delayed")])


class NoLinear(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3)

    def training_step(self, batch, batch_idx):
        return self.conv(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_model_without_linear_layers_raises():
    data = torch.utils.data.DataLoader(torch.randn(8, 4, 16), batch_size=4)
    with pytest.raises(ValueError, match="no layer that can run in FP8"):
        make_trainer(FP8Precision(), max_steps=1).fit(NoLinear(), data)


def test_all_layers_excluded_raises_with_reasons():
    with pytest.raises(ValueError, match="excluded by pattern"):
        make_trainer(FP8Precision(exclude=["*"]), max_steps=1).fit(TinyDecoder(), loader(n=2_000))


class LBFGSModel(TinyDecoder):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


def test_lbfgs_is_rejected():
    with pytest.raises(TypeError, match="LBFGS"):
        make_trainer(FP8Precision(), max_steps=1).fit(LBFGSModel(), loader(n=2_000))


class OtherStrategy(L.pytorch.strategies.Strategy):
    pass


def test_unsupported_strategy_is_rejected():
    """FSDP1 (reached on a GPU only: Lightning refuses the plugin earlier on a CPU) is refused with a pointer to FSDP2
    through ModelParallelStrategy."""
    plugin = FP8Precision()
    model = TinyDecoder()

    class FakeTrainer:
        strategy = L.pytorch.strategies.FSDPStrategy.__new__(L.pytorch.strategies.FSDPStrategy)

    model._trainer = FakeTrainer()  # the plugin asks the module for its trainer's strategy
    with pytest.raises(ValueError, match="FSDPStrategy strategy. Supported: single device.*FSDP2.*ModelParallelStrategy"):
        plugin.convert_module(model)


# ---------------------------------------------------------------- conversion and the log line


def test_conversion_in_place_and_one_log_line(caplog):
    model = TinyDecoder()
    linear_ids = {name: id(m) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    params = {name: p for name, p in model.named_parameters()}
    trainer = make_trainer(FP8Precision(exclude=["lm_head"]), max_steps=1)
    with caplog.at_level(logging.INFO):
        trainer.fit(model, loader(n=2_000))
    for name, ident in linear_ids.items():
        module = model.get_submodule(name)
        assert id(module) == ident
        assert isinstance(module, FP8Linear) == (name != "lm_head")
    assert all(p is params[n] for n, p in model.named_parameters())
    lines = [r.getMessage() for r in caplog.records if "FP8 active" in r.getMessage()]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "recipe=tensorwise" in line and "8 Linear layer(s) in FP8" in line and "1 skipped" in line
    assert "lm_head: excluded by pattern 'lm_head'" in line and "emulated FP8 GEMM on cpu" in line


def test_exclude_typo_raises_at_setup_and_names_the_layer():
    """`exclude=["lm_haed"]` must not silently train the head in FP8: setup fails before any step."""
    model = TinyDecoder()
    trainer = make_trainer(FP8Precision(exclude=["lm_haed"]), max_steps=1)
    with pytest.raises(ValueError, match=r"FP8Precision\(exclude=\['lm_haed'\]\): pattern 'lm_haed' matches no") as err:
        trainer.fit(model, loader(n=2_000))
    assert "closest layer names: 'lm_head'" in str(err.value)
    assert trainer.global_step == 0
    with pytest.raises(ValueError, match=r"'blocks.0', which is not a layer.*'blocks\.0\.\*'"):
        make_trainer(FP8Precision(exclude=["blocks.0"]), max_steps=1).fit(TinyDecoder(), loader(n=2_000))
    model = TinyDecoder()
    make_trainer(FP8Precision(exclude=["lm_head", "blocks.0.*"]), max_steps=1).fit(model, loader(n=2_000))
    assert type(model.lm_head) is nn.Linear and type(model.blocks[0].fc) is nn.Linear
    assert isinstance(model.blocks[1].fc, FP8Linear)


def test_layers_kept_in_high_precision_by_name_are_honoured_like_exclude():
    """keep_in_high_precision: an exact name (glob characters are not patterns), kept by every conversion of the
    model with its reason; a name no layer has is no error (it may name a layer of a model set up later)."""
    plugin = FP8Precision()
    plugin.keep_in_high_precision("blocks.0.fc", "measured as sensitive")
    plugin.keep_in_high_precision("blocks.*", "a name, not a pattern")
    model = TinyDecoder()
    trainer = make_trainer(plugin, max_steps=1)
    trainer.fit(model, loader(n=2_000))
    assert type(model.blocks[0].fc) is nn.Linear and isinstance(model.blocks[1].fc, FP8Linear)
    assert isinstance(model.blocks[0].out, FP8Linear)
    assert plugin.report.skipped == {"blocks.0.fc": "measured as sensitive"} and len(plugin.report.fp8_layers) == 8
    trainer.validate(model, loader(n=2_000))  # converts the model again
    assert type(model.blocks[0].fc) is nn.Linear and plugin.report.skipped == {"blocks.0.fc": "measured as sensitive"}
    # switched now on a set-up model, and kept by the next conversion
    plugin.keep_in_high_precision("lm_head", "now")
    assert type(model.lm_head) is nn.Linear and plugin.report.skipped["lm_head"] == "now"
    trainer.validate(model, loader(n=2_000))
    assert type(model.lm_head) is nn.Linear and "lm_head" not in plugin.report.fp8_layers
    assert plugin.state_dict()["high_precision_layers"] == {
        "blocks.0.fc": "measured as sensitive", "blocks.*": "a name, not a pattern", "lm_head": "now"
    }
    with pytest.raises(ValueError, match="name must be"):
        plugin.keep_in_high_precision("", "no name")


class ConfigureModelDecoder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.head = None

    def configure_model(self):
        if self.head is None:
            self.head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))

    def training_step(self, batch, batch_idx):
        return self.head(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_layers_created_in_configure_model_are_converted():
    model = ConfigureModelDecoder()
    data = torch.utils.data.DataLoader(torch.randn(16, 32), batch_size=8)
    make_trainer(FP8Precision(), max_steps=2).fit(model, data)
    assert isinstance(model.head[0], FP8Linear) and isinstance(model.head[2], FP8Linear)
    assert int(model.head[0].fp8_counts[0, 0]) == 2 * 8 * 32  # two steps of input elements


def test_convert_module_is_idempotent():
    plugin = FP8Precision()
    model = TinyDecoder()
    plugin.convert_module(model)
    plugin.convert_module(model)
    assert len(plugin.report.already_fp8) == 9 and not plugin.report.converted


# ---------------------------------------------------------------- training


def epoch_losses(recipe_or_precision: str, epochs: int = 3, **model_kwargs) -> list[float]:
    torch.manual_seed(0)
    model = TinyDecoder(**model_kwargs)
    means: list[float] = []
    batch_losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            batch_losses.append(float(outputs["loss"]))

        def on_train_epoch_end(self, trainer, pl_module):
            means.append(sum(batch_losses) / len(batch_losses))
            batch_losses.clear()

    if recipe_or_precision == "bf16-mixed":
        trainer = make_trainer(precision="bf16-mixed", max_epochs=epochs, callbacks=[Record()])
    else:
        trainer = make_trainer(FP8Precision(recipe=recipe_or_precision), max_epochs=epochs, callbacks=[Record()])
    trainer.fit(model, loader(n=4_000))
    return means


@pytest.fixture(scope="module")
def bf16_losses():
    return epoch_losses("bf16-mixed")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_decoder_trains_and_tracks_bf16(recipe, bf16_losses):
    fp8 = epoch_losses(recipe)
    bf16 = bf16_losses
    assert all(math.isfinite(x) for x in fp8)
    assert fp8[-1] < fp8[0] - 1.0, fp8  # clearly learning (starts near ln(256) = 5.5)
    assert abs(fp8[-1] - bf16[-1]) < 0.05 * bf16[-1], (fp8, bf16)


def test_fp16_compute_dtype_trains():
    torch.manual_seed(0)
    model = TinyDecoder()
    plugin = FP8Precision(compute_dtype=torch.float16, recipe="delayed")
    trainer = make_trainer(plugin, max_steps=20)
    trainer.fit(model, loader(n=8_000))
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    assert float(trainer.callback_metrics["train_loss"]) < 4.5


class Snapshot(L.Callback):
    """Weights before and after every optimizer step, and the loss scale."""

    def __init__(self):
        self.before, self.after, self.scales = {}, {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = batch_idx
        self.after[step] = [p.detach().clone() for p in pl_module.parameters()]
        self.scales[step] = float(trainer.precision_plugin.loss_scale)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("loss_scaling", ["dynamic", "auto"])
def test_non_finite_loss_skips_step_and_backs_off(recipe, loss_scaling):
    torch.manual_seed(0)
    model = TinyDecoder()
    model.inject_nan_at_step = 3
    snap = Snapshot()
    plugin = FP8Precision(recipe=recipe, loss_scaling=loss_scaling)
    trainer = make_trainer(plugin, max_steps=8, callbacks=[snap])
    trainer.fit(model, loader(n=8_000))
    # The NaN step left every weight bit-identical, training went on.
    assert all(torch.equal(a, b) for a, b in zip(snap.before[3], snap.after[3]))
    assert not all(torch.equal(a, b) for a, b in zip(snap.before[4], snap.after[4]))
    if loss_scaling == "dynamic":  # the scale halved
        # the scale logged after a step is the one its backward used: the back-off applies from step 4 on
        assert snap.scales[3] == 2.0**16 and snap.scales[4] == 2.0**15 and snap.scales[7] == 2.0**15
    else:  # bf16 default: no scaling, nothing to back off
        assert plugin.loss_scaling == "skip_nonfinite" and set(snap.scales.values()) == {1.0}
    assert int(plugin.skipped_steps) == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    for module in model.modules():
        if isinstance(module, FP8Linear):
            assert torch.isfinite(module.fp8_scale[:2]).all()
            if recipe == "delayed":
                assert torch.isfinite(module.fp8_scale).all()


def filled(module: FP8Linear, role: int) -> int:
    return int((module.fp8_amax_history[role] != 0).sum())


def test_gradient_accumulation_rolls_once_per_optimizer_step():
    torch.manual_seed(0)
    model = TinyDecoder()
    plugin = FP8Precision(recipe="delayed", amax_history_len=32)
    trainer = make_trainer(plugin, max_steps=5, accumulate_grad_batches=3)
    trainer.fit(model, loader(n=8_000))
    assert trainer.global_step == 5
    layer = model.blocks[0].fc
    for role in range(3):
        assert filled(layer, role) == 5  # 15 micro-batches, 5 optimizer steps
    assert int(layer.fp8_counts[0, 0]) == 15 * 8 * 32 * 64  # every micro-batch was recorded
    assert torch.all(layer.fp8_amax_pending == 0)


def grads_recorder():
    seen = []

    class Record(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(max(p.grad.abs().max().item() for p in pl_module.parameters() if p.grad is not None))

    return seen, Record()


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradients_unscaled_before_hook_and_clipped(algorithm):
    torch.manual_seed(0)
    model = TinyDecoder(optimizer="adamw_fused")  # Lightning's own AMP plugin refuses clipping with fused optimizers
    seen, record = grads_recorder()
    clipped = []
    original_step = torch.optim.AdamW.step

    def spy_step(self, *args, **kwargs):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if algorithm == "value":
            clipped.append(max(g.abs().max().item() for g in grads))
        else:
            clipped.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
        return original_step(self, *args, **kwargs)

    torch.optim.AdamW.step = spy_step
    try:
        trainer = make_trainer(
            FP8Precision(), max_steps=3, gradient_clip_val=0.05, gradient_clip_algorithm=algorithm, callbacks=[record]
        )
        trainer.fit(model, loader(n=8_000))
    finally:
        torch.optim.AdamW.step = original_step
    # Unscaled: a loss scale of 65536 would make these enormous.
    assert all(0 < g < 100 for g in seen), seen
    assert all(c <= 0.05 * (1 + 1e-3) for c in clipped), clipped


class ManualTwoOptimizers(TinyDecoder):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.clipped_norms = []

    def training_step(self, batch, batch_idx):
        opt_body, opt_head = self.optimizers()
        loss = self.loss(batch)
        opt_body.zero_grad()
        opt_head.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt_body, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt_body.step()
        # After the step the gradients are unscaled whichever way: clipping must have seen them unscaled.
        body = [p.grad for n, p in self.named_parameters() if not n.startswith("lm_head")]
        self.clipped_norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in body])).item())
        opt_head.step()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        body = [p for n, p in self.named_parameters() if not n.startswith("lm_head")]
        opt_body = torch.optim.AdamW(body, lr=3e-3)
        opt_head = torch.optim.SGD(self.lm_head.parameters(), lr=0.1)
        return [opt_body, opt_head], [
            torch.optim.lr_scheduler.StepLR(opt_body, 2),
            torch.optim.lr_scheduler.StepLR(opt_head, 2),
        ]


def test_manual_optimization_two_optimizers_and_schedulers():
    torch.manual_seed(0)
    model = ManualTwoOptimizers()
    head_before = model.lm_head.weight.detach().clone()
    plugin = FP8Precision(recipe="delayed")
    trainer = make_trainer(plugin, max_steps=8)  # global_step counts both optimizers' steps
    trainer.fit(model, loader(n=8_000))
    assert not torch.equal(head_before, model.lm_head.weight)
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    # Two optimizer steps per batch, but the history rolls once per batch (4 batches).
    assert filled(model.blocks[0].qkv, 0) == 4
    assert model.optimizers()[0].param_groups[0]["lr"] < 3e-3  # schedulers stepped
    # self.clip_gradients clipped the unscaled gradients (scaled ones would end up ~1/65536 after unscaling).
    assert all(0.05 < n <= 1.0 + 1e-4 for n in model.clipped_norms), model.clipped_norms


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_activation_checkpointing_does_not_double_count(recipe):
    results = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = TinyDecoder(activation_checkpointing=ckpt)
        make_trainer(FP8Precision(recipe=recipe), max_steps=3).fit(model, loader(n=8_000))
        results.append(model)
    plain, ckpt = results
    for (name, a), (_, b) in zip(plain.named_modules(), ckpt.named_modules()):
        if isinstance(a, FP8Linear):
            assert torch.equal(a.fp8_counts, b.fp8_counts), name
            assert torch.equal(a.fp8_amax_history, b.fp8_amax_history), name
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("optimizer", "syncs"), [("adamw_fused", 0), ("sgd", 1)])
def test_optimizer_step_synchronisations(optimizer, syncs):
    """Fused optimizers take the scaler's tensors: no sync. Others: GradScaler reads found_inf once.
    (Non-fused AdamW adds one ``.item()`` per parameter of its own; SGD adds none.)"""
    torch.manual_seed(0)
    model = TinyDecoder(optimizer=optimizer)
    counts = []
    plugin = FP8Precision(recipe="delayed")
    original = plugin.optimizer_step

    def counted(*args, **kwargs):
        with SyncCounter() as counter:
            out = original(*args, **kwargs)
        counts.append(counter.count)
        return out

    plugin.optimizer_step = counted
    make_trainer(plugin, max_steps=4, log_every_n_steps=1000).fit(model, loader(n=8_000))
    # optimizer_step covers the closure: forward, loss scaling, backward, unscale, clip, step, update, roll.
    assert counts == [syncs] * 4, counts


def test_validation_does_not_touch_fp8_state_and_can_run_high_precision():
    torch.manual_seed(0)
    model = TinyDecoder()
    plugin = FP8Precision(recipe="delayed")
    trainer = make_trainer(plugin, max_steps=2)
    trainer.fit(model, loader(n=4_000))
    state = lf.fp8_state_dict(model)
    trainer.validate(model, loader(n=4_000), verbose=False)
    after = lf.fp8_state_dict(model)
    for name, entry in per_layer(state).items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, per_layer(after)[name][key]), (name, key)
    fp8_val = float(trainer.callback_metrics["val_loss"])
    plugin.fp8_eval = False
    trainer.validate(model, loader(n=4_000), verbose=False)
    hp_val = float(trainer.callback_metrics["val_loss"])
    assert fp8_val != hp_val and abs(fp8_val - hp_val) < 0.05 * hp_val


def test_one_plugin_reused_for_a_new_model_tracks_only_that_model(tmp_path):
    """A notebook re-runs its cell: the same FP8Precision fits a second, new model. The Trainer trains one model,
    so the plugin must forget the first one: its state would otherwise be checkpointed, rolled and logged with
    the second (stale layers in the metrics), and a stats-callback pattern checked against both."""
    plugin = FP8Precision(exclude=["lm_head"])
    for run in range(2):
        torch.manual_seed(run)
        model = TinyDecoder()
        callback = lf.FP8StatsCallback(log_every_n_steps=1, exclude=["lm_head"])
        make_trainer(plugin, callbacks=[callback], max_steps=2, default_root_dir=tmp_path).fit(model, loader(n=2_000))
        assert plugin.fp8_models == [model] and len(plugin.reports) == 1
        assert len(plugin.state_dict()["models"]) == 1
        assert len(callback.layer_names) == len(set(callback.layer_names)) == len(plugin.report.fp8_layers)
    # the same model again (fit, then validate) keeps it: nothing is forgotten
    make_trainer(plugin, max_steps=1, default_root_dir=tmp_path).validate(model, loader(n=2_000))
    assert plugin.fp8_models == [model]
