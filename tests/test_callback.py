"""FP8StatsCallback with real loggers whose files are read back."""

from __future__ import annotations

import csv
import math
import os
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from models import TinyDecoder, loader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from utils import SyncCounter, make_trainer, per_layer

from lightning_fp8 import FP8Precision, FP8StatsCallback


def fit(tmp_path, callback, loggers, steps=12, recipe="delayed", model=None, loss_scaling="auto", **kwargs):
    torch.manual_seed(0)
    model = model or TinyDecoder()
    trainer = make_trainer(
        FP8Precision(recipe=recipe, loss_scaling=loss_scaling), callbacks=[callback], logger=loggers, max_steps=steps,
        default_root_dir=tmp_path, **kwargs,
    )
    trainer.fit(model, loader(n=8_000))
    return trainer, model


def warnings_recorded():
    """Record every warning (``pytest.warns(None)`` is gone)."""
    manager = warnings.catch_warnings(record=True)
    warnings.simplefilter("always")
    return manager


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_csv_and_tensorboard_receive_the_metrics(tmp_path):
    callback = FP8StatsCallback(log_every_n_steps=4)
    csv_logger, tb_logger = CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")
    trainer, model = fit(tmp_path, callback, [csv_logger, tb_logger])

    rows = [r for r in read_csv(os.path.join(csv_logger.log_dir, "metrics.csv")) if r.get("fp8/loss_scale")]
    # Same step axis as Lightning's own metrics of that batch (0-based count of optimizer steps before it).
    assert [int(r["step"]) for r in rows] == [3, 7, 11]
    last = rows[-1]
    layer = model.blocks[0].fc
    assert float(last["fp8/blocks.0.fc/input/amax"]) == pytest.approx(float(layer.fp8_amax_history[0, 0]))
    assert float(last["fp8/blocks.0.fc/weight/scale"]) == pytest.approx(float(layer.fp8_scale[1]))
    assert float(last["fp8/loss_scale"]) == 1.0  # bf16 default: gradients are not scaled
    assert float(last["fp8/skipped_steps"]) == 0.0
    for name in ("overflow_frac", "underflow_frac"):
        assert 0.0 <= float(last[f"fp8/blocks.0.fc/grad_output/{name}"]) <= 1.0
    worst = float(last["fp8/worst/overflow_frac"])
    index = int(float(last["fp8/worst/overflow_layer"]))
    worst_layer = callback.layer_names[index]
    assert worst == max(float(last[f"fp8/{worst_layer}/{t}/overflow_frac"]) for t in ("input", "weight", "grad_output"))
    assert float(last["fp8/scale_min"]) <= float(last["fp8/scale_max"])

    # The interval fraction is the counter delta divided by the elements seen in the interval.
    seen_per_step = 8 * 32 * 64
    assert float(rows[0]["fp8/blocks.0.fc/input/overflow_frac"]) * 4 * seen_per_step == pytest.approx(
        round(float(rows[0]["fp8/blocks.0.fc/input/overflow_frac"]) * 4 * seen_per_step)
    )

    events = EventAccumulator(tb_logger.log_dir, size_guidance={"scalars": 0, "histograms": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    assert "fp8/blocks.0.fc/grad_output/amax" in tags["scalars"]
    assert [e.step for e in events.Scalars("fp8/loss_scale")] == [3, 7, 11]
    amax = events.Scalars("fp8/blocks.0.fc/input/amax")[-1].value
    assert amax == pytest.approx(float(layer.fp8_amax_history[0, 0]), rel=1e-6)
    assert "fp8/blocks.0.fc/input/amax_history" in tags["histograms"]
    assert "fp8/amax_heatmap" in tags["images"]  # written at the end of fit
    for logger in (csv_logger, tb_logger):
        assert os.path.getsize(os.path.join(logger.log_dir, "fp8_amax_heatmap.png")) > 1000

    # Standard path: the values are in callback_metrics for ModelCheckpoint / EarlyStopping.
    assert float(trainer.callback_metrics["fp8/loss_scale"]) == 1.0


def test_checkpoint_and_early_stopping_can_monitor(tmp_path):
    callback = FP8StatsCallback(log_every_n_steps=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="fp8/worst/overflow_frac", every_n_train_steps=2)
    stop = EarlyStopping(monitor="fp8/loss_scale", mode="max", patience=1000, check_on_train_epoch_end=True)
    torch.manual_seed(0)
    trainer = make_trainer(
        FP8Precision(), callbacks=[callback, checkpoint, stop], logger=CSVLogger(tmp_path), max_epochs=1,
        limit_train_batches=6, enable_checkpointing=True,
    )
    trainer.fit(TinyDecoder(), loader(n=8_000))
    assert checkpoint.best_model_path and os.path.exists(checkpoint.best_model_path)
    assert checkpoint.best_model_score is not None and math.isfinite(float(checkpoint.best_model_score))
    assert float(stop.best_score) == 1.0


class SeparatorCSV(CSVLogger):
    @property
    def group_separator(self):
        return "."


def test_logger_group_separator_is_honoured(tmp_path):
    logger = SeparatorCSV(tmp_path)
    fit(tmp_path, FP8StatsCallback(log_every_n_steps=4), [logger], steps=4)
    header = read_csv(os.path.join(logger.log_dir, "metrics.csv"))[0].keys()
    assert "fp8.loss_scale" in header and "fp8.blocks.0.fc.input.amax" in header
    assert not any(k.startswith("fp8/") for k in header)


def test_include_exclude_patterns(tmp_path):
    logger = CSVLogger(tmp_path)
    fit(tmp_path, FP8StatsCallback(log_every_n_steps=4, include=["blocks.*"], exclude=["*.qkv"]), [logger], steps=4)
    header = read_csv(os.path.join(logger.log_dir, "metrics.csv"))[0].keys()
    layers = {k.split("/")[1] for k in header if k.startswith("fp8/") and k.count("/") == 3}
    assert layers == {f"blocks.{i}.{n}" for i in (0, 1) for n in ("proj", "fc", "out")}


def test_include_typo_raises_at_fit_start_with_the_closest_names(tmp_path):
    callback = FP8StatsCallback(log_every_n_steps=1, include=["blocks.*.qvk"])
    with pytest.raises(ValueError, match=r"include pattern 'blocks\.\*\.qvk' matches no FP8 layer") as err:
        fit(tmp_path, callback, False, steps=1)
    assert "closest FP8 layer names: 'blocks.0.qkv', 'blocks.1.qkv'" in str(err.value)
    assert callback.fetches == 0  # before any reading
    # include: a layer the plugin keeps in high precision is not an FP8 layer: the message says why
    torch.manual_seed(0)
    trainer = make_trainer(
        FP8Precision(exclude=["lm_head"]), callbacks=[FP8StatsCallback(include=["lm_head"])], max_steps=1
    )
    with pytest.raises(ValueError, match=r"include pattern 'lm_head'.*'lm_head' is not an FP8 layer \(excluded by"):
        trainer.fit(TinyDecoder(), loader(n=2_000))
    # exclude: the same layer in both exclude lists is redundant, not an error (it is not logged either way)
    torch.manual_seed(0)
    callback = FP8StatsCallback(log_every_n_steps=1, exclude=["lm_head"])
    trainer = make_trainer(FP8Precision(exclude=["lm_head"]), callbacks=[callback], max_steps=1)
    trainer.fit(TinyDecoder(), loader(n=2_000))
    assert callback.layer_names and not any("lm_head" in name for name in callback.layer_names)


def test_run_shorter_than_the_interval_warns_and_still_summarises(tmp_path, caplog):
    """max_steps=3 with a 50-step interval: no step is a logging step. One warning at the start names both
    numbers; the end of training reads the statistics once, so the summary, the heatmap and one logged row exist."""
    import logging

    callback = FP8StatsCallback(log_every_n_steps=50)
    logger = CSVLogger(tmp_path)
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="interval") as record:
        fit(tmp_path, callback, [logger], steps=3)
    warnings = [str(w.message) for w in record if "FP8StatsCallback: the logging interval" in str(w.message)]
    assert warnings == [
        "FP8StatsCallback: the logging interval of 50 steps (FP8StatsCallback(log_every_n_steps=50)) is longer than "
        "the run of 3 optimizer steps: no step of this run is a logging step, so FP8 statistics are read only once, "
        "at the end of training (for the summary and the heatmap). To log during the run, set "
        "FP8StatsCallback(log_every_n_steps=N) with N <= 3."
    ]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "FP8 summary (whole run, worst first)" in text and "blocks.0.fc" in text
    table = callback.summary_table().splitlines()
    assert len(table) == 2 + 9 * 3  # every layer and tensor
    heatmap = os.path.join(logger.log_dir, "fp8_amax_heatmap.png")
    assert os.path.getsize(heatmap) > 1000 and heatmap in text
    rows = [r for r in read_csv(os.path.join(logger.log_dir, "metrics.csv")) if r.get("fp8/loss_scale")]
    assert [int(r["step"]) for r in rows] == [2]  # the step axis of the last batch's own metrics
    seen = 3 * 8 * 32 * 64  # three steps of blocks.0.fc's input elements, all of the run
    assert callback._total_counts["blocks.0.fc"][0][0] == seen
    assert callback.fetches == 1 + 1  # baseline + the end-of-run reading


def test_trainer_interval_warning_and_no_warning_when_the_run_is_long_enough_or_unbounded(tmp_path):
    with pytest.warns(UserWarning, match=r"interval of 50 steps \(Trainer\(log_every_n_steps=50\), which FP8Stats"):
        fit(tmp_path, FP8StatsCallback(), False, steps=2)

    class Batches(torch.utils.data.IterableDataset):  # no len(): Lightning cannot tell the run's length
        def __iter__(self):
            return iter(list(loader(n=2_000))[:2])

    for callback, data, steps in ((FP8StatsCallback(log_every_n_steps=2), loader(n=8_000), 4),
                                  (FP8StatsCallback(log_every_n_steps=50), Batches(), -1)):  # fmt: skip
        torch.manual_seed(0)
        trainer = make_trainer(FP8Precision(), callbacks=[callback], max_steps=steps, max_epochs=1)
        with warnings_recorded() as record:
            trainer.fit(TinyDecoder(), data if steps > 0 else torch.utils.data.DataLoader(data, batch_size=None))
        assert not [w for w in record if "logging interval" in str(w.message)]
        assert callback._total_counts  # read at the end in either case


def test_no_logger_warns_once_and_still_saves_heatmap(tmp_path, capsys):
    callback = FP8StatsCallback(log_every_n_steps=2)
    with pytest.warns(UserWarning, match="no logger") as record:
        fit(tmp_path, callback, False, steps=4)
    assert len([w for w in record if "no logger" in str(w.message)]) == 1
    assert os.path.exists(tmp_path / "fp8_amax_heatmap.png")
    assert callback.fetches == 1 + 2  # baseline + two logging steps


def test_device_to_host_transfers(tmp_path):
    """Zero syncs on any step; exactly one batched copy on a logging step, none otherwise."""
    callback = FP8StatsCallback(log_every_n_steps=3)
    per_step = []
    original = callback.on_train_batch_end

    def counted(trainer, *args):
        before = callback.fetches
        with SyncCounter() as counter:
            original(trainer, *args)
        per_step.append((trainer.global_step, callback.fetches - before, counter.count))

    callback.on_train_batch_end = counted
    fit(tmp_path, callback, CSVLogger(tmp_path), steps=9)
    assert [(s, f) for s, f, _ in per_step] == [(s, 1 if s % 3 == 0 else 0) for s in range(1, 10)]
    assert all(syncs == 0 for _, _, syncs in per_step)


class Inflate(L.Callback):
    """Multiply one layer's weights by 4 before every step: the delayed weight scale always lags."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= 3:
            with torch.no_grad():
                pl_module.blocks[0].fc.weight.mul_(4.0)


def test_saturating_layer_raises_overflow_and_alert(tmp_path):
    callback = FP8StatsCallback(log_every_n_steps=1, overflow_alert_threshold=0.05, alert_patience=3)
    logger = CSVLogger(tmp_path)
    with pytest.warns(UserWarning, match=r"'blocks\.0\.fc' \(weight\) has overflowed.*3 consecutive logs") as record:
        fit_inflated(tmp_path, callback, logger)
    assert sum("blocks.0.fc' (weight)" in str(w.message) for w in record) == 1  # once, not every step
    rows = [r for r in read_csv(os.path.join(logger.log_dir, "metrics.csv")) if r.get("fp8/loss_scale")]
    fracs = [float(r["fp8/blocks.0.fc/weight/overflow_frac"]) for r in rows]
    assert max(fracs[:3]) < 0.05 and min(fracs[-3:]) > 0.5, fracs
    assert "troubleshooting" in str(record[-1].message) and "margin=1" in str(record[-1].message)
    assert callback.summary_table().splitlines()[2].split()[:2] == ["blocks.0.fc", "weight"]  # worst first


def fit_inflated(tmp_path, callback, logger):
    torch.manual_seed(0)
    trainer = make_trainer(
        FP8Precision(recipe="delayed"), callbacks=[Inflate(), callback], logger=logger, max_steps=9
    )
    model = TinyDecoder()
    trainer.fit(model, loader(n=8_000))
    return trainer, model


def test_summary_table_printed_at_end(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        fit(tmp_path, FP8StatsCallback(log_every_n_steps=4), CSVLogger(tmp_path), steps=4)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "FP8 summary (whole run, worst first)" in text
    assert "blocks.0.fc" in text and "grad_output" in text
    assert "fp8_amax_heatmap.png" in text


def test_callback_state_survives_resume(tmp_path):
    def run(callback, epochs, seed, ckpt_path=None, save=None):
        torch.manual_seed(seed)
        trainer = make_trainer(
            FP8Precision(recipe="delayed"), callbacks=[callback], logger=CSVLogger(tmp_path), max_epochs=epochs,
            limit_train_batches=5,
        )
        trainer.fit(TinyDecoder(), loader(n=8_000), ckpt_path=ckpt_path)
        if save:
            trainer.save_checkpoint(save)

    straight = FP8StatsCallback(log_every_n_steps=2)
    run(straight, 2, 0)
    run(FP8StatsCallback(log_every_n_steps=2), 1, 0, save=tmp_path / "epoch1.ckpt")
    resumed = FP8StatsCallback(log_every_n_steps=2)
    run(resumed, 2, 1, ckpt_path=tmp_path / "epoch1.ckpt")
    assert resumed._total_counts == straight._total_counts
    assert resumed._heatmap_steps == straight._heatmap_steps == [2, 4, 6, 8, 10]
    assert resumed.summary_table() == straight.summary_table()


def test_invalid_settings():
    for kwargs, field in (
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"include": "blocks"}, "include"),
        ({"overflow_alert_threshold": 2.0}, "overflow_alert_threshold"),
        ({"alert_patience": 0}, "alert_patience"),
    ):
        with pytest.raises(ValueError, match=field):
            FP8StatsCallback(**kwargs)


def test_non_finite_amax_alert(tmp_path):
    model = TinyDecoder()
    model.inject_nan_at_step = 2
    with pytest.warns(UserWarning, match="amax of layer .* is (nan|inf).*NaN or Inf"):
        fit(tmp_path, FP8StatsCallback(log_every_n_steps=1), CSVLogger(tmp_path), steps=4, model=model)


@pytest.mark.slow
@pytest.mark.gloo("ddp_stats")
def test_ddp_reduction_and_layer_that_runs_on_one_rank(gloo_runs):
    """tests/scripts/ddp_stats.py on 2 processes (gloo), run by tests/scripts/gloo_checks.py."""
    tmp_path = gloo_runs.folder("ddp_stats")
    rank0 = per_layer(torch.load(tmp_path / "state_rank0.pt", weights_only=True))
    rank1 = per_layer(torch.load(tmp_path / "state_rank1.pt", weights_only=True))
    rows = [r for r in read_csv(tmp_path / "logs" / "metrics.csv") if r.get("fp8/loss_scale")]
    assert [int(r["step"]) for r in rows] == [1, 3]  # logged once per logging step, not once per rank
    last = rows[-1]
    for name in ("body", "extra"):
        for r, role in enumerate(("input", "weight", "grad_output")):
            want = max(float(rank0[name]["amax_history"][r, 0]), float(rank1[name]["amax_history"][r, 0]))
            assert float(last[f"fp8/{name}/{role}/amax"]) == pytest.approx(want)
            want_scale = min(float(rank0[name]["scale"][r]), float(rank1[name]["scale"][r]))
            assert float(last[f"fp8/{name}/{role}/scale"]) == pytest.approx(want_scale)
    # Counts are summed: 'extra' ran on rank 0 only, 'body' on both.
    assert int(rank1["extra"]["counts"][0, 0]) == 0 and int(rank0["extra"]["counts"][0, 0]) > 0
    summed = int(rank0["body"]["counts"][0, 0]) + int(rank1["body"]["counts"][0, 0])
    assert summed == 2 * int(rank0["body"]["counts"][0, 0])


def test_wandb_offline_receives_scalars_histograms_and_heatmap(tmp_path, monkeypatch):
    """W&B in offline mode: the run file holds our scalars and histograms, the heatmap lands in its media."""
    import wandb  # part of the test extra: a missing install fails the test, it does not skip it
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="lightning-fp8-test")
    try:
        fit(tmp_path, FP8StatsCallback(log_every_n_steps=2), logger, steps=4, loss_scaling="dynamic")
    finally:
        wandb.finish()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/*.wandb")
    data = run_file.read_bytes()  # protobuf records: keys and JSON values are stored as plain strings
    for key in ("fp8/blocks.0.fc/input/amax", "fp8/loss_scale", "fp8/worst/overflow_frac",
                "fp8/blocks.0.fc/grad_output/amax_history"):
        assert key.encode() in data, key
    assert b"65536" in data
    assert list(tmp_path.glob("wandb/offline-run-*/files/media/images/fp8/amax_heatmap_*.png"))
