"""torch.compile with the Trainer, the documented way: compile the inner model in ``configure_model``.

Lightning calls ``configure_model`` before the precision plugin's ``convert_module``; ``torch.compile`` is lazy, so
the plugin converts the Linear layers inside the ``OptimizedModule`` in place (their class changes, the module
objects stay) and the first compiled forward traces the FP8 layers. Expected: one graph for the whole run (no graph
break, no recompilation after the first step), every step in FP8.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from models import loader
from torch import nn
from torch._dynamo import OptimizedModule
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from utils import make_trainer, per_layer

from lightning_fp8 import FP8Linear, FP8Precision, fp8_state_dict
from lightning_fp8.recipe import RECIPES

SEQ, BATCH, DIM = 16, 4, 32


class CompiledInConfigureModel(L.LightningModule):
    def __init__(self, backend="aot_eager"):
        super().__init__()
        self.backend = backend
        self.model = nn.Sequential(
            nn.Embedding(256, DIM), nn.Linear(DIM, 64), nn.GELU(), nn.Linear(64, DIM), nn.LayerNorm(DIM),
            nn.Linear(DIM, 256),
        )  # fmt: skip
        self.losses: list[torch.Tensor] = []

    def configure_model(self):
        if not isinstance(self.model, OptimizedModule):  # configure_model runs again on every fit/validate call
            self.model = torch.compile(self.model, backend=self.backend)

    def training_step(self, batch, batch_idx):
        idx, target = batch
        loss = F.cross_entropy(self.model(idx).float().view(-1, 256), target.reshape(-1))
        self.log("train_loss", loss)  # eager: the LightningModule is not compiled, only self.model
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("recipe", RECIPES)
def test_model_compiled_in_configure_model_trains_in_fp8_in_one_graph(recipe):
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    model = CompiledInConfigureModel(backend)
    plugin = FP8Precision(recipe=recipe)
    with torch._dynamo.config.patch(error_on_recompile=True):
        make_trainer(plugin, max_steps=3).fit(model, loader(seq_len=SEQ, batch_size=BATCH, n=1_000))
    assert isinstance(model.model, OptimizedModule)
    layers = [m for m in model.model.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 3
    assert plugin.report.fp8_layers == ["model._orig_mod.1", "model._orig_mod.3", "model._orig_mod.5"]
    assert len(model.losses) == 3 and all(math.isfinite(float(loss)) for loss in model.losses)
    assert dict(counters["graph_break"]) == {}
    assert backend.frame_count == 1  # compiled once: no graph break, no recompilation after the first step
    assert not counters["recompiles"]
    # the compiled graph ran the FP8 layers on every step: their element counters saw all three steps' inputs
    assert int(layers[0].fp8_counts[0, 0]) == 3 * BATCH * SEQ * DIM
    assert bool((layers[0].fp8_amax_history[0] > 0).any())


def test_exclude_names_inside_a_compiled_model_carry_orig_mod():
    """torch.compile registers the model as `_orig_mod`: a name without it matches nothing, and the error says
    which names exist and which glob matches."""
    with pytest.raises(ValueError, match=r"'model\.5' matches no layer \(it would match 'model\._orig_mod\.5' without"):
        make_trainer(FP8Precision(exclude=["model.5"]), max_steps=1).fit(
            CompiledInConfigureModel(), loader(seq_len=SEQ, batch_size=BATCH, n=1_000)
        )
    model = CompiledInConfigureModel()
    plugin = FP8Precision(exclude=["*.5"])
    plugin.convert_module(model.configure_model() or model)  # what the Trainer does: configure_model, then convert
    assert type(model.model._orig_mod[5]) is nn.Linear and isinstance(model.model._orig_mod[1], FP8Linear)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 64), nn.Linear(64, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class _CheckpointedBlock(_Block):
    """A block in an activation checkpoint, compiled with it (torchtitan's order: checkpoint, then compile)."""

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(super().forward, x, use_reentrant=False)


def _fp8_state_by_layer(model):
    """The model's FP8 state by layer name, without the compiled wrappers' ``_orig_mod`` (eager and compiled twins
    compare)."""
    return {name.replace("._orig_mod", ""): fields for name, fields in per_layer(fp8_state_dict(model)).items()}


def _assert_same_fp8_state(a, b):
    """Two :func:`_fp8_state_by_layer` results equal: the same layers, every field bit for bit."""
    assert a.keys() == b.keys()
    for name, fields in a.items():
        for field, value in fields.items():
            other = b[name][field]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (name, field)


class BlocksCompiledInConfigureModel(L.LightningModule):
    """Each block compiled on its own in ``configure_model`` (torchtitan's way, and Lightning's model-parallel
    examples'), more blocks than torch's recompile limit (8)."""

    def __init__(self, backend, n_blocks=10, checkpoint=False):
        super().__init__()
        self.backend = backend
        self.embed = nn.Embedding(256, DIM)
        block = _CheckpointedBlock if checkpoint else _Block
        self.blocks = nn.ModuleList(block() for _ in range(n_blocks))
        self.head = nn.Linear(DIM, 256)  # not compiled: eager and compiled layers share the state table

    def configure_model(self):
        if self.backend is None:  # the eager twin
            return
        for i, block in enumerate(self.blocks):
            if not isinstance(block, OptimizedModule):
                self.blocks[i] = torch.compile(block, backend=self.backend, fullgraph=True)

    def training_step(self, batch, batch_idx):
        idx, target = batch
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).float().view(-1, 256), target.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


#: a per-tensor, the history and a block recipe: how the block graphs share the table does not depend on the cast specs
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "mxfp8"])
def test_blocks_compiled_in_configure_model_share_one_graph(recipe):
    """Identical blocks compiled one by one share one graph under the plugin: a layer's row in the state table is not
    a constant of the graph. Before, every block compiled its own graph and, past the recompile limit, the remaining
    blocks ran eager with only a warning."""
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    model = BlocksCompiledInConfigureModel(backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        make_trainer(FP8Precision(recipe=recipe), max_steps=3).fit(model, loader(seq_len=SEQ, batch_size=BATCH, n=1_000))
    assert all(isinstance(block, OptimizedModule) for block in model.blocks)
    assert backend.frame_count == 1 and not counters["recompiles"] and dict(counters["graph_break"]) == {}
    # every block's layers ran in FP8 and recorded into their own rows, three steps each
    for block in model.blocks:
        for layer, width in ((block.up, DIM), (block.down, 64)):
            assert isinstance(layer, FP8Linear)
            assert int(layer.fp8_counts[0, 0]) == 3 * BATCH * SEQ * width
    histories = [block.up.fp8_amax_history[0, :3] for block in model.blocks]
    assert all(bool((h > 0).all()) for h in histories)
    assert len({tuple(h.tolist()) for h in histories}) == len(histories)  # each row its own layer's amaxes


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_checkpointed_blocks_compiled_in_configure_model_match_eager(recipe):
    """Activation-checkpointed blocks compiled one by one in ``configure_model`` (torchtitan's way): one graph with
    ``fullgraph=True`` for every block, ``delayed`` included, and the run bit for bit the eager one's (parameters and
    FP8 state after three steps). Before, ``delayed`` could not compile there (dynamo refused a host-side store of the
    layers inside the checkpoint) and ran the blocks eager."""
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    runs = []
    for compile_backend in (None, backend):
        torch.manual_seed(0)
        model = BlocksCompiledInConfigureModel(compile_backend, n_blocks=3, checkpoint=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            trainer = make_trainer(FP8Precision(recipe=recipe), max_steps=3)
            trainer.fit(model, loader(seq_len=SEQ, batch_size=BATCH, n=1_000))
        runs.append(([p.detach().clone() for p in model.parameters()], _fp8_state_by_layer(model)))
    assert backend.frame_count == 1 and not counters["recompiles"] and dict(counters["graph_break"]) == {}
    (params_eager, state_eager), (params_compiled, state_compiled) = runs
    assert all(torch.equal(a, b) for a, b in zip(params_eager, params_compiled))
    _assert_same_fp8_state(state_eager, state_compiled)
    # each input recorded once a step (not again by the recomputation)
    assert int(model.blocks[0].up.fp8_counts[0, 0]) == 3 * BATCH * SEQ * DIM


class CompiledGAN(L.LightningModule):
    """Manual optimization with two optimizers in the DCGAN order: the generator's forward once, the discriminator's
    step (where the plugin rolls the state table, the generator's rows too) between the generator's forward and its
    backward. The generator's blocks are compiled one by one (``backend=None``: eager)."""

    def __init__(self, backend, checkpoint=False):
        super().__init__()
        torch.manual_seed(0)
        self.backend = backend
        self.automatic_optimization = False
        block = _CheckpointedBlock if checkpoint else _Block
        self.blocks = nn.ModuleList(block() for _ in range(3))
        self.d = nn.Sequential(nn.Linear(DIM, 64), nn.GELU(), nn.Linear(64, 16))
        self.g_grads = []

    def configure_model(self):
        if self.backend is not None:
            for i, block in enumerate(self.blocks):
                if not isinstance(block, OptimizedModule):
                    self.blocks[i] = torch.compile(block, backend=self.backend, fullgraph=True)

    def training_step(self, batch, batch_idx):
        z, real = batch
        opt_g, opt_d = self.optimizers()
        fake = z
        for block in self.blocks:
            fake = block(fake)
        d_loss = self.d(real).float().mean() - self.d(fake).float().mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss, retain_graph=True)
        opt_d.step()  # rolls the table
        g_loss = self.d(fake).float().mean() * 8  # gradients larger than the history's: a stale scale shows
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        self.g_grads.append([p.grad.clone() for p in self.blocks.parameters()])
        opt_g.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.blocks.parameters(), lr=0.01), torch.optim.SGD(self.d.parameters(), lr=0.01)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_compiled_blocks_roll_between_forward_and_backward_match_eager(checkpoint):
    """The discriminator's optimizer step rolls the table between the generator's compiled forward and its backward:
    the generator's backward must scale its gradients with the rolled grad_output history, as eager does (it used the
    flag as read in the forward: wrong gradients, no error). Checkpointed, the compiled recomputation in the backward
    must cast the input and weight with the scales of the forward, from before the roll, as eager's replay does (it
    read the rolled ones: gradients 3 to 5% off, no error)."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(12, 8, DIM, generator=g), torch.randn(12, 8, DIM, generator=g))
    runs = []
    for backend in (None, "aot_eager"):
        torch._dynamo.reset()
        model = CompiledGAN(backend, checkpoint)
        make_trainer(FP8Precision(recipe="delayed"), max_steps=4).fit(model, torch.utils.data.DataLoader(data, batch_size=4))
        runs.append((model.g_grads, _fp8_state_by_layer(model)))
    (grads_eager, state_eager), (grads_compiled, state_compiled) = runs
    assert len(grads_eager) == len(grads_compiled) == 2
    for step, (a, b) in enumerate(zip(grads_eager, grads_compiled)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"generator gradients differ at step {step}"
    _assert_same_fp8_state(state_eager, state_compiled)
