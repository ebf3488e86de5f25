"""Checkpoints: plain model state_dict, weights_only-safe plugin state, exact resume (single device and DDP)."""

from __future__ import annotations

import csv
import os

import lightning as L
import pytest
import torch
from models import TinyDecoder, loader
import utils
from utils import per_layer

import lightning_fp8 as lf
from lightning_fp8 import FP8Precision

N_DATA = 10 * 8 * 32 + 1  # 10 batches of 8 windows per epoch


def make_trainer(plugin, epochs, **kwargs):
    return utils.make_trainer(plugin, max_epochs=epochs, **kwargs)


def fresh(seed=0):
    torch.manual_seed(seed)
    return TinyDecoder()


@pytest.fixture(scope="module")
def delayed_checkpoint(tmp_path_factory):
    model = fresh()
    trainer = make_trainer(FP8Precision(recipe="delayed"), 1)
    trainer.fit(model, loader(n=N_DATA))
    path = tmp_path_factory.mktemp("ckpt") / "epoch1.ckpt"
    trainer.save_checkpoint(path)
    return path, model


def test_checkpoint_model_state_is_the_plain_models(delayed_checkpoint):
    path, _ = delayed_checkpoint
    ckpt = torch.load(path, weights_only=True)  # the whole checkpoint: no pickled objects anywhere
    plain = TinyDecoder()  # never converted
    expected = plain.state_dict()
    assert list(ckpt["state_dict"]) == list(expected)
    for key, value in ckpt["state_dict"].items():
        assert value.dtype == expected[key].dtype, key
    plain.load_state_dict(ckpt["state_dict"], strict=True)


def test_plugin_state_holds_only_tensors_and_plain_values(delayed_checkpoint):
    path, model = delayed_checkpoint
    state = torch.load(path, weights_only=True)["FP8Precision"]
    assert state["recipe"]["name"] == "delayed"
    assert state["loss_scaling"] == "skip_nonfinite" and state["loss_scaler"]["scale"] == 1.0  # bf16 default
    (model_state,) = state["models"]
    layers = per_layer(model_state)
    fp8_names = {n for n, m in model.named_modules() if isinstance(m, lf.FP8Linear)}
    assert set(layers) == fp8_names
    history = layers["blocks.0.fc"]["amax_history"]
    assert torch.equal(history, model.blocks[0].fc.fp8_amax_history)

    def plain(value):
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (torch.Tensor, str, int, float, bool))

    assert plain(state)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_exact_resume_single_device(recipe, tmp_path):
    straight = fresh()
    make_trainer(FP8Precision(recipe=recipe), 2).fit(straight, loader(n=N_DATA))

    first = fresh()
    trainer = make_trainer(FP8Precision(recipe=recipe), 1)
    trainer.fit(first, loader(n=N_DATA))
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")

    resumed = fresh(seed=1)  # different init: everything must come from the checkpoint
    plugin = FP8Precision(recipe=recipe)
    make_trainer(plugin, 2).fit(resumed, loader(n=N_DATA), ckpt_path=tmp_path / "epoch1.ckpt")

    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    s, r = lf.fp8_state_dict(straight), lf.fp8_state_dict(resumed)
    for name, entry in per_layer(s).items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, per_layer(r)[name][key]), (name, key)


# ------------------------------------------- the exact-resume recipes of docs/checkpoints.md ("Resume is exact")


class _MLP(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _dataset():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(160, 32, generator=g), torch.randn(160, 32, generator=g))


def _straight_then_resumed(tmp_path, make_loader, every: dict, resume_from: str, epochs: int):
    """One run of ``epochs`` epochs writing checkpoints, then a new run resumed from one of them."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    straight = _MLP()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, **every)
    make_trainer(FP8Precision(recipe="delayed"), epochs, enable_checkpointing=True, callbacks=[checkpoints]).fit(
        straight, make_loader()
    )
    torch.manual_seed(1)  # a different init and random state: everything must come from the checkpoint
    resumed = _MLP()
    make_trainer(FP8Precision(recipe="delayed"), epochs).fit(resumed, make_loader(), ckpt_path=tmp_path / resume_from)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    s, r = per_layer(lf.fp8_state_dict(straight)), per_layer(lf.fp8_state_dict(resumed))
    for name, entry in s.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):  # counters included: a single device restores them exactly
                assert torch.equal(value, r[name][key]), (name, key)


def test_exact_resume_from_an_epoch_end_checkpoint_with_a_shuffling_sampler(tmp_path):
    """Epoch-end checkpoints of ModelCheckpoint, and a sampler that Lightning reseeds through set_epoch: bit-exact."""

    def make_loader():
        dataset = _dataset()
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        return torch.utils.data.DataLoader(dataset, batch_size=16, sampler=sampler)

    sampler = make_loader().sampler
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first  # it does reshuffle every epoch
    _straight_then_resumed(tmp_path, make_loader, {"every_n_epochs": 1}, "epoch=0-step=10.ckpt", epochs=3)


def test_exact_resume_from_a_mid_epoch_checkpoint_with_a_stateful_dataloader(tmp_path):
    """ModelCheckpoint(every_n_train_steps) in the middle of an epoch, torchdata's StatefulDataLoader: bit-exact."""
    import torchdata.stateful_dataloader as stateful  # in the test extra: this test must run, not skip

    def make_loader():
        return stateful.StatefulDataLoader(_dataset(), batch_size=16, shuffle=True)

    _straight_then_resumed(tmp_path, make_loader, {"every_n_train_steps": 5}, "epoch=1-step=15.ckpt", epochs=2)


def test_resume_with_another_recipe_is_a_clear_error(delayed_checkpoint):
    path, _ = delayed_checkpoint
    with pytest.raises(ValueError, match="trained with FP8 recipe .*delayed.*configured with .*tensorwise"):
        make_trainer(FP8Precision(recipe="tensorwise"), 2).fit(fresh(), loader(n=N_DATA), ckpt_path=path)


def test_resume_with_other_history_length_is_a_clear_error(delayed_checkpoint):
    path, _ = delayed_checkpoint
    with pytest.raises(ValueError, match="amax_history_len"):
        make_trainer(FP8Precision(recipe="delayed", amax_history_len=8), 2).fit(
            fresh(), loader(n=N_DATA), ckpt_path=path
        )


def test_bf16_checkpoint_resumes_in_fp8(tmp_path):
    """Documented conversion: a checkpoint without FP8 state starts the FP8 state fresh."""
    model = fresh()
    trainer = utils.make_trainer(precision="bf16-mixed", max_epochs=1)
    trainer.fit(model, loader(n=N_DATA))
    trainer.save_checkpoint(tmp_path / "bf16.ckpt")
    resumed = fresh(1)
    make_trainer(FP8Precision(), 2).fit(resumed, loader(n=N_DATA), ckpt_path=tmp_path / "bf16.ckpt")
    assert int(resumed.blocks[0].fc.fp8_counts[0, 0]) == 10 * 8 * 32 * 64  # one epoch recorded, from zero


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.gloo(f"ddp_resume/{r}")) for r in ["delayed"]])
def test_exact_resume_ddp_two_processes(recipe, gloo_runs):
    """tests/scripts/ddp_resume.py on 2 processes (gloo), run by tests/scripts/gloo_checks.py."""
    tmp_path = gloo_runs.folder(f"ddp_resume/{recipe}")
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    for name, value in result["straight"].items():
        assert torch.equal(value, result["resumed"][name]), name
    # The amax reduction keeps every rank's histories (and so its delayed scales) identical.
    rank0 = per_layer(torch.load(tmp_path / "fp8_rank0.pt", weights_only=True))
    rank1 = per_layer(torch.load(tmp_path / "fp8_rank1.pt", weights_only=True))
    for name in rank0:
        for key in ("amax_history", "scale", "initialized"):
            assert torch.equal(rank0[name][key], rank1[name][key]), (name, key)
    fp8_s, fp8_r = per_layer(result["fp8_straight"]), per_layer(result["fp8_resumed"])
    for name in fp8_s:
        assert torch.equal(fp8_s[name]["amax_history"], fp8_r[name]["amax_history"]), name
        assert torch.equal(fp8_s[name]["scale"], fp8_r[name]["scale"]), name
    # The statistics continue exactly: the whole-run counts (summed over ranks) of the resumed run are the straight
    # run's. (Restoring the saving rank's counters on every rank made them wrong, even negative per interval.)
    totals_s, totals_r = result["totals_straight"], result["totals_resumed"]
    assert totals_s.keys() == totals_r.keys() and totals_s
    for name in totals_s:
        assert totals_s[name] == totals_r[name], name
        assert all(value >= 0 for role in totals_r[name] for value in role), name
    # What was logged after the resume is what the straight run logged at the same steps: the interval of the step-3
    # log began before the checkpoint (step 2), and the run-end reading covers step 4.
    logged_s, logged_r = (fp8_rows(tmp_path / run / "version_0" / "metrics.csv") for run in ("straight", "resumed"))
    assert logged_r and set(logged_r) <= set(logged_s)
    for step, row in logged_r.items():
        assert row == logged_s[step], step
    assert any(key.endswith("/underflow_frac") for row in logged_r.values() for key in row)


def fp8_rows(path):
    """The FP8 metrics a CSVLogger wrote, by step: ``{step: {name: value}}``, values as written."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    by_step = {}
    for row in rows:
        values = {k: v for k, v in row.items() if k.startswith("fp8/") and v != ""}
        if values:
            by_step.setdefault(int(row["step"]), {}).update(values)
    return by_step


# ------------------------------------------------------------------ checkpoints written by lightning-fp8 0.1

V01 = os.path.join(os.path.dirname(__file__), "data", "fp8_state_v0_1.pt")  # made by data/make_fp8_state_v0_1.py


def test_plugin_state_of_version_0_1_loads():
    """0.1 stored one dict per layer (fp8_scale, fp8_amax_history, ...); it loads into the state table, and
    the dynamic loss scale it saved does not leak into the bf16 default (which does not scale)."""
    from lightning.fabric import Fabric

    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

    saved = torch.load(V01, weights_only=True)
    old = saved["fp8"]
    assert old["version"] == 1 and set(old["fp8"]["layers"]) == {"0", "2"}
    for loss_scaling, scale in (("dynamic", old["loss_scaler"]["scale"]), ("auto", 1.0)):
        plugin = FabricFP8Precision(recipe="delayed", amax_history_len=4, loss_scaling=loss_scaling)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
        model.load_state_dict(saved["model"])
        model = fabric.setup(model)
        if loss_scaling == "auto":
            with pytest.warns(UserWarning, match="loss scaling mode is 'dynamic'.*starts fresh"):
                plugin.load_state_dict(old)
        else:
            plugin.load_state_dict(old)
        assert float(plugin.loss_scale) == scale
        ratio = scale / old["loss_scaler"]["scale"]  # the gradient amaxes follow the scale the run continues with
        for name in ("0", "2"):
            layer = model.module.get_submodule(name)
            want = {k: v.clone() for k, v in old["fp8"]["layers"][name].items() if isinstance(v, torch.Tensor)}
            want["fp8_amax_history"][2] *= ratio
            want["fp8_amax_pending"][2] *= ratio
            want["fp8_scale"][2] /= ratio  # delayed: fp8_max / amax, and the ratio is a power of two
            for buffer in ("fp8_scale", "fp8_amax_history", "fp8_amax_pending", "fp8_counts", "fp8_initialized"):
                assert torch.equal(getattr(layer, buffer), want[buffer]), (name, buffer, loss_scaling)
        assert int(plugin.skipped_steps) == int(old["skipped_steps"])
        # and training goes on from the loaded histories
        with lf.fp8_autocast():
            model(torch.randn(4, 32))

    # another recipe is still refused, naming both
    plugin = FabricFP8Precision(recipe="tensorwise")
    with pytest.raises(ValueError, match="trained with FP8 recipe .*delayed.*configured with .*tensorwise"):
        plugin.load_state_dict(old)
