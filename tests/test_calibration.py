"""Calibration of the ``delayed`` amax histories (issue 12): ``lightning_fp8.calibrate`` and
``FP8Precision(calibration_batches=N)`` on a real Trainer."""

from __future__ import annotations


import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers.logger import Logger
from models import TinyDecoder, loader
from utils import make_trainer

import lightning_fp8 as lf
from lightning_fp8.fabric import FP8Precision as FabricFP8Precision
from lightning_fp8.recipe import GRAD_OUTPUT, INPUT, WEIGHT, amax_to_scale
from lightning_fp8.state import NONZERO, OVERFLOW, fp8_layers, layer_state, state_tables


def take_input(model, batch):
    return model(batch[0])


def lm_loss(logits, batch):
    return F.cross_entropy(logits.float().view(-1, 256), batch[1].reshape(-1))


def converted(recipe="delayed"):
    model = TinyDecoder()
    lf.convert_to_fp8(model, recipe=recipe, log_summary=False)
    return model


class AmaxProbe:
    """Independent measurement with hooks: per FP8 layer and batch, the amax of its input, its weight and the
    gradient of its output."""

    def __init__(self, model):
        self.layers = dict(fp8_layers(model))
        self.amax = {name: {INPUT: [], WEIGHT: [], GRAD_OUTPUT: []} for name in self.layers}
        self.handles = [layer.register_forward_hook(self._hook(name)) for name, layer in self.layers.items()]

    def _hook(self, name):
        def hook(module, args, output):
            self.amax[name][INPUT].append(args[0].detach().abs().amax().float())
            self.amax[name][WEIGHT].append(module.weight.detach().abs().amax().float())
            if output.requires_grad:
                output.register_hook(lambda g: self.amax[name][GRAD_OUTPUT].append(g.abs().amax().float()))

        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


# ------------------------------------------------------------------------------------------- the function
def test_calibrate_fills_histories_with_the_measured_amaxes_and_changes_nothing_else():
    model = converted()
    batches = list(loader(n=2_000))[:3]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with lf.fp8_autocast():  # one real step first: counters, .grad and optimizer state are not empty
        lm_loss(take_input(model, batches[0]), batches[0]).backward()
    optimizer.step()
    (table,) = state_tables(model)
    history_before = table.amax_history.clone()
    counts, epoch = table.counts, table.counts_epoch.clone()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.grad for name, p in model.named_parameters()}
    grad_values = {name: g.clone() for name, g in grads.items()}
    optimizer_state = {k: v.clone() for k, v in optimizer.state[model.lm_head.weight].items()}
    model.eval()
    model.blocks[0].train()  # a mixed pattern of modes, restored as it was

    probe = AmaxProbe(model)
    assert lf.calibrate(model, batches, lm_loss, forward=take_input) == 3
    probe.remove()

    # one history entry per batch, most recent first, equal to the amaxes measured by the hooks
    for row, (name, layer) in enumerate(probe.layers.items()):
        assert layer.fp8_state.index == row
        for role in (INPUT, WEIGHT, GRAD_OUTPUT):
            measured = torch.stack(probe.amax[name][role][::-1])
            assert torch.equal(table.amax_history[row, role, :3], measured), (name, role)
            assert torch.equal(table.amax_history[row, role, 3:4], history_before[row, role, :1])  # the training step's
    assert bool(table.initialized.all())
    # the scale the next cast uses: from the history (max over the entries)
    expected = amax_to_scale(table.amax_history.amax(-1), table._role_max(), 0, False)
    assert torch.equal(table.scale, expected)
    # nothing else moved
    assert torch.equal(table.counts, counts) and torch.equal(table.counts_epoch, epoch)
    assert float(table.amax_pending.abs().sum()) == 0
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]), name
        assert p.grad is grads[name] and torch.equal(p.grad, grad_values[name]), name
    assert all(torch.equal(optimizer.state[model.lm_head.weight][k], v) for k, v in optimizer_state.items())
    assert not model.training and model.blocks[0].training and not model.blocks[1].training


def test_forward_only_calibration_under_no_grad():
    model = converted()
    batches = [b[0] for b in list(loader(n=2_000))[:2]]  # model inputs only
    (table,) = state_tables(model)
    with torch.no_grad():
        assert lf.calibrate(model, batches) == 2
    assert bool((table.amax_history[:, [INPUT, WEIGHT], :2] > 0).all())
    assert bool(table.initialized[:, [INPUT, WEIGHT]].all())
    assert float(table.amax_history[:, GRAD_OUTPUT].abs().sum()) == 0 and not bool(table.initialized[:, GRAD_OUTPUT].any())
    assert int(table.counts.sum()) == 0  # calibration casts are not counted
    assert lf.calibrate(model, iter(batches * 5), num_batches=3) == 3  # a prefix of any iterable
    assert bool((table.amax_history[:, INPUT, :5] > 0).all()) and float(table.amax_history[:, INPUT, 5:].sum()) == 0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_calibration_only_applies_to_delayed(recipe):
    model = converted(recipe)
    with pytest.raises(ValueError, match="calibration only applies to recipe='delayed'"):
        lf.calibrate(model, [torch.zeros(2, 32, dtype=torch.long)])
    with pytest.raises(ValueError, match="no FP8 layers"):
        lf.calibrate(torch.nn.Linear(16, 16), [torch.zeros(2, 16)])
    with pytest.raises(ValueError, match="no batches"):
        lf.calibrate(converted(), [])


def test_grad_output_history_is_in_the_loss_scaled_domain_under_dynamic_loss_scaling():
    """float16 compute, dynamic loss scaling (Fabric): calibration records the gradients as training casts them,
    multiplied by the loss scale, so the first training step's gradients fit the calibrated scale."""
    torch.manual_seed(0)
    plugin = FabricFP8Precision(recipe="delayed", compute_dtype=torch.float16, init_scale=2.0**10)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = TinyDecoder()
    model, _ = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    batches = list(loader(n=2_000))[:3]
    probe = AmaxProbe(model.module)
    lf.calibrate(model, batches, lm_loss, forward=take_input)  # the plugin is found from the model
    probe.remove()
    (table,) = plugin.state_tables
    scaled = torch.stack([torch.stack(probe.amax[name][GRAD_OUTPUT]).amax() for name in probe.layers])
    calibrated = table.amax_history[:, GRAD_OUTPUT].amax(-1)
    assert torch.equal(calibrated, scaled)  # what the casts saw: loss-scaled gradients
    assert float(plugin.loss_scale) == 2.0**10

    fabric.backward(lm_loss(take_input(model, batches[0]), batches[0]))  # the first training step's backward
    ratio = table.amax_pending[:, GRAD_OUTPUT] / calibrated
    assert bool(((ratio > 0.5) & (ratio < 2)).all()), ratio  # same domain (the true-gradient domain is 2**10 off)
    assert int(table.counts[:, GRAD_OUTPUT, OVERFLOW].sum()) == 0
    assert bool(table.initialized.all())


# ------------------------------------------------------------------------------------------- the plugin argument
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"recipe": "delayed", "calibration_batches": -1}, "calibration_batches must be an int >= 0, got -1"),
        ({"recipe": "delayed", "calibration_batches": 2.0}, "calibration_batches must be an int >= 0, got 2.0"),
        ({"recipe": "delayed", "calibration_batches": True}, "calibration_batches must be an int >= 0, got True"),
        ({"calibration_batches": 2}, "calibration_batches=2 has no effect with recipe='tensorwise'"),
        ({"recipe": "rowwise", "calibration_batches": 1}, "calibration_batches=1 has no effect with recipe='rowwise'"),
    ],
)
def test_calibration_batches_is_validated_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lf.FP8Precision(**kwargs)
    assert lf.FP8Precision(recipe="delayed", calibration_batches=3).calibration_batches == 3


def test_calibration_batches_on_fabric_is_an_error_pointing_to_calibrate():
    with pytest.raises(ValueError, match=r"Trainer plugin .* only.*lightning_fp8\.calibrate"):
        FabricFP8Precision(recipe="delayed", calibration_batches=2)
    assert FabricFP8Precision(recipe="delayed").calibration_batches == 0


class StepRecorder(L.Callback):
    """The FP8 state at the start of batch 0, and the overflow fraction of every training step (state counters)."""

    def __init__(self):
        self.start, self.overflow, self.input_overflow = None, [], []

    def _counts(self, trainer):
        return torch.stack([t.counts.sum(0) for t in trainer.precision_plugin.state_tables]).sum(0)  # (roles, fields)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.start is None:
            self.start = {k: v.clone() for t in trainer.precision_plugin.state_tables for k, v in t.tensors().items()}
        self._before = self._counts(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = self._counts(trainer) - self._before
        self.overflow.append(float(step[:, OVERFLOW].sum() / step[:, NONZERO].sum()))
        self.input_overflow.append(int(step[INPUT, OVERFLOW]))


def fit(calibration_batches, steps=10, **trainer_kwargs):
    torch.manual_seed(0)
    model, recorder = TinyDecoder(), StepRecorder()
    plugin = lf.FP8Precision(recipe="delayed", calibration_batches=calibration_batches)
    ckpt_path, callbacks = trainer_kwargs.pop("ckpt_path", None), trainer_kwargs.pop("callbacks", [])
    trainer = make_trainer(plugin, max_steps=steps, callbacks=[recorder, *callbacks], **trainer_kwargs)
    trainer.fit(model, loader(n=20_000), ckpt_path=ckpt_path)
    return model, recorder


def test_trainer_calibrates_before_the_first_step_and_the_first_step_saturates_no_more_than_steady_state():
    _, calibrated = fit(calibration_batches=4)
    start = calibrated.start
    history = start["amax_history"]
    assert bool((history[..., :4] > 0).all()) and float(history[..., 4:].sum()) == 0  # one entry per batch, all roles
    assert bool(start["initialized"].all())
    assert int(start["counts"].sum()) == 0  # calibration casts are not counted
    assert float(start["amax_pending"].sum()) == 0

    _, plain = fit(calibration_batches=0)
    assert float(plain.start["amax_history"].sum()) == 0  # without calibration: empty histories at step 1
    steady = sorted(calibrated.overflow[-4:])[1]  # a later steady-state step (second smallest of the last four)
    print(f"overflow fraction: first step {calibrated.overflow[0]:.2e} calibrated, {plain.overflow[0]:.2e} without "
          f"(current amax); steady state {steady:.2e}; per step calibrated {calibrated.overflow}, without {plain.overflow}")  # fmt: skip
    assert calibrated.overflow[0] <= steady
    # The second step: without calibration its input scales come from one amax (the first step's), with it from five.
    assert calibrated.input_overflow[1] <= plain.input_overflow[1]


def test_trainer_does_not_calibrate_on_resume(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(calibration_batches=2, steps=3, enable_checkpointing=True, callbacks=[checkpoint])
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["FP8Precision"]["models"][0]["tables"][0]
    _, resumed = fit(calibration_batches=2, steps=5, ckpt_path=tmp_path / "last.ckpt")
    for name in ("amax_history", "scale", "initialized"):
        assert torch.equal(resumed.start[name], saved[name]), name


def test_trainer_calibration_uses_training_step_with_logging_muted():
    """TinyDecoder's training_step calls self.log: calibration runs it, and its losses reach no logger and no metric
    (unmuted, Lightning would log their mean as an epoch-level train_loss at on_train_start)."""
    losses, logged = [], []

    class Counting(TinyDecoder):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            losses.append((self.trainer.global_step, float(loss)))
            return loss

    class Capture(Logger):
        name, version = "capture", 0

        def log_metrics(self, metrics, step=None):
            logged.append(metrics["train_loss"])

        def log_hyperparams(self, *args, **kwargs):
            pass

    torch.manual_seed(0)
    trainer = make_trainer(
        lf.FP8Precision(recipe="delayed", calibration_batches=2), max_steps=2, logger=Capture(), log_every_n_steps=1
    )
    trainer.fit(Counting(), loader(n=2_000))
    assert [step for step, _ in losses] == [0, 0, 0, 1]  # two calibration batches, then two training steps
    assert logged == [loss for _, loss in losses[2:]]
    assert float(trainer.callback_metrics["train_loss"]) == losses[-1][1]



def test_trainer_calibration_with_manual_optimization_is_a_clear_error():
    class Manual(TinyDecoder):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    trainer = make_trainer(lf.FP8Precision(recipe="delayed", calibration_batches=2), max_steps=1)
    with pytest.raises(ValueError, match=r"calibration_batches=2\) runs training_step .* automatic optimization"):
        trainer.fit(Manual(), loader(n=2_000))

class WithBatchNorm(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 32)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.b(self.norm(self.a(batch))), batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class FirstStep(L.Callback):
    """The module's buffers at the start of the first batch, and the pending amaxes after the first micro-batch."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.buffers = {k: v.clone() for k, v in pl_module.named_buffers()}
            self.history = trainer.precision_plugin.state_tables[0].amax_history.clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            self.pending = trainer.precision_plugin.state_tables[0].amax_pending.clone()


def fit_small(calibration_batches, **trainer_kwargs):
    torch.manual_seed(0)
    model, probe = WithBatchNorm(), FirstStep()
    plugin = lf.FP8Precision(recipe="delayed", calibration_batches=calibration_batches)
    trainer = make_trainer(plugin, max_steps=2, callbacks=[probe], **trainer_kwargs)
    trainer.fit(model, torch.utils.data.DataLoader(torch.randn(64, 32), batch_size=8))
    return model, probe


def test_calibration_leaves_buffers_such_as_batchnorm_running_stats_unchanged():
    _, plain = fit_small(0)
    _, calibrated = fit_small(2)
    for name, value in plain.buffers.items():
        assert torch.equal(calibrated.buffers[name], value), name
    model = WithBatchNorm()
    lf.convert_to_fp8(model, recipe="delayed", log_summary=False)
    before = {k: v.clone() for k, v in model.named_buffers()}
    lf.calibrate(model, [torch.randn(8, 32)], lambda out, batch: F.mse_loss(out, batch), forward=lambda m, b: m.b(m.norm(m.a(b))))
    for name, value in before.items():
        assert torch.equal(dict(model.named_buffers())[name], value), name


def test_calibration_records_grad_output_in_the_domain_of_training_under_gradient_accumulation():
    """Lightning divides the loss by accumulate_grad_batches before the backward: calibration on batch 0 must
    record the grad_output amax that the first training micro-batch (the same batch 0) records."""
    _, probe = fit_small(1, accumulate_grad_batches=4)
    torch.testing.assert_close(probe.history[:, GRAD_OUTPUT, 0], probe.pending[:, GRAD_OUTPUT], rtol=1e-3, atol=0)


def test_calibration_does_not_change_the_data_order_of_a_loader_with_its_own_generator():
    """DataLoader(shuffle=True, generator=g): calibration iterates the loader once more; g must be restored."""

    def first_batches(calibration_batches):
        seen = []

        class Record(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                seen.append(batch.clone())

        torch.manual_seed(0)
        data = torch.utils.data.DataLoader(
            torch.randn(64, 32), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1)
        )
        plugin = lf.FP8Precision(recipe="delayed", calibration_batches=calibration_batches)
        make_trainer(plugin, max_steps=3, callbacks=[Record()]).fit(WithBatchNorm(), data)
        return seen

    for plain, calibrated in zip(first_batches(0), first_batches(2), strict=True):
        assert torch.equal(plain, calibrated)


class TwoLoaders(L.LightningModule):
    """Trains on a dict of two loaders' batches; records the input amax of every forward of ``a``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.input_amax = []
        self.a.register_forward_hook(lambda m, args, out: self.input_amax.append(args[0].abs().amax().float()))

    def training_step(self, batch, batch_idx):
        x = batch["x"] + batch["y"]
        return F.mse_loss(self.b(F.gelu(self.a(x))), x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("shuffle", [False, True])
def test_calibration_and_the_sensitivity_callback_read_the_first_batches_and_change_no_data_order(shuffle):
    """Both take the first N batches of a pass over the training loaders (a dict of two loaders, combined as for
    training; one with its own generator) on the device, and leave the training's data order as it was. In a fixed
    order those are the training's first batches; a shuffling sampler draws another order for that pass (Lightning
    has drawn the training's before on_train_start), the same for both."""

    def run(extra):
        seen = []

        class Record(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                seen.append({k: v.clone() for k, v in batch.items()})

        torch.manual_seed(0)
        loaders = {
            "x": torch.utils.data.DataLoader(torch.randn(64, 32), batch_size=8, shuffle=shuffle),
            "y": torch.utils.data.DataLoader(
                torch.randn(64, 32) * (1 + torch.arange(64)[:, None]), batch_size=8, shuffle=shuffle,
                generator=torch.Generator().manual_seed(1),
            ),
        }  # fmt: skip
        model = TwoLoaders()
        plugin = lf.FP8Precision(recipe="delayed", calibration_batches=2 if extra else 0)
        sensitivity = lf.FP8SensitivityCallback(num_batches=3)
        make_trainer(plugin, max_steps=3, callbacks=[Record(), *([sensitivity] if extra else [])]).fit(model, loaders)
        return seen, model, sensitivity

    plain, _, _ = run(extra=False)
    seen, model, sensitivity = run(extra=True)
    for before, after in zip(plain, seen, strict=True):
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # the forwards of `a`: the report on three batches (it runs a copy of the model, whose hook records into the same
    # list), calibration on two, then the three training steps
    assert sensitivity.report.num_batches == 3 and len(model.input_amax) == 3 + 2 + 3
    amax = [float(a) for a in model.input_amax]
    report, calibration, training = amax[:3], amax[3:5], amax[5:]
    assert training == [float((batch["x"] + batch["y"]).abs().amax()) for batch in seen]
    assert calibration == report[:2]  # the same first batches: the report's pass left the random state as it was
    assert (report == training) != shuffle


@pytest.mark.slow
@pytest.mark.gloo("ddp_calibration")
def test_ddp_ranks_calibrate_on_their_own_batches_and_reduce_the_amaxes(gloo_runs):
    """tests/scripts/ddp_calibration.py on 2 processes (gloo), run by tests/scripts/gloo_checks.py."""
    tmp_path = gloo_runs.folder("ddp_calibration")
    starts = [torch.load(tmp_path / f"start_rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    histories = [layer_state(start["fp8"], "body")["amax_history"] for start in starts]
    assert torch.equal(histories[0], histories[1])  # MAX-reduced across the ranks, as in training
    local = [start["calibration_input_amax"] for start in starts]  # each rank's own two batches
    assert not torch.equal(local[0], local[1])
    assert torch.equal(histories[0][INPUT, :2], torch.maximum(local[0], local[1]).flip(0))
    assert float(histories[0][:, 2:].sum()) == 0 and bool((histories[0][:, :2] > 0).all())
    assert int(layer_state(starts[0]["fp8"], "body")["counts"].sum()) == 0
