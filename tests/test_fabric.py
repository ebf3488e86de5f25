"""lightning_fp8.fabric.FP8Precision with a real Fabric training loop."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.fabric import Fabric
from models import TinyDecoder, loader
from utils import SyncCounter, per_layer

import lightning_fp8 as lf
from lightning_fp8.fabric import FP8Precision


def setup(recipe="tensorwise", optimizer="adamw", **plugin_kwargs):
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FP8Precision(recipe=recipe, **plugin_kwargs)])
    model = TinyDecoder(optimizer=optimizer)
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer


def fabric_loss(model, batch):
    """Forward through the Fabric wrapper (which enters the precision plugin's forward context)."""
    logits = model(batch[0])
    return torch.nn.functional.cross_entropy(logits.float().view(-1, 256), batch[1].reshape(-1))


def train_steps(fabric, model, optimizer, batches, clip=None):
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = fabric_loss(model, batch)
        fabric.backward(loss)
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        losses.append(loss.detach())
    return losses


def test_fabric_loop_trains_in_fp8():
    fabric, model, optimizer = setup("delayed")
    assert isinstance(model.module.blocks[0].fc, lf.FP8Linear)
    batches = list(loader(n=4_000))
    losses = train_steps(fabric, model, optimizer, batches * 3, clip=1.0)
    first, last = float(sum(losses[:5]) / 5), float(sum(losses[-5:]) / 5)
    assert math.isfinite(last) and last < first - 1.0
    plugin = fabric.strategy.precision
    assert float(plugin.loss_scale) == 1.0 and int(plugin.skipped_steps) == 0  # bf16: no loss scaling by default
    assert int((model.module.blocks[0].fc.fp8_amax_history[0] != 0).sum()) == 16  # full ring buffer


def test_fabric_forward_runs_in_autocast_and_fp8_region():
    fabric, model, optimizer = setup()
    seen = {}

    def hook(module, args, output):
        seen["fp8"] = lf.is_fp8_autocast_enabled()
        seen["autocast"] = torch.is_autocast_enabled("cpu")
        seen["dtype"] = output.dtype

    model.module.blocks[0].fc.register_forward_hook(hook)
    batch = next(iter(loader(n=2_000)))
    model.module.loss(batch)  # direct call: outside Fabric's forward context
    assert seen == {"fp8": False, "autocast": False, "dtype": torch.float32}
    model(batch[0])  # through the Fabric wrapper
    assert seen == {"fp8": True, "autocast": True, "dtype": torch.bfloat16}


@pytest.mark.parametrize(("optimizer", "syncs"), [("adamw_fused", 0), ("sgd", 1)])
def test_fabric_step_synchronisations(optimizer, syncs):
    fabric, model, optimizer = setup("delayed", optimizer=optimizer)
    batches = list(loader(n=4_000))[:4]
    train_steps(fabric, model, optimizer, batches[:1])  # warm-up: lazy scaler init
    counts = []
    for batch in batches[1:]:
        with SyncCounter() as counter:
            optimizer.zero_grad()
            fabric.backward(fabric_loss(model, batch))
            optimizer.step()
        counts.append(counter.count)
    assert counts == [syncs] * 3, counts


def test_fabric_checkpoint_roundtrip(tmp_path):
    fabric, model, optimizer = setup("delayed")
    batches = list(loader(n=4_000))
    train_steps(fabric, model, optimizer, batches[:6])
    plugin = fabric.strategy.precision
    fabric.save(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer, "fp8": plugin})
    expected = lf.fp8_state_dict(model.module)

    fabric2, model2, optimizer2 = setup("delayed")
    plugin2 = fabric2.strategy.precision
    fabric2.load(tmp_path / "state.ckpt", {"model": model2, "optimizer": optimizer2, "fp8": plugin2})
    loaded = lf.fp8_state_dict(model2.module)
    for name, entry in per_layer(expected).items():
        assert torch.equal(entry["amax_history"], per_layer(loaded)[name]["amax_history"])
    # Continuing both gives bit-identical weights.
    train_steps(fabric, model, optimizer, batches[6:9])
    train_steps(fabric2, model2, optimizer2, batches[6:9])
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_layers_kept_in_high_precision_are_switched_saved_and_restored(tmp_path):
    fabric, model, optimizer = setup("delayed")
    batches = list(loader(n=4_000))
    train_steps(fabric, model, optimizer, batches[:3])
    plugin = fabric.strategy.precision
    plugin.keep_in_high_precision("blocks.0.fc", "measured as sensitive")
    assert type(model.module.blocks[0].fc) is torch.nn.Linear  # now
    assert plugin.report.skipped["blocks.0.fc"] == "measured as sensitive"
    plugin.keep_in_high_precision("blocks.1.fc", "later", before_next_forward=True)
    assert isinstance(model.module.blocks[1].fc, lf.FP8Linear)
    train_steps(fabric, model, optimizer, batches[3:4])  # switched at the start of the forward
    assert type(model.module.blocks[1].fc) is torch.nn.Linear and "blocks.1.fc" not in plugin.report.fp8_layers
    fabric.save(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer, "fp8": plugin})
    kept = {"blocks.0.fc": "measured as sensitive", "blocks.1.fc": "later"}
    assert not set(kept) & set(per_layer(lf.fp8_state_dict(model.module)))

    # a fresh plugin converts every layer, then learns the kept layers from the checkpoint and switches them
    fabric2, model2, optimizer2 = setup("delayed")
    plugin2 = fabric2.strategy.precision
    assert isinstance(model2.module.blocks[0].fc, lf.FP8Linear)
    fabric2.load(tmp_path / "state.ckpt", {"model": model2, "optimizer": optimizer2, "fp8": plugin2})
    assert plugin2.high_precision_layers == kept
    assert type(model2.module.blocks[0].fc) is torch.nn.Linear and type(model2.module.blocks[1].fc) is torch.nn.Linear
    assert plugin2.report.skipped == kept
    train_steps(fabric, model, optimizer, batches[4:7])
    train_steps(fabric2, model2, optimizer2, batches[4:7])
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)

    # a model set up later with the plugin keeps them too, as exclude would
    later = fabric2.setup_module(TinyDecoder())
    assert type(later.module.blocks[0].fc) is torch.nn.Linear and plugin2.reports[-1].skipped == kept


@pytest.mark.parametrize(("loss_scaling", "scale_after"), [("dynamic", 2.0**15), ("auto", 1.0)])
def test_fabric_non_finite_loss_skips_step(loss_scaling, scale_after):
    fabric, model, optimizer = setup(loss_scaling=loss_scaling)
    batches = list(loader(n=4_000))
    train_steps(fabric, model, optimizer, batches[:2])
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    fabric.backward(fabric_loss(model, batches[2]) * float("inf"))
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    plugin = fabric.strategy.precision
    assert int(plugin.skipped_steps) == 1
    train_steps(fabric, model, optimizer, batches[3:4])
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert float(plugin.loss_scale) == scale_after  # backed off for the backward after the skipped step


def test_fabric_lbfgs_is_rejected():
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FP8Precision()])
    model = TinyDecoder()
    optimizer = torch.optim.LBFGS(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    batch = next(iter(loader(n=2_000)))
    fabric.backward(fabric_loss(model, batch))
    with pytest.raises(TypeError, match="LBFGS"):
        optimizer.step(lambda: fabric_loss(model, batch))


def test_fabric_loss_scaling_off():
    fabric, model, optimizer = setup(loss_scaling=False)
    train_steps(fabric, model, optimizer, list(loader(n=2_000))[:2])
    assert fabric.strategy.precision.loss_scale is None


# ---------------------------------------------------------------- loss scaling across several optimizers and models


def _two_optimizers_one_backward(loss_scaling):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    plugin = FP8Precision(compute_dtype=torch.float16, loss_scaling=loss_scaling, init_scale=1024.0, growth_interval=1)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    first = torch.optim.SGD(model[0].parameters(), lr=1.0)
    second = torch.optim.SGD(model[2].parameters(), lr=1.0)
    wrapped, first, second = fabric.setup(model, first, second)
    before = model[2].weight.detach().clone()
    fabric.backward(wrapped(torch.randn(16, 32)).float().square().mean())
    first.step()
    second.step()
    return before - model[2].weight.detach(), plugin


def test_two_optimizers_on_one_backward_see_the_same_unscaled_gradients():
    """The scale grows after every clean step here; the second optimizer used to be unscaled with the grown scale
    (its update halved). GradScaler.update now runs once per backward."""
    dynamic, plugin = _two_optimizers_one_backward("dynamic")
    reference, _ = _two_optimizers_one_backward("off")
    torch.testing.assert_close(dynamic, reference)
    assert float(plugin.loss_scale) == 1024.0  # the growth applies from the next backward on
    assert plugin.state_dict()["loss_scaler"]["scale"] == 2048.0  # a checkpoint saves the updated scale


def _gan_grad_output_overflow(growth_interval, share_trunk=False):
    """Two models on one plugin, delayed + dynamic loss scaling; the overflows of G's (or the trunk's) gradients."""
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh())
    gen = torch.nn.Sequential(trunk, torch.nn.Linear(64, 32))
    disc_trunk = trunk if share_trunk else torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh())
    disc = torch.nn.Sequential(torch.nn.Linear(32, 32), disc_trunk, torch.nn.Linear(64, 16))
    plugin = FP8Precision(recipe="delayed", compute_dtype=torch.float16, loss_scaling="dynamic", init_scale=1.0,
                          growth_interval=growth_interval)  # fmt: skip
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=1e-3), torch.optim.SGD(disc.parameters(), lr=1e-3)
    gen_w, opt_g = fabric.setup(gen, opt_g)
    disc_w, opt_d = fabric.setup(disc, opt_d)
    assert len(plugin.state_tables) == len({id(t) for t in plugin.state_tables})
    z, real = torch.randn(64, 32), torch.randn(64, 32)
    layer = trunk[0]
    overflow = 0
    for _ in range(6):
        opt_d.zero_grad()
        fabric.backward((disc_w(real).float() - 1).square().mean() + disc_w(gen_w(z).detach()).float().square().mean())
        opt_d.step()
        opt_g.zero_grad()
        before = int(layer.fp8_counts[2, 2])
        fabric.backward((disc_w(gen_w(z)).float() - 1).square().mean())
        overflow += int(layer.fp8_counts[2, 2]) - before
        opt_g.step()
    return overflow, plugin


@pytest.mark.parametrize("share_trunk", [False, True])
def test_gan_gradient_scales_follow_the_loss_scale_of_the_other_optimizer(share_trunk):
    """When D's step moves the loss scale, G's next backward must cast with a delayed scale derived from the
    rescaled history (it used the stale one: ~8% of G's gradient elements saturated). A trunk shared by both models
    is rescaled once, not once per model."""
    moving, plugin = _gan_grad_output_overflow(growth_interval=1, share_trunk=share_trunk)
    steady, _ = _gan_grad_output_overflow(growth_interval=10**6, share_trunk=share_trunk)
    assert float(plugin.loss_scale) > 2.0**6  # the scale really moved
    assert moving == steady, (moving, steady)


def test_a_model_without_fp8_layers_next_to_an_fp8_one(caplog):
    """A conv discriminator or a frozen teacher next to an FP8 student: it runs in compute_dtype, with one log line.
    Only when no model set up with the plugin has an FP8 layer does the first forward refuse to train."""
    import logging

    plugin = FP8Precision()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    teacher = fabric.setup(torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3), torch.nn.Flatten(), torch.nn.Linear(56, 1)))
    student = fabric.setup(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)))
    with caplog.at_level(logging.INFO):
        assert teacher(torch.randn(2, 4, 16)).shape == (2, 1)
        student(torch.randn(2, 16))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lightning_fp8:")]
    assert any("Sequential has no layer that can run in FP8" in line and "not both multiples of 16" in line for line in lines)
    assert any("2 Linear layer(s) in FP8" in line for line in lines)
    assert len(plugin.fp8_models) == 1 and isinstance(student.module[0], lf.FP8Linear)

    alone = FP8Precision()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[alone])
    model = fabric.setup(torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3)))
    with pytest.raises(ValueError, match="no layer that can run in FP8.*Refusing to train silently"):
        model(torch.randn(2, 4, 16))


def _gan(exclude):
    gen = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    disc = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh())
    disc.head = torch.nn.Linear(64, 16)
    plugin = FP8Precision(exclude=exclude)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    return fabric.setup(gen), fabric.setup(disc), gen, disc


def test_exclude_patterns_are_checked_across_all_models():
    """GAN pattern: `head` names a layer of the discriminator only; it must not fail on the generator, set up
    first. A pattern that matches no layer of either model fails at the first forward, naming the closest names."""
    gen_w, disc_w, gen, disc = _gan(["head"])
    disc_w(gen_w(torch.randn(4, 32)))
    assert type(disc.head) is torch.nn.Linear and isinstance(gen[0], lf.FP8Linear) and isinstance(disc[0], lf.FP8Linear)

    gen_w, disc_w, gen, disc = _gan(["haed"])
    with pytest.raises(ValueError, match=r"'haed' matches no layer.*closest layer names: 'head'.*2 models"):
        gen_w(torch.randn(4, 32))
    assert isinstance(disc.head, lf.FP8Linear)  # converted, but no step can run: the error comes first


def test_checkpoint_without_fp8_state_starts_fresh_with_a_warning():
    """strategy='ddp_spawn' saves from the main process, which never trains: its plugin state holds no model."""
    source = FP8Precision()  # never set up
    state = source.state_dict()
    assert state["models"] == []
    plugin = FP8Precision()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    fabric.setup(torch.nn.Sequential(torch.nn.Linear(16, 16)))
    with pytest.warns(UserWarning, match="holds no FP8 state"):
        plugin.load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs",
    [{"recipe": "rowwise", "power_of_2_scale": False}, {"recipe": "delayed", "margin": 2, "amax_compute_algo": "most_recent"},
     {"recipe": "tensorwise", "fp8_format": "e4m3", "power_of_2_scale": True}],
)  # fmt: skip
def test_every_recipe_setting_resumes_from_its_own_checkpoint(kwargs):
    states = []
    for _ in range(2):
        plugin = FP8Precision(**kwargs)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(16, 16)))
        model(torch.randn(4, 16))
        states.append((plugin, plugin.state_dict()))
    states[1][0].load_state_dict(states[0][1])


def _delayed_run(loss_scaling, steps=3, plugin=None, fabric=None, model=None, optimizer=None, **kwargs):
    if plugin is None:
        torch.manual_seed(0)
        plugin = FP8Precision(recipe="delayed", loss_scaling=loss_scaling, **kwargs)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer = fabric.setup(model, optimizer)
    for i in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(8, 32, generator=torch.Generator().manual_seed(i))).float().square().mean()
        fabric.backward(loss)
        optimizer.step()
    return plugin, fabric, model, optimizer


@pytest.mark.parametrize(("saved", "loaded"), [("dynamic", "skip_nonfinite"), ("skip_nonfinite", "dynamic")])
def test_resuming_under_another_loss_scaling_mode_rescales_the_gradient_histories(saved, loaded):
    """The gradient amaxes of a checkpoint were recorded under its loss scale; after a resume under another mode the
    scale starts fresh, and the histories must follow it (else delayed gradient casts under- or overflow for
    amax_history_len steps)."""
    plugin, *_ = _delayed_run(saved, init_scale=2.0**8, growth_interval=2)
    state = plugin.state_dict()
    saved_scale = state["loss_scaler"]["scale"]
    history = state["models"][0]["tables"][0]["amax_history"][:, 2]
    other, _, model, _ = _delayed_run(loaded, steps=0, init_scale=2.0**8)
    with pytest.warns(UserWarning, match="starts fresh.*rescaled"):
        other.load_state_dict(state)
    new_scale = float(other.loss_scale)
    assert new_scale == (1.0 if loaded == "skip_nonfinite" else 2.0**8) and saved_scale != new_scale
    for row, name in enumerate(("0", "2")):
        got = model.module.get_submodule(name).fp8_amax_history[2]
        assert torch.equal(got, history[row] * (new_scale / saved_scale)), name


def test_reloading_in_place_drops_the_step_in_progress():
    """fabric.load into the same live plugin (rolling back after a divergence): the scale update pending from the
    undone steps must not be applied on top of the restored scale."""
    plugin, fabric, model, optimizer = _delayed_run("dynamic", init_scale=2.0**8, growth_interval=1)
    state = plugin.state_dict()
    _delayed_run(None, 2, plugin, fabric, model, optimizer)  # two more steps: an update is pending again
    plugin.load_state_dict(state)
    fresh, *_ = _delayed_run("dynamic", steps=0, init_scale=2.0**8, growth_interval=1)
    fresh.load_state_dict(state)
    assert float(plugin.loss_scale) == float(fresh.loss_scale) == state["loss_scaler"]["scale"]
    _delayed_run(None, 1, plugin, fabric, model, optimizer)
    assert float(plugin.loss_scale) == state["loss_scaler"]["scale"]  # the reloaded scale, no stale update on top


def test_models_set_up_in_another_order_are_refused():
    def setup(first, second):
        plugin = FP8Precision()
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        for module in (first, second):
            fabric.setup(module)
        return plugin

    class Generator(torch.nn.Sequential):
        pass

    class Critic(torch.nn.Sequential):
        pass

    state = setup(Generator(torch.nn.Linear(16, 16)), Critic(torch.nn.Linear(16, 16))).state_dict()
    assert state["model_classes"] == [Generator.__qualname__, Critic.__qualname__]
    swapped = setup(Critic(torch.nn.Linear(16, 16)), Generator(torch.nn.Linear(16, 16)))
    with pytest.raises(ValueError, match="same order"):
        swapped.load_state_dict(state)


def test_an_optimizer_that_gains_parameters_rolls_their_model_too():
    """The optimizer -> tables lookup is cached: add_param_group() must refresh it (else B's history never rolls)."""
    plugin = FP8Precision(recipe="delayed")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    a, b = torch.nn.Sequential(torch.nn.Linear(16, 16)), torch.nn.Sequential(torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(a.parameters(), lr=0.01)
    wa, optimizer = fabric.setup(a, optimizer)
    wb = fabric.setup(b)

    def step():
        optimizer.zero_grad()
        fabric.backward((wa(torch.randn(4, 16)) + wb(torch.randn(4, 16))).float().square().mean())
        optimizer.step()

    step()
    assert int((b[0].fp8_amax_history != 0).sum()) == 0  # not updated by this optimizer: not rolled
    optimizer.add_param_group({"params": list(b.parameters())})
    step()
    assert int((b[0].fp8_amax_history[:2] != 0).sum(dim=1).min()) >= 1


def test_a_plain_models_optimizer_rolls_no_fp8_table():
    plugin = FP8Precision(recipe="delayed")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    fp8_model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(16, 16)))
    plain = torch.nn.Sequential(torch.nn.Conv1d(16, 16, 1))
    plain, optimizer = fabric.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.01))
    optimizer.zero_grad()
    fabric.backward(plain(fp8_model(torch.randn(4, 16)).unsqueeze(-1)).float().square().mean())
    optimizer.step()
    assert int((fp8_model.module[0].fp8_amax_history != 0).sum()) == 0
    assert bool((fp8_model.module[0].fp8_amax_pending[:2] > 0).all())  # waits for its own optimizer's step
