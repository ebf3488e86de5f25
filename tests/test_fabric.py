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
    assert float(plugin.loss_scale) == scale_after and int(plugin.skipped_steps) == 1
    train_steps(fabric, model, optimizer, batches[3:4])
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


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


def test_sharded_parameters_are_rejected():
    """FSDP2 turns parameters into DTensors; the plugin refuses them at the first forward."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    import tempfile

    store_file = tempfile.NamedTemporaryFile(delete=False).name
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plugin = FP8Precision()
        model = torch.nn.Sequential(torch.nn.Linear(32, 32))
        plugin.convert_module(model)
        model[0].weight = torch.nn.Parameter(DTensor.from_local(model[0].weight.detach(), mesh, [Replicate()]))
        with pytest.raises(ValueError, match="FSDP"):
            plugin.forward_context()
    finally:
        dist.destroy_process_group()
