"""FP8FallbackCallback: a planted outlier layer is switched to high precision after `patience` readings."""

from __future__ import annotations

import math
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from torch import nn
from utils import SyncCounter, make_trainer

from lightning_fp8 import FP8FallbackCallback, FP8Linear, FP8Precision
from lightning_fp8.stats import SWITCHED_BY_FALLBACK


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
    """Records, per global step, whether `mid` is FP8 at batch start, in the forward (global step during the batch)
    and after the other callbacks at the end of the batch (global step after the optimizer step)."""

    def __init__(self) -> None:
        self.at_start: dict[int, bool] = {}
        self.in_forward: dict[int, bool] = {}
        self.at_end: dict[int, bool] = {}

    def on_fit_start(self, trainer, pl_module):
        def record(module, args, output):
            if module.training:
                self.in_forward[trainer.global_step] = isinstance(module, FP8Linear)

        pl_module.mid.register_forward_hook(record)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.at_start[trainer.global_step] = isinstance(pl_module.mid, FP8Linear)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.at_end[trainer.global_step] = isinstance(pl_module.mid, FP8Linear)


def fit(tmp_path, callback, steps, ckpt_path=None, callbacks_extra=(), model_class=None, plugin=None, **kwargs):
    torch.manual_seed(0)
    model = (model_class or Planted)()
    probe = Probe()
    trainer = make_trainer(
        plugin or FP8Precision(recipe="delayed"),
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


class PlantedEval(Planted):
    """Records the type of ``mid`` and the loss of every evaluation batch (validate, test and predict)."""

    def __init__(self, start: int = 4) -> None:
        super().__init__(start)
        self.seen_in_eval: list[type] = []
        self.eval_losses: list[float] = []

    def _evaluate(self, batch):
        x, y = batch
        self.seen_in_eval.append(type(self.mid))
        loss = F.cross_entropy(self.out(torch.relu(self.mid(torch.relu(self.inp(x))))).float(), y)
        self.eval_losses.append(float(loss))
        return loss

    def validation_step(self, batch, batch_idx):
        return self._evaluate(batch)

    def test_step(self, batch, batch_idx):
        return self._evaluate(batch)

    def predict_step(self, batch, batch_idx):
        return self._evaluate(batch)


def quietly(run, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run(*args, **kwargs)


def evaluate(trainer, stage, model, ckpt_path=None):
    """Run ``stage`` ("validate", "test" or "predict"); the types ``mid`` had and the losses of its batches."""
    model.seen_in_eval, model.eval_losses = [], []
    quietly(getattr(trainer, stage), model, loader(), ckpt_path=ckpt_path)
    assert model.seen_in_eval
    return set(model.seen_in_eval), model.eval_losses


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
    # switched before the next forward: still FP8 for every callback at the end of step 8, not in step 9's forward
    assert probe.at_end == {s: s <= 8 for s in range(1, 13)}
    assert probe.in_forward == {s: s < 8 for s in range(12)}
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


def test_readings_without_counts_neither_clear_nor_extend_a_bad_streak(tmp_path):
    # statistics_every_n_steps=2 and a reading after every step: every other reading covers no counting step, so it
    # has no overflow fraction. It must not count as a clean reading (which would reset the streak: no fallback ever)
    callback = FP8FallbackCallback(every_n_steps=1, patience=2)
    plugin = FP8Precision(recipe="delayed", statistics_every_n_steps=2)
    trainer, model, probe, messages = fit(tmp_path, callback, steps=12, plugin=plugin)
    # steps 4, 6, ... overflow and count (the steps in between overflow too, uncounted): bad at the readings after
    # steps 4 and 6, the one after step 5 carrying nothing; switched at the reading after step 6 (global step 7)
    assert list(callback.fallen_back) == ["mid"] and callback.fallen_back["mid"]["step"] == 7
    assert type(model.mid) is nn.Linear


def test_fallback_is_in_the_checkpoint_and_resumes(tmp_path):
    callback = FP8FallbackCallback(every_n_steps=2, patience=2)
    trainer, _, _, _ = fit(tmp_path, callback, steps=9)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)
    saved = next(v for k, v in state["callbacks"].items() if "FP8FallbackCallback" in k)
    assert list(saved["fallen_back"]) == ["mid"] and saved["fallen_back"]["mid"]["step"] == 8
    # the plugin's state is where the layers kept in high precision are (the callback's holds when and why)
    kept = state["FP8Precision"]["high_precision_layers"]
    assert list(kept) == ["mid"] and kept["mid"].startswith(SWITCHED_BY_FALLBACK)

    resumed = FP8FallbackCallback(every_n_steps=2, patience=2)
    trainer, model, probe, messages = fit(tmp_path, resumed, steps=14, ckpt_path=path)
    assert min(probe.at_start) == 9 and not any(probe.at_start.values())  # high precision from the first step
    assert type(model.mid) is nn.Linear and isinstance(model.inp, FP8Linear) and isinstance(model.out, FP8Linear)
    assert list(resumed.fallen_back) == ["mid"] and resumed.fallen_back["mid"]["step"] == 8
    assert any("as in the run this checkpoint comes from" in m and "'mid'" in m for m in messages), messages
    assert all(math.isfinite(loss.item()) for loss in model.losses)
    # the end-of-fit advice is the same as in the run that switched the layer
    summaries = [m for m in messages if m.startswith("FP8FallbackCallback: 1 layer")]
    assert len(summaries) == 1 and "mid: at global step 8" in summaries[0]
    assert "FP8Precision(exclude=['mid'])" in summaries[0] and resumed.exclude == ["mid"]

    # without the callback the plugin keeps the layer in high precision too: its state carries the switched layers
    torch.manual_seed(0)
    model = Planted()
    plain = make_trainer(FP8Precision(recipe="delayed"), callbacks=[probe := Probe()], max_steps=12,
                         default_root_dir=tmp_path)  # fmt: skip
    quietly(plain.fit, model, loader(), ckpt_path=path)
    assert plain.global_step == 12 and not any(probe.at_start.values()) and type(model.mid) is nn.Linear
    assert plain.precision_plugin.high_precision_layers == kept
    plain.save_checkpoint(tmp_path / "again.ckpt")  # and the next checkpoint carries them on
    assert torch.load(tmp_path / "again.ckpt", weights_only=True)["FP8Precision"]["high_precision_layers"] == kept
    # the printed exclude list works as well
    torch.manual_seed(0)
    model = Planted()
    excluded = make_trainer(FP8Precision(recipe="delayed", exclude=["mid"]), max_steps=10, default_root_dir=tmp_path)
    excluded.fit(model, loader(), ckpt_path=path)
    assert type(model.mid) is nn.Linear and excluded.global_step == 10


def test_a_checkpoint_from_before_the_plugin_kept_the_switched_layers_still_loads(tmp_path):
    """Checkpoints written when only the callback's state named the switched layers (no ``high_precision_layers`` in
    the plugin's state): with the callback, a resumed fit and an evaluation keep the layer in high precision; without
    it the plugin refuses the checkpoint and says how to resume, as it did."""
    trainer, _, _, _ = fit(tmp_path, FP8FallbackCallback(every_n_steps=2, patience=2), steps=9, model_class=PlantedEval)
    path = tmp_path / "old.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)
    del state["FP8Precision"]["high_precision_layers"]
    torch.save(state, path)

    resumed = FP8FallbackCallback(every_n_steps=2, patience=2)
    trainer, model, probe, messages = fit(tmp_path, resumed, steps=12, ckpt_path=path, model_class=PlantedEval)
    assert min(probe.at_start) == 9 and not any(probe.at_start.values()) and type(model.mid) is nn.Linear
    assert any("as in the run this checkpoint comes from" in m for m in messages), messages
    assert trainer.precision_plugin.high_precision_layers["mid"].startswith(SWITCHED_BY_FALLBACK)

    fresh_model = PlantedEval()
    fresh = make_trainer(FP8Precision(recipe="delayed"), callbacks=[FP8FallbackCallback()], default_root_dir=tmp_path)
    assert evaluate(fresh, "validate", fresh_model, ckpt_path=path)[0] == {nn.Linear}

    torch.manual_seed(0)
    plain = make_trainer(FP8Precision(recipe="delayed"), max_steps=10, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"missing \['mid'\].*resume with the same `exclude`, or with FP8FallbackCallback"):
        plain.fit(PlantedEval(), loader(), ckpt_path=path)


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
    # the forward of steps 4 and 5 (global_step 3 and 4 during the batch) sees the NaN: readings 4 and 5 are bad; the
    # switch takes effect before the next forward
    assert probe.at_end == {s: s <= 5 for s in range(1, 9)} and probe.in_forward == {s: s < 5 for s in range(8)}
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


class SpikedNaN(Planted):
    """A NaN in ``mid``'s input in the forwards of the global steps ``spikes`` only."""

    def __init__(self, spikes: tuple[int, ...]) -> None:
        super().__init__()
        self.spikes = spikes

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(self.inp(x))
        if self.global_step in self.spikes:
            h = h.clone()
            h[0, 0] = float("nan")
        h = torch.nan_to_num(self.mid(h), nan=0.0)
        return F.cross_entropy(self.out(torch.relu(h)).float(), y)


@pytest.mark.parametrize("every, spikes", [(1, (2, 4)), (2, (1, 3))])
def test_isolated_nonfinite_readings_are_not_a_streak_whatever_statistics_every_n_steps(tmp_path, every, spikes):
    # NaN amaxes in the readings after two steps, finite ones (recorded on every step) in the reading between: that
    # reading clears the non-finite streak, also when it counted nothing (statistics_every_n_steps=2: the spikes on
    # the steps that do not count, so the overflow rule sees none of them)
    torch.manual_seed(0)
    callback = FP8FallbackCallback(every_n_steps=1, patience=2)
    plugin = FP8Precision(recipe="tensorwise", statistics_every_n_steps=every)
    trainer = make_trainer(plugin, callbacks=[callback], max_steps=7, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(SpikedNaN(spikes), loader())
    assert callback.fallen_back == {}
    assert callback._bad_nonfinite == {"inp": 0, "mid": 0, "out": 0}  # the readings did see the NaNs and the clean one


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


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_a_switched_layer_stays_in_high_precision_in_every_stage(tmp_path, stage):
    """The plugin converts the model again for validate / test / predict: it must keep the switched layer in high
    precision, after the fit with the same Trainer and from the checkpoint with a fresh one (with or without the
    callback), and evaluate the same numbers each time."""
    torch.manual_seed(0)
    model = PlantedEval()
    trainer = make_trainer(FP8Precision(recipe="delayed"), callbacks=[FP8FallbackCallback(every_n_steps=2, patience=2)],
                           max_steps=10, default_root_dir=tmp_path)  # fmt: skip
    quietly(trainer.fit, model, loader())
    assert type(model.mid) is nn.Linear
    path = tmp_path / "fit.ckpt"
    trainer.save_checkpoint(path)

    seen, after_fit = evaluate(trainer, stage, model)
    assert seen == {nn.Linear} and type(model.mid) is nn.Linear
    assert isinstance(model.inp, FP8Linear) and isinstance(model.out, FP8Linear)
    report = trainer.precision_plugin.report
    assert report.skipped["mid"].startswith(SWITCHED_BY_FALLBACK) and "mid" not in report.fp8_layers
    seen, from_checkpoint = evaluate(trainer, stage, model, ckpt_path=path)
    assert seen == {nn.Linear} and from_checkpoint == after_fit

    for callbacks in ([], [FP8FallbackCallback()]):
        fresh_model = PlantedEval()
        fresh = make_trainer(FP8Precision(recipe="delayed"), callbacks=callbacks, default_root_dir=tmp_path)
        seen, losses = evaluate(fresh, stage, fresh_model, ckpt_path=path)
        assert seen == {nn.Linear} and type(fresh_model.mid) is nn.Linear
        assert isinstance(fresh_model.inp, FP8Linear) and isinstance(fresh_model.out, FP8Linear)
        assert fresh.precision_plugin.report.skipped["mid"].startswith(SWITCHED_BY_FALLBACK)
        assert losses == after_fit  # the same weights and FP8 state: the same numbers


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


class Capture(Logger):
    """Keeps every ``log_metrics`` call in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass


def test_the_order_of_the_stats_and_fallback_callbacks_does_not_matter(tmp_path):
    """Both read at the end of the same steps. The switch takes effect before the next forward, so in either order
    the stats callback reads the switching interval of the layer, and the two runs log the same statistics."""
    from lightning_fp8 import FP8StatsCallback

    runs = []
    for stats_first in (True, False):
        stats = FP8StatsCallback(log_every_n_steps=2, summary=False)
        fallback = FP8FallbackCallback(every_n_steps=2, patience=2)
        logger = Capture()
        torch.manual_seed(0)
        trainer = make_trainer(FP8Precision(recipe="delayed"), max_steps=12, logger=logger, default_root_dir=tmp_path,
                               callbacks=[stats, fallback] if stats_first else [fallback, stats])  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(Planted(), loader())
        assert not [w for w in caught if "FP8StatsCallback" in str(w.message) and "before" in str(w.message)]
        fp8 = [(step, {k: v for k, v in m.items() if k.startswith("fp8/")}) for step, m in logger.logged]
        runs.append((fallback.fallen_back, [(step, m) for step, m in fp8 if m]))
    (switched, logged), (switched_other_order, logged_other_order) = runs
    assert list(switched) == ["mid"] and switched["mid"]["step"] == 8
    assert switched_other_order == switched
    assert logged_other_order == logged
    # the last logging step that reads `mid` is the one that made it switch, with the overflow the fallback saw
    with_mid = [m for _, m in logged if "fp8/mid/input/overflow_frac" in m]
    assert len(with_mid) == 4 and len(logged) == 6
    assert with_mid[-1]["fp8/mid/input/overflow_frac"] == switched["mid"]["value"]


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


@pytest.mark.slow
@pytest.mark.gloo("ddp_fallback")
def test_ddp_both_ranks_switch_the_same_layer_at_the_same_step_when_one_rank_overflows(gloo_runs):
    """2 gloo processes (tests/scripts/ddp_fallback.py, run by tests/scripts/gloo_checks.py); `mid` overflows on rank
    1's data only. The readings are reduced across the ranks, so both switch it at the same step (no hang, no rank
    computing alone in FP8) and the weights stay identical."""
    tmp_path = gloo_runs.folder("ddp_fallback")
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert list(ranks[0]["fallen_back"]) == ["mid"] and ranks[1]["fallen_back"] == ranks[0]["fallen_back"]
    step = ranks[0]["fallen_back"]["mid"]["step"]
    # in FP8 up to the switching step's forward, in high precision from the next one on, on both ranks
    assert ranks[0]["in_forward"] == ranks[1]["in_forward"] == {s: s < step for s in range(10)}
    assert 3 < step < 10
    params = [rank["params"] for rank in ranks]
    assert params[0].keys() == params[1].keys()
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
