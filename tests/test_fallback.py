"""FP8FallbackCallback: a planted outlier layer is switched to high precision after `patience` readings."""

from __future__ import annotations

import math
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from utils import SyncCounter, make_trainer

from lightning_fp8 import FP8FallbackCallback, FP8Linear, FP8Precision


class Planted(L.LightningModule):
    """Three Linear layers; from global step ``start`` on, the input of ``mid`` grows 4x per step (and its output is
    divided back, so the loss stays sane): the delayed scale, derived from past amaxes, always lags and ``mid``'s input
    overflows on a large fraction of its elements at every step."""

    def __init__(self, start: int = 4) -> None:
        super().__init__()
        self.start = start
        self.inp, self.mid, self.out = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        k = self.global_step - self.start + 1
        factor = 4.0**k if k > 0 else 1.0
        h = torch.relu(self.inp(x))
        h = self.mid(h * factor) / factor
        loss = F.cross_entropy(self.out(torch.relu(h)).float(), y)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, 32, generator=g), torch.randint(0, 16, (512,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


class Probe(L.Callback):
    """Records, per global step, whether `mid` is still FP8 (at batch start and after the other callbacks)."""

    def __init__(self) -> None:
        self.at_start: dict[int, bool] = {}
        self.at_end: dict[int, bool] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.at_start[trainer.global_step] = isinstance(pl_module.mid, FP8Linear)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.at_end[trainer.global_step] = isinstance(pl_module.mid, FP8Linear)


def fit(tmp_path, callback, steps, ckpt_path=None, callbacks_extra=(), **kwargs):
    torch.manual_seed(0)
    model = Planted()
    probe = Probe()
    trainer = make_trainer(
        FP8Precision(recipe="delayed"),
        callbacks=[callback, probe, *callbacks_extra],
        max_steps=steps,
        default_root_dir=tmp_path,
        **kwargs,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(), ckpt_path=ckpt_path)
    messages = [str(w.message) for w in caught if "FP8FallbackCallback" in str(w.message)]
    return trainer, model, probe, messages


def test_planted_outlier_layer_falls_back_after_patience(tmp_path):
    callback = FP8FallbackCallback(every_n_steps=2, patience=2)
    syncs: list[tuple[int, int, int]] = []
    original = callback.on_train_batch_end

    def counted(trainer, *args):
        before = callback.fetches
        with SyncCounter() as counter:
            original(trainer, *args)
        syncs.append((trainer.global_step, callback.fetches - before, counter.count))

    callback.on_train_batch_end = counted
    trainer, model, probe, messages = fit(tmp_path, callback, steps=12)

    # readings at steps 2, 4 (clean), 6 and 8 (overflowing: steps 5.. run with the growing input): switched at 8
    assert [s for s, f, _ in syncs if f] == [2, 4, 6, 8, 10, 12]
    assert all(n == 0 for s, f, n in syncs if not f), syncs  # no host sync on the other steps
    assert probe.at_end == {s: s < 8 for s in range(1, 13)}
    assert list(callback.fallen_back) == ["mid"] and callback.fallen_back["mid"]["step"] == 8
    assert callback.fallen_back["mid"]["value"] > 0.05 and "input overflow fraction" in callback.fallen_back["mid"]["reason"]
    assert type(model.mid) is nn.Linear and not hasattr(model.mid, "fp8_state")
    assert isinstance(model.inp, FP8Linear) and isinstance(model.out, FP8Linear)
    assert all(math.isfinite(loss.item()) for loss in model.losses)
    plugin = trainer.precision_plugin
    assert "mid" in plugin.report.skipped and "mid" not in plugin.report.fp8_layers
    # loud: the layer, the reason and the step; and the summary at the end with the exclude list
    assert any("'mid'" in m and "global step 8" in m and "overflow fraction" in m for m in messages), messages
    assert any("FP8Precision(exclude=['mid'])" in m and m.startswith("FP8FallbackCallback: 1 layer") for m in messages)
    assert callback.exclude == ["mid"]

    # the switched layer computes exactly like nn.Linear under the plugin's autocast
    x = torch.randn(4, 64)
    with plugin.forward_context():
        got = model.mid(x)
        want = F.linear(x, model.mid.weight, model.mid.bias)
    assert torch.equal(got, want)


def test_fallback_is_in_the_checkpoint_and_resumes(tmp_path):
    callback = FP8FallbackCallback(every_n_steps=2, patience=2)
    trainer, _, _, _ = fit(tmp_path, callback, steps=9)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)
    saved = next(v for k, v in state["callbacks"].items() if "FP8FallbackCallback" in k)
    assert list(saved["fallen_back"]) == ["mid"] and saved["fallen_back"]["mid"]["step"] == 8

    resumed = FP8FallbackCallback(every_n_steps=2, patience=2)
    trainer, model, probe, messages = fit(tmp_path, resumed, steps=14, ckpt_path=path)
    assert min(probe.at_start) == 9 and not any(probe.at_start.values())  # high precision from the first step
    assert type(model.mid) is nn.Linear and isinstance(model.inp, FP8Linear) and isinstance(model.out, FP8Linear)
    assert list(resumed.fallen_back) == ["mid"] and resumed.fallen_back["mid"]["step"] == 8
    assert any("as in the run this checkpoint comes from" in m and "'mid'" in m for m in messages), messages
    assert all(math.isfinite(loss.item()) for loss in model.losses)

    # without the callback: the plugin refuses the checkpoint and says how to resume; the printed exclude list works
    torch.manual_seed(0)
    plain = make_trainer(FP8Precision(recipe="delayed"), max_steps=10, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"missing \['mid'\].*resume with the same `exclude`, or with FP8FallbackCallback"):
        plain.fit(Planted(), loader(), ckpt_path=path)
    torch.manual_seed(0)
    model = Planted()
    excluded = make_trainer(FP8Precision(recipe="delayed", exclude=["mid"]), max_steps=10, default_root_dir=tmp_path)
    excluded.fit(model, loader(), ckpt_path=path)
    assert type(model.mid) is nn.Linear and excluded.global_step == 10


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"overflow_threshold": 1.0}, "overflow_threshold"),
        ({"overflow_threshold": -0.1}, "overflow_threshold"),
        ({"overflow_threshold": "0.1"}, "overflow_threshold"),
        ({"nonfinite": 1}, "nonfinite"),
        ({"patience": 0}, "patience"),
        ({"patience": True}, "patience"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"every_n_steps": 2.5}, "every_n_steps"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FP8FallbackCallback(**kwargs)


class PlantedNaN(Planted):
    """From global step ``start`` on, one element of ``mid``'s input is NaN (the output is cleaned with nan_to_num, so
    the loss stays finite): with current (tensorwise) scaling the amax of that input is NaN."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(self.inp(x))
        if self.global_step >= self.start:
            h = h.clone()
            h[0, 0] = float("nan")
        h = torch.nan_to_num(self.mid(h), nan=0.0)
        loss = F.cross_entropy(self.out(torch.relu(h)).float(), y)
        self.losses.append(loss.detach())
        return loss


def test_nonfinite_amax_falls_back(tmp_path):
    torch.manual_seed(0)
    model = PlantedNaN(start=3)
    callback = FP8FallbackCallback(every_n_steps=1, patience=2)
    probe = Probe()
    trainer = make_trainer(FP8Precision(recipe="tensorwise"), callbacks=[callback, probe], max_steps=8, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"layer 'mid' switched to high precision .* at global step 5: non-finite input amax"):
        trainer.fit(model, loader())
    # the forward of steps 4 and 5 (global_step 3 and 4 during the batch) sees the NaN: readings 4 and 5 are bad
    assert probe.at_end == {s: s < 5 for s in range(1, 9)}
    assert list(callback.fallen_back) == ["mid"] and math.isnan(callback.fallen_back["mid"]["value"])
    assert isinstance(model.inp, FP8Linear) and isinstance(model.out, FP8Linear)
    assert all(math.isfinite(loss.item()) for loss in model.losses)

    off = FP8FallbackCallback(every_n_steps=1, patience=2, nonfinite=False, overflow_threshold=0.5)
    torch.manual_seed(0)
    model = PlantedNaN(start=3)
    trainer = make_trainer(FP8Precision(recipe="tensorwise"), callbacks=[off], max_steps=8, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="'mid' switched"):
        trainer.fit(model, loader())
    # NaN elements are overflows too (a NaN amax turns the whole cast into NaN): the overflow rule switches it instead
    assert "non-finite" not in off.fallen_back["mid"]["reason"] and off.fallen_back["mid"]["value"] == 1.0


def test_with_the_stats_callback_a_fallen_back_layer_leaves_a_gap_in_the_heatmap(tmp_path):
    """Both callbacks together: after the switch the stats callback reads one layer fewer. Its heatmap must still be
    drawn at the end of fit (the switched layer's later cells blank), and its checkpoint must round-trip."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_fp8 import FP8StatsCallback

    stats = FP8StatsCallback(log_every_n_steps=2)
    trainer, model, _, messages = fit(
        tmp_path, FP8FallbackCallback(every_n_steps=2, patience=2), 14, logger=CSVLogger(tmp_path)
    )
    assert any("mid" in m for m in messages) and not isinstance(model.mid, FP8Linear)
    stats_run = make_trainer(FP8Precision(recipe="delayed"), callbacks=[stats, FP8FallbackCallback(every_n_steps=2,
                             patience=2)], max_steps=14, default_root_dir=tmp_path, logger=CSVLogger(tmp_path))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stats_run.fit(Planted(), loader())
    heatmap = tmp_path / "lightning_logs" / "version_1" / "fp8_amax_heatmap.png"
    assert heatmap.is_file()
    state = stats.state_dict()
    assert len(state["heatmap_layers"]) == len(state["heatmap_amax"])
    assert "mid" in state["heatmap_layers"][0] and "mid" not in state["heatmap_layers"][-1]
    fresh = FP8StatsCallback()
    fresh.load_state_dict(state)
    assert fresh.state_dict()["heatmap_layers"] == state["heatmap_layers"]


class PlantedEval(Planted):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.seen_in_eval = type(self.mid)
        return F.cross_entropy(self.out(torch.relu(self.mid(torch.relu(self.inp(x))))).float(), y)


def test_validate_after_fit_keeps_switched_layers_in_high_precision(tmp_path):
    """trainer.validate / test / predict after fit run the plugin's convert_module again: a switched layer must not
    silently come back in FP8 (with fresh state) for the evaluation."""
    callback = FP8FallbackCallback(every_n_steps=2, patience=2)
    torch.manual_seed(0)
    model = PlantedEval()
    trainer = make_trainer(FP8Precision(recipe="delayed"), callbacks=[callback], max_steps=10, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader())
    assert list(callback.fallen_back) == ["mid"] and type(model.mid) is nn.Linear
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.validate(model, loader())
    assert model.seen_in_eval is nn.Linear
    assert type(model.mid) is nn.Linear
    assert "mid" in trainer.precision_plugin.report.skipped and "mid" not in trainer.precision_plugin.report.fp8_layers


def test_stats_include_pattern_of_a_switched_layer_is_no_error_on_resume(tmp_path):
    """An FP8StatsCallback include pattern that matched the switched layer was valid in the run that switched it: the
    resumed run (where the fallback switches it at on_fit_start) must not refuse it."""
    from lightning_fp8 import FP8StatsCallback

    callback = FP8FallbackCallback(every_n_steps=2, patience=2)
    trainer, _, _, _ = fit(tmp_path, callback, steps=9)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    stats = FP8StatsCallback(log_every_n_steps=2, include=["mid"], summary=False)
    trainer, model, _, _ = fit(tmp_path, FP8FallbackCallback(every_n_steps=2, patience=2), 12, ckpt_path=path,
                               callbacks_extra=[stats])
    assert type(model.mid) is nn.Linear and trainer.global_step == 12


@pytest.mark.parametrize("stats_first", [True, False])
def test_listed_before_the_stats_callback_it_warns(tmp_path, stats_first):
    """Both read at the end of the same steps: the stats callback must read before a layer is switched."""
    from lightning_fp8 import FP8StatsCallback

    callbacks = [FP8StatsCallback(), FP8FallbackCallback()]
    trainer = make_trainer(FP8Precision(recipe="delayed"), callbacks=callbacks if stats_first else callbacks[::-1],
                           max_steps=1, default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Planted(), loader())
    order = [str(w.message) for w in caught if "List FP8StatsCallback first" in str(w.message)]
    assert len(order) == (0 if stats_first else 1)


def test_a_switched_layer_the_model_no_longer_has_is_left_out_of_the_exclude_advice(tmp_path):
    callback = FP8FallbackCallback()
    state = callback.state_dict()
    state["fallen_back"] = {"ghost": {"step": 4, "reason": "overflow", "value": 0.5}}
    callback.load_state_dict(state)
    trainer = make_trainer(FP8Precision(recipe="delayed"), callbacks=[callback], max_steps=1, default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Planted(), loader())
    assert any("'ghost'" in str(w.message) and "no such module" in str(w.message) for w in caught)
    assert callback.exclude == []  # FP8Precision(exclude=['ghost']) would fail at setup: no such layer
